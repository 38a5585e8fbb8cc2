"""Hypothesis model test of the chunk store: puts (pinned or not), references taken and dropped in
metadata transactions, sweeps (with pack compaction) and reopen, against a plain model."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import pytest_twisted
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from twisted.internet import reactor

from storage import Store, errors

DATAS = [bytes([i]) * n for i, n in enumerate([1, 700, 2500, 3900, 2048])]


def wait(d):
    return pytest_twisted.blockon(d)


class ChunkModel(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.dir = tempfile.mkdtemp(prefix="storage-chunks-")
        self.store = self._open()
        self.present = {}  # addr -> (seq, data)
        self.pinned = set()
        self.refs = {}
        self.last_seq = 0

    def _open(self):
        # 8 KiB packs: a few chunks each, so sweeps delete and compact packs
        return Store.open(self.dir, fsync="never", reactor=reactor, node_id=1, pack_bytes=8 << 10,
                          retention_check_s=0, chunk_grace_s=0)

    def teardown(self):
        if getattr(self, "store", None) is not None:
            wait(self.store.close())
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(i=st.integers(0, len(DATAS) - 1), pin=st.booleans())
    def put(self, i, pin):
        data = DATAS[i]
        addr = wait(self.store.chunks.put(data, pin=pin))
        assert addr == hashlib.sha256(data).digest()
        if addr not in self.present:
            self.last_seq += 1
            self.present[addr] = (self.last_seq, data)
        if pin:
            self.pinned.add(addr)

    @rule(idx=st.lists(st.integers(0, len(DATAS) - 1), max_size=6), pin=st.booleans(), known=st.booleans())
    def put_many(self, idx, pin, known):
        datas = [DATAS[i] for i in idx]
        addrs = [hashlib.sha256(d).digest() for d in datas]
        got = wait(self.store.chunks.put_many(datas, pin=pin, addrs=addrs if known else None))
        assert got == addrs
        for addr, data in zip(addrs, datas):  # new ones take sequence numbers in call order
            if addr not in self.present:
                self.last_seq += 1
                self.present[addr] = (self.last_seq, data)
            if pin:
                self.pinned.add(addr)

    @rule(idx=st.lists(st.integers(0, len(DATAS) - 1), min_size=1, max_size=3), up=st.booleans())
    def reference(self, idx, up):
        addrs = [hashlib.sha256(DATAS[i]).digest() for i in idx]

        def fn(txn):
            (txn.chunk_incref if up else txn.chunk_decref)(addrs)

        wait(self.store.meta.transact(fn))
        for a in addrs:
            self.refs[a] = self.refs.get(a, 0) + 1 if up else max(0, self.refs.get(a, 0) - 1)

    @rule()
    def sweep(self):
        wait(self.store.chunks.sweep_now())
        for addr in list(self.present):
            if self.refs.get(addr, 0) == 0 and addr not in self.pinned:
                del self.present[addr]

    @rule()
    def reopen(self):
        wait(self.store.close())
        self.store = self._open()

    @invariant()
    def matches(self):
        if not hasattr(self, "store"):
            return
        chunks = self.store.chunks
        addrs = [hashlib.sha256(d).digest() for d in DATAS]
        assert chunks.has_many(addrs) == [a in self.present for a in addrs]
        assert chunks.last_seq() == self.last_seq
        assert chunks.by_seq(0, 1 << 40, 1000) == sorted((seq, a) for a, (seq, _) in self.present.items())
        unknown = hashlib.sha256(b"never stored").digest()
        assert wait(chunks.get_many(addrs + [unknown, b"short"])) == [
            self.present[a][1] if a in self.present else None for a in addrs] + [None, None]
        for a in addrs:
            if a in self.present:
                assert wait(chunks.get(a)) == self.present[a][1]
                assert wait(chunks.get(a, 1, 10)) == self.present[a][1][1:11]
                size, seq, pinned, ref = chunks.info(a)
                assert (seq, pinned, ref) == (self.present[a][0], a in self.pinned, self.refs.get(a, 0))
            else:
                try:
                    wait(chunks.get(a))
                    raise AssertionError("a swept chunk was served")
                except errors.ChunkNotFound:
                    pass
                assert self.store.meta.read(lambda t: t.chunk_refcount(a)) == self.refs.get(a, 0)


ChunkModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_chunk_model = ChunkModel.TestCase


# ---------------------------------------------------------------------------------------------
# batched puts and reads (the swarm sync path)


@pytest_twisted.inlineCallbacks
def test_put_many_get_many_spans_and_corruption(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path / "s"), fsync="never", reactor=reactor, node_id=1, pack_bytes=64 << 10,
                       retention_check_s=0)
    try:
        datas = [bytes([i]) * (3000 + i) for i in range(60)]  # ~180 KiB: three 64 KiB packs
        addrs = yield store.chunks.put_many(datas, pin=True)
        assert addrs == [hashlib.sha256(d).digest() for d in datas]
        assert store.chunks.last_seq() == 60
        assert store.chunks.by_seq(1, 60, 100) == list(zip(range(1, 61), addrs))
        assert len(store.packs.fds) == 3
        # again, with a duplicate inside the call: nothing new, same answer
        again = yield store.chunks.put_many(datas[:3] + datas[:1], pin=True)
        assert again == addrs[:3] + addrs[:1] and store.chunks.last_seq() == 60

        spans = []
        read_span = store.packs.read_span
        monkeypatch.setattr(store.packs, "read_span", lambda *a: spans.append(a) or read_span(*a))
        order = list(reversed(addrs)) + [hashlib.sha256(b"x").digest()]
        got = yield store.chunks.get_many(order)
        assert got == list(reversed(datas)) + [None]
        assert len(spans) == 3  # back-to-back entries: one pread per pack

        # flip a byte of chunk 5: it alone is refused, its neighbours are still served
        pack_id, pos = store.packs.active, None
        with store.env.begin() as txn:
            from storage import index
            from storage.chunks import CHUNK_VAL
            pack_id, pos = CHUNK_VAL.unpack(txn.get(addrs[5], db=store.dbs[index.CHUNKS]))[:2]
        os.pwrite(store.packs.fds[pack_id], b"\xff", pos + 100)
        got = yield store.chunks.get_many(addrs[4:7])
        assert got[0] == datas[4] and got[2] == datas[6]
        assert isinstance(got[1], errors.DataCorrupted)

        with pytest.raises(errors.InvalidRequest):
            yield store.chunks.put_many([b"a"], addrs=[])
        assert (yield store.chunks.put_many([])) == []
        assert (yield store.chunks.get_many([])) == []
    finally:
        yield store.close()


CRASH_CHILD = """
import os, sys
from twisted.internet import defer, task
from storage import Store

@defer.inlineCallbacks
def main(reactor):
    store = Store.open(sys.argv[1], fsync="always", reactor=reactor, node_id=1)
    i = 0
    while True:
        datas = [os.urandom(4096) for _ in range(64)]
        addrs = yield store.chunks.put_many(datas, pin=True)
        for a, d in zip(addrs, datas):
            sys.stdout.write("%s %s\\n" % (a.hex(), d[:16].hex()))
        sys.stdout.flush()
        i += 1

task.react(main)
"""


@pytest_twisted.inlineCallbacks
def test_put_many_acked_chunks_survive_kill9(tmp_path):
    """CONTRACT durability: a chunk put_many acknowledged under --fsync always survives SIGKILL."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = str(tmp_path / "s")
    proc = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, path], stdout=subprocess.PIPE, env=env)
    acked = []
    deadline = time.monotonic() + 30
    while len(acked) < 64 * 8 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        acked.append(line.split())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(acked) >= 64 * 8, "the child acked only %d chunks" % len(acked)

    store = Store.open(path, fsync="always", reactor=reactor, node_id=1)
    try:
        addrs = [bytes.fromhex(a.decode()) for a, _ in acked]
        got = yield store.chunks.get_many(addrs)
        for (a, head), data in zip(acked, got):
            assert isinstance(data, bytes), "acked chunk %s lost: %r" % (a, data)
            assert hashlib.sha256(data).digest().hex() == a.decode() and data[:16].hex() == head.decode()
        assert store.chunks.last_seq() >= len(acked)
    finally:
        yield store.close()
