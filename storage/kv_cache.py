"""The key-value row cache: LMDB's values of recently merged or read keys, in memory, for the
key-value server's compiled GET pass (docs/storage.md "The row cache").

A read of GETs whose keys no memtable holds is answered from here by one compiled call
(``protocols/partition/gets_kernel.cached_replies``), without LMDB's random ``txn.get`` (~1.5-1.9
us per key at 1M keys: B-tree pages and TLB misses) and without Python per key; only the keys it
misses are looked up in LMDB (and then cached). The table and arena are numpy arrays worked on by
the kernels of ``storage/kv_cache_kernel.py`` (layout and eviction there), only on the reactor
thread.

What it holds, and why that is always LMDB's value: an entry is put in only (1) by a GET pass, from
the reactor's current LMDB snapshot, for a key no memtable holds, or (2) by a merge landing
(``KeyValue._merged``), for each key of the merged memtable, the value that memtable gave it (what
LMDB now holds; a remove drops the entry). LMDB's key-value table changes only by those merges
(the merge worker's chunks, the writer thread's ``_Merge``) and by the WAL replay at open (the
cache starts empty then): every other writer of keys (cluster snapshot installs, trims, partition
drops, replica apply) writes through ``write_many`` into the memtable. While a merge runs, the
frozen memtable is read before the cache and LMDB for each of its keys, so a key whose LMDB value
changes is never read from the cache until its entry has been updated; keys the merge does not
touch keep their value. The cache is consulted after both memtables, never for a key either holds.

A merge's update of the cache (a kernel call per merged memtable, ~0.3 us of Python and ~0.4 us
compiled per key) runs on a thread of its own, the kernel without the GIL, not on the reactor: a
memtable of 160k keys would hold the reactor ~120 ms; sliced, UPDATE_SLICE keys per call. Meanwhile the cache is ``busy``: the server
does not read or fill it (its GETs take the LMDB path), so nothing reads the table while it
changes; it is readable again once every merge landed so far has been applied, in landing order.

Memory: at most ``limit`` bytes (two generations of slots and arena), allocated lazily by the
kernel (numpy's zeroed and uninitialised arrays are untouched pages until written).
"""

import collections
import sys
import threading
from itertools import islice

import msgpack
import numpy as np
from twisted.logger import Logger

from storage.index import KEY_KEEP, KV, OP_PUTS

KERNELS = "storage.kv_cache_kernel"
DEFAULT_BYTES = 256 << 20  # --kv-cache-mb's default (docs/operations.md)
MIN_BYTES = 4096
SLOT_SHARE = 8  # a generation's slots take 1/SLOT_SHARE of its bytes; its arena the rest
LOAD_LIMIT = 0.7  # a generation is full at this share of its slots used
UPDATE_SLICE = 4096  # keys of a merged memtable per kernel call of its update
UPDATE_OPS = 256  # packed runs (of 16 SETs from a read of the bench's generator) per kernel call
# A GET the cache misses costs more than one straight to LMDB (the probe and the insert, ~0.7-1 us
# at 1M keys: docs/benchmarks.md). When, over WINDOW GETs read through it, fewer than BYPASS_BELOW
# were hits (a working set past the cache, or no key read twice), the server sends only one read
# in SAMPLE through it (the others straight to LMDB) until a window of those is above it again.
WINDOW = 32768
BYPASS_BELOW = 0.35
SAMPLE = 64


def kernels():
    """The kernel module if it has been imported (by the loader of the compiled GET passes, on its
    thread); None otherwise. Never imports it: importing numba holds the GIL for most of a second."""
    return sys.modules.get(KERNELS)


def joined_values(values):
    """``(joined, lengths)`` of stored values (bytes, or None for a key without one) as the
    kernels take them: the values one after another, and an int64 array of their lengths (-1 for
    None)."""
    if None in values:
        return (b"".join([v for v in values if v is not None]),
                np.array([-1 if v is None else len(v) for v in values], np.int64))
    return b"".join(values), np.fromiter(map(len, values), np.int64, len(values))


class RowCache:
    """The arrays of the cache and the calls on them: on the reactor thread, except a merge's
    update, on the cache's own thread while ``busy`` (the reactor then leaves the arrays alone)."""

    log = Logger()

    def __init__(self, limit, kernel, call_from_thread=None):
        """``call_from_thread``: the reactor's ``callFromThread`` (None: updates run in place, as
        the store's inline test mode does everything)."""
        limit = max(MIN_BYTES, int(limit))
        gen = limit // 2
        slots = 1 << max(6, (gen // SLOT_SHARE // 8).bit_length() - 1)
        self.limit = limit
        self.k = kernel
        self.slots = np.zeros(2 * slots, np.int64)
        self.arena = np.empty(2 * (gen - 8 * slots), np.uint8)
        meta = self.meta = np.zeros(kernel.META_LEN, np.int64)
        meta[kernel.M_SLOTS] = slots
        meta[kernel.M_ARENA] = gen - 8 * slots
        meta[kernel.M_MAX_USED] = int(slots * LOAD_LIMIT)
        self.hits = self.misses = 0  # GETs answered from the cache, and looked up in LMDB (counted by the server)
        self.bypass = False  # reactor thread: the hit rate is low; one read in SAMPLE comes here
        self.reads = 0  # reads of GETs while bypassed (the server counts them)
        self.window = WINDOW  # GETs left in this window (the server counts them down)
        self._judged = (0, 0)  # (hits, misses) at the last judgement
        self.busy = False  # reactor thread: an update is queued or running; nothing reads the arrays
        self.failed = False  # an update raised (a bug): the cache stays busy for good
        self.updates = 0  # merged memtables applied
        self._call_from_thread = call_from_thread
        self._lock = threading.Condition()
        self._queue = collections.deque()  # memtables landed, not yet taken by the update thread (under _lock)
        self._pending = 0  # memtables landed whose update has not been settled on the reactor (under _lock)
        self._thread = None  # the update thread, once the first merge landed
        self._stopped = False

    def judge(self):
        """Reactor thread, once per WINDOW GETs read through the cache: bypass it (but for one read
        in SAMPLE) while its hit rate is below BYPASS_BELOW."""
        hits, misses = self.hits - self._judged[0], self.misses - self._judged[1]
        self._judged = (self.hits, self.misses)
        self.window = WINDOW
        self.bypass = hits < BYPASS_BELOW * (hits + misses)

    def merged(self, entries):
        """Reactor thread: a memtable has landed in LMDB: each of its keys gets the value it merged
        (or is removed). ``entries``: ``{key: stored value, or None for a remove}``, or its writes
        in order as ``kv._Memtable.writes`` lists them (parts: ``(keys, stored values)``, two
        iterables, or a run's packed ``OP_PUTS`` op; a key may come more than once: the last wins,
        as the kernel's insert replaces a key's entry). The cache is ``busy`` until that is done
        (at once in the inline mode)."""
        if isinstance(entries, dict):
            if not entries:
                return
            entries = [(entries.keys(), entries.values())]
        if self._call_from_thread is None:
            self._update(entries)
            return
        self.busy = True
        with self._lock:
            self._queue.append(entries)
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-row-cache", daemon=True)
                self._thread.start()
            self._lock.notify()

    def stop(self):
        """The store is closing: the update thread ends (after the update it is running)."""
        with self._lock:
            self._stopped = True
            self._queue.clear()
            self._lock.notify()

    def _run(self):  # the update thread: one for the cache's life, idle between merges
        while True:
            with self._lock:
                while not self._queue and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    return
                entries = self._queue.popleft()
            try:
                if not self.failed:
                    self._update(entries)
                del entries
            except Exception:
                self.failed = True
                self.log.failure("the kv row cache's update failed; the cache is off from now on")
            self._call_from_thread(self._settled)

    def _settled(self):  # reactor thread: one update done
        with self._lock:
            self._pending -= 1
            if not self._pending and not self.failed:
                self.busy = False

    def _update(self, parts):
        """Apply one merged memtable (its parts, ``merged``): pairs of iterables UPDATE_SLICE keys
        per kernel call (the GIL released inside it; the Python between the calls, listing,
        measuring and joining the slice's keys and values, ~0.3 us per key, holds the GIL in
        pieces of ~1-2 ms rather than one of tens of ms that would stall the reactor); packed ops
        UPDATE_OPS at a time, joined, parsed by the kernel (``update_ops``): no Python per key."""
        ops = []
        for part in parts:
            if part.__class__ is not tuple:
                ops.append(part)
                if len(ops) >= UPDATE_OPS:
                    self._update_ops(ops)
                    ops = []
                continue
            if ops:
                self._update_ops(ops)
                ops = []
            keys, values = iter(part[0]), iter(part[1])
            while True:
                ks = list(islice(keys, UPDATE_SLICE))
                if not ks:
                    break
                klens = np.fromiter(map(len, ks), np.int64, len(ks))
                joined, vlens = joined_values(list(islice(values, len(ks))))
                self.k.update(self.slots, self.arena, self.meta, b"".join(ks), klens, joined, vlens, KEY_KEEP)
        if ops:
            self._update_ops(ops)
        self.updates += 1

    def _update_ops(self, ops):
        starts = np.zeros(len(ops) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, ops), np.int64, len(ops)), out=starts[1:])
        done = self.k.update_ops(self.slots, self.arena, self.meta, b"".join(ops), starts, OP_PUTS, KV, KEY_KEEP)
        if done < 0:  # not the ops the SET pass makes (never, as built): the rest through msgpack
            for op in ops[-done - 1:]:
                _code, _db, keys, stored = msgpack.unpackb(op)
                klens = np.fromiter(map(len, keys), np.int64, len(keys))
                joined, vlens = joined_values(stored)
                self.k.update(self.slots, self.arena, self.meta, b"".join(keys), klens, joined, vlens, KEY_KEEP)

    def clear(self):
        """Reactor thread, not ``busy``: forget every entry (the slots zeroed; the arena reused
        from its start)."""
        self.slots[:] = 0
        meta = self.meta
        k = self.k
        meta[k.M_POS] = meta[k.M_POS + 1] = 0
        meta[k.M_USED] = meta[k.M_USED + 1] = 0

    def stats(self):
        meta = self.meta
        k = self.k
        return {
            "limit": self.limit,
            "arena_used": int(meta[k.M_POS] + meta[k.M_POS + 1]),
            "dropped_generations": int(meta[k.M_DROPS]),
            "bypass": self.bypass,
            "hits": self.hits,
            "updates": self.updates,
            "misses": self.misses,
        }
