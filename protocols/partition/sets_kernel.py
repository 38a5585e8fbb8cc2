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
from protocols.partition.codec import GET, HEADER_LEN, MAX_MESSAGE, MAX_VALUE, OK, SET
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


# How many of the run's SETs, newest first, a GET in the run is looked for among: a GET of a key
# set further back (or never in the run) ends the run (the server's loop then takes the read).
GET_LOOKBACK = 64


@njit(**JIT)
def _same_key(buf, a, b, klen):
    """Whether the ``klen``-byte keys at ``buf[a]`` and ``buf[b]`` are equal."""
    for k in range(klen):
        if buf[np.uint64(a + k)] != buf[np.uint64(b + k)]:
            return False
    return True


@njit(**JIT)
def set_run(buf, room, room_bytes, payload, replies, where):
    """``(count, end, payload_len, key_bytes, value_bytes, budget, items, replies_len, full)`` for
    the run of whole SETs, and GETs of keys the run set, at the start of ``buf`` (bytes) that
    ``_write_run`` would take: each SET with at least 28 bytes left, key_len >= 1, the whole frame
    in ``buf``, total_len <= MAX_MESSAGE, the key and the u32 value_len inside the frame,
    value_len <= MAX_VALUE and the value inside the frame, of keys of at most KEY_KEEP bytes (a
    longer one ends the run: the store keeps it another way); each GET whole, key_len >= 1 and the
    key inside the frame, of a key one of the run's last GET_LOOKBACK SETs set (the newest such
    SET's value is its answer, as ``_write_run``'s ``batch`` gives it; any other GET ends the
    run); and no more than ``_write_run``'s budget (it stops after the request that makes ``room``
    requests or ``room_bytes`` value bytes; ``budget`` 1 then, else 0).

    ``count`` SETs and ``items`` requests (SETs and GETs) are taken. ``payload`` (a bytearray of at
    least ``len(buf) + 16`` bytes) gets the SETs' WAL op, ``payload_len`` bytes; ``replies`` the
    requests' replies in order, ``replies_len`` bytes (a SET's OK: 26 bytes; a GET's reply with the
    key and value, CONTRACT §4). A GET whose reply would not fit in ``replies`` ends the run with
    ``full`` 1 (the caller grows it and calls again). ``where`` (int64, at least 2 entries per
    frame of ``buf``) is scratch. All zeros if the first frame is not such a SET."""
    n = len(buf)
    pos = np.int64(0)
    count = np.int64(0)
    items = np.int64(0)
    kbytes = np.int64(0)
    vbytes = np.int64(0)
    budget = np.int64(0)
    full = np.int64(0)
    rlen = np.int64(0)
    cap = len(replies)
    while n - pos >= 28:
        total, cmd, klen = _frame_head(buf, pos)
        if total < 0 or klen == 0 or total > n - pos or total > MAX_MESSAGE:
            break
        kend = pos + 28 + klen
        if cmd == SET:
            if klen > KEY_KEEP or kend + 4 > pos + total:
                break
            vlen = _be(buf, kend, 4)
            if vlen > MAX_VALUE or kend + 4 + vlen > pos + total:
                break
            if rlen + HEADER_LEN > cap:
                full = 1
                break
            where[np.uint64(2 * items)] = pos
            where[np.uint64(2 * items + 1)] = -1
            rlen += HEADER_LEN
            count += 1
            kbytes += klen
            vbytes += vlen
        elif cmd == GET and count > 0:
            if kend > pos + total:
                break
            # the newest of the run's last GET_LOOKBACK SETs of this key
            ref = np.int64(-1)
            seen = 0
            i = items - 1
            while i >= 0 and seen < GET_LOOKBACK:
                sp = where[np.uint64(2 * i)]
                if where[np.uint64(2 * i + 1)] == -1:
                    seen += 1
                    if _be(buf, sp + 26, 2) == klen and _same_key(buf, sp + 28, pos + 28, klen):
                        ref = sp
                        break
                i -= 1
            if ref < 0:
                break
            vlen = _be(buf, ref + 28 + klen, 4)
            if rlen + 32 + klen + vlen > cap:
                full = 1
                break
            where[np.uint64(2 * items)] = pos
            where[np.uint64(2 * items + 1)] = ref
            rlen += 32 + klen + vlen
        else:
            break
        items += 1
        pos += total
        if items >= room or vbytes >= room_bytes:
            budget = 1
            break
    if count == 0:
        z = np.int64(0)
        return z, z, z, z, z, z, z, z, full
    end = pos
    # [OP_PUTS, KV, [key, ...], [b"\x00" + value, ...]]
    payload[0] = np.uint8(0x94)
    payload[1] = np.uint8(OP_PUTS)
    payload[2] = np.uint8(KV)
    q = _array_head(payload, 3, count)
    r = np.int64(0)
    for i in range(items):  # the keys, and the replies
        pos = where[np.uint64(2 * i)]
        ref = where[np.uint64(2 * i + 1)]
        klen = _be(buf, pos + 26, 2)
        if ref == -1:
            q = _bin_head(payload, q, klen)
            for k in range(klen):
                payload[np.uint64(q + k)] = buf[np.uint64(pos + 28 + k)]
            q += klen
            _put_be(replies, r, HEADER_LEN, 8)
            for k in range(8):
                replies[np.uint64(r + 8 + k)] = buf[np.uint64(pos + 8 + k)]
            _put_be(replies, r + 16, 0, 8)
            _put_be(replies, r + 24, OK, 2)
            r += HEADER_LEN
        else:
            # CONTRACT §4 GET reply: header (num_elems 1, OK), u16 key_len, key, u32 value_len, value
            v = ref + 28 + klen
            vlen = _be(buf, v, 4)
            _put_be(replies, r, 32 + klen + vlen, 8)
            for k in range(8):
                replies[np.uint64(r + 8 + k)] = buf[np.uint64(pos + 8 + k)]
            _put_be(replies, r + 16, 1, 8)
            _put_be(replies, r + 24, OK, 2)
            _put_be(replies, r + 26, klen, 2)
            r += 28
            for k in range(klen):
                replies[np.uint64(r + k)] = buf[np.uint64(pos + 28 + k)]
            r += klen
            for k in range(4 + vlen):  # value_len and value, as the SET sent them
                replies[np.uint64(r + k)] = buf[np.uint64(v + k)]
            r += 4 + vlen
    q = _array_head(payload, q, count)
    for i in range(items):  # the stored values
        if where[np.uint64(2 * i + 1)] != -1:
            continue
        pos = where[np.uint64(2 * i)]
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
    return count, end, q, kbytes, vbytes, budget, items, rlen, full
