"""Transactional metadata for the other layers (Toasty file tree, swarm sync intervals, counters).

``transact(fn)`` runs ``fn(txn)`` in the writer thread inside the group's LMDB transaction (a
nested one, so a raising ``fn`` writes nothing); its writes reach the WAL as one entry, so the
change is atomic and durable across restarts. ``read(fn)`` runs on a read-only snapshot.
Tables are key prefixes (``table`` + NUL) of one ordered LMDB table; values are msgpack.
"""

import msgpack

from storage import errors, index
from storage.index import decode_value, encode_key, encode_value

COUNTERS = "__counter"


def _pack(value):
    return msgpack.packb(value, use_bin_type=True)


def _unpack(raw):
    return msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=False)


_PREFIXES = {}


def _prefix(table: str) -> bytes:
    pfx = _PREFIXES.get(table)
    if pfx is None:
        t = table.encode()
        if b"\x00" in t:
            raise errors.InvalidRequest("table names contain no NUL")
        pfx = t + b"\x00"
        if len(_PREFIXES) < 1024:  # the few table names in use are cached
            _PREFIXES[table] = pfx
    return pfx


class _ReadTxn:
    """Read methods over an LMDB transaction (read-only snapshot or the writer's transaction)."""

    def __init__(self, txn, dbs):
        self._txn = txn
        self._dbs = dbs

    def _raw_get(self, db, key):
        return self._txn.get(key, db=self._dbs[db])

    def _cursor(self, db):
        return self._txn.cursor(db=self._dbs[db])

    def get(self, table, key):
        pfx = _prefix(table)
        key = bytes(key)
        stored = self._raw_get(index.META, encode_key(pfx, key))
        if stored is None:
            return None
        full, value = decode_value(stored)
        if full is not None and full != key:
            return None
        return _unpack(value)

    def scan(self, table, start=b"", prefix=None, reverse=False, limit=None):
        """[(key, value)] of ``table``: keys >= start ascending, or with ``reverse`` keys <= start
        descending (start b"" or None = from the end), optionally only keys with ``prefix``."""
        pfx = _prefix(table)
        start = bytes(start) if start else None
        prefix = bytes(prefix) if prefix else None
        out = []
        if limit is not None and limit <= 0:
            return out
        cur = self._cursor(index.META)
        if not reverse:
            if prefix is not None and (start is None or start < prefix):
                start = prefix
            if not index.seek_forward(cur, pfx, start):
                return out
        elif not index.seek_backward(cur, pfx, start):
            return out
        for key, value in index.iter_ordered(cur, reverse, pfx):
            if start is not None and (key > start if reverse else key < start):
                continue
            if prefix is not None and not key.startswith(prefix):
                if (key > prefix) != reverse:
                    break
                continue
            out.append((key, _unpack(value)))
            if limit is not None and len(out) >= limit:
                break
        return out

    def chunk_has(self, addr) -> bool:
        return self._raw_get(index.CHUNKS, bytes(addr)) is not None

    def chunk_refcount(self, addr) -> int:
        raw = self._raw_get(index.CHUNKREF, bytes(addr))
        return index.U64.unpack(raw)[0] if raw else 0

    def _readonly(self, *a, **k):
        raise errors.InvalidRequest("read-only transaction")

    put = delete = next_id = chunk_incref = chunk_decref = chunk_put = _readonly


def _counter_key(name) -> bytes:
    return name.encode() if isinstance(name, str) else bytes(name)


class Counter:
    """See ``Txn.counter``."""

    __slots__ = ("txn", "key", "first", "value")

    def __init__(self, txn, key: bytes):
        self.txn = txn
        self.key = key
        self.first = self.value = None

    def next(self) -> int:
        if self.value is None:
            self.first = self.value = self.txn.get(COUNTERS, self.key) or 0
        self.value += 1
        return self.value

    def store(self):
        if self.value is not None and self.value != self.first:
            self.txn.put(COUNTERS, self.key, self.value)


class Txn(_ReadTxn):
    """The writer-thread transaction handed to ``transact(fn)``; ``chunks`` is the store's
    ChunkStore (chunk references and chunk bytes in the same transaction)."""

    def __init__(self, raw, chunks):
        super().__init__(raw.txn, raw.dbs)
        self._raw = raw
        self._chunks = chunks

    def put(self, table, key, value):
        pfx = _prefix(table)
        key = bytes(key)
        self._raw.put(index.META, encode_key(pfx, key), encode_value(key, pfx, _pack(value)))

    def put_new(self, table, key, value) -> bool:
        """``put`` only if ``key`` is absent: True if stored, False if the key was taken."""
        if self.get(table, key) is not None:
            return False
        self.put(table, key, value)
        return True

    def delete(self, table, key):
        pfx = _prefix(table)
        self._raw.delete(index.META, encode_key(pfx, bytes(key)))

    def next_id(self, name) -> int:
        current = self.get(COUNTERS, _counter_key(name)) or 0
        self.put(COUNTERS, _counter_key(name), current + 1)
        return current + 1

    def counter(self, name) -> "Counter":
        """``next_id(name)`` for a transaction that takes many ids: the counter is read at the
        first ``next()`` and written back once by ``store()``; nothing else in this transaction
        may take ids of ``name`` meanwhile."""
        return Counter(self, _counter_key(name))

    def chunk_incref(self, addrs):
        self._chunks.incref_in(self._raw, addrs)

    def chunk_decref(self, addrs):
        self._chunks.decref_in(self._raw, addrs)

    def chunk_get(self, addr):
        """The chunk's bytes (CRC checked; DataCorrupted if not), or None if it is not held."""
        return self._chunks.get_in(self._raw, addr)

    def chunk_put(self, data) -> bytes:
        """Store a chunk in this transaction (unreferenced until ``chunk_incref``); its address."""
        return self._chunks.put_in(self._raw, bytes(data))


class Meta:
    def __init__(self, core, chunks):
        self._core = core
        self._chunks = chunks

    def transact(self, fn):
        """Run ``fn(txn)`` atomically and durably in the writer thread; fires with its result."""
        chunks = self._chunks
        return self._core.transact(lambda raw: fn(Txn(raw, chunks)), 512)

    def read(self, fn):
        return fn(_ReadTxn(self._core.snapshot(), self._core.dbs))

    def next_id(self, counter_name):
        return self.transact(lambda txn: txn.next_id(counter_name))
