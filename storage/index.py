"""The LMDB environment: the batch index, stream metadata, chunk index, key-value and metadata
tables, and the WAL checkpoint, plus the raw operations the WAL records.

Every change to LMDB is a list of raw operations ``[code, db, key, value]`` written to the WAL
(entry type ``T_OPS``) before the LMDB transaction that applies it commits, so recovery can replay
exactly the entries past the checkpoint (stored in the same transaction).
"""

import hashlib
import struct

import lmdb

# database numbers (stable: they are written into the WAL)
SYS, STREAMS, INDEX, KV, META, CHUNKS, CHUNKSEQ, CHUNKREF, CHUNKFREE, PACKS = range(10)
DB_NAMES = [b"sys", b"streams", b"index", b"kv", b"meta", b"chunks", b"chunkseq", b"chunkref", b"chunkfree", b"packs"]

OP_PUT, OP_DEL, OP_DELRANGE = 0, 1, 2

CHECKPOINT = b"wal_checkpoint"
STREAM_COUNTER = b"stream_n"
CHUNK_SEQ = b"chunk_seq"

U64 = struct.Struct(">Q")
INDEX_KEY = struct.Struct(">QQ")  # stream_id, base_offset
# WAL position, entry length (header included), record_count, append time ms
INDEX_VAL = struct.Struct(">QIIQ")

# LMDB keys are at most 511 bytes; longer user keys keep their first bytes (so order holds for
# all keys that differ there) plus a hash, and the full key rides in the value.
KEY_KEEP = 440


def open_env(path: str, sync: bool, map_size: int = 1 << 38):
    env = lmdb.open(
        path,
        map_size=map_size,
        max_dbs=len(DB_NAMES) + 2,
        sync=sync,
        metasync=False,  # the previous meta page stays valid; the WAL replays the last commit
        readahead=False,
        max_readers=512,
        lock=True,
    )
    dbs = [env.open_db(name) for name in DB_NAMES]
    return env, dbs


def apply_ops(txn, dbs, ops):
    for op in ops:
        code, db, key = op[0], dbs[op[1]], op[2]
        if code == OP_PUT:
            txn.put(key, op[3], db=db)
        elif code == OP_DEL:
            txn.delete(key, db=db)
        else:
            delete_range(txn, db, key, op[3])


def delete_range(txn, db, start: bytes, end: bytes) -> int:
    """Delete keys in [start, end)."""
    n = 0
    cur = txn.cursor(db=db)
    if not cur.set_range(start):
        return 0
    while cur.key() < end:
        n += 1
        if not cur.delete():
            break
        if not cur.key():
            break
    return n


def encode_key(prefix: bytes, key: bytes) -> bytes:
    full = prefix + key
    if len(full) <= KEY_KEEP:
        return full
    return full[:KEY_KEEP] + hashlib.sha256(full).digest()[:16]


def encode_value(key: bytes, prefix: bytes, value: bytes) -> bytes:
    if len(prefix) + len(key) <= KEY_KEEP:
        return b"\x00" + value
    return b"\x01" + struct.pack(">I", len(key)) + key + value


def decode_value(stored: bytes):
    """(full key or None if short, value)."""
    if stored[:1] == b"\x00":
        return None, stored[1:]
    (n,) = struct.unpack_from(">I", stored, 1)
    return stored[5:5 + n], stored[5 + n:]


def user_key(prefix: bytes, lmdb_key: bytes, stored: bytes) -> bytes:
    full, _ = decode_value(stored)
    return full if full is not None else lmdb_key[len(prefix):]


class RawTxn:
    """The writer thread's view of one LMDB write transaction: reads see earlier writes of the
    same group; every write is applied at once and recorded for the WAL."""

    def __init__(self, txn, dbs, store):
        self.txn = txn
        self.dbs = dbs
        self.store = store
        self.ops = []
        self.after_commit = []  # callables run in the writer thread once the group committed
        self.on_reactor = []  # callables run on the reactor thread once the group is durable

    def get(self, db: int, key: bytes):
        return self.txn.get(key, db=self.dbs[db])

    def put(self, db: int, key: bytes, value: bytes):
        self.txn.put(key, value, db=self.dbs[db])
        self.ops.append([OP_PUT, db, key, value])

    def delete(self, db: int, key: bytes):
        if self.txn.delete(key, db=self.dbs[db]):
            self.ops.append([OP_DEL, db, key])

    def delete_range(self, db: int, start: bytes, end: bytes):
        if delete_range(self.txn, self.dbs[db], start, end):
            self.ops.append([OP_DELRANGE, db, start, end])

    def cursor(self, db: int):
        return self.txn.cursor(db=self.dbs[db])
