"""Key-value pairs in 8 range partitions (CONTRACT §2: partition = first key byte >> 5).

One ordered LMDB table holds every partition: partition order equals key order, so partition p is
the key range [p << 5, (p + 1) << 5) of the first byte and scans cross partitions naturally.
Writes go through the group commit (durable per the fsync policy); reads are synchronous.
"""

from twisted.internet import defer

from storage import errors, index
from storage.index import (KEY_KEEP, OP_PUT, decode_value, encode_key, encode_value, iter_ordered,
                           seek_backward, seek_forward)
from storage.store import K_OPS, K_TXN, _Op

MAX_KEY = 65535
MAX_VALUE = 16 << 20
PARTITIONS = 8


def partition_of(key: bytes) -> int:
    return key[0] >> 5


def partition_bounds(p: int):
    """(first key byte included, first key byte excluded or None) of partition ``p``."""
    return bytes([p << 5]), (bytes([(p + 1) << 5]) if p < PARTITIONS - 1 else None)


class KeyValue:
    def __init__(self, store):
        self._store = store
        self._db = store.dbs[index.KV]

    @staticmethod
    def _check_key(key):
        if not isinstance(key, (bytes, bytearray, memoryview)) or not 1 <= len(key) <= MAX_KEY:
            raise errors.InvalidRequest("keys are 1..65535 bytes")

    def get(self, key):
        if type(key) is not bytes:
            key = bytes(key)
        stored = self._store.snapshot().get(key if len(key) <= KEY_KEEP else encode_key(b"", key), db=self._db)
        if stored is None:
            return None
        if stored[0] == 0:
            return stored[1:]
        full, value = decode_value(stored)
        return value if full == key else None

    def get_many(self, keys):
        """[value or None] for each key, from one snapshot."""
        get = self._store.snapshot().get
        db = self._db
        out = []
        for key in keys:
            if type(key) is not bytes:
                key = bytes(key)
            stored = get(key if len(key) <= KEY_KEEP else encode_key(b"", key), db=db)
            if stored is None:
                out.append(None)
            elif stored[0] == 0:
                out.append(stored[1:])
            else:
                full, value = decode_value(stored)
                out.append(value if full == key else None)
        return out

    def put(self, key, value):
        store = self._store
        try:
            self._check_key(key)
            if len(value) > MAX_VALUE:
                raise errors.PayloadTooLarge("values are at most 16 MiB")
            nbytes = len(key) + len(value) + 64
            store._check_writable(nbytes)
        except errors.StoreError:
            return defer.fail()
        key = bytes(key)
        op = [OP_PUT, index.KV, encode_key(b"", key), encode_value(key, b"", bytes(value))]
        return store._submit(_Op(K_OPS, [op], nbytes=nbytes))

    def delete(self, key):
        """Fires with True if the key existed."""
        try:
            self._check_key(key)
        except errors.StoreError:
            return defer.fail()
        key = bytes(key)
        lk = encode_key(b"", key)
        store = self._store

        def fn(raw):
            existed = raw.get(index.KV, lk) is not None
            if existed:
                raw.delete(index.KV, lk)
            return existed

        try:
            store._check_writable(64)
        except errors.StoreError:
            return defer.fail()
        return store._submit(_Op(K_TXN, fn, nbytes=len(key) + 64))

    def scan_forward(self, start, limit):
        """Pairs with key >= ``start`` (None = from the first key), ascending."""
        out = []
        if limit <= 0:
            return out
        start = None if start is None else bytes(start)
        cur = self._store.snapshot().cursor(db=self._db)
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
        cur = self._store.snapshot().cursor(db=self._db)
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
        cur = self._store.snapshot().cursor(db=self._db)
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
