"""The store: one WAL + one LMDB environment + chunk packs, one writer thread, one read pool.

Threads: the reactor thread owns the in-memory stream state (offsets are assigned there, at call
time) and fires every Deferred; the writer thread owns the WAL, the packs and the single LMDB write
transaction of each group; a small thread pool serves reads. See docs/storage.md.
"""

import collections
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import msgpack
from twisted.internet import defer, task
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from storage import errors, index
from storage.index import INDEX_KEY, INDEX_VAL, U64, RawTxn, apply_ops
from storage.policy import FsyncPolicy
from storage.presync import PreSync
from storage.wal import ENTRY_SIZE, T_BATCH, T_OPS, Wal

_BATCH_PREFIX = struct.Struct(">QQ")  # stream_id, append_ms
_BASE = struct.Struct(">q")

K_BATCH, K_TXN, K_STOP, K_SYNC, K_OPS = range(5)
# ``op.a(txn)`` runs in the writer thread directly in the group's LMDB transaction (no nested
# transaction, no RawTxn) and returns ``(result, raw ops for the WAL or None)``; it must not raise
# for a caller's error (a raise fails the whole group, as an I/O error does). store.kv's batched
# writes use it.
K_DIRECT = 5

MAX_GROUP_BYTES = 16 << 20
QUEUE_HIGH = 64 << 20  # above this many queued bytes the store reports congestion
QUEUE_HARD = 512 << 20  # above this, writes fail with StoreBusy instead of growing memory


POSTPONED_POLL_S = 0.002


def interval_sync_wait(now: float, last_sync: float, interval: float, presync_busy: bool) -> float:
    """Seconds until the ``interval`` policy's sync is due; 0.0: sync now.

    It is due ``interval`` after the last one. While a pre-sync is writing (storage/presync.py:
    the disk is slow or stalled) it waits for it, but never past twice the interval, as Redis's
    ``everysec`` postpones its fsync: groups keep committing meanwhile instead of queueing behind
    a sync that would wait for the same disk, and the pre-sync leaves it less to write."""
    due = last_sync + interval - now
    if due > 0:
        return due
    late = now - last_sync
    if presync_busy and late < 2 * interval:
        return min(POSTPONED_POLL_S, 2 * interval - late)
    return 0.0


def _daemon_thread(*args, **kwargs):
    t = threading.Thread(*args, **kwargs)
    t.daemon = True
    return t


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class RangeMeta:
    range_index: int
    start_offset: int
    next_offset: int
    end_offset: int  # -1 while open
    replicas: list = field(default_factory=list)  # [(server_id, advertise_addr, is_primary)]


@dataclass
class StreamMeta:
    stream_id: int
    replica_nums: int
    retention_period_ms: int
    trim_offset: int
    next_offset: int
    ranges: List[RangeMeta]
    origin: Optional[str]
    attrs: dict
    created_ms: int


class _Stream:
    """Reactor-thread state of one stream."""

    __slots__ = ("sid", "replica_nums", "retention_period_ms", "trim_offset", "ranges", "origin",
                 "attrs", "created_ms", "next_offset", "assigned", "waiters")

    def __init__(self, sid, replica_nums=1, retention_period_ms=0, origin=None, attrs=None, created_ms=0):
        self.sid = sid
        self.replica_nums = replica_nums
        self.retention_period_ms = retention_period_ms
        self.trim_offset = 0
        self.ranges = [[0, 0, -1, []]]  # [index, start, end (-1 open), replicas]
        self.origin = origin
        self.attrs = dict(attrs or {})
        self.created_ms = created_ms
        self.next_offset = 0  # durable and visible
        self.assigned = 0  # handed out to appends (>= next_offset)
        self.waiters = []  # [(offset, Deferred)]

    def encode(self) -> bytes:
        return msgpack.packb(
            {"r": self.replica_nums, "ret": self.retention_period_ms, "trim": self.trim_offset,
             "ranges": self.ranges, "origin": self.origin, "attrs": self.attrs, "created": self.created_ms},
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, sid, raw):
        d = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=False)
        s = cls(sid, d["r"], d["ret"], d["origin"], d["attrs"], d["created"])
        s.trim_offset = d["trim"]
        s.ranges = [[r[0], r[1], r[2], [tuple(x) for x in r[3]]] for r in d["ranges"]]
        return s

    def range_meta(self, r) -> RangeMeta:
        nxt = self.next_offset if r[2] < 0 else r[2]
        return RangeMeta(r[0], r[1], nxt, r[2], [tuple(x) for x in r[3]])

    def meta(self) -> StreamMeta:
        return StreamMeta(self.sid, self.replica_nums, self.retention_period_ms, self.trim_offset,
                          self.next_offset, [self.range_meta(r) for r in self.ranges], self.origin,
                          dict(self.attrs), self.created_ms)


class _Op:
    __slots__ = ("kind", "a", "b", "c", "d", "nbytes", "ok", "value", "raw")

    def __init__(self, kind, a=None, b=None, c=None, nbytes=64):
        self.kind = kind
        self.a = a
        self.b = b
        self.c = c
        self.d = defer.Deferred()
        self.nbytes = nbytes
        self.ok = False
        self.value = None
        self.raw = None


class Store:
    logger = Logger()  # ``store.log`` is the record log (the API's name)

    def __init__(self):
        raise TypeError("use Store.open(path, fsync=..., reactor=...)")

    @classmethod
    def open(cls, path: str, fsync="always", reactor=None, node_id: int = 0,
             segment_bytes: int = 64 << 20, pack_bytes: int = 256 << 20,
             retention_check_s: float = 1.0, chunk_grace_s: float = 60.0) -> "Store":
        """Open (creating if needed) the store in directory ``path``; blocking, at start-up."""
        if reactor is None:
            from twisted.internet import reactor
        self = object.__new__(cls)
        self._init(path, FsyncPolicy.parse(fsync), reactor, node_id, segment_bytes, pack_bytes,
                   retention_check_s, chunk_grace_s)
        return self

    def _init(self, path, policy, reactor, node_id, segment_bytes, pack_bytes, retention_check_s, chunk_grace_s):
        from storage.chunks import ChunkStore, Packs
        from storage.kv import KeyValue
        from storage.log import RecordLog
        from storage.meta import Meta

        self.path = path
        self._reactor_thread = threading.get_ident()  # Store.open runs on the reactor's thread
        self.policy = policy
        self.reactor = reactor
        self.node_id = node_id
        self.closed = False
        self.failed = None  # set after an I/O error in the writer: the store refuses writes
        os.makedirs(path, exist_ok=True)
        started = time.monotonic()
        self.env, self.dbs = index.open_env(os.path.join(path, "index"), sync=policy.always)
        self.wal = Wal(os.path.join(path, "wal"), segment_bytes, sync_dir=policy.mode != "never")
        self.packs = Packs(os.path.join(path, "chunks"), pack_bytes, sync_dir=policy.mode != "never")
        replayed = self.replayed = self._recover()
        self._queue = collections.deque()
        self._cond = threading.Condition()
        self._queued_bytes = 0
        self._drain_waiters = []
        self.log = RecordLog(self)
        self.chunks = ChunkStore(self, chunk_grace_s)
        self.kv = KeyValue(self)
        self.meta = Meta(self)
        self.log._load()
        self.chunks._load()
        self._pool = ThreadPool(minthreads=1, maxthreads=4, name="storage-read")
        # daemon workers: a node that fails start-up after opening the store must still exit
        self._pool.threadFactory = _daemon_thread
        self._pool.start()
        self._presync = None
        if policy.mode == "interval":
            self._presync = PreSync(self.wal, self.packs, policy.interval_ms / 1000.0)
            self._presync.start()
        self._writer = threading.Thread(target=self._run_writer, name="storage-writer", daemon=True)
        self._writer.start()
        self._timers = []
        if retention_check_s:
            self._timers.append(self._every(retention_check_s, self.log._retention_tick))
            self._timers.append(self._every(max(retention_check_s, chunk_grace_s / 4.0), self.chunks._sweep_tick))
        self.logger.info(
            "store opened at {path} ({streams} streams, replayed {replayed} WAL entries) in {ms:.0f} ms",
            path=path, streams=len(self.log._streams), replayed=replayed, ms=(time.monotonic() - started) * 1000,
        )

    def _every(self, seconds, fn):
        def tick():
            d = defer.maybeDeferred(fn)
            d.addErrback(self._tick_failed, fn)
            return d

        loop = task.LoopingCall(tick)
        loop.clock = self.reactor
        loop.start(seconds, now=False)
        return loop

    def _tick_failed(self, failure, fn):
        if not self.closed:  # a tick racing close() fails with StoreClosed: not worth a line
            self.logger.failure("periodic store task {task} failed", failure, task=fn.__name__)

    # -- recovery ---------------------------------------------------------------------------------

    def _recover(self) -> int:
        """Replay WAL entries past the checkpoint into LMDB; the tail is CRC-checked and cut at the
        first torn or corrupt entry."""
        with self.env.begin(write=True) as txn:
            raw = txn.get(index.CHECKPOINT, db=self.dbs[index.SYS])
            checkpoint = U64.unpack(raw)[0] if raw else 0
            n = 0
            live = index.LiveBytes(self.wal)
            for pos, etype, payload in self.wal.scan(checkpoint):
                self._apply_entry(txn, pos, etype, payload, live)
                n += 1
            live.flush(txn, self.dbs)
            end = max(self.wal.end, checkpoint)
            self.wal.ensure_at(end)
            txn.put(index.CHECKPOINT, U64.pack(end), db=self.dbs[index.SYS])
            self._checkpoint = end
        if n:
            self.env.sync(True)
        return n

    def _apply_entry(self, txn, pos, etype, payload, live):
        if etype == T_BATCH:
            sid, append_ms = _BATCH_PREFIX.unpack_from(payload, 0)
            base = _BASE.unpack_from(payload, 17)[0]
            count = int.from_bytes(payload[25:29], "big", signed=True)
            total = ENTRY_SIZE + len(payload)
            index.put_batch_index(txn, self.dbs, INDEX_KEY.pack(sid, base),
                                  INDEX_VAL.pack(pos, total, count, append_ms), live, pos, total)
        else:
            apply_ops(txn, self.dbs, msgpack.unpackb(payload, raw=True, use_list=True), live)

    # -- the write queue (reactor thread) -----------------------------------------------------

    def _check_writable(self, nbytes=0):
        if self.closed:
            raise errors.StoreClosed("the store is closed")
        if self.failed is not None:
            raise errors.StoreError("the store stopped accepting writes after an I/O error: %s" % self.failed)
        if self._queued_bytes + nbytes > QUEUE_HARD:
            raise errors.StoreBusy("the store's write queue is full")

    def _submit(self, op: _Op) -> defer.Deferred:
        self._queued_bytes += op.nbytes
        self._queue.append(op)  # deque.append is atomic; the lock is taken only to wake the writer
        if self._writer_idle:
            with self._cond:
                self._cond.notify()
        return op.d

    def transact_raw(self, fn, nbytes=256) -> defer.Deferred:
        """Run ``fn(RawTxn)`` in the writer thread inside the next group's transaction."""
        try:
            self._check_writable(nbytes)
        except errors.StoreError:
            return defer.fail()
        return self._submit(_Op(K_TXN, fn, nbytes=nbytes))

    @property
    def congested(self) -> bool:
        """True while more than QUEUE_HIGH bytes wait for the writer (protocols should pause)."""
        return self._queued_bytes > QUEUE_HIGH

    def queued_bytes(self) -> int:
        return self._queued_bytes

    def when_drained(self) -> defer.Deferred:
        """Fires once the queue is back below half of QUEUE_HIGH."""
        if self._queued_bytes <= QUEUE_HIGH // 2:
            return defer.succeed(None)
        d = defer.Deferred(lambda d: self._drain_waiters.remove(d))
        self._drain_waiters.append(d)
        return d

    def stats(self) -> dict:
        """A snapshot of sizes and counters for ``sbpctl status`` (sync, cheap)."""
        txn = self.snapshot()
        entries = {name.decode(): txn.stat(self.dbs[i])["entries"] for i, name in enumerate(index.DB_NAMES)}
        wal_bytes = sum(self.wal.segment_size(b) for b in self.wal.bases)
        return {
            "fsync": str(self.policy),
            "streams": len(self.log._streams),
            "batches": entries["index"],
            "wal_segments": len(self.wal.bases),
            "wal_bytes": wal_bytes,
            "wal_position": self.wal.end,
            "chunks": entries["chunks"],
            "chunk_packs": len(self.packs.fds),
            "chunk_last_seq": self.chunks.last_seq(),
            "kv_keys": entries["kv"],
            "meta_keys": entries["meta"],
            "queued_bytes": self._queued_bytes,
            "failed": self.failed,
        }

    def sync(self) -> defer.Deferred:
        """Make everything written so far durable, whatever the policy."""
        return self._submit(_Op(K_SYNC))

    # -- the writer thread ----------------------------------------------------------------------

    _writer_idle = False

    def _take(self, timeout):
        with self._cond:
            if not self._queue:
                # set under the lock before re-checking: a submitter that sees it notifies after
                # our wait() released the lock, so no wake-up is lost
                self._writer_idle = True
                if not self._queue:
                    self._cond.wait(timeout)
                self._writer_idle = False
            group, size = [], 0
            q = self._queue
            while q and (not group or size + q[0].nbytes <= MAX_GROUP_BYTES):
                op = q.popleft()
                group.append(op)
                size += op.nbytes
                if op.kind == K_STOP:
                    break
            return group

    def _run_writer(self):
        try:
            self._writer_loop()
        except BaseException as e:  # a bug, not an I/O error: refuse writes rather than hang them
            self.failed = "writer thread died: %s: %s" % (type(e).__name__, e)
            self.logger.failure("the store's writer thread died")
            failure = Failure()
            with self._cond:
                rest = list(self._queue)
                self._queue.clear()
            for op in rest:
                op.ok, op.value = False, failure
            self.reactor.callFromThread(self._deliver, rest)

    def _writer_loop(self):
        policy = self.policy
        interval = policy.interval_ms / 1000.0 if policy.mode == "interval" else None
        last_sync = time.monotonic()
        stopping = None
        presync = self._presync

        def sync_wait():  # seconds until the interval sync is due, with last_sync as it is now
            return interval_sync_wait(time.monotonic(), last_sync, interval, presync is not None and presync.busy)

        while stopping is None:
            timeout = None
            if interval is not None and self._unsynced():
                timeout = sync_wait()
            group = self._take(timeout)
            force_sync = False
            for op in group:
                if op.kind == K_STOP:
                    stopping = op
                elif op.kind == K_SYNC:
                    force_sync = True
            work = [op for op in group if op.kind in (K_BATCH, K_TXN, K_OPS, K_DIRECT)]
            try:
                if work:
                    self._commit_group(work, policy.always or force_sync)
                if force_sync or stopping is not None or (
                    interval is not None and self._unsynced() and not sync_wait()
                ):
                    self._sync_all()
                    last_sync = time.monotonic()
            except Exception as e:  # an I/O error: fail this group and refuse later writes
                self.failed = "%s: %s" % (type(e).__name__, e)
                failure = Failure()
                for op in work:
                    op.ok, op.value = False, failure
            if group:
                self.reactor.callFromThread(self._deliver, group)

    def _unsynced(self) -> bool:
        return self.wal.dirty or self.packs.dirty or self._env_dirty

    _env_dirty = False

    def _sync_all(self):
        self.packs.sync()
        self.wal.sync()
        self.env.sync(True)
        self._env_dirty = False

    def _sync_all_quietly(self):
        try:
            self._sync_all()
        except Exception as e:
            self.logger.error("final sync failed: {error}", error=e)

    def _commit_group(self, work, durable):
        wal = self.wal
        txn = self.env.begin(write=True)
        try:
            raw_ops = []
            live = index.LiveBytes(wal)
            merged = []  # consecutive K_OPS share one WAL entry (one msgpack call)
            for op in work:
                if op.kind == K_OPS:
                    apply_ops(txn, self.dbs, op.a, live)
                    merged.extend(op.a)
                    op.ok = True
                    continue
                if op.kind == K_DIRECT:
                    op.value, ops = op.a(txn)
                    op.ok = True
                    if ops:
                        merged.extend(ops)
                    continue
                if merged:
                    wal.add(T_OPS, (msgpack.packb(merged, use_bin_type=True),))
                    merged = []
                if op.kind == K_BATCH:
                    sid, batch, base = op.a, op.b, op.c
                    count = int.from_bytes(batch[9:13], "big", signed=True)
                    append_ms = now_ms()
                    if base is None:  # a replica batch keeps its base_offset
                        parts = (_BATCH_PREFIX.pack(sid, append_ms), batch)
                        base = _BASE.unpack_from(batch, 1)[0]
                    else:
                        parts = (_BATCH_PREFIX.pack(sid, append_ms), batch[:1], _BASE.pack(base), memoryview(batch)[9:])
                    pos = wal.add(T_BATCH, parts)
                    total = ENTRY_SIZE + 16 + len(batch)
                    index.put_batch_index(txn, self.dbs, INDEX_KEY.pack(sid, base),
                                          INDEX_VAL.pack(pos, total, count, append_ms), live, pos, total, wal.active)
                    op.ok, op.value = True, base
                else:
                    live.flush(txn, self.dbs)  # so the function reads current segment counts
                    sub = self.env.begin(write=True, parent=txn)
                    raw = RawTxn(sub, self.dbs, self)
                    try:
                        result = op.a(raw)
                    except Exception:
                        sub.abort()
                        op.ok, op.value = False, Failure()
                        continue
                    sub.commit()
                    live.merge(raw.live)
                    op.ok, op.value, op.raw = True, result, raw
                    if raw.ops:
                        wal.add(T_OPS, (msgpack.packb(raw.ops, use_bin_type=True),))
                    raw_ops.append(raw)
            if merged:
                wal.add(T_OPS, (msgpack.packb(merged, use_bin_type=True),))
            if self.packs.dirty and durable:
                self.packs.sync()  # chunk bytes are durable before the WAL entry naming them
            wal.flush()
            # Under --fsync always every group's WAL bytes are synced before the LMDB commit names
            # them: batch bytes live only in the WAL, and LMDB's commit (metasync=False) syncs its
            # data pages but not its meta page, so after a power cut it may fall back to the
            # previous commit. Recovery then replays this group from the synced WAL. A group of
            # metadata/kv/chunk-index changes alone is not durable through the commit by itself.
            if durable:
                wal.sync()
            live.flush(txn, self.dbs)
            if wal.end != self._checkpoint:  # an idle pass (e.g. GC finding nothing) writes nothing
                txn.put(index.CHECKPOINT, U64.pack(wal.end), db=self.dbs[index.SYS])
            txn.commit()
            self._checkpoint = wal.end
            if not durable:
                self._env_dirty = True
        except BaseException:
            txn.abort()
            wal.discard()
            raise
        for raw in raw_ops:
            for fn in raw.after_commit:
                try:
                    fn()
                except Exception as e:
                    self.logger.error("post-commit step failed: {error}", error=e)

    # -- completion (reactor thread) ------------------------------------------------------------

    def _deliver(self, group):
        self._drop_snapshot()
        log = self.log
        for op in group:
            self._queued_bytes -= op.nbytes
            try:
                if op.kind == K_BATCH and op.ok:
                    log._advance(op.a, op.value, int.from_bytes(op.b[9:13], "big", signed=True))
                if op.ok and op.raw is not None:
                    for fn in op.raw.on_reactor:
                        fn()
            except Exception:  # never leave the rest of the group unanswered
                self.logger.failure("store completion step failed")
            if op.ok:
                op.d.callback(op.value)
            elif op.value is not None:
                op.d.errback(op.value)
            else:
                op.d.callback(None)
        if self._drain_waiters and self._queued_bytes <= QUEUE_HIGH // 2:
            waiters, self._drain_waiters = self._drain_waiters, []
            for d in waiters:
                d.callback(None)

    # -- reads ----------------------------------------------------------------------------------

    def in_pool(self, fn, *args):
        if self.closed:
            return defer.fail(errors.StoreClosed("the store is closed"))
        return deferToThreadPool(self.reactor, self._pool, fn, *args)

    _rtxn = None

    def snapshot(self):
        """A read-only LMDB transaction for the synchronous reads of the reactor thread. One is
        reused until the next group is delivered (a begin per read costs more than the read), so
        every acknowledged write is visible and no snapshot outlives one group commit."""
        if threading.get_ident() != self._reactor_thread:
            return self.env.begin()  # another thread: its own snapshot, released when dropped
        txn = self._rtxn
        if txn is None:
            if self.closed and not self._writer.is_alive():
                raise errors.StoreClosed("the store is closed")
            txn = self._rtxn = self.env.begin()
        return txn

    def _drop_snapshot(self):
        txn, self._rtxn = self._rtxn, None
        if txn is not None:
            txn.abort()

    # -- close ----------------------------------------------------------------------------------

    def close(self) -> defer.Deferred:
        """Finish queued writes, sync everything, stop the threads; fires when done."""
        if self.closed:
            return defer.succeed(None)
        self.closed = True
        for loop in self._timers:
            if loop.running:
                loop.stop()
        stop = _Op(K_STOP, nbytes=0)
        self._queue.append(stop)
        with self._cond:
            self._cond.notify()
        done = defer.Deferred()

        def finish(_):
            self._writer.join()
            if self._presync is not None:
                self._presync.stop()
            self.log._close_waiters()
            self.chunks._close_waiters()
            self._pool.stop()
            self._drop_snapshot()
            self.wal.close()
            self.packs.close()
            self.env.close()
            self.logger.info("store closed")
            done.callback(None)

        stop.d.addBoth(finish)
        if not self._writer.is_alive():  # it died (logged then): nobody will take the stop
            with self._cond:
                self._queue.clear()
            stop.d.callback(None)
        return done
