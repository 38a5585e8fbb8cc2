"""The key-value row cache (storage/kv_cache.py, issue 19): its kernels against a dict model, with
generations dropped all the time; the server's compiled GET pass reading through it over a real
store, with merges landing, overwrites, removes and restarts in between."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from twisted.internet import task
from twisted.internet.testing import StringTransport

from protocols.partition import codec as c
from protocols.partition import gets_compiled
from protocols.partition.server import KvServerFactory
from storage import kv_cache
from tests.storage_helpers.inline import close, open_inline


@pytest.fixture(scope="module")
def kernel():
    gets_compiled.start_loading()
    assert gets_compiled.wait(120) and gets_compiled.state == "compiled", gets_compiled.state
    return kv_cache.kernels()


def cached_value(cache, key):
    """What the cache holds for ``key``: its value, or None (not cached)."""
    k = cache.k
    e = k.find(cache.slots, cache.arena, cache.meta, key)
    if e < 0:
        return None
    n = int(cache.arena[e]) | int(cache.arena[e + 1]) << 8
    assert cache.arena[e + 6 : e + 6 + n].tobytes() == key
    vlen = k.value_len(cache.arena, e)
    return cache.arena[e + 6 + n : e + 6 + n + vlen].tobytes()


small_keys = st.binary(min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(limit=st.sampled_from([4096, 8192, 1 << 16]),
       batches=st.lists(st.lists(st.tuples(small_keys, st.one_of(st.none(), st.binary(max_size=300))), max_size=40),
                        max_size=12))
def test_kernels_never_answer_a_value_other_than_the_last(kernel, limit, batches):
    """Merged batches (values, removes, keys again) into a cache small enough that generations are
    dropped all the time: a key is either not cached or cached with its last value; a removed key
    is never cached; the arena and slots stay within the limit."""
    cache = kv_cache.RowCache(limit, kernel)
    model = {}
    for batch in batches:
        entries = {}
        for k, v in batch:
            entries[k] = None if v is None else b"\x00" + v
        cache.merged(entries)
        for k, v in entries.items():
            model[k] = None if v is None else v[1:]
        for k, v in model.items():
            got = cached_value(cache, k)
            assert got is None or got == v, (k, got, v)
            if v is None:
                assert got is None
    assert cache.slots.nbytes + cache.arena.nbytes <= max(limit, kv_cache.MIN_BYTES)
    meta = cache.meta
    for g in (0, 1):
        assert meta[kernel.M_POS + g] <= meta[kernel.M_ARENA]


def test_the_latest_merges_stay_cached_and_long_keys_never(kernel):
    """Generations: after many merges the newest entries are cached (the oldest dropped); keys over
    KEY_KEEP bytes are never cached."""
    cache = kv_cache.RowCache(1 << 16, kernel)
    keys = [struct.pack(">Q", i) for i in range(5000)]
    for i in range(0, 5000, 500):
        cache.merged({k: b"\x00v" + k for k in keys[i : i + 500]})
    assert cache.meta[kernel.M_DROPS] > 0
    assert all(cached_value(cache, k) == b"v" + k for k in keys[-200:])
    assert cached_value(cache, keys[0]) is None
    long = b"p" * 441
    cache.merged({long: b"\x00x"})
    assert cached_value(cache, long) is None


# -- through the server ---------------------------------------------------------------------------


def connect(store):
    proto = KvServerFactory(store.kv, store=store).buildProtocol(None)
    tr = StringTransport()
    proto.makeConnection(tr)
    return proto, tr


def get_all(store, keys):
    """GET ``keys`` (one length) in one read on a new idle connection: {key: value or None}."""
    proto, tr = connect(store)
    proto.dataReceived(b"".join(c.encode_get(i, k) for i, k in enumerate(keys)))
    data, pos, out = tr.value(), 0, {}
    for i, k in enumerate(keys):
        (total,) = struct.unpack_from(">Q", data, pos)
        r = c.decode_reply(data, c.GET, pos)
        assert r.client_id == i
        out[k] = r.items[0][1] if r.items else None
        if r.items:
            assert r.items[0][0] == k
        else:
            assert r.cmd == c.DATA_NOT_FOUND
        pos += total
    assert pos == len(data)
    return out


def wait_merged(store):
    d = store.kv.flush()
    assert d.called
    d = store.kv.flush()
    assert d.called and not store.kv.unmerged()


def test_gets_read_the_cache_only_where_it_holds_lmdbs_value(tmp_path, kernel):
    """Merged writes are cached at the merge (the next GETs are hits, not LMDB lookups); a key
    written again is read from the memtable until its merge lands, then from the cache with its
    new value; a removed key is not found; a key never written is looked up in LMDB (a miss) and
    then cached; a restart starts with an empty cache."""
    path = tmp_path / "store"
    store = open_inline(path, task.Clock())
    cache = store.kv.start_row_cache()
    assert cache is not None
    keys = [struct.pack(">Q", (i * 0x9E3779B97F4A7C15) & (2**64 - 1)) for i in range(300)]
    assert store.kv.write_sets(keys, [b"a" + k for k in keys]).called
    assert get_all(store, keys) == {k: b"a" + k for k in keys}  # from the memtable
    assert cache.hits == 0
    wait_merged(store)
    assert get_all(store, keys) == {k: b"a" + k for k in keys}
    assert (cache.hits, cache.misses) == (300, 0)
    # overwrite and remove some: the memtable first, then the merge updates the cache
    store.kv.write_many([(k, b"b" + k) for k in keys[:50]] + [(k, None) for k in keys[50:80]])
    want = {k: (b"b" + k if i < 50 else None if i < 80 else b"a" + k) for i, k in enumerate(keys)}
    assert get_all(store, keys) == want
    assert cache.hits == 300  # (the read holds memtable keys: not through the cache)
    assert get_all(store, keys[100:]) == {k: want[k] for k in keys[100:]}
    assert cache.hits == 500  # (none of these keys in a memtable: the cache)
    wait_merged(store)
    assert get_all(store, keys) == want
    assert (cache.hits, cache.misses) == (770, 30)  # the removed keys: not cached, looked up
    # keys never written: misses (looked up, not found); written since the merge, but the value is
    # in LMDB only after a merge, so a key is cached only from a merge or an LMDB read
    new = [b"new%05d" % i for i in range(20)]
    assert get_all(store, new) == {k: None for k in new}
    assert cache.misses == 50
    close(store)
    store = open_inline(path, task.Clock())
    cache = store.kv.start_row_cache()
    assert get_all(store, keys[:100]) == {k: want[k] for k in keys[:100]}
    assert (cache.hits, cache.misses) == (0, 100)
    assert get_all(store, keys[:100]) == {k: want[k] for k in keys[:100]}
    assert cache.hits == 70  # the 30 removed keys are not cached
    close(store)


def test_a_tiny_cache_evicts_and_still_answers_right(tmp_path, kernel):
    """A cache of 4 KiB (generations dropped every few dozen entries) over 2,000 keys: every GET
    right, some from the cache, some looked up again."""
    store = open_inline(tmp_path / "store", task.Clock())
    store.kv.row_cache_bytes = 4096
    cache = store.kv.start_row_cache()
    keys = [struct.pack(">I", i) for i in range(2000)]
    store.kv.write_sets(keys, [b"v%d" % i for i in range(2000)])
    wait_merged(store)
    for rnd in range(2):
        for i in range(0, 2000, 32):
            for again in range(2):  # (a read of 32 just missed fits in the newer generation)
                assert get_all(store, keys[i : i + 32]) == {k: b"v%d" % (i + j) for j, k in enumerate(keys[i : i + 32])}
    assert cache.meta[cache.k.M_DROPS] > 10
    assert cache.hits and cache.misses
    close(store)


def test_no_cache_with_limit_0_and_the_same_replies(tmp_path, kernel):
    store = open_inline(tmp_path / "store", task.Clock())
    store.kv.row_cache_bytes = 0
    assert store.kv.start_row_cache() is None
    keys = [b"k%03d" % i for i in range(100)]
    store.kv.write_sets(keys, [b"v" + k for k in keys])
    wait_merged(store)
    assert get_all(store, keys + [b"zzzz"]) == {**{k: b"v" + k for k in keys}, b"zzzz": None}
    assert store.stats()["kv_row_cache"] is None
    close(store)


def test_big_replies_grow_the_scratch(tmp_path, kernel):
    """Replies past the 1 MiB scratch (values of 60 KiB): written whole, hits and misses."""
    store = open_inline(tmp_path / "store", task.Clock())
    store.kv.start_row_cache()
    keys = [b"big%02d" % i for i in range(40)]
    store.kv.write_sets(keys, [bytes([i]) * 60000 for i in range(40)])
    wait_merged(store)
    assert get_all(store, keys) == {k: bytes([i]) * 60000 for i, k in enumerate(keys)}
    store.kv.start_row_cache().clear()
    assert get_all(store, keys) == {k: bytes([i]) * 60000 for i, k in enumerate(keys)}
    close(store)


def test_a_low_hit_rate_bypasses_the_cache_and_a_high_one_comes_back(tmp_path, kernel, monkeypatch):
    """Reads whose keys the cache keeps missing (a scan over more than it holds) turn the bypass on
    (one read in SAMPLE through the cache); reads of a few keys again and again turn it off.
    Replies right throughout."""
    monkeypatch.setattr(kv_cache, "WINDOW", 256)
    monkeypatch.setattr(kv_cache, "SAMPLE", 4)
    store = open_inline(tmp_path / "store", task.Clock())
    store.kv.row_cache_bytes = 4096
    cache = store.kv.start_row_cache()
    cache.window = 256
    keys = [struct.pack(">I", i) for i in range(4000)]
    store.kv.write_sets(keys, [b"v%d" % i for i in range(4000)])
    wait_merged(store)
    cache.clear()
    for i in range(0, 4000, 32):
        assert get_all(store, keys[i : i + 32]) == {k: b"v%d" % (i + j) for j, k in enumerate(keys[i : i + 32])}
    assert cache.bypass
    passed = cache.hits + cache.misses
    for _ in range(200):
        assert get_all(store, keys[:16]) == {k: b"v%d" % j for j, k in enumerate(keys[:16])}
    assert not cache.bypass
    assert cache.hits + cache.misses - passed < 200 * 16  # (bypassed reads went straight to LMDB)
    close(store)
