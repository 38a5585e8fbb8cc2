"""Hypothesis model test: the record log against a plain in-memory model, with reopen as an action.

Runs against a real store in a temp dir (real files, the real writer thread); Deferreds are waited
for with ``pytest_twisted.blockon``.
"""

import shutil
import tempfile

import pytest_twisted
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from twisted.internet import defer, reactor

from storage import Store, errors
from storage import record_batch as rb
from tests.storage_helpers.util import batch


def wait(d):
    return pytest_twisted.blockon(d)


def fails(d, exc):
    try:
        wait(d)
    except exc:
        return True
    return False


class LogModel(RuleBasedStateMachine):
    """Model per stream: list of (base, count, bytes-after-base), trim point, ranges."""

    @initialize()
    def setup(self):
        self.dir = tempfile.mkdtemp(prefix="storage-model-")
        self.store = self._open()
        self.streams = {}  # sid -> dict(batches=[(base, count, tail)], trim, ranges=[[idx, start, end]])
        self.create()
        self.create()

    def _open(self):
        # tiny segments so appends roll segments and retention/GC paths see several files
        return Store.open(self.dir, fsync="never", reactor=reactor, node_id=3, segment_bytes=4096,
                          retention_check_s=0)

    def teardown(self):
        if getattr(self, "store", None) is not None:
            wait(self.store.close())
        shutil.rmtree(self.dir, ignore_errors=True)

    def _next(self, m):
        return m["batches"][-1][0] + m["batches"][-1][1] if m["batches"] else m["trim"]

    @rule()
    def create(self):
        meta = wait(self.store.log.create_stream())
        self.streams[meta.stream_id] = {"batches": [], "trim": 0, "ranges": [[0, 0, -1]], "next": 0}

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), n=st.integers(1, 5), size=st.integers(0, 3000), k=st.integers(1, 4))
    def append(self, data, n, size, k):
        sid = data.draw(st.sampled_from(sorted(self.streams)))
        m = self.streams[sid]
        bs = [batch(n, size, tag=i) for i in range(k)]
        bases = wait(defer.gatherResults([self.store.log.append(sid, b) for b in bs]))
        for b, base in zip(bs, bases):
            assert base == m["next"]
            m["batches"].append((base, n, b[9:]))
            m["next"] = base + n

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), max_bytes=st.integers(0, 20000))
    def read(self, data, max_bytes):
        sid = data.draw(st.sampled_from(sorted(self.streams)))
        m = self.streams[sid]
        offset = data.draw(st.integers(max(0, m["trim"] - 2), m["next"] + 2))
        d = self.store.log.read(sid, offset, max_bytes)
        if offset < m["trim"] or offset > m["next"]:
            assert fails(d, errors.OffsetOutOfRange)
            return
        got = wait(d)
        if offset == m["next"]:
            assert got == []
            return
        expect, total = [], 0
        for base, count, tail in m["batches"]:
            if base + count <= offset:
                continue
            if expect and total >= max_bytes:
                break
            expect.append((base, tail))
            total += 9 + len(tail)
        assert [(rb.read_header(g).base_offset, g[9:]) for g in got] == expect
        for g in got:
            rb.validate(g)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def trim(self, data):
        sid = data.draw(st.sampled_from(sorted(self.streams)))
        m = self.streams[sid]
        offset = data.draw(st.integers(0, m["next"] + 3))
        meta = wait(self.store.log.trim(sid, offset))
        point = max(m["trim"], min(offset, m["next"]))
        m["trim"] = point
        m["batches"] = [b for b in m["batches"] if b[0] + b[1] > point]
        keep = [r for r in m["ranges"][:-1] if not (0 <= r[2] <= point)] + [m["ranges"][-1]]
        keep[0][1] = max(keep[0][1], point)
        m["ranges"] = keep
        assert meta.trim_offset == point

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def seal(self, data):
        sid = data.draw(st.sampled_from(sorted(self.streams)))
        m = self.streams[sid]
        idx = data.draw(st.sampled_from([r[0] for r in m["ranges"]] + [99]))
        d = self.store.log.seal_range(sid, idx)
        r = [r for r in m["ranges"] if r[0] == idx]
        if not r:
            assert fails(d, errors.RangeNotFound)
        elif r[0][2] >= 0:
            assert fails(d, errors.RangeAlreadySealed)
        else:
            sealed, new = wait(d)
            r[0][2] = m["next"]
            m["ranges"].append([idx + 1, m["next"], -1])
            assert (sealed.end_offset, new.range_index, new.start_offset) == (m["next"], idx + 1, m["next"])

    @rule()
    def collect(self):
        wait(self.store.log.gc_now())

    @rule()
    def reopen(self):
        wait(self.store.close())
        self.store = self._open()

    @invariant()
    def metadata_matches(self):
        if not hasattr(self, "store"):
            return
        assert sorted(s.stream_id for s in self.store.log.streams()) == sorted(self.streams)
        for sid, m in self.streams.items():
            meta = self.store.log.stream(sid)
            assert (meta.trim_offset, meta.next_offset) == (m["trim"], m["next"])
            assert [[r.range_index, r.start_offset, r.end_offset] for r in meta.ranges] == m["ranges"]
            assert [(b, c) for b, c, _ in self.store.log.batches(sid, m["trim"], 1 << 20)] == \
                [(b, c) for b, c, _ in m["batches"]]
        # the per-segment live byte counts match what the index points at
        from storage import index

        st = self.store
        want = {}
        with st.env.begin() as txn:
            for _, v in txn.cursor(db=st.dbs[index.INDEX]):
                pos, total = index.INDEX_VAL.unpack(v)[:2]
                seg = st.wal.segment_of(pos)
                want[seg] = want.get(seg, 0) + total
            have = {index.U64.unpack(k)[0]: index.U64.unpack(v)[0] for k, v in txn.cursor(db=st.dbs[index.SEGLIVE])}
        assert have == want


LogModel.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_log_model = LogModel.TestCase
