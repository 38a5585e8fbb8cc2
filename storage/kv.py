"""Key-value pairs in 8 range partitions (CONTRACT §2: partition = first key byte >> 5).

One ordered LMDB table holds every partition: partition order equals key order, so partition p is
the key range [p << 5, (p + 1) << 5) of the first byte and scans cross partitions naturally.

Writes go to a *memtable* in front of LMDB (issue 19; the LSM idea of the original yesSQL
partitions and of RocksDB), so a SET does not pay a random LMDB page write:

- ``write_many`` hands the run's operations to the commit core as one ``Direct(memtable=True)``
  operation that writes only the WAL (a ``T_OPS`` entry, under every fsync policy) and leaves
  LMDB alone; the core never moves the WAL checkpoint past the first such entry not yet merged
  (``CommitCore.kv_floor``), and a group that changed nothing in LMDB does not commit it (so
  under ``--fsync always`` a group of kv writes costs one fdatasync, the WAL's).
- Once the group is durable (on the reactor thread, before the caller's callbacks) the writes
  enter the *active* memtable (``_Memtable``: a dict of key -> LMDB stored value, or None for a
  remove; the key order is built on the first scan), where reads see them; until then they are
  invisible to every reader (the key-value server shows a connection its own pending writes,
  protocols/partition/server.py).
- ``flush`` freezes the active memtable and has it merged into LMDB, sorted, as a sequence of
  LMDB transactions of at most ``MERGE_CHUNK_KEYS`` keys: by the merge worker process
  (``_WorkerMerge``, storage/kv_merge.py: off the node's GIL), then one writer operation moves
  the floor; or by the writer thread (``_Merge``: in the inline test mode, and when the worker
  fails), whose last transaction moves the floor. It runs when the memtable passes ``FLUSH_BYTES``,
  once no write has landed for a whole ``FLUSH_IDLE_S`` period (one timer, looked at once per
  period: 1-2 periods after the last write), and at the latest ``FLUSH_MAX_AGE_S`` after the
  first write into an empty one: a write burst is merged in runs of ``FLUSH_BYTES``, not of
  whatever arrived in one second.
- Reads merge, newest first: active memtable, the one being merged, LMDB. Scans merge the three
  in key order (``_merge``).
- Recovery after kill -9: the WAL entries past the checkpoint (so every unmerged memtable write)
  are replayed into LMDB at open (``commit.recover``), in WAL order, over an LMDB that already
  holds every merged write (all older than the floor) and possibly part of a merge that did not
  finish (values the replay writes again): each key ends at its last logged write. A REMOVE is
  logged only when the key existed as the writes before it left it, so a REMOVE of a missing key
  changes nothing anywhere. The memtable starts empty. (docs/storage.md has the cases.)
- Bounded memory: over ``HARD_BYTES`` in the memtables, writes fail with ``StoreBusy`` (the server
  answers ERR 0) until the flush catches up; ``congested`` is true from ``FLUSH_BYTES * 2`` on,
  and protocols that watch the store stop reading.
"""

import collections
import functools
import itertools

import msgpack
import numpy
from sortedcontainers import SortedList
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from storage import errors, index, kv_cache
from storage.commit import Direct
from storage.kv_merge import MergeWorker, chunk_cut
from storage.index import (KEY_KEEP, OP_DEL, OP_PUT, OP_PUTS, decode_value, encode_key, encode_value, iter_ordered,
                           seek_backward, seek_forward)

MAX_KEY = 65535
MAX_VALUE = 16 << 20
PARTITIONS = 8

FLUSH_BYTES = 32 << 20  # merge the memtable into LMDB once it holds this many bytes
HARD_BYTES = 256 << 20  # memtables over this: writes refused (StoreBusy) until a flush lands
FLUSH_IDLE_S = 1.0  # and once no write has landed for this long
FLUSH_MAX_AGE_S = 5.0  # or this long after the first write into an empty memtable, whichever first
ENTRY_OVERHEAD = 100  # per-entry bytes counted beyond key and value (objects' headers, dict slot)
MERGE_CHUNK_KEYS = 8192  # keys merged into LMDB per transaction (see KeyValue.flush)
MERGE_CHUNK_BYTES = 8 << 20  # and at most about this many value bytes
KV_DB = index.KV
# Merges run in a worker process (storage/kv_merge.py), off the node's GIL; the writer thread
# merges instead in the inline test mode, when this is False, and after MAX_WORKER_FAILURES
# worker failures in a row (each failed merge is then done by the writer: nothing is lost).
MERGE_WORKER = True
MAX_WORKER_FAILURES = 3
# While the worker merges, the reactor's reused read snapshot is renewed this often (without
# deliveries, in a run of GETs, one snapshot would pin every page the worker's chunks free: the
# LMDB file grew by ~100 MiB at 1M keys)
SNAPSHOT_RENEW_S = 0.02
# An unread backlog of landed runs (the lazy memtable dict, _Memtable.entries) is folded in slices
# of FOLD_SLICE runs once writes pause for FOLD_PAUSE_S, when it passed FOLD_BACKLOG runs
FOLD_BACKLOG = 1024
FOLD_PAUSE_S = 0.02
FOLD_SLICE = 256
_MISSING = object()


def partition_of(key: bytes) -> int:
    return key[0] >> 5


def partition_bounds(p: int):
    """(first key byte included, first key byte excluded or None) of partition ``p``."""
    return bytes([p << 5]), (bytes([(p + 1) << 5]) if p < PARTITIONS - 1 else None)


def _lmdb_item(key, value):
    """The LMDB (key, stored value) of a user pair, as index.encode_key/encode_value have it."""
    if len(key) <= KEY_KEEP:
        return key, b"\x00" + value
    return encode_key(b"", key), encode_value(key, b"", value)


def _pairs(entries, keys):
    for k in keys:
        stored = entries[k]
        yield k, (None if stored is None else _stored_value(stored))


def _merge(sources, descending):
    """Merge iterators of (key, value or None) sorted the same way; for a key in several, the
    first source's entry wins; None (a remove) hides the key. Yields (key, value)."""
    heads = []
    for it in sources:
        e = next(it, None)
        heads.append((e, it))
    while True:
        best = None
        for e, _ in heads:
            if e is not None and (best is None or (e[0] > best if descending else e[0] < best)):
                best = e[0]
        if best is None:
            return
        value = _MISSING
        for i, (e, it) in enumerate(heads):
            if e is not None and e[0] == best:
                if value is _MISSING:
                    value = e[1]
                heads[i] = (next(it, None), it)
        if value is not None:
            yield best, value


# Keys of one length sort as fixed-width numpy items: big-endian unsigned integers for 1, 2, 4 or 8
# bytes, byte strings ("S<n>": memcmp order, the same as bytes' for items of one length) otherwise.
_SORT_DTYPES = {1: ">u1", 2: ">u2", 4: ">u4", 8: ">u8"}
SORT_FIXED_MAX = 64  # longer keys (or keys of several lengths) sort with Python's sorted()


def sorted_items(entries):
    """``(keys, values)``: the keys of the dict ``entries`` (distinct ``bytes``) in ascending order,
    and their values in the same order. When every key has the same length (at most
    SORT_FIXED_MAX) the order is computed by numpy's argsort over the keys joined into one buffer:
    ~0.4 against ~0.6-1.0 us per key for 160k 8-byte keys (Python compares bytes objects through
    rich comparison, one call per comparison, with the GIL held throughout); keys and values are
    then taken in that order from the dict's own iteration (a dict's keys and values iterate in the
    same order) with one object-array take each: 0.49 against 0.78 us per key for sorting plus a
    lookup per key in a 160k-key dict (random probes), measured alone."""
    keys = list(entries)
    if len(keys) < 2:
        return keys, list(entries.values())
    first = len(keys[0])
    if first > SORT_FIXED_MAX or len(set(map(len, keys))) != 1:
        keys = sorted(keys)
        return keys, list(map(entries.__getitem__, keys))
    order = numpy.frombuffer(b"".join(keys), dtype=_SORT_DTYPES.get(first, "S%d" % first)).argsort()
    values = numpy.fromiter(entries.values(), dtype=object, count=len(keys))[order].tolist()
    return numpy.fromiter(keys, dtype=object, count=len(keys))[order].tolist(), values


def _only_bytes(items):
    """Every item is exactly ``bytes`` (one C-level pass)."""
    types = set(map(type, items))
    return len(types) == 1 and bytes in types


class PackedRun:
    """A run of puts as the key-value server's compiled SET pass makes it (``write_packed``): its
    WAL op (``op``, a ``PackedOp``: exactly ``msgpack.packb([OP_PUTS, KV_DB, keys, stored])``) and
    how many puts it holds; its keys and stored values (two lists) made from ``op`` by one
    ``msgpack.unpackb`` only when something reads them (``keys``, ``stored``), and ``{key: stored
    value}`` (each key's last put) only when something looks a key up in it (a REMOVE's answer, a
    GET of the connection's own pending write, the memtable's fold). A run nobody reads before its
    merge never makes a Python object per key: the merge worker reads its op back from the WAL and
    the row cache's update parses it in a kernel (``_Memtable.writes``). ``PackedRun(keys, stored)``:
    one made from the lists (``op`` None)."""

    __slots__ = ("op", "count", "_keys", "_stored", "_map")

    def __init__(self, keys, stored):
        self.op = None
        self.count = len(keys)
        self._keys = keys
        self._stored = stored
        self._map = None

    @classmethod
    def of_op(cls, op, count):
        run = cls.__new__(cls)
        run.op = op
        run.count = count
        run._keys = run._stored = run._map = None
        return run

    def _unpack(self):
        _code, _db, self._keys, self._stored = msgpack.unpackb(self.op)

    @property
    def keys(self):
        if self._keys is None:
            self._unpack()
        return self._keys

    @property
    def stored(self):
        if self._stored is None:
            self._unpack()
        return self._stored

    def mapping(self):
        if self._map is None:
            self._map = dict(zip(self.keys, self.stored))
        return self._map

    def get(self, key, default=None):
        return self.mapping().get(key, default)

    def items(self):
        return self.mapping().items()

    def __iter__(self):
        return iter(self.mapping())

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        """The ``i``-th stored value (the server's run reads its values through this)."""
        return self.stored[i]

    def update_into(self, entries):
        entries.update(zip(self.keys, self.stored) if self._map is None else self._map)


class _Memtable:
    """Writes not yet merged into LMDB, on the reactor thread: ``entries`` maps a user key to its
    LMDB stored value (``_lmdb_item``: ``b"\\x00" + value`` for a key up to KEY_KEEP bytes) or None
    for a remove. A plain dict, made lazily: a landing run is only appended to ``landed`` (``land``),
    and ``entries`` folds the runs landed since into the dict when something reads it (a GET, a
    REMOVE's answer, a scan). A write burst nobody reads before its merge (the merge worker reads
    the WAL, the row cache takes the runs: ``writes``) never builds the dict: its inserts (random
    stores into a dict of up to ~160k keys, memory-bound) were ~12% of the reactor's time per SET
    (docs/benchmarks.md, issue 19's tenth pass). The key order scans need is built on the first
    scan (``sorted_keys``) and kept up to date from then on (the keys a fold adds go to
    ``unsorted``, folded in by the next scan). Keys are never dropped from a memtable (a remove is
    a None), so that order only grows. Reactor thread only, but for ``entries`` of a frozen
    memtable folded before another thread reads it (``_Merge``)."""

    __slots__ = ("_dict", "landed", "nbytes", "sorted", "unsorted", "plain")

    def __init__(self):
        self._dict = {}
        self.landed = []  # runs (dict, or PackedRun) landed and not yet folded into _dict, in order
        self.nbytes = 0  # bytes counted against FLUSH_BYTES / HARD_BYTES (an overwrite counts again)
        self.sorted = None  # SortedList of the keys, once a scan asked for it
        self.unsorted = []  # keys added since ``sorted`` was brought up to date
        self.plain = True  # no remove and no key over KEY_KEEP bytes: the merge skips looking for them

    @property
    def entries(self):
        """{key: stored value or None}, every landed run folded in (in landing order)."""
        if self.landed:
            self.fold(len(self.landed))
        return self._dict

    def fold(self, count):
        """Fold the first ``count`` landed runs into the dict (``entries`` folds them all; the
        store folds a backlog in slices while writes pause, ``KeyValue._fold_idle``)."""
        landed = self.landed
        if count:
            self.landed = landed[count:]
            landed = landed[:count]
            d = self._dict
            unsorted = self.unsorted if self.sorted is not None else None
            for run in landed:
                if unsorted is not None:
                    unsorted.extend([k for k in run if k not in d])
                if run.__class__ is PackedRun:
                    run.update_into(d)
                else:
                    d.update(run)

    def land(self, run):
        """A durable run (``{key: stored value or None}`` or a ``PackedRun``) enters: kept as it
        is until something reads ``entries`` (the caller must not change it)."""
        self.landed.append(run)

    def empty(self) -> bool:
        return not self.landed and not self._dict

    def count(self) -> int:
        """Entries, without folding: an upper bound (a key landed twice and not folded counts twice)."""
        return len(self._dict) + sum(map(len, self.landed))

    def writes(self):
        """The memtable's writes in order, without folding (the row cache's update of a merged
        memtable, storage/kv_cache.py): a list of parts, each ``(keys, stored values)`` (two
        iterables; the folded dict's first) or a packed run's op bytes (``PackedOp``: parsed by the
        cache's kernel, no Python object per key). A key may come more than once: the last wins."""
        parts = [(self._dict.keys(), self._dict.values())] if self._dict else []
        ks = vs = None  # the lists behind the last part of runs without an op (chained lazily)
        for run in self.landed:
            if run.__class__ is PackedRun:
                if run.op is not None and run._keys is None:
                    parts.append(run.op)
                    ks = None
                    continue
                keys, values = run.keys, run.stored
            else:
                keys, values = run.keys(), run.values()
            if ks is None:
                ks, vs = [], []
                parts.append((itertools.chain.from_iterable(ks), itertools.chain.from_iterable(vs)))
            ks.append(keys)
            vs.append(values)
        return parts

    def sorted_keys(self):
        entries = self.entries  # (folds what landed: its new keys into unsorted)
        if self.sorted is None:
            self.sorted = SortedList(entries)
            self.unsorted = []
        elif self.unsorted:
            self.sorted.update(self.unsorted)
            self.unsorted = []
        return self.sorted


def _stored_value(stored):
    """The user value of an LMDB stored value (``_lmdb_item``)."""
    if stored[0] == 0:
        return stored[1:]
    return decode_value(stored)[1]


class KeyValue:
    logger = Logger()

    def __init__(self, core):
        self._core = core
        self._db = core.dbs[index.KV]
        self._active = _Memtable()  # durable writes not yet merged
        self._flushing = None  # the frozen _Memtable the writer is merging into LMDB
        # The runs submitted and not yet durable, oldest first, each {key: stored value or None}
        # (for REMOVE's answer: whether the key exists counts the writes submitted before it).
        self._runs = collections.deque()
        self._idle_flush = None  # the pending FLUSH_IDLE_S call
        self._landed_runs = 0  # write runs entered into the active memtable, ever
        self._armed_at = (0, 0.0)  # (_landed_runs, reactor time of the first write) when it was set
        self._flush_waiters = []  # flush() callers waiting for the running merge
        # A merge the store refused part-way (the disk full, or read-only after a disk error): its
        # frozen memtable stays in _flushing, read before LMDB, until a flush() can run it again.
        self._stuck = None
        self._folding = None  # the pending _fold_idle call
        self.flushes = 0  # merges landed (observability, tests)
        self.merge_txns = 0  # LMDB transactions those merges took (MERGE_CHUNK_KEYS each at most)
        self.worker_merges = 0  # merges the worker process did (the rest: the writer thread)
        self.worker_cpu = [0.0, 0.0, 0.0]  # its CPU seconds: reading the WAL, sorting, writing LMDB
        self._worker = None  # the MergeWorker, once the first merge needed it
        self._worker_failures = 0  # in a row
        self._inline = core.inline  # no writer thread, no worker: the merge runs in place (tests)
        # The row cache (storage/kv_cache.py), made once the kv server's compiled GET passes have
        # loaded (start_row_cache); at most row_cache_bytes (0: none; the node's --kv-cache-mb)
        self.row_cache = None
        self.row_cache_bytes = kv_cache.DEFAULT_BYTES
        core.on_close.insert(0, self._cancel_idle_flush)
        core.on_close.insert(0, self._cancel_folding)
        core.on_close.append(self._drop_row_cache)
        core.on_close.append(self._stop_worker)

    # -- reads --------------------------------------------------------------------------------

    def _lmdb_get(self, get, key):
        if len(key) <= KEY_KEEP:
            stored = get(key, db=self._db)
            return None if stored is None else stored[1:]
        stored = get(encode_key(b"", key), db=self._db)
        if stored is None:
            return None
        full, value = decode_value(stored)
        return value if full == key else None

    def get(self, key):
        if type(key) is not bytes:
            key = bytes(key)
        stored = self._active.entries.get(key, _MISSING)
        if stored is _MISSING and self._flushing is not None:
            stored = self._flushing.entries.get(key, _MISSING)
        if stored is not _MISSING:
            return None if stored is None else _stored_value(stored)
        return self._lmdb_get(self._core.snapshot().get, key)

    def point_reader(self):
        """``(active, flushing, get, db)`` for a caller that looks up many keys in one reactor turn
        with no write landing in between (the key-value server's run of GETs): the memtables'
        dicts (None when empty; key -> stored value, or None for a remove) and the snapshot's
        ``get`` and LMDB table for keys of at most KEY_KEEP bytes, read newest first as ``get``
        does (``_stored_value`` of a memtable entry; ``stored[1:]`` of LMDB's). Longer keys: ``get``."""
        active = self._active.entries
        flushing = self._flushing.entries if self._flushing is not None else None
        return (active or None), (flushing or None), self._core.snapshot().get, self._db

    def unmerged(self) -> bool:
        """A memtable holds something (a read must look there before LMDB and the row cache)."""
        return not self._active.empty() or (self._flushing is not None and not self._flushing.empty())

    def start_row_cache(self):
        """Reactor thread: the row cache (storage/kv_cache.py), made now if there is none, the
        limit is not 0 and its kernels are loaded (by the compiled GET passes' loader; never
        imported here); None otherwise. A new cache is empty, so it is right from the start:
        every later merge landing updates it (``_merged``)."""
        cache = self.row_cache
        if cache is None and self.row_cache_bytes > 0 and not self._core.closed:
            kernel = kv_cache.kernels()
            if kernel is not None:
                reactor = self._core.reactor
                cache = self.row_cache = kv_cache.RowCache(
                    self.row_cache_bytes, kernel, None if self._inline else reactor.callFromThread)
        return cache

    def _drop_row_cache(self):
        cache, self.row_cache = self.row_cache, None
        if cache is not None:
            cache.stop()

    def get_many(self, keys):
        """[value or None] for each key (any bytes-like object), from one snapshot."""
        get = self._core.snapshot().get
        db = self._db
        active = self._active.entries
        flushing = self._flushing.entries if self._flushing is not None else None
        if not active and not flushing and _only_bytes(keys) and max(map(len, keys)) <= KEY_KEEP:
            # Everything is in LMDB and every key is stored as itself (the common GET run): one
            # lookup per key in a comprehension, without the memtables' probes.
            return [None if stored is None else stored[1:] for stored in [get(key, None, db) for key in keys]]
        lmdb_get = self._lmdb_get
        out = []
        append = out.append
        for key in keys:
            if type(key) is not bytes:
                key = bytes(key)
            if active:
                stored = active.get(key, _MISSING)
                if stored is not _MISSING:
                    append(None if stored is None else _stored_value(stored))
                    continue
            if flushing is not None:
                stored = flushing.get(key, _MISSING)
                if stored is not _MISSING:
                    append(None if stored is None else _stored_value(stored))
                    continue
            append(lmdb_get(get, key))
        return out

    # -- writes -------------------------------------------------------------------------------

    def put(self, key, value):
        """Fires with None once durable."""
        return self.write_many([(key, value)]).addCallback(lambda _: None)

    def delete(self, key):
        """Fires with True if the key existed."""
        return self.write_many([(key, None)]).addCallback(lambda existed: existed[0])

    def _exists(self, key, run, get):
        stored = run.get(key, _MISSING)
        if stored is _MISSING:
            for earlier in reversed(self._runs):
                stored = earlier.get(key, _MISSING)
                if stored is not _MISSING:
                    break
            else:
                stored = self._active.entries.get(key, _MISSING)
                if stored is _MISSING and self._flushing is not None:
                    stored = self._flushing.entries.get(key, _MISSING)
                if stored is _MISSING:
                    return self._lmdb_get(get, key) is not None
        return stored is not None

    def write_many(self, ops):
        """Apply ``[(key, value or None to remove)]`` in order, atomically, in one group commit.

        Fires once durable (per the fsync policy) with one bool per op: True for a put, whether
        the key existed for a remove. Fails as a whole, before anything is queued, if any key is
        not 1..65535 bytes (``InvalidRequest``), any value is over 16 MiB (``PayloadTooLarge``), or
        the memtables are full (``StoreBusy``). Keys and values may be any bytes-like object; they
        are copied before this returns."""
        run = {}  # key -> stored value or None: this run's last write of each key
        results = []
        logged = []  # the WAL's raw ops (index.apply_ops replays them)
        add_result = results.append
        log = logged.append
        nbytes = 0
        get = None
        plain = True  # no remove, no key over KEY_KEEP (_Memtable.plain)
        try:
            for key, value in ops:
                if key.__class__ is not bytes:
                    if not isinstance(key, (bytearray, memoryview)):
                        raise errors.InvalidRequest("keys are bytes")
                    key = bytes(key)
                klen = len(key)
                if not 0 < klen <= MAX_KEY:
                    raise errors.InvalidRequest("keys are 1..65535 bytes")
                if value is None:
                    # Each answer is decided now, in submission order (the order the store applies
                    # them): a remove finds the key in the writes submitted before it, the
                    # memtables or LMDB.
                    if get is None:
                        get = self._core.snapshot().get
                    existed = self._exists(key, run, get)
                    add_result(existed)
                    if existed:
                        log((OP_DEL, KV_DB, encode_key(b"", key)))
                    run[key] = None
                    nbytes += klen + ENTRY_OVERHEAD
                    plain = False
                    continue
                if value.__class__ is not bytes:
                    value = bytes(value)
                vlen = len(value)
                if vlen > MAX_VALUE:
                    raise errors.PayloadTooLarge("values are at most 16 MiB")
                if klen <= KEY_KEEP:
                    stored = b"\x00" + value
                    log((OP_PUT, KV_DB, key, stored))
                else:
                    stored = encode_value(key, b"", value)
                    log((OP_PUT, KV_DB, encode_key(b"", key), stored))
                    plain = False
                add_result(True)
                run[key] = stored
                nbytes += klen + vlen + ENTRY_OVERHEAD
            self._check_room(nbytes)
        except errors.StoreError:
            return defer.fail()
        self._runs.append(run)

        def apply(txn):  # writer thread: the WAL entry is all; LMDB gets it at the next merge
            return results, logged

        d = self._core.submit(Direct(apply, nbytes, memtable=True))
        d.addBoth(self._landed, run, nbytes, plain)
        return d

    def _check_room(self, nbytes):
        """Raise StoreBusy while the memtables are over HARD_BYTES (starting a merge), or what
        ``check_writable`` raises (read-only, disk full, queue full)."""
        if self._active.nbytes + self.flushing_bytes + nbytes > HARD_BYTES:
            self.flush()
            raise errors.StoreBusy("the key-value memtable is full; a merge into LMDB is running")
        self._core.check_writable(nbytes)

    def write_sets(self, keys, values, value_bytes=None):
        """``write_many(zip(keys, values))`` for a run of puts alone (two lists of one length; keys
        ``bytes``): the same answer, one True per put. When every key has 1..KEY_KEEP bytes and
        every value at most 16 MiB (a key-value server's run of SETs; checked here in two C-level
        passes, else this is ``write_many``) there is no Python step per put: the stored values are
        made with one ``map``, the run's memtable entry with one ``dict``, and the WAL gets the run
        as one ``OP_PUTS`` op (two lists) instead of an op per put. ``value_bytes``: the values'
        total length, from a caller that checked each is at most 16 MiB."""
        n = len(keys)
        lengths = list(map(len, keys))
        if not n or min(lengths) < 1 or max(lengths) > KEY_KEEP or (
                value_bytes is None and max(map(len, values)) > MAX_VALUE):
            return self.write_many(zip(keys, values))
        if value_bytes is None:
            value_bytes = sum(map(len, values))
        stored = list(map(b"\x00".__add__, values))
        nbytes = sum(lengths) + value_bytes + ENTRY_OVERHEAD * n
        try:
            self._check_room(nbytes)
        except errors.StoreError:
            return defer.fail()
        return self._submit_puts(dict(zip(keys, stored)), n, nbytes, [(OP_PUTS, KV_DB, keys, stored)])

    def write_packed(self, run, op, nbytes):
        """``write_sets`` of a run whose WAL op the caller has packed already (the key-value
        server's compiled SET pass, protocols/partition/sets_kernel.py): ``op`` (an
        ``index.PackedOp``) is exactly ``msgpack.packb([OP_PUTS, KV_DB, keys, stored])`` of the
        run's puts, ``run`` (a ``PackedRun``) has the same keys and stored values (every key
        1..KEY_KEEP bytes, every stored value ``b"\\x00" +`` a value of at most 16 MiB; the
        store keeps it as the memtable's run: the caller may read it, never change it);
        ``nbytes`` the keys' and the values' lengths summed. Fires as ``write_sets`` does (one
        True per put); the writer thread logs ``op`` without packing it (commit ``pack_ops``)."""
        count = len(run)
        nbytes += ENTRY_OVERHEAD * count
        try:
            self._check_room(nbytes)
        except errors.StoreError:
            return defer.fail()
        return self._submit_puts(run, count, nbytes, [op])

    def _submit_puts(self, run, count, nbytes, logged):
        """``write_sets``' and ``write_packed``'s run of ``count`` puts, room checked: ``run`` (its
        memtable entry) is read by GETs until durable and then lands in the memtable (``_landed``);
        the WAL gets ``logged``. Fires with one True per put."""
        self._runs.append(run)
        results = [True] * count

        def apply(txn):  # writer thread: the WAL entry is all; LMDB gets it at the next merge
            return results, logged

        d = self._core.submit(Direct(apply, nbytes, memtable=True))
        d.addBoth(self._landed, run, nbytes, True)
        return d

    def _landed(self, result, run, nbytes, plain=True):
        """Reactor thread, the run durable (or failed): into the active memtable, before the
        caller's callbacks run."""
        runs = self._runs
        if runs[0] is run:  # runs are delivered in submission order
            runs.popleft()
        else:
            runs.remove(run)
        if isinstance(result, Failure):
            return result
        active = self._active
        was_empty = active.empty()
        active.land(run)  # folded into its dict when something reads it (_Memtable.entries)
        active.nbytes += nbytes
        if not plain:
            active.plain = False
        self._landed_runs += 1
        if len(active.landed) >= FOLD_BACKLOG and self._folding is None and not self._core.closed:
            self._folding = self._core.reactor.callLater(FOLD_PAUSE_S, self._fold_idle, self._landed_runs)
        if active.nbytes >= FLUSH_BYTES:
            self.flush()
        elif was_empty and self._idle_flush is None and not self._core.closed:
            self._arm_idle_flush()
            if self._worker is None and MERGE_WORKER and not self._inline:
                self.merge_worker().start()  # the first key-value write: the worker starts now
        return result

    def _fold_idle(self, runs):
        """FOLD_PAUSE_S after the unread backlog passed FOLD_BACKLOG runs: if writes go on, look
        again later (a burst nobody reads is never folded: the point of the lazy dict); if they
        paused, fold FOLD_SLICE runs (the merging memtable's first) and go on at the next turn,
        so that a read coming after the pause does not pay the whole backlog at once (~1 us per
        key: ~0.3 s for two full memtables)."""
        self._folding = None
        core = self._core
        if core.closed:
            return
        if self._landed_runs != runs:
            self._folding = core.reactor.callLater(FOLD_PAUSE_S, self._fold_idle, self._landed_runs)
            return
        for table in (self._flushing, self._active):
            if table is not None and table.landed:
                table.fold(min(FOLD_SLICE, len(table.landed)))
                self._folding = core.reactor.callLater(0, self._fold_idle, runs)
                return

    # -- merging into LMDB --------------------------------------------------------------------

    def _arm_idle_flush(self):
        """The first write into an empty active memtable landed: merge it once writes pause."""
        reactor = self._core.reactor
        self._armed_at = (self._landed_runs, reactor.seconds())
        self._idle_flush = reactor.callLater(FLUSH_IDLE_S, self._flush_idle)

    def _flush_idle(self):
        """FLUSH_IDLE_S after the timer was set: if writes landed meanwhile (a burst goes on) and
        the memtable is younger than FLUSH_MAX_AGE_S, look again in FLUSH_IDLE_S (one timer per
        second, not one reset per write); else merge."""
        self._idle_flush = None
        runs, first = self._armed_at
        reactor = self._core.reactor
        if self._landed_runs != runs and reactor.seconds() - first + FLUSH_IDLE_S <= FLUSH_MAX_AGE_S \
                and not self._core.closed:
            self._armed_at = (self._landed_runs, first)
            self._idle_flush = reactor.callLater(FLUSH_IDLE_S, self._flush_idle)
            return
        self.flush()

    def _cancel_folding(self):
        if self._folding is not None and self._folding.active():
            self._folding.cancel()
        self._folding = None

    def _cancel_idle_flush(self):
        if self._idle_flush is not None and self._idle_flush.active():
            self._idle_flush.cancel()
        self._idle_flush = None

    @property
    def flushing_bytes(self) -> int:
        return self._flushing.nbytes if self._flushing is not None else 0

    @property
    def congested(self) -> bool:
        return self._active.nbytes + self.flushing_bytes > 2 * FLUSH_BYTES

    def memtable_bytes(self) -> int:
        return self._active.nbytes + self.flushing_bytes

    def memtable_keys(self) -> int:
        """Entries in the memtables (an upper bound of the keys they add to LMDB's count)."""
        return self._active.count() + (self._flushing.count() if self._flushing is not None else 0)

    def flush(self) -> defer.Deferred:
        """Merge the active memtable into LMDB (sorted, in the writer thread); fires once merged
        (at once if there is nothing to merge). One merge at a time: while one runs, this fires
        when it lands and the rest waits for the next.

        A merge is a sequence of ``Direct`` operations, each one LMDB transaction of at most
        MERGE_CHUNK_KEYS keys (or MERGE_CHUNK_BYTES), the next submitted when one lands: a
        transaction of 80k random keys dirtied most pages of a 1M-key tree at once (hundreds of
        MiB of LMDB's private dirty pages, and a map file twice the tree), and held the writer
        (so every write) for its whole length. Reads go on seeing the frozen memtable first until
        the last chunk lands, so a partly merged LMDB is never visible; only the last chunk moves
        the kv floor (``CommitCore.kv_floor``), so a crash in between replays the whole memtable
        again from the WAL (putting the same values: harmless)."""
        core = self._core
        if self._stuck is not None:
            if core.closed or core.failed is not None or core.full is not None:
                return defer.succeed(None)  # nothing merges now; reads keep the frozen memtable
            merge, self._stuck = self._stuck, None
            merge.restart()
        if self._flushing is not None:
            d = defer.Deferred()
            self._flush_waiters.append(d)
            return d
        if self._active.empty() or self._core.closed or self._core.failed is not None:
            return defer.succeed(None)
        self._cancel_idle_flush()
        frozen = self._flushing = self._active
        self._active = _Memtable()
        done = defer.Deferred()
        self._flush_waiters.append(done)
        # Every write not in ``frozen`` is still in flight or was delivered after this point: its
        # WAL entry lies at or past the end of the last group delivered whole. (A flush from a
        # callback of a group's delivery sees the group before it: the group's later runs are not
        # in ``frozen``; CommitCore._deliver moves delivered_wal_end only after the whole group.)
        if MERGE_WORKER and not self._inline and self._worker_failures < MAX_WORKER_FAILURES:
            # The frozen memtable's writes are logged in [kv_floor, landing_wal_end): the floor is
            # at or before the first of them (set by the first kv group after the last merge), and
            # every run that entered a memtable was in a group delivered up to landing_wal_end
            # (which also covers the rest of a group whose delivery is freezing it now).
            _WorkerMerge(self, frozen, core.delivered_wal_end, core.kv_floor, core.landing_wal_end).submit()
        else:
            _Merge(self, frozen, core.delivered_wal_end).submit()
        return done

    def merge_worker(self):
        """The MergeWorker (made on first use; its process starts with the first kv write)."""
        if self._worker is None:
            core = self._core
            self._worker = MergeWorker(core.env.path(), core.wal.dir, core.policy.always, core.reactor.callFromThread)
        return self._worker

    def merge_worker_pid(self):
        """The merge worker process's pid, while it runs (benchmarks count its CPU as the node's)."""
        return self._worker.pid if self._worker is not None else None

    def _worker_failed(self, why):
        self._worker_failures += 1
        self.logger.error(
            "the kv merge worker failed ({why}); the writer thread merges this memtable instead{more}",
            why=why, more=(" and every later one" if self._worker_failures >= MAX_WORKER_FAILURES
                           else "; a new worker takes the next merge"))

    def _stop_worker(self):
        """Core closing (the writer has stopped): end the worker; at once if a merge is running
        (a close without merging, as a crash: the WAL replays the memtable at the next open)."""
        if self._worker is not None:
            self._worker.stop(kill=self._flushing is not None)

    def _floor_after_merge(self, floor_at_freeze):
        """The kv floor a merge landing now sets: it must cover every write not in the frozen
        memtable, those delivered since the freeze (in the active memtable) or in flight now
        (the ones submitted later queue behind the merge's last operation and set the floor
        themselves); None when there are none."""
        return floor_at_freeze if (not self._active.empty() or self._runs) else None

    def _merge_stuck(self, merge):
        """Reactor thread: the store refused the running merge part-way (the disk full: writes
        resume when space returns; or read-only after a disk error). Its frozen memtable is not
        dropped: it holds acknowledged writes that LMDB may lack, so reads go on seeing it first
        (a restart replays them from the WAL); the next ``flush()`` the store allows runs ``merge``
        again from its first key. The flush waiters fire, as for a merge that landed."""
        self._stuck = merge
        waiters, self._flush_waiters = self._flush_waiters, []
        for w in waiters:
            w.callback(None)

    def _merged(self):
        """Reactor thread: the running merge landed (or the store is closing without it: the
        WAL replays the frozen memtable at the next open). The row cache takes the merged values
        (the one change to LMDB's key-value table after the open, storage/kv_cache.py)."""
        frozen, self._flushing = self._flushing, None
        if self.row_cache is not None and frozen is not None:
            if self._core.closed:
                self._drop_row_cache()
            else:
                self.row_cache.merged(frozen.writes())
        self.flushes += 1
        waiters, self._flush_waiters = self._flush_waiters, []
        for w in waiters:
            w.callback(None)
        if self._active.nbytes >= FLUSH_BYTES:
            self.flush()
        elif not self._active.empty() and self._idle_flush is None and not self._core.closed:
            self._arm_idle_flush()


    # -- scans --------------------------------------------------------------------------------

    def _mem_sources(self, start, descending):
        sources = []
        for table in (self._active, self._flushing):
            if table is not None and not table.empty():
                order = table.sorted_keys()
                if descending:
                    keys = order.irange(maximum=start, reverse=True)
                else:
                    keys = order.irange(minimum=start)
                sources.append(_pairs(table.entries, keys))
        return sources

    def _lmdb_iter(self, start, descending):
        cur = self._core.snapshot().cursor(db=self._db)
        if not (seek_backward if descending else seek_forward)(cur, b"", start):
            return
        for key, value in iter_ordered(cur, descending):
            if start is not None and (key > start if descending else key < start):
                continue
            yield key, value

    def _scan(self, start, limit, descending):
        out = []
        if limit <= 0:
            return out
        start = None if start is None else bytes(start)
        sources = self._mem_sources(start, descending)
        it = self._lmdb_iter(start, descending)
        if sources:
            it = _merge(sources + [it], descending)
        for pair in it:
            out.append(pair)
            if len(out) >= limit:
                break
        return out

    def scan_forward(self, start, limit):
        """Pairs with key >= ``start`` (None = from the first key), ascending."""
        return self._scan(start, limit, False)

    def scan_backward(self, start, limit):
        """Pairs with key <= ``start`` (None = from the last key), descending."""
        return self._scan(start, limit, True)

    def scan_keys(self, start, limit, prefix=None):
        """Keys >= ``start`` (None = first), ascending, optionally only those with ``prefix``."""
        out = []
        if limit <= 0:
            return out
        start = None if start is None else bytes(start)
        if prefix is not None:
            prefix = bytes(prefix)
            if start is None or start < prefix:
                start = prefix
        sources = self._mem_sources(start, False)
        it = self._lmdb_iter(start, False)
        if sources:
            it = _merge(sources + [it], False)
        for key, _ in it:
            if prefix is not None and not key.startswith(prefix):
                break  # keys >= prefix that lack it sort after every key that has it
            out.append(key)
            if len(out) >= limit:
                break
        return out

    def partition_of(self, key):
        return partition_of(key)


class _Merge:
    """One merge of a frozen memtable into LMDB, chunk by chunk (``KeyValue.flush``). Its own
    object rather than closures calling each other: those made a reference cycle holding the
    frozen memtable (tens of MiB) until Python's cyclic GC ran."""

    __slots__ = ("kv", "frozen", "floor_at_freeze", "keys", "values", "at")

    def __init__(self, kv, frozen, floor_at_freeze):  # reactor thread
        self.kv = kv
        self.frozen = frozen
        frozen.entries  # folded here: the writer thread reads the dict (chunk), never folds it
        self.floor_at_freeze = floor_at_freeze
        self.keys = None  # sorted, by the writer thread in the first chunk
        self.values = None  # the frozen memtable's values in that order
        self.at = 0

    def submit(self):
        kv = self.kv
        floor = kv._floor_after_merge(self.floor_at_freeze)
        d = kv._core.submit(Direct(functools.partial(self.chunk, floor), 64))
        d.addCallbacks(self.chunk_landed, self.failed)

    def chunk(self, floor, txn):  # writer thread
        """Merge the next chunk of keys (in key order, so LMDB's pages are written in order) in
        C-level passes: a Python loop per key here held the GIL against the reactor."""
        keys = self.keys
        if keys is None:
            keys, self.values = sorted_items(self.frozen.entries)
            self.keys = keys
        at = self.at
        stored = self.values[at : at + MERGE_CHUNK_KEYS]
        cut = chunk_cut(stored, MERGE_CHUNK_BYTES)
        chunk = keys[at : at + cut]
        if cut < len(stored):
            stored = stored[:cut]
        plain = self.frozen.plain
        db = self.kv._db
        if not plain and (None in stored or max(map(len, chunk)) > KEY_KEEP):
            puts = []
            for key, value in zip(chunk, stored):
                if value is None:
                    txn.delete(encode_key(b"", key), db=db)
                else:
                    puts.append((key if len(key) <= KEY_KEEP else encode_key(b"", key), value))
        else:
            puts = zip(chunk, stored)
        txn.cursor(db=db).putmulti(puts)
        self.at = at = at + len(chunk)
        last = at >= len(keys)
        if last:
            self.kv._core.kv_floor = floor
        return last, None

    def chunk_landed(self, last):
        kv = self.kv
        kv.merge_txns += 1
        core = kv._core
        if last or core.closed:
            self.keys = self.values = None
            kv._merged()
        elif core.failed is not None:
            self.stuck()
        else:
            self.submit()

    def failed(self, failure):
        """A chunk's transaction was refused (``DiskFull``, ``StoreReadOnly``, the store closed)."""
        if self.kv._core.closed:
            self.keys = self.values = None
            self.kv._merged()
        else:
            self.stuck()

    def stuck(self):
        self.keys = self.values = None  # sorted again when it runs again
        self.kv._merge_stuck(self)

    def restart(self):
        """Run again from the first key: the chunks that landed are written again with the same
        values (the frozen memtable's, still the newest: only one merge runs at a time)."""
        self.at = 0
        self.submit()


def _set_floor(core, floor, txn):  # writer thread
    core.kv_floor = floor
    return True, None


class _WorkerMerge:
    """One merge of a frozen memtable done by the merge worker process (``storage/kv_merge.py``):
    it reads the memtable's writes back from the WAL range ``[start, end)`` and writes them into
    LMDB in sorted chunks; once it has answered, one ``Direct`` operation moves the kv floor (and
    so the checkpoint) as ``_Merge``'s last chunk does, and when that lands the frozen memtable is
    dropped (reads see it before LMDB until then). A worker that fails or dies: the writer thread
    merges the memtable itself (``_Merge``), from the start (what the worker wrote is rewritten)."""

    __slots__ = ("kv", "frozen", "floor_at_freeze", "start", "end", "renewing")

    def __init__(self, kv, frozen, floor_at_freeze, start, end):
        self.kv = kv
        self.frozen = frozen
        self.floor_at_freeze = floor_at_freeze
        self.start = start
        self.end = end
        self.renewing = None

    def submit(self):
        if self.start is None or self.start >= self.end:
            self.worker_done(("ok", 0, 0, (0.0, 0.0, 0.0)))  # nothing logged (removes of missing keys alone)
            return
        self.kv.merge_worker().merge(self.start, self.end, MERGE_CHUNK_KEYS, MERGE_CHUNK_BYTES, self.worker_done)
        self.renewing = self.kv._core.reactor.callLater(SNAPSHOT_RENEW_S, self.renew)

    def renew(self):
        """The worker's chunks are visible to new snapshots as they commit: harmless to reads, as
        the frozen memtable still comes first (docs/storage.md)."""
        core = self.kv._core
        if not core.closed:
            core.renew_snapshot()
            self.renewing = core.reactor.callLater(SNAPSHOT_RENEW_S, self.renew)

    def worker_done(self, answer):  # reactor thread
        if self.renewing is not None and self.renewing.active():
            self.renewing.cancel()
        self.renewing = None
        kv = self.kv
        core = kv._core
        if core.closed or (core.failed is not None and answer[0] == "ok"):
            kv._merged()  # closing (the WAL replays it), or merged whole into LMDB
            return
        if core.failed is not None:
            _Merge(kv, self.frozen, self.floor_at_freeze).stuck()  # LMDB may lack part of it
            return
        if answer[0] != "ok":
            kv._worker_failed(answer[1])
            _Merge(kv, self.frozen, self.floor_at_freeze).submit()
            return
        kv._worker_failures = 0
        kv.worker_merges += 1
        kv.merge_txns += answer[2]
        kv.worker_cpu = [a + b for a, b in zip(kv.worker_cpu, answer[3])]
        floor = kv._floor_after_merge(self.floor_at_freeze)
        d = core.submit(Direct(functools.partial(_set_floor, core, floor), 64))
        d.addCallbacks(self.landed, self.landed)

    def landed(self, _):
        self.frozen = None
        self.kv._merged()
