"""Compiled (numba) passes over a read of pipelined GETs (CONTRACT §4), for the key-value server's
run of GETs straight from a read (``server.KvServerProtocol._gets_from_read``). Imported lazily
through ``storage.jit.import_compiled`` by ``protocols/partition/gets_compiled.py``: the server keeps
its Python loop for when this is absent or still loading.

``get_frames`` finds the run of whole, well-formed GETs of one length at the start of a read (the
checks of the server's loop, in the same order); ``get_replies`` writes the replies of such a run, all found,
into one buffer. Between the two the server looks the keys up (LMDB and the memtables are Python
objects). Every position is checked against the buffer's end before it is read. Arrays are indexed
with unsigned integers: numba then skips its negative-index wraparound.
"""

import numpy as np
from numba import njit

from protocols.partition.bytes_kernel import frame_head as _frame_head, put_be as _put_be
from protocols.partition.codec import DATA_NOT_FOUND, GET, MAX_MESSAGE, OK
from storage import kv_cache_kernel as ck

JIT = dict(cache=True, nogil=True)


@njit(**JIT)
def _le_u32(buf, p):
    v = np.int64(0)
    for k in range(4):
        v |= np.int64(buf[np.uint64(p + k)]) << (8 * k)
    return v


@njit(**JIT)
def get_frames(buf):
    """``(count, end, frame_len)``: the run of whole GETs at the start of ``buf`` (bytes) that the
    server's loop would take (each: total_len >= 28 + key_len, key_len >= 1, the whole frame in
    ``buf``, total_len <= MAX_MESSAGE), cut at the first frame that is not exactly as long as the
    first (28 + its key_len, so every key has the same length): their number, the position after
    them, and that length. ``(0, 0, 0)`` if the first frame is not such a GET."""
    n = len(buf)
    pos = np.int64(0)
    count = np.int64(0)
    frame_len = np.int64(0)
    while n - pos >= 28:
        total, cmd, klen = _frame_head(buf, pos)
        if total < 0 or cmd != GET or klen == 0 or 28 + klen > total or total > n - pos or total > MAX_MESSAGE:
            break
        if count == 0:
            if total != 28 + klen:
                break
            frame_len = total
        elif total != frame_len or klen != frame_len - 28:
            break
        pos += total
        count += 1
    if count == 0:
        return np.int64(0), np.int64(0), np.int64(0)
    return count, pos, frame_len


@njit(**JIT)
def _put_reply(out, p, buf, f, klen, src, sp, vlen):
    """The reply (CONTRACT §4: OK, num_elems 1, u16 key_len, key, u32 value_len, value) to the GET
    frame at ``buf[f]`` with the value ``src[sp : sp + vlen]``, at ``out[p]``; the position after."""
    _put_be(out, p, 32 + klen + vlen, 8)
    for k in range(8):
        out[np.uint64(p + 8 + k)] = buf[np.uint64(f + 8 + k)]
    _put_be(out, p + 16, 1, 8)
    _put_be(out, p + 24, OK, 2)
    _put_be(out, p + 26, klen, 2)
    for k in range(klen):
        out[np.uint64(p + 28 + k)] = buf[np.uint64(f + 28 + k)]
    q = p + 28 + klen
    _put_be(out, q, vlen, 4)
    q += 4
    for k in range(vlen):
        out[np.uint64(q + k)] = src[np.uint64(sp + k)]
    return q + vlen


@njit(**JIT)
def get_replies(buf, count, frame_len, values, lens, out):
    """The replies of ``count`` GETs of ``frame_len`` bytes each from the start of ``buf`` (key_len
    = frame_len - 28), every one found, into ``out`` (a bytearray of exactly ``count * (frame_len +
    3) + len(values)`` bytes): header (total_len, the request's client_id, num_elems 1, OK), u16
    key_len, key, u32 value_len, value (CONTRACT §4). ``values`` (bytes) holds the stored values
    one after another, each as long as the ``i``-th little-endian u32 of ``lens`` (bytes) says, of
    which the first byte is the store's prefix (not sent)."""
    klen = frame_len - 28
    p = np.int64(0)  # in out
    v = np.int64(0)  # in values
    for i in range(count):
        vlen = _le_u32(lens, 4 * i) - 1
        p = _put_reply(out, p, buf, i * frame_len, klen, values, v + 1, vlen)
        v += vlen + 1
    return p


# -- the row cache (storage/kv_cache.py): a read's GETs answered from it ----------------------------



@njit(**JIT)
def cached_replies(buf, slots, arena, meta, keep, where, missed, out):
    """The run of GETs at the start of ``buf`` (``get_frames``'s, cut at ``len(where)`` frames)
    looked up in the row cache: ``(count, end, frame_len, misses, size)``. ``where[i]``: the
    arena position of the ``i``-th GET's entry, or -1; ``missed[:misses]``: the indices of the GETs
    not cached; ``size``: the bytes of the cached GETs' replies. When every GET is cached and
    ``size <= len(out)`` the replies are written into ``out[:size]``. ``misses`` is -1 (nothing
    looked up) when the keys are longer than ``keep`` bytes; ``count`` 0 when the read does not
    start with a GET."""
    count, end, frame_len = get_frames(buf)
    if count == 0:
        return count, end, frame_len, np.int64(0), np.int64(0)
    klen = frame_len - 28
    if klen > keep:
        return count, end, frame_len, np.int64(-1), np.int64(0)
    if count > len(where):
        count = np.int64(len(where))
        end = count * frame_len
    misses = np.int64(0)
    size = np.int64(0)
    for i in range(count):
        f = i * frame_len
        e = ck.lookup(slots, arena, meta, buf, f + 28, klen, ck.key_hash(buf, f + 28, klen))
        where[np.uint64(i)] = e
        if e < 0:
            missed[np.uint64(misses)] = i
            misses += 1
        else:
            size += frame_len + 4 + ck.value_len(arena, e)
    if misses == 0 and size <= len(out):
        p = np.int64(0)
        for i in range(count):
            e = where[np.uint64(i)]
            p = _put_reply(out, p, buf, i * frame_len, klen, arena, e + 6 + klen, ck.value_len(arena, e))
    return count, end, frame_len, misses, size


@njit(**JIT)
def mixed_replies(buf, count, frame_len, where, slots, arena, meta, values, vlens, out):
    """The replies of ``cached_replies``'s run when some GETs were not cached: those looked up
    since, in order, have the stored values ``values`` (one after another, ``vlens`` bytes each,
    the first byte the store's prefix, not sent; -1: not found, DATA_NOT_FOUND). Written into
    ``out``, then the values found are cached. Returns ``(size, found)``, or ``(-size, 0)`` with
    nothing written or cached if ``out`` is shorter than the ``size`` bytes of the replies."""
    klen = frame_len - 28
    size = np.int64(0)
    j = 0
    found = np.int64(0)
    for i in range(count):
        e = where[np.uint64(i)]
        if e >= 0:
            size += frame_len + 4 + ck.value_len(arena, e)
            found += 1
        else:
            vn = vlens[np.uint64(j)]
            j += 1
            if vn < 0:
                size += 26
            else:
                size += frame_len + 3 + vn
                found += 1
    if size > len(out):
        return -size, np.int64(0)
    p = np.int64(0)
    v = np.int64(0)
    j = 0
    for i in range(count):
        f = i * frame_len
        e = where[np.uint64(i)]
        if e >= 0:
            p = _put_reply(out, p, buf, f, klen, arena, e + 6 + klen, ck.value_len(arena, e))
            continue
        vn = vlens[np.uint64(j)]
        j += 1
        if vn < 0:
            _put_be(out, p, 26, 8)
            for k in range(8):
                out[np.uint64(p + 8 + k)] = buf[np.uint64(f + 8 + k)]
            _put_be(out, p + 16, 0, 8)
            _put_be(out, p + 24, DATA_NOT_FOUND, 2)
            p += 26
        else:
            p = _put_reply(out, p, buf, f, klen, values, v + 1, vn - 1)
            v += vn
    # cached after the replies are written: an insert may drop the generation ``where`` points into
    v = np.int64(0)
    j = 0
    for i in range(count):
        if where[np.uint64(i)] >= 0:
            continue
        vn = vlens[np.uint64(j)]
        j += 1
        if vn >= 0:
            f = i * frame_len + 28
            ck.insert(slots, arena, meta, buf, f, klen, values, v + 1, vn - 1, ck.key_hash(buf, f, klen))
            v += vn
    return size, found
