"""Hypothesis model test of the chunk store: puts (pinned or not), references taken and dropped in
metadata transactions, sweeps (with pack compaction) and reopen, against a plain model."""

import hashlib
import shutil
import tempfile

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
