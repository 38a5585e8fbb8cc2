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
  enter the *active* memtable (a ``SortedDict``: key -> value, or None for a remove), where
  reads see them; until then they are invisible to every reader (the key-value server shows a
  connection its own pending writes, protocols/partition/server.py).
- ``flush`` freezes the active memtable and queues one ``Direct`` that merges it into LMDB as one
  sorted run in the writer thread (off the reactor) and moves the floor; it runs when the
  memtable passes ``FLUSH_BYTES``, and ``FLUSH_IDLE_S`` after the first write into an empty one.
- Reads merge, newest first: active memtable, the one being flushed, LMDB. Scans merge the three
  in key order (``_merge``).
- Recovery after kill -9: the WAL entries past the checkpoint (so every unmerged memtable write)
  are replayed into LMDB at open (``commit.recover``): the memtable starts empty.
- Bounded memory: over ``HARD_BYTES`` in the memtables, writes fail with ``StoreBusy`` (the server
  answers ERR 0) until the flush catches up; ``congested`` is true from ``FLUSH_BYTES * 2`` on,
  and protocols that watch the store stop reading.
"""

from sortedcontainers import SortedDict
from twisted.internet import defer
from twisted.python.failure import Failure

from storage import errors, index
from storage.commit import Direct
from storage.index import (KEY_KEEP, OP_DEL, OP_PUT, decode_value, encode_key, encode_value, iter_ordered,
                           seek_backward, seek_forward)

MAX_KEY = 65535
MAX_VALUE = 16 << 20
PARTITIONS = 8

FLUSH_BYTES = 16 << 20  # merge the memtable into LMDB once it holds this many bytes
HARD_BYTES = 256 << 20  # memtables over this: writes refused (StoreBusy) until a flush lands
FLUSH_IDLE_S = 1.0  # and this long after the first write into an empty memtable
ENTRY_OVERHEAD = 100  # per-entry bytes counted beyond key and value (dict + SortedList slots)
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


def _pairs(table, keys):
    for k in keys:
        yield k, table[k]


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


class KeyValue:
    def __init__(self, core):
        self._core = core
        self._db = core.dbs[index.KV]
        self._active = SortedDict()  # reactor thread: durable writes not yet merged
        self._active_bytes = 0
        self._flushing = None  # the frozen memtable the writer is merging into LMDB
        self._flushing_bytes = 0
        self._inflight = {}  # key -> [value or None, count]: submitted, not yet durable (for REMOVE's answer)
        self._inflight_runs = 0
        self._idle_flush = None  # the pending FLUSH_IDLE_S call
        self._flush_waiters = []  # flush() callers waiting for the running merge
        self.flushes = 0  # merges landed (observability, tests)
        core.on_close.insert(0, self._cancel_idle_flush)

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
        value = self._active.get(key, _MISSING)
        if value is _MISSING and self._flushing is not None:
            value = self._flushing.get(key, _MISSING)
        if value is not _MISSING:
            return value
        return self._lmdb_get(self._core.snapshot().get, key)

    def get_many(self, keys):
        """[value or None] for each key (any bytes-like object), from one snapshot."""
        get = self._core.snapshot().get
        active = self._active
        flushing = self._flushing
        out = []
        append = out.append
        for key in keys:
            if type(key) is not bytes:
                key = bytes(key)
            if active:
                value = active.get(key, _MISSING)
                if value is not _MISSING:
                    append(value)
                    continue
            if flushing is not None:
                value = flushing.get(key, _MISSING)
                if value is not _MISSING:
                    append(value)
                    continue
            append(self._lmdb_get(get, key))
        return out

    # -- writes -------------------------------------------------------------------------------

    def put(self, key, value):
        """Fires with None once durable."""
        return self.write_many([(key, value)]).addCallback(lambda _: None)

    def delete(self, key):
        """Fires with True if the key existed."""
        return self.write_many([(key, None)]).addCallback(lambda existed: existed[0])

    def _exists(self, key, get):
        entry = self._inflight.get(key)
        if entry is not None:
            return entry[0] is not None
        value = self._active.get(key, _MISSING)
        if value is _MISSING and self._flushing is not None:
            value = self._flushing.get(key, _MISSING)
        if value is not _MISSING:
            return value is not None
        return self._lmdb_get(get, key) is not None

    def write_many(self, ops):
        """Apply ``[(key, value or None to remove)]`` in order, atomically, in one group commit.

        Fires once durable (per the fsync policy) with one bool per op: True for a put, whether
        the key existed for a remove. Fails as a whole, before anything is queued, if any key is
        not 1..65535 bytes (``InvalidRequest``), any value is over 16 MiB (``PayloadTooLarge``), or
        the memtables are full (``StoreBusy``). Keys and values may be any bytes-like object; they
        are copied before this returns."""
        items = []
        append = items.append
        nbytes = 0
        try:
            for key, value in ops:
                if key.__class__ is not bytes:
                    if not isinstance(key, (bytearray, memoryview)):
                        raise errors.InvalidRequest("keys are bytes")
                    key = bytes(key)
                klen = len(key)
                if not 0 < klen <= MAX_KEY:
                    raise errors.InvalidRequest("keys are 1..65535 bytes")
                if value is not None:
                    if len(value) > MAX_VALUE:
                        raise errors.PayloadTooLarge("values are at most 16 MiB")
                    if value.__class__ is not bytes:
                        value = bytes(value)
                    nbytes += len(value)
                append((key, value))
                nbytes += klen + ENTRY_OVERHEAD
            if self._active_bytes + self._flushing_bytes + nbytes > HARD_BYTES:
                self.flush()
                raise errors.StoreBusy("the key-value memtable is full; a merge into LMDB is running")
            self._core.check_writable(nbytes)
        except errors.StoreError:
            return defer.fail()
        # Each op's answer is decided now, in submission order (the order the store applies them):
        # a remove finds the key in the writes submitted before it, the memtables or LMDB.
        get = self._core.snapshot().get
        inflight = self._inflight
        results = []
        logged = []
        for key, value in items:
            if value is None:
                existed = self._exists(key, get)
                results.append(existed)
                if existed:
                    logged.append([OP_DEL, index.KV, encode_key(b"", key)])
            else:
                results.append(True)
                lk, lv = _lmdb_item(key, value)
                logged.append([OP_PUT, index.KV, lk, lv])
            entry = inflight.get(key)
            if entry is None:
                inflight[key] = [value, 1]
            else:
                entry[0] = value
                entry[1] += 1
        self._inflight_runs += 1

        def apply(txn):  # writer thread: the WAL entry is all; LMDB gets it at the next flush
            return results, logged

        d = self._core.submit(Direct(apply, nbytes, memtable=True))
        d.addBoth(self._landed, items, nbytes)
        return d

    def _landed(self, result, items, nbytes):
        """Reactor thread, the run durable (or failed): into the active memtable, before the
        caller's callbacks run."""
        self._inflight_runs -= 1
        inflight = self._inflight
        ok = not isinstance(result, Failure)
        active = self._active
        was_empty = not active
        for key, value in items:
            entry = inflight[key]
            entry[1] -= 1
            if not entry[1]:
                del inflight[key]
            if ok:
                old = active.get(key, _MISSING)
                if old is not _MISSING:
                    self._active_bytes -= len(key) + ENTRY_OVERHEAD + (len(old) if old is not None else 0)
                active[key] = value
                self._active_bytes += len(key) + ENTRY_OVERHEAD + (len(value) if value is not None else 0)
        if ok:
            if self._active_bytes >= FLUSH_BYTES:
                self.flush()
            elif was_empty and active and self._idle_flush is None and not self._core.closed:
                self._idle_flush = self._core.reactor.callLater(FLUSH_IDLE_S, self._flush_idle)
        return result

    # -- merging into LMDB --------------------------------------------------------------------

    def _flush_idle(self):
        self._idle_flush = None
        self.flush()

    def _cancel_idle_flush(self):
        if self._idle_flush is not None and self._idle_flush.active():
            self._idle_flush.cancel()
        self._idle_flush = None

    @property
    def congested(self) -> bool:
        return self._active_bytes + self._flushing_bytes > 2 * FLUSH_BYTES

    def memtable_bytes(self) -> int:
        return self._active_bytes + self._flushing_bytes

    def memtable_keys(self) -> int:
        """Entries in the memtables (an upper bound of the keys they add to LMDB's count)."""
        return len(self._active) + (len(self._flushing) if self._flushing is not None else 0)

    def flush(self) -> defer.Deferred:
        """Merge the active memtable into LMDB (one sorted run, in the writer thread); fires once
        merged (at once if there is nothing to merge). One merge at a time: while one runs, this
        fires when it lands and the rest waits for the next."""
        if self._flushing is not None:
            d = defer.Deferred()
            self._flush_waiters.append(d)
            return d
        if not self._active or self._core.closed or self._core.failed is not None:
            return defer.succeed(None)
        self._cancel_idle_flush()
        frozen, self._flushing = self._active, self._active
        self._flushing_bytes, self._active_bytes = self._active_bytes, 0
        self._active = SortedDict()
        core = self._core
        # After this merge the oldest unmerged write is one not yet delivered when it was frozen:
        # its WAL entry lies at or past the end of the last delivered group.
        floor = core.delivered_wal_end if self._inflight_runs else None
        db = self._db

        def merge(txn):  # writer thread
            puts = []
            cur = txn.cursor(db=db)
            for key, value in frozen.items():
                if value is None:
                    txn.delete(encode_key(b"", key), db=db)
                else:
                    puts.append(_lmdb_item(key, value))
            if puts:
                cur.putmulti(puts)
            core.kv_floor = floor
            return None, None

        d = core.submit(Direct(merge, 64))
        done = defer.Deferred()
        self._flush_waiters.append(done)

        def landed(result):
            self._flushing = None
            self._flushing_bytes = 0
            self.flushes += 1
            waiters, self._flush_waiters = self._flush_waiters, []
            for w in waiters:
                w.callback(None)
            if self._active_bytes >= FLUSH_BYTES:
                self.flush()
            elif self._active and self._idle_flush is None and not core.closed:
                self._idle_flush = core.reactor.callLater(FLUSH_IDLE_S, self._flush_idle)
            return result

        d.addBoth(landed)
        d.addErrback(lambda f: None)  # a failed merge poisoned the store; the caller sees it there
        return done

    # -- scans --------------------------------------------------------------------------------

    def _mem_sources(self, start, descending):
        sources = []
        for table in (self._active, self._flushing):
            if table:
                if descending:
                    keys = table.irange(maximum=start, reverse=True)
                else:
                    keys = table.irange(minimum=start)
                sources.append(_pairs(table, keys))
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
