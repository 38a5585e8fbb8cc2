"""An in-memory stand-in for the documented storage API, for swarm protocol units only.

Protocol units drive the server and syncer with StringTransport and task.Clock, which need a store
whose Deferreds fire synchronously; integration tests (tests/test_swarm_sync.py) use real nodes and
the real store. Only what swarm calls is here, with the semantics the brief documents.
"""

import hashlib

from twisted.internet import defer


class StreamNotFound(Exception):
    pass


class MemChunks:
    def __init__(self):
        self.data = {}
        self.pinned = set()
        self.seq = []
        self.waiters = []

    def put(self, data, pin=False):
        addr = hashlib.sha256(data).digest()
        if addr not in self.data:
            self.data[addr] = bytes(data)
            self.seq.append(addr)
        if pin:
            self.pinned.add(addr)
        waiting, self.waiters = self.waiters, []
        for seq, d in waiting:
            if self.last_seq() >= seq:
                d.callback(None)
            else:
                self.waiters.append((seq, d))
        return defer.succeed(addr)

    def put_many(self, datas, pin=False, addrs=None):
        return defer.gatherResults([self.put(d, pin) for d in datas])

    def get_many(self, addrs):
        return defer.succeed([self.data.get(bytes(a)) for a in addrs])

    def get(self, addr, offset=0, length=None):
        if addr not in self.data:
            return defer.fail(KeyError(addr))
        return defer.succeed(self.data[addr])

    def has(self, addr):
        return addr in self.data

    def has_many(self, addrs):
        return [a in self.data for a in addrs]

    def last_seq(self):
        return len(self.seq)

    def by_seq(self, from_seq, to_seq, limit):
        out = []
        for s in range(max(1, from_seq), min(to_seq, len(self.seq)) + 1):
            out.append((s, self.seq[s - 1]))
            if len(out) >= limit:
                break
        return out

    def wait_for_seq(self, seq):
        if self.last_seq() >= seq:
            return defer.succeed(None)
        d = defer.Deferred(lambda d: self.waiters.remove((seq, d)))
        self.waiters.append((seq, d))
        return d


class Meta:
    def __init__(self, sid, origin=None):
        self.stream_id = sid
        self.origin = origin
        self.trim_offset = 0
        self.next_offset = 0
        self.batches = []  # (base, count, bytes)
        self.replica_nums = 1
        self.retention_period_ms = 0
        self.attrs = {}


class MemLog:
    def __init__(self, node_id):
        self.node_id = node_id
        self.s = {}
        self.n = 0
        self.waiters = []

    def create_stream(self):
        self.n += 1
        sid = (self.node_id << 32) | self.n
        self.s[sid] = Meta(sid)
        return defer.succeed(self.s[sid])

    def create_replica_stream(self, sid, origin, replica_nums, retention_period_ms, attrs=None):
        self.s[sid] = Meta(sid, origin)
        return defer.succeed(self.s[sid])

    def stream(self, sid):
        if sid not in self.s:
            raise StreamNotFound(sid)
        return self.s[sid]

    def streams(self):
        return list(self.s.values())

    def _add(self, m, batch):
        count = int.from_bytes(batch[9:13], "big")
        m.batches.append((m.next_offset, count, batch))
        m.next_offset += count
        waiting, self.waiters = self.waiters, []
        for sid, off, d in waiting:
            if sid == m.stream_id and m.next_offset > off:
                d.callback(None)
            else:
                self.waiters.append((sid, off, d))

    def append(self, sid, batch):
        m = self.stream(sid)
        base = m.next_offset
        batch = batch[:1] + base.to_bytes(8, "big") + batch[9:]
        self._add(m, batch)
        return defer.succeed(base)

    def append_replica(self, sid, batch):
        m = self.stream(sid)
        base = int.from_bytes(batch[1:9], "big")
        assert base == m.next_offset, (base, m.next_offset)
        self._add(m, batch)
        return defer.succeed(base)

    def batches(self, sid, from_offset, limit):
        m = self.stream(sid)
        out = []
        for base, count, b in m.batches:
            if base + count <= from_offset:
                continue
            out.append((base, count, len(b)))
            if len(out) >= limit:
                break
        return out

    def read(self, sid, offset, max_bytes):
        m = self.stream(sid)
        out, total = [], 0
        for base, count, b in m.batches:
            if base + count <= offset:
                continue
            if out and total >= max_bytes:
                break
            out.append(b)
            total += len(b)
        return defer.succeed(out)

    def wait_for_data(self, sid, offset):
        if self.stream(sid).next_offset > offset:
            return defer.succeed(None)
        entry = [sid, offset, None]
        d = defer.Deferred(lambda d: self.waiters.remove(tuple(entry)))
        entry[2] = d
        self.waiters.append(tuple(entry))
        return d


class Txn:
    def __init__(self, tables):
        self.tables = tables

    def get(self, table, key):
        return self.tables.get(table, {}).get(key)

    def put(self, table, key, value):
        self.tables.setdefault(table, {})[key] = value


class MemMeta:
    def __init__(self):
        self.tables = {}

    def read(self, fn):
        return fn(Txn(self.tables))

    def transact(self, fn):
        return defer.maybeDeferred(fn, Txn(self.tables))


class MemStore:
    def __init__(self, node_id=1):
        self.chunks = MemChunks()
        self.log = MemLog(node_id)
        self.meta = MemMeta()


class FakeConfig:
    data_dir = None


class FakeNode:
    def __init__(self, clock, node_id=1):
        self.reactor = clock
        self.node_id = node_id
        self.store = MemStore(node_id)
        self.metrics = {}
        self.config = FakeConfig()
        self.hooks = []

    def on_shutdown(self, fn):
        self.hooks.append(fn)
