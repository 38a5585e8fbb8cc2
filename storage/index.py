"""The LMDB environment: the batch index, stream metadata, chunk index, key-value and metadata
tables, and the WAL checkpoint, plus the raw operations the WAL records.

Every change to LMDB is a list of raw operations ``[code, db, key, value]`` written to the WAL
(entry type ``T_OPS``) before the LMDB transaction that applies it commits, so recovery can replay
exactly the entries past the checkpoint (stored in the same transaction).
"""

import hashlib
import struct

import lmdb
import msgpack

# database numbers (stable: they are written into the WAL)
SYS, STREAMS, INDEX, KV, META, CHUNKS, CHUNKSEQ, CHUNKREF, CHUNKFREE, PACKS, SEGLIVE = range(11)
DB_NAMES = [b"sys", b"streams", b"index", b"kv", b"meta", b"chunks", b"chunkseq", b"chunkref", b"chunkfree", b"packs",
            b"seglive"]

OP_PUT, OP_DEL, OP_DELRANGE = 0, 1, 2
# [OP_PUTS, db, keys, values]: one put per (key, value) of the two lists, in order (a key-value
# write run logged as two lists: msgpack packs them without a list per put, storage/kv.py)
OP_PUTS = 3


class PackedOp(bytes):
    """One raw op already packed: exactly the bytes ``msgpack.packb(op, use_bin_type=True)`` gives
    for it (the key-value server's compiled SET pass writes an ``OP_PUTS`` op straight from a read,
    storage/kv.py ``write_packed``). The commit core puts it in a ``T_OPS`` entry as it is
    (``pack_ops``), so the entry is the same bytes as if the op had been packed there."""

    __slots__ = ()


def pack_ops(ops):
    """The parts of a ``T_OPS`` entry holding ``ops`` (raw ops, some of them ``PackedOp``): the
    same bytes as ``msgpack.packb(ops, use_bin_type=True)``, a packed op taken as it is."""
    n = len(ops)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 65536:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return (head, *[op if op.__class__ is PackedOp else msgpack.packb(op, use_bin_type=True) for op in ops])

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


def apply_ops(txn, dbs, ops, live=None):
    for op in ops:
        code, dbn, key = op[0], op[1], op[2]
        db = dbs[dbn]
        if code == OP_PUT:
            txn.put(key, op[3], db=db)
        elif code == OP_PUTS:
            txn.cursor(db=db).putmulti(zip(key, op[3]))
        elif code == OP_DEL:
            old = txn.pop(key, db=db)
            if old is not None and dbn == INDEX and live is not None:
                live.drop(old)
        else:
            delete_range(txn, db, key, op[3], live.drop if (dbn == INDEX and live is not None) else None)


def delete_range(txn, db, start: bytes, end: bytes, on_value=None) -> int:
    """Delete keys in [start, end), passing each deleted value to ``on_value``."""
    n = 0
    cur = txn.cursor(db=db)
    if not cur.set_range(start):
        return 0
    while cur.key() < end:
        n += 1
        if on_value is not None:
            on_value(cur.value())
        if not cur.delete():
            break
        if not cur.key():
            break
    return n


class LiveBytes:
    """Per-segment deltas of live batch bytes in one transaction (table ``seglive``: segment
    base -> bytes of batch entries the index still points at). A segment at 0 holds nothing live
    (its other entries are all behind the checkpoint) and can be deleted."""

    def __init__(self, wal):
        self.wal = wal
        self.delta = {}

    def add(self, pos, n, base=None):
        if base is None:
            base = self.wal.segment_of(pos)
        self.delta[base] = self.delta.get(base, 0) + n

    def drop(self, index_value):
        pos, total = INDEX_VAL.unpack(index_value)[:2]
        self.add(pos, -total)

    def merge(self, other):
        for base, n in other.delta.items():
            self.delta[base] = self.delta.get(base, 0) + n

    def flush(self, txn, dbs):
        db = dbs[SEGLIVE]
        for base, n in self.delta.items():
            if not n or base is None:
                continue
            key = U64.pack(base)
            cur = txn.get(key, db=db)
            value = (U64.unpack(cur)[0] if cur else 0) + n
            if value > 0:
                txn.put(key, U64.pack(value), db=db)
            elif cur is not None:
                txn.delete(key, db=db)
        self.delta = {}


def put_batch_index(txn, dbs, key, value, live, pos, total, base=None):
    """Index one batch entry; an entry re-appended by the segment cleaner replaces its old place."""
    old = txn.replace(key, value, db=dbs[INDEX])
    live.add(pos, total, base)
    if old is not None:
        live.drop(old)


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


def iter_ordered(cur, reverse: bool, pfx: bytes = b""):
    """(user key, value) in true key order from the cursor's position, forward or backward.

    Keys longer than KEY_KEEP share their LMDB key's first KEY_KEEP bytes with every other long key
    of the same prefix, and those form one contiguous run in LMDB order (a short key can never
    fall inside it); each run is sorted by full key before it is yielded."""
    it = cur.iterprev() if reverse else cur.iternext()
    run, run_prefix = [], None
    n = len(pfx)
    for lk, stored in it:
        if n and not lk.startswith(pfx):
            break
        if len(lk) <= KEY_KEEP:
            if run:
                run.sort(reverse=reverse)
                yield from run
                run = []
            yield lk[n:], stored[1:]
        else:
            p = lk[:KEY_KEEP]
            if run and p != run_prefix:
                run.sort(reverse=reverse)
                yield from run
                run = []
            run_prefix = p
            run.append(decode_value(stored))
    if run:
        run.sort(reverse=reverse)
        yield from run


def seek_forward(cur, pfx: bytes, start) -> bool:
    """Put the cursor at or before the first key >= ``start`` (None: the first key of ``pfx``)."""
    if start is None:
        return cur.set_range(pfx) if pfx else cur.first()
    return cur.set_range((pfx + start)[:KEY_KEEP])


def seek_backward(cur, pfx: bytes, start) -> bool:
    """Put the cursor at or after the last key <= ``start`` (None: the last key of ``pfx``), so a
    backward iter_ordered() sees every key <= start."""
    if start is None:
        if pfx:
            upper = pfx[:-1] + bytes([pfx[-1] + 1])
            return cur.prev() if cur.set_range(upper) else cur.last()
        return cur.last()
    full = pfx + start
    if len(full) > KEY_KEEP:  # past the whole run of long keys sharing start's prefix
        return cur.prev() if cur.set_range(full[:KEY_KEEP] + b"\xff" * 17) else cur.last()
    if cur.set_range(full):
        return True if cur.key() == full else cur.prev()
    return cur.last()


class RawTxn:
    """The writer thread's view of one LMDB write transaction: reads see earlier writes of the
    same group; every write is applied at once and recorded for the WAL."""

    def __init__(self, txn, dbs, wal):
        self.txn = txn
        self.dbs = dbs
        self.ops = []
        self.live = LiveBytes(wal)
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
        if delete_range(self.txn, self.dbs[db], start, end, self.live.drop if db == INDEX else None):
            self.ops.append([OP_DELRANGE, db, start, end])

    def cursor(self, db: int):
        return self.txn.cursor(db=self.dbs[db])
