"""Compiled (numba) pass over a read of pipelined SETs (CONTRACT §4), for the key-value server's
run of writes straight from a read (``server.KvServerProtocol._writes_from_read``). Imported lazily
through ``storage.jit.import_compiled`` by ``protocols/partition/sets_compiled.py``: the server keeps
its Python loop (``_write_run``) for when this is absent or still loading.

``set_run`` finds the run of whole, well-formed SETs at the start of a read (the checks of the
server's ``_write_run``, in the same order, and its budget), and in the same call writes

- the run's WAL op, exactly the bytes ``msgpack.packb([OP_PUTS, KV_DB, keys, stored], use_bin_type=True)``
  gives (``stored``: each value behind the store's one-byte prefix ``b"\\x00"``, storage/kv.py
  ``_lmdb_item``), so the writer thread logs it without packing and every reader of the WAL
  (recovery, the merge worker) reads what it always read; and the server makes the run's key and
  stored value objects with one ``msgpack.unpackb`` of it (each stored value one object, no
  ``b"\\x00" +`` copy);
- the run's OK replies (header: total_len 26, the request's client_id, num_elems 0, OK), one after
  another, sent as they are once the run is durable.

Every position is checked against the buffer's end before it is read. Arrays are indexed with
unsigned integers: numba then skips its negative-index wraparound.
"""

import numpy as np
from numba import njit

from protocols.partition.bytes_kernel import be as _be, frame_head as _frame_head, put_be as _put_be
from protocols.partition.codec import HEADER_LEN, MAX_MESSAGE, MAX_VALUE, OK, SET
from storage.index import KEY_KEEP, KV, OP_PUTS

JIT = dict(cache=True, nogil=True)


@njit(**JIT)
def _array_head(out, p, n):
    """A msgpack array header of ``n`` items at ``p``; the position after it."""
    if n < 16:
        out[np.uint64(p)] = np.uint8(0x90 | n)
        return p + 1
    if n < 65536:
        out[np.uint64(p)] = np.uint8(0xDC)
        _put_be(out, p + 1, n, 2)
        return p + 3
    out[np.uint64(p)] = np.uint8(0xDD)
    _put_be(out, p + 1, n, 4)
    return p + 5


@njit(**JIT)
def _bin_head(out, p, n):
    """A msgpack bin header of ``n`` bytes at ``p`` (the smallest, as msgpack packs it)."""
    if n < 256:
        out[np.uint64(p)] = np.uint8(0xC4)
        out[np.uint64(p + 1)] = np.uint8(n)
        return p + 2
    if n < 65536:
        out[np.uint64(p)] = np.uint8(0xC5)
        _put_be(out, p + 1, n, 2)
        return p + 3
    out[np.uint64(p)] = np.uint8(0xC6)
    _put_be(out, p + 1, n, 4)
    return p + 5


@njit(**JIT)
def set_run(buf, room, room_bytes, payload, replies):
    """``(count, end, payload_len, key_bytes, value_bytes, budget)`` for the run of whole SETs at
    the start of ``buf`` (bytes) that ``_write_run`` would take (each: at least 28 bytes left,
    key_len >= 1, the whole frame in ``buf``, total_len <= MAX_MESSAGE, the key and the u32
    value_len inside the frame, value_len <= MAX_VALUE and the value inside the frame), of keys of
    at most KEY_KEEP bytes (a longer one ends the run: the store keeps it another way), and no more
    than ``_write_run``'s budget (it stops after the write that makes ``room`` writes or
    ``room_bytes`` value bytes; ``budget`` 1 then, else 0). ``payload`` (a bytearray of at least
    ``len(buf) + 16`` bytes) gets the run's WAL op, ``payload_len`` bytes; ``replies`` (at least
    26 bytes per SET taken) the OK replies. ``(0, 0, 0, 0, 0, 0)`` if the first frame is not such
    a SET."""
    n = len(buf)
    pos = np.int64(0)
    count = np.int64(0)
    kbytes = np.int64(0)
    vbytes = np.int64(0)
    budget = np.int64(0)
    while n - pos >= 28:
        total, cmd, klen = _frame_head(buf, pos)
        if total < 0 or klen == 0 or total > n - pos or total > MAX_MESSAGE or cmd != SET or klen > KEY_KEEP:
            break
        kend = pos + 28 + klen
        if kend + 4 > pos + total:
            break
        vlen = _be(buf, kend, 4)
        if vlen > MAX_VALUE or kend + 4 + vlen > pos + total:
            break
        count += 1
        kbytes += klen
        vbytes += vlen
        pos += total
        if count >= room or vbytes >= room_bytes:
            budget = 1
            break
    if count == 0:
        return np.int64(0), np.int64(0), np.int64(0), np.int64(0), np.int64(0), np.int64(0)
    end = pos
    # [OP_PUTS, KV, [key, ...], [b"\x00" + value, ...]]
    payload[0] = np.uint8(0x94)
    payload[1] = np.uint8(OP_PUTS)
    payload[2] = np.uint8(KV)
    q = _array_head(payload, 3, count)
    pos = np.int64(0)
    for i in range(count):  # the keys, and the replies
        total = _be(buf, pos + 4, 4)
        klen = _be(buf, pos + 26, 2)
        q = _bin_head(payload, q, klen)
        for k in range(klen):
            payload[np.uint64(q + k)] = buf[np.uint64(pos + 28 + k)]
        q += klen
        r = i * HEADER_LEN
        _put_be(replies, r, HEADER_LEN, 8)
        for k in range(8):
            replies[np.uint64(r + 8 + k)] = buf[np.uint64(pos + 8 + k)]
        _put_be(replies, r + 16, 0, 8)
        _put_be(replies, r + 24, OK, 2)
        pos += total
    q = _array_head(payload, q, count)
    pos = np.int64(0)
    for i in range(count):  # the stored values
        total = _be(buf, pos + 4, 4)
        klen = _be(buf, pos + 26, 2)
        kend = pos + 28 + klen
        vlen = _be(buf, kend, 4)
        q = _bin_head(payload, q, vlen + 1)
        payload[np.uint64(q)] = np.uint8(0)
        q += 1
        v = kend + 4
        for k in range(vlen):
            payload[np.uint64(q + k)] = buf[np.uint64(v + k)]
        q += vlen
        pos += total
    return count, end, q, kbytes, vbytes, budget
