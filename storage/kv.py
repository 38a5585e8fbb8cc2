"""Key-value pairs in 8 range partitions (CONTRACT §2: partition = first key byte >> 5).

One ordered LMDB table holds every partition: partition order equals key order, so partition p is
the key range [p << 5, (p + 1) << 5) of the first byte and scans cross partitions naturally.
Writes go through the group commit (durable per the fsync policy); reads are synchronous.

A run of writes (``write_many``) is one queue entry, one ``putmulti`` into the group's LMDB
transaction and one Deferred. Under ``--fsync always`` the run's raw operations are also framed
into the WAL (one entry per group), as every other LMDB change is. Under ``interval`` and ``never``
they are not: the LMDB commit that applies them (to the OS page cache, before the ack) is all a
kv write has, and all it needs (see docs/storage.md, "Key-value partitions").
"""

from twisted.internet import defer

from storage import errors, index
from storage.commit import Direct
from storage.index import (KEY_KEEP, OP_DEL, OP_PUT, decode_value, encode_key, encode_value, iter_ordered,
                           seek_backward, seek_forward)

MAX_KEY = 65535
MAX_VALUE = 16 << 20
PARTITIONS = 8


def partition_of(key: bytes) -> int:
    return key[0] >> 5


def partition_bounds(p: int):
    """(first key byte included, first key byte excluded or None) of partition ``p``."""
    return bytes([p << 5]), (bytes([(p + 1) << 5]) if p < PARTITIONS - 1 else None)


class KeyValue:
    def __init__(self, core):
        self._core = core
        self._db = core.dbs[index.KV]

    def get(self, key):
        if type(key) is not bytes:
            key = bytes(key)
        stored = self._core.snapshot().get(key if len(key) <= KEY_KEEP else encode_key(b"", key), db=self._db)
        if stored is None:
            return None
        if stored[0] == 0:
            return stored[1:]
        full, value = decode_value(stored)
        return value if full == key else None

    def get_many(self, keys):
        """[value or None] for each key (any bytes-like object), from one snapshot."""
        get = self._core.snapshot().get
        db = self._db
        out = []
        append = out.append
        for key in keys:
            if len(key) <= KEY_KEEP:
                stored = get(key, db=db)
                append(None if stored is None else stored[1:])
                continue
            stored = get(encode_key(b"", bytes(key)), db=db)
            if stored is None:
                append(None)
            else:
                full, value = decode_value(stored)
                append(value if full == key else None)
        return out

    def put(self, key, value):
        """Fires with None once durable."""
        return self.write_many([(key, value)]).addCallback(lambda _: None)

    def delete(self, key):
        """Fires with True if the key existed."""
        return self.write_many([(key, None)]).addCallback(lambda existed: existed[0])

    def write_many(self, ops):
        """Apply ``[(key, value or None to remove)]`` in order, atomically, in one group commit.

        Fires once durable (per the fsync policy) with one bool per op: True for a put, whether
        the key existed for a remove. Fails as a whole, before anything is queued, if any key is
        not 1..65535 bytes (``InvalidRequest``) or any value is over 16 MiB (``PayloadTooLarge``).
        Keys and values may be any bytes-like object; they are copied before this returns."""
        items = []
        append = items.append
        nbytes = 0
        removes = False
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
                    removes = True
                    append((key if klen <= KEY_KEEP else encode_key(b"", key), None))
                    nbytes += klen + 64
                    continue
                if len(value) > MAX_VALUE:
                    raise errors.PayloadTooLarge("values are at most 16 MiB")
                if klen <= KEY_KEEP:
                    append((key, b"\x00" + value))  # index.encode_value of a short key
                else:
                    append((encode_key(b"", key), encode_value(key, b"", bytes(value))))
                nbytes += klen + len(value) + 64
            self._core.check_writable(nbytes)
        except errors.StoreError:
            return defer.fail()
        db = self._db
        wal = self._core.policy.always

        def apply(txn):
            if not removes:
                txn.cursor(db=db).putmulti(items)
                return [True] * len(items), ([[OP_PUT, index.KV, k, v] for k, v in items] if wal else None)
            existed = []
            logged = [] if wal else None
            for k, v in items:
                if v is None:
                    found = txn.pop(k, db=db) is not None
                    existed.append(found)
                    if found and wal:
                        logged.append([OP_DEL, index.KV, k])
                else:
                    txn.put(k, v, db=db)
                    existed.append(True)
                    if wal:
                        logged.append([OP_PUT, index.KV, k, v])
            return existed, logged

        return self._core.submit(Direct(apply, nbytes))

    def scan_forward(self, start, limit):
        """Pairs with key >= ``start`` (None = from the first key), ascending."""
        out = []
        if limit <= 0:
            return out
        start = None if start is None else bytes(start)
        cur = self._core.snapshot().cursor(db=self._db)
        if not seek_forward(cur, b"", start):
            return out
        for key, value in iter_ordered(cur, False):
            if start is not None and key < start:
                continue
            out.append((key, value))
            if len(out) >= limit:
                break
        return out

    def scan_backward(self, start, limit):
        """Pairs with key <= ``start`` (None = from the last key), descending."""
        out = []
        if limit <= 0:
            return out
        start = None if start is None else bytes(start)
        cur = self._core.snapshot().cursor(db=self._db)
        if not seek_backward(cur, b"", start):
            return out
        for key, value in iter_ordered(cur, True):
            if start is not None and key > start:
                continue
            out.append((key, value))
            if len(out) >= limit:
                break
        return out

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
        cur = self._core.snapshot().cursor(db=self._db)
        if not seek_forward(cur, b"", start):
            return out
        for key, _ in iter_ordered(cur, False):
            if start is not None and key < start:
                continue
            if prefix is not None and not key.startswith(prefix):
                break  # keys >= prefix that lack it sort after every key that has it
            out.append(key)
            if len(out) >= limit:
                break
        return out

    def partition_of(self, key):
        return partition_of(key)
