"""Key-value and metadata scans against a sorted model, including keys longer than LMDB's key limit
(stored as a 440-byte prefix + hash) that share long prefixes."""

import shutil
import tempfile
import unittest

import pytest
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


def open_kv_store(path, fsync="never"):
    return Store.open(str(path), fsync=fsync, reactor=reactor, node_id=1, retention_check_s=0)


@pytest_twisted.ensureDeferred
async def test_write_many_applies_a_run_in_order():
    """One call, one Deferred: puts answer True, removes whether the key existed at that point of
    the run; later ops of the run see earlier ones (duplicates: the last write wins)."""
    d = tempfile.mkdtemp(prefix="storage-kv-")
    st = open_kv_store(d)
    try:
        long_a, long_b = LONG + b"zzzzz-a", LONG + b"zzzzz-b"  # share their first 440 bytes
        results = await st.kv.write_many([
            (b"a", b"1"), (b"b", b"2"), (b"a", None), (b"a", None), (b"c", bytearray(b"3")),
            (b"b", b"22"), (memoryview(b"d"), b""), (long_a, b"la"), (long_b, b"lb"), (long_a, None),
            (b"gone", None),
        ])
        assert results == [True, True, True, False, True, True, True, True, True, True, False]
        assert st.kv.get_many([b"a", b"b", b"c", b"d", long_a, long_b, b"gone"]) == [
            None, b"22", b"3", b"", None, b"lb", None]
        assert st.kv.get_many([bytearray(b"b"), memoryview(long_b)]) == [b"22", b"lb"]
        assert [k for k, _ in st.kv.scan_forward(None, 10)] == [b"b", b"c", b"d", long_b]
        assert await st.kv.write_many([(b"x%d" % i, b"v") for i in range(300)]) == [True] * 300
        assert await st.kv.put(b"p", b"q") is None
        assert await st.kv.delete(b"p") is True and await st.kv.delete(b"p") is False
    finally:
        await st.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest_twisted.ensureDeferred
async def test_write_many_refuses_a_bad_op_before_anything_is_queued():
    from storage import errors

    d = tempfile.mkdtemp(prefix="storage-kv-")
    st = open_kv_store(d)
    try:
        for bad, exc in [((b"", b"v"), errors.InvalidRequest), ((b"k" * 65536, b"v"), errors.InvalidRequest),
                         ((b"k", b"v" * ((16 << 20) + 1)), errors.PayloadTooLarge), ((b"", None), errors.InvalidRequest),
                         (("text", b"v"), errors.InvalidRequest), ((None, None), errors.InvalidRequest)]:
            with pytest.raises(exc):
                await st.kv.write_many([(b"ok", b"v"), bad])
        assert st.kv.get(b"ok") is None and st.queued_bytes() == 0
    finally:
        await st.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("fsync", ["never", "interval:1000", "always"])
@pytest_twisted.ensureDeferred
async def test_kv_writes_go_to_the_wal_and_the_memtable_then_to_lmdb_on_flush(fsync):
    """Under every policy a kv write is a WAL entry and a memtable entry (LMDB untouched: the
    checkpoint stays before it); the merge puts it in LMDB and moves the checkpoint. Either way a
    reopen (and a WAL replay past the checkpoint) keeps them."""
    from storage import index

    d = tempfile.mkdtemp(prefix="storage-kv-")
    st = open_kv_store(d, fsync)
    try:
        start = st.wal.end
        await st.kv.write_many([(b"k%d" % i, b"v%d" % i) for i in range(50)] + [(b"k0", None)])
        assert st.wal.end > start
        assert st.snapshot().stat(st.dbs[index.KV])["entries"] == 0 and st.kv.memtable_keys() == 50
        assert st.kv.get_many([b"k0", b"k1", b"k49"]) == [None, b"v1", b"v49"]
        await st.kv.flush()
        assert st.snapshot().stat(st.dbs[index.KV])["entries"] == 49 and st.kv.memtable_keys() == 0
        await st.kv.write_many([(b"k1", None), (b"late", b"x")])  # unmerged at close: replayed at open
        await st.meta.transact(lambda t: t.put("t", b"m", 1))  # a later WAL entry, replayed on open
        await st.close()
        st = open_kv_store(d, fsync)
        assert st.kv.get_many([b"k0", b"k1", b"k2", b"k49", b"late"]) == [None, None, b"v2", b"v49", b"x"]
        assert st.meta.read(lambda t: t.get("t", b"m")) == 1
    finally:
        await st.close()
        shutil.rmtree(d, ignore_errors=True)


def test_a_merge_started_inside_a_group_delivery_keeps_the_floor_below_the_rest_of_it(tmp_path, monkeypatch):
    """Found by tests/test_storage_kv_crash.py: the memtable passing its size as one run of a
    group lands (so the freeze happens in the middle of the group's delivery) while a later run
    of the same group has not landed yet. That run goes to the new active memtable; the merge's
    floor must stay at or below its WAL entry (it was the end of the group being delivered, so the
    checkpoint passed the run: a crash after the merge lost it)."""
    from twisted.internet import task

    import storage.kv as kvmod
    from tests.storage_helpers.inline import close, complete, hold, open_inline

    monkeypatch.setattr(kvmod, "FLUSH_BYTES", 1000)  # the first run alone passes it
    path = tmp_path / "store"
    store = open_inline(path, task.Clock())
    hold(store)
    first = store.kv.write_many([(b"a", b"1" * 2000)])
    second = store.kv.write_many([(b"b", b"2")])
    complete(store, None)  # one group: the first run lands, the merge starts, then the second lands
    assert first.called and second.called
    assert store.kv.flushes == 1 and store.kv.memtable_keys() == 1  # b is in the new active memtable
    # a crash now: the core stops without the clean close's merge of the active memtable
    hold(store, False)
    store.core.close()
    reopened = open_inline(path, task.Clock())
    try:
        assert reopened.kv.get_many([b"a", b"b"]) == [b"1" * 2000, b"2"]
    finally:
        close(reopened)


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.integers(1, 70).flatmap(lambda n: st.sets(st.binary(min_size=n, max_size=n), max_size=60)),
    st.sets(keys, max_size=40),
))
def test_sorted_items_is_bytes_order(ks):
    """The merge's numpy sort (keys of one length: unsigned integers or fixed-width strings, with
    zero bytes anywhere) and its fallback (several lengths, or over 64 bytes) give sorted(), and
    each value stays with its key."""
    from storage.kv import sorted_items

    entries = {k: (None if i % 3 == 0 else b"v%d" % i) for i, k in enumerate(ks)}
    keys, values = sorted_items(entries)
    assert keys == sorted(ks)
    assert values == [entries[k] for k in keys]


@pytest.mark.parametrize("mixed", ["plain", "removes", "long keys"])
def test_a_merge_with_and_without_removes_and_long_keys(tmp_path, mixed):
    """A memtable of SETs of short keys only is merged without looking for removes or long keys
    (``_Memtable.plain``); one run with a remove or a key over 440 bytes makes it look again."""
    from twisted.internet import task

    from tests.storage_helpers.inline import close, open_inline

    store = open_inline(tmp_path / "store", task.Clock())
    try:
        model = {}
        ops = [(bytes([i % 256, 0, i // 256, 0]), b"v%d" % i) for i in range(600)]
        if mixed == "removes":
            ops += [(bytes([i % 256, 0, i // 256, 0]), None) for i in range(0, 600, 7)]
        elif mixed == "long keys":
            ops += [(LONG + bytes([i]) * 9, b"long%d" % i) for i in range(20)]
        store.kv.write_many(ops[:300])
        assert store.kv._active.plain
        store.kv.write_many(ops[300:])
        assert store.kv._active.plain == (mixed == "plain")
        for k, v in ops:
            if v is None:
                model.pop(k, None)
            else:
                model[k] = v
        store.kv.flush()
        assert store.kv.memtable_keys() == 0 and store.kv.flushes == 1
        assert store.kv.scan_forward(None, 10_000) == sorted(model.items())
        assert store.kv.get_many(list(model)) == list(model.values())
    finally:
        close(store)


def test_the_merge_timer_waits_for_a_pause_in_writes(tmp_path, monkeypatch):
    """A memtable under FLUSH_BYTES is merged once no write landed for a whole FLUSH_IDLE_S (1 to 2
    of them after the last write: the timer is looked at once per period, not reset per write),
    not FLUSH_IDLE_S after the first while writes go on; FLUSH_MAX_AGE_S after the first at the
    latest."""
    from twisted.internet import task

    import storage.kv as kvmod
    from tests.storage_helpers.inline import close, open_inline

    monkeypatch.setattr(kvmod, "FLUSH_IDLE_S", 1.0)
    monkeypatch.setattr(kvmod, "FLUSH_MAX_AGE_S", 5.0)
    clock = task.Clock()
    store = open_inline(tmp_path / "store", clock)
    try:
        for i in range(3):  # a write every 0.6 s: never a pause of 1 s
            store.kv.write_many([(b"k%d" % i, b"v")])
            clock.advance(0.6)
        assert store.kv.flushes == 0
        clock.advance(0.9)
        assert store.kv.flushes == 0  # the timer of t=2.0 saw the write of t=1.2
        clock.advance(1.1)  # the pause: the timer of t=3.0 sees none
        assert store.kv.flushes == 1 and store.kv.memtable_keys() == 0
        for i in range(20):  # writes every 0.5 s for 10 s: merged by age
            store.kv.write_many([(b"a%d" % i, b"v")])
            clock.advance(0.5)
        assert store.kv.flushes in (2, 3)  # at 5 s after the first write (and again by then)
    finally:
        close(store)


# -- the merge worker process (storage/kv_merge.py) ---------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_the_merge_worker_takes_every_run_of_a_group_whose_delivery_froze_the_memtable(monkeypatch):
    """Two runs committed as one group; the second one's landing passes FLUSH_BYTES and freezes the
    memtable in the middle of the group's delivery (``delivered_wal_end`` is still the previous
    group's end). The worker's WAL range must reach the end of this group (``landing_wal_end``):
    once the merge landed and the frozen memtable is dropped, LMDB itself holds both runs, and so
    does a store reopened after the core stopped without merging (a crash's view)."""
    import storage.kv as kvmod
    from storage import index

    monkeypatch.setattr(kvmod, "FLUSH_BYTES", 1000)
    d = tempfile.mkdtemp(prefix="storage-kv-")
    st = open_kv_store(d, "always")
    try:
        st.core.hold_wakeups()  # both runs queued before the writer wakes: one group
        first = st.kv.write_many([(b"a", b"1")])
        second = st.kv.write_many([(b"b", b"2" * 2000)])
        third = st.kv.write_many([(b"c", b"3")])  # lands after the freeze: the new active memtable
        st.core.release_wakeups()
        await defer.gatherResults([first, second, third])
        await st.kv.flush()  # the running merge (of a and b)
        assert st.kv.flushes == 1 and st.kv.memtable_keys() == 1  # c only
        assert st.kv.get_many([b"a", b"b", b"c"]) == [b"1", b"2" * 2000, b"3"]
        await st.kv.flush()  # the one of c
        assert st.kv.worker_merges >= 1 and st.kv.memtable_keys() == 0
        txn = st.snapshot()
        assert [txn.get(k, db=st.dbs[index.KV]) for k in (b"a", b"b", b"c")] == [b"\x001", b"\x00" + b"2" * 2000, b"\x003"]
        await st.kv.write_many([(b"a", None), (b"d", b"4")])
        await st.core.close()  # no merge of the last run: the WAL replays it
        st = open_kv_store(d, "always")
        assert st.kv.get_many([b"a", b"b", b"c", b"d"]) == [None, b"2" * 2000, b"3", b"4"]
    finally:
        await st.close()
        shutil.rmtree(d, ignore_errors=True)


@pytest_twisted.ensureDeferred
async def test_a_failing_merge_worker_leaves_the_merge_to_the_writer(monkeypatch):
    """A worker that cannot start (or fails, or dies) fails its merge: the writer thread merges
    that memtable instead, nothing is lost; after MAX_WORKER_FAILURES in a row the writer merges
    every later one without asking the worker again."""
    import storage.kv as kvmod
    import storage.kv_merge as mergemod

    calls = []

    def broken_spawn(self):
        calls.append(1)
        raise mergemod.MergeError("no worker today")

    monkeypatch.setattr(mergemod.MergeWorker, "_spawn", broken_spawn)
    d = tempfile.mkdtemp(prefix="storage-kv-")
    st = open_kv_store(d, "never")
    try:
        model = {}
        for i in range(kvmod.MAX_WORKER_FAILURES + 2):
            ops = [(b"k%d-%d" % (i, j), b"v%d" % j) for j in range(20)] + [(b"k%d-0" % (i - 1), None)]
            await st.kv.write_many(ops)
            for k, v in ops:
                if v is None:
                    model.pop(k, None)
                else:
                    model[k] = v
            await st.kv.flush()
            assert st.kv.memtable_keys() == 0
            assert st.kv.get_many(sorted(model)) == [model[k] for k in sorted(model)]
        assert st.kv.worker_merges == 0 and st.kv.flushes == kvmod.MAX_WORKER_FAILURES + 2
        tries = len(calls)
        assert tries >= kvmod.MAX_WORKER_FAILURES
        await st.kv.write_many([(b"late", b"x")])
        await st.kv.flush()
        assert len(calls) == tries  # not asked again
        assert st.kv.scan_forward(None, 1000) == sorted(list(model.items()) + [(b"late", b"x")])
    finally:
        await st.close()
        shutil.rmtree(d, ignore_errors=True)


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.integers(1, 70).flatmap(lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=1, max_size=40)),
    st.lists(keys, max_size=30),
), st.integers(0, 3000), st.data())
def test_the_merge_workers_last_writes_are_bytes_order_and_last_wins(ks, copies, data):
    """The merge worker's sort (storage/kv_merge.py ``last_writes``: keys of one length by a stable
    numpy argsort, the last write of each key kept; else a dict and sorted()) against a dict of
    the writes in order, with keys written several times (deletes as None) and zero bytes anywhere;
    ``copies`` repeats the writes past the numpy path's threshold."""
    from storage.kv_merge import last_writes

    writes = [(k, None if i % 5 == 0 else b"v%d" % i) for i, k in enumerate(ks)]
    writes += data.draw(st.lists(st.sampled_from(writes), max_size=20)) if writes else []
    writes = [(k, v) for _ in range(1 + copies // max(1, len(writes))) for k, v in writes]
    writes += [(k, b"w%d" % i) for i, (k, _) in enumerate(writes[-3:])]
    model = dict(writes)
    got_keys, got_values = last_writes([k for k, _ in writes], [v for _, v in writes])
    assert got_keys == sorted(model)
    assert got_values == [model[k] for k in got_keys]
