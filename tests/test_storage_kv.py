"""Key-value and metadata scans against a sorted model, including keys longer than LMDB's key limit
(stored as a 440-byte prefix + hash) that share long prefixes."""

import shutil
import tempfile
import unittest

import pytest_twisted
from hypothesis import given, settings, strategies as st
from twisted.internet import defer, reactor

from storage import Store
from storage.kv import partition_bounds, partition_of

LONG = b"p" * 436

# tails over a tiny alphabet, so long keys often share their first 440 bytes and differ after
tail = st.lists(st.sampled_from([b"\x00", b"a", b"b"]), max_size=14).map(b"".join)
keys = st.one_of(
    st.binary(min_size=1, max_size=6),
    st.builds(lambda t: LONG + t, tail),  # around the 440-byte edge
    st.builds(lambda t, n, u: LONG + t + b"z" * n + u, tail, st.integers(0, 300), tail),
)


def wait(d):
    return pytest_twisted.blockon(d)


class _Store:
    def __enter__(self):
        self.dir = tempfile.mkdtemp(prefix="storage-kv-")
        self.store = Store.open(self.dir, fsync="never", reactor=reactor, node_id=1, retention_check_s=0)
        return self.store

    def __exit__(self, *exc):
        wait(self.store.close())
        shutil.rmtree(self.dir, ignore_errors=True)


class KvScans(unittest.TestCase):
    """A stdlib TestCase (like hypothesis' state machines): pytest-twisted runs plain test functions
    in the reactor's greenlet, where ``blockon`` cannot wait."""

    @settings(max_examples=60, deadline=None)
    @given(st.lists(keys, min_size=1, max_size=40, unique=True), st.lists(keys, min_size=1, max_size=6),
           st.integers(1, 50), st.one_of(st.none(), st.binary(max_size=3)))
    def test_kv_scans_match_sorted_model(self, ks, starts, limit, prefix):
        check_scans(ks, starts, limit, prefix)


def check_scans(ks, starts, limit, prefix):
    with _Store() as store:
        wait(defer.gatherResults([store.kv.put(k, b"v" + k[-3:]) for k in ks]))
        model = sorted(ks)
        assert store.kv.get_many(ks) == [b"v" + k[-3:] for k in ks]
        assert [k for k, _ in store.kv.scan_forward(None, limit)] == model[:limit]
        assert [k for k, _ in store.kv.scan_backward(None, limit)] == model[::-1][:limit]
        for s in starts + ks[:3]:
            assert [k for k, _ in store.kv.scan_forward(s, limit)] == [k for k in model if k >= s][:limit]
            assert [k for k, _ in store.kv.scan_backward(s, limit)] == [k for k in model[::-1] if k <= s][:limit]
            want = [k for k in model if k >= max(s, prefix or b"") and k.startswith(prefix or b"")][:limit]
            assert store.kv.scan_keys(s, limit, prefix=prefix) == want

        def fill(txn):
            for k in ks:
                txn.put("t", k, {"k": k})
            txn.put("u", b"other", 1)

        wait(store.meta.transact(fill))
        got = store.meta.read(lambda t: t.scan("t"))
        assert [k for k, _ in got] == model and all(v == {"k": k} for k, v in got)
        assert [k for k, _ in store.meta.read(lambda t: t.scan("t", reverse=True, limit=limit))] == model[::-1][:limit]
        for s in starts:
            assert [k for k, _ in store.meta.read(lambda t: t.scan("t", start=s, limit=limit))] == \
                [k for k in model if k >= s][:limit]
            assert [k for k, _ in store.meta.read(lambda t: t.scan("t", start=s, reverse=True, limit=limit))] == \
                [k for k in model[::-1] if k <= s][:limit]
        if prefix:
            assert [k for k, _ in store.meta.read(lambda t: t.scan("t", prefix=prefix))] == \
                [k for k in model if k.startswith(prefix)]
            assert [k for k, _ in store.meta.read(lambda t: t.scan("t", prefix=prefix, reverse=True))] == \
                [k for k in model[::-1] if k.startswith(prefix)]
        for k in ks[:5]:
            assert wait(store.kv.delete(k)) is True
            assert store.kv.get(k) is None


def test_partitions():
    assert [partition_of(bytes([b])) for b in (0, 31, 32, 224, 255)] == [0, 0, 1, 7, 7]
    assert partition_bounds(0) == (b"\x00", b"\x20") and partition_bounds(7) == (b"\xe0", None)
