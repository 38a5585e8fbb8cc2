"""The memtable's lazily built dict (storage/kv.py ``_Memtable``): landed runs are kept as they are
and folded into the dict when something reads ``entries``; ``writes`` hands the row cache the runs
in order without folding (a packed run as its op bytes); ``sorted_keys`` stays the key order of
everything landed. Checked against a plain dict model with hypothesis: runs of puts and removes
(plain dicts, as ``write_many`` lands them, and ``PackedRun``s, from lists or from their op as the
compiled SET pass makes them), reads, scans and ``writes`` interleaved; and the row cache's update
from those parts (its kernel ``update_ops`` parsing the ops) against the same model."""

import os

import msgpack
import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer

from storage import kv_cache
from storage.index import KV, OP_PUTS
from storage.kv import PackedRun, _Memtable

keys = st.binary(min_size=1, max_size=3)
stored = st.one_of(st.none(), st.binary(max_size=4).map(lambda v: b"\x00" + v))
dict_run = st.dictionaries(keys, stored, min_size=1, max_size=6)
packed_run = st.lists(st.tuples(keys, st.binary(max_size=4).map(lambda v: b"\x00" + v)), min_size=1, max_size=6)
step = st.one_of(
    st.tuples(st.just("dict"), dict_run),
    st.tuples(st.just("packed"), packed_run),
    st.tuples(st.just("op"), packed_run),
    st.tuples(st.just("read"), st.none()),
    st.tuples(st.just("scan"), st.none()),
    st.tuples(st.just("writes"), st.none()),
    st.tuples(st.just("fold"), st.integers(0, 4)),
)


def _last_writes(parts):
    out = {}
    for part in parts:
        if part.__class__ is tuple:
            ks, vs = part
        else:
            code, db, ks, vs = msgpack.unpackb(part)
            assert (code, db) == (OP_PUTS, KV)
        for k, v in zip(list(ks), list(vs)):
            out[k] = v
    return out


def _packed(pairs):
    keys, stored = [k for k, _ in pairs], [v for _, v in pairs]
    return PackedRun.of_op(msgpack.packb([OP_PUTS, KV, keys, stored], use_bin_type=True), len(keys))


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=25))
def test_lazy_memtable_against_a_dict(steps):
    table = _Memtable()
    model = {}
    landed = 0
    for kind, arg in steps:
        if kind == "dict":
            table.land(dict(arg))
            model.update(arg)
            landed += len(arg)
        elif kind == "packed":
            run = PackedRun([k for k, _ in arg], [v for _, v in arg])
            if landed % 2:
                run.mapping()  # a GET of the connection's pending write looked in it first
            table.land(run)
            model.update(arg)
            landed += len(arg)
        elif kind == "op":
            run = _packed(arg)
            if landed % 3 == 1:
                run.get(arg[0][0])  # unpacked already (a GET of a pending write)
            table.land(run)
            model.update(arg)
            landed += len(arg)
        elif kind == "read":
            assert table.entries == model
        elif kind == "fold":
            table.fold(min(arg, len(table.landed)))  # a slice, as the store folds a backlog
        elif kind == "scan":
            assert list(table.sorted_keys()) == sorted(model)
        else:
            assert _last_writes(table.writes()) == model
        assert table.empty() == (not model)
        assert table.count() >= len(model)
    assert _last_writes(table.writes()) == model
    assert table.entries == model
    assert list(table.sorted_keys()) == sorted(model)
    assert table.count() == len(model)  # folded: exact


@pytest.fixture(scope="module")
def kernel():
    from storage.jit import import_compiled

    mod, why = import_compiled(kv_cache.KERNELS)
    if mod is None:
        pytest.skip("no numba: %s" % why)
    return mod


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("dict"), dict_run), st.tuples(st.just("op"), packed_run)), min_size=1,
                max_size=40))
def test_row_cache_takes_the_parts_in_order(kernel, runs):
    """A merged memtable's parts (runs of puts and removes, packed ops among them) leave the row
    cache with each key's last write: its value, or no entry for a remove."""
    table = _Memtable()
    model = {}
    for kind, arg in runs:
        table.land(dict(arg) if kind == "dict" else _packed(arg))
        model.update(arg)
    cache = kv_cache.RowCache(1 << 20, kernel)
    old = kv_cache.UPDATE_OPS
    kv_cache.UPDATE_OPS = 3  # several kernel calls per merge
    try:
        cache.merged(table.writes())
    finally:
        kv_cache.UPDATE_OPS = old
    for key, stored in model.items():
        e = kernel.find(cache.slots, cache.arena, cache.meta, key)
        if stored is None:
            assert e < 0
        else:
            n = kernel.value_len(cache.arena, e)
            assert e >= 0 and bytes(cache.arena[e + 6 + len(key): e + 6 + len(key) + n]) == stored[1:]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=2, max_size=2), st.one_of(st.none(), st.binary(max_size=40))), min_size=1,
                max_size=300), st.integers(1, 7), st.integers(1, 200))
def test_the_workers_merge_through_the_order_writes_what_the_sorted_lists_do(tmp_path_factory, writes, chunk_keys,
                                                                             chunk_bytes):
    """The merge worker's ``merge_into`` through ``last_write_order`` (no sorted lists; the chunks'
    cuts from cumulative sizes) leaves LMDB as the sorted lists of ``last_writes`` do, chunk for
    chunk: the same pairs and the same number of transactions."""
    from storage import index, kv_merge

    keys = [k for k, _ in writes]
    values = [None if v is None else b"\x00" + v for _, v in writes]
    old = kv_merge._NUMPY_FROM
    kv_merge._NUMPY_FROM = 1
    try:
        take = kv_merge.last_write_order(keys)
    finally:
        kv_merge._NUMPY_FROM = old
    assert take is not None
    got = []
    for how in ("lists", "order"):
        env, dbs = index.open_env(str(tmp_path_factory.mktemp(how)), sync=False)
        db = dbs[index.KV]
        with env.begin(write=True) as txn:  # something to delete and to overwrite
            for k in set(keys[::2]):
                txn.put(k, b"\x00old", db=db)
        if how == "lists":
            ks, vs = kv_merge.last_writes(keys, values)
            txns = kv_merge.merge_into(env, db, ks, vs, chunk_keys, chunk_bytes, os.getppid())
        else:
            txns = kv_merge.merge_into(env, db, keys, values, chunk_keys, chunk_bytes, os.getppid(), take)
        with env.begin() as txn:
            got.append((txns, list(txn.cursor(db=db))))
        env.close()
    assert got[0] == got[1]


@pytest_twisted.ensureDeferred
async def test_an_unread_backlog_is_folded_in_slices_once_writes_pause(tmp_path, monkeypatch):
    """A burst nobody reads stays unfolded while it goes on; once writes pause, the store folds
    the backlog in slices (``KeyValue._fold_idle``), so a later read does not pay it at once."""
    from twisted.internet import reactor

    from storage import FsyncPolicy, Store, kv
    from tests.waiting import reactor_until

    monkeypatch.setattr(kv, "FOLD_BACKLOG", 8)
    monkeypatch.setattr(kv, "FOLD_SLICE", 3)
    st = Store.open(str(tmp_path), fsync=FsyncPolicy.parse("interval:1000"), reactor=reactor, node_id=7)
    await defer.DeferredList([st.kv.write_many([(b"k%d" % i, b"v%d" % i)]) for i in range(40)])
    active = st.kv._active
    assert active.landed  # nothing read it
    await reactor_until(lambda: not st.kv._active.landed, timeout=10, what="the backlog folded")
    assert active._dict == {b"k%d" % i: b"\x00v%d" % i for i in range(40)}
    assert [st.kv.get(b"k%d" % i) for i in range(40)] == [b"v%d" % i for i in range(40)]
    await st.close()
