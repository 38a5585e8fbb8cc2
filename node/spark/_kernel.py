"""The compiled FETCH-result decoder (numba); node/spark/decode.py imports it lazily.

The functions live at module level so that numba's on-disk cache (``cache=True``) finds them again
in a new process: a Spark Python worker loads the machine code instead of compiling it (seconds).

Every position is checked against the end of its records block before it is read, so the kernel
never reads past ``buf``. Arrays are indexed with unsigned integers: numba then skips its
negative-index wraparound, which otherwise blocks vectorising the byte copies (measured: 8x slower
body copies).
"""

import numpy as np
from numba import njit

from node.spark.decode import FALLBACK, OK
from storage.msgpack_scan import JIT as _JIT, be_uint, byte, read_array, read_bytes, read_int


@njit(**_JIT)
def copy(dst, d, src, s, n):
    d = np.uint64(d)
    s = np.uint64(s)
    for k in range(np.uint64(n)):
        dst[d + k] = src[s + k]


@njit(**_JIT)
def grow(a, need):
    """``a``, or a copy at least ``need`` long (doubling) holding ``a``'s elements."""
    if need <= a.size:
        return a
    out = np.empty(max(need, 2 * a.size), a.dtype)
    out[: a.size] = a
    return out


@njit(**_JIT)
def decode_fetch(buf, lo, hi):
    """The rows with ``lo <= offset < hi`` of the whole record batches in ``buf`` (uint8 array).

    Returns ``(status, next_offset, rows, offsets, timestamps_us, body_offsets, body_data,
    header_list_offsets, headers, name_offsets, name_data, value_offsets, value_data)``. The
    arrays may be longer than their used part: ``rows`` (+1 for offsets), ``body_offsets[rows]``
    bytes of body data, ``headers`` (+1) name/value offsets, ``name_offsets[headers]`` bytes of
    name data. ``status`` is FALLBACK, with nothing decoded, for anything but well-formed batches.
    """
    size = buf.size
    status = OK if size < 1 << 31 else FALLBACK  # int32 value offsets (FETCH frames are <= 16 MiB)
    # Pass 1, the 29-byte batch headers (CONTRACT §3, big-endian): the rows in [lo, hi).
    pos = 0
    rows = 0
    next_offset = lo
    while status == OK and pos < size:
        if size - pos < 29 or byte(buf, pos) != 0x22:
            status = FALLBACK
            break
        base = be_uint(buf, pos + 1, 8)
        count = be_uint(buf, pos + 9, 4)
        rlen = be_uint(buf, pos + 25, 4)
        if count < 1 or count >= 1 << 31 or rlen >= 1 << 31 or pos + 29 + rlen > size:
            status = FALLBACK  # record_count < 1, records_len < 0, or a truncated batch
            break
        if 5 * count >= rlen:
            status = FALLBACK  # a record takes 5 bytes at least: do not size arrays by a lie
            break
        first = max(lo - base, 0)
        last = min(hi - base, count)
        if first < last:
            rows += last - first
        next_offset = base + count
        pos += 29 + rlen
    if status != OK:
        rows = 0
    offsets = np.empty(rows, np.int64)
    timestamps = np.empty(rows, np.int64)
    body_offsets = np.empty(rows + 1, np.int32)
    body_data = np.empty(size if rows else 0, np.uint8)  # bodies are parts of buf
    list_offsets = np.empty(rows + 1, np.int32)
    name_offsets = np.empty(64, np.int32)
    value_offsets = np.empty(64, np.int32)
    name_data = np.empty(256, np.uint8)
    value_data = np.empty(256, np.uint8)
    body_offsets[0] = 0
    list_offsets[0] = 0
    name_offsets[0] = 0
    value_offsets[0] = 0
    r = 0  # rows written
    nh = 0  # headers written
    body_used = 0
    name_used = 0
    value_used = 0
    # Pass 2, the records blocks of the batches with rows in [lo, hi). msgpack decodes only those
    # too; each is walked whole, the rows outside [lo, hi) skipped.
    pos = 0
    while status == OK and pos < size:
        base = be_uint(buf, pos + 1, 8)
        count = be_uint(buf, pos + 9, 4)
        base_ts = be_uint(buf, pos + 13, 8)
        end = pos + 29 + be_uint(buf, pos + 25, 4)
        p = pos + 29
        pos = end
        first = max(lo - base, 0)
        last = min(hi - base, count)
        if first >= last:
            continue
        n, p = read_array(buf, p, end)
        if p < 0 or n != count:
            status = FALLBACK
            break
        for i in range(count):
            # [offset_delta, timestamp_delta_ms, [[name, value], ...], body]
            k, p = read_array(buf, p, end)
            if p < 0 or k != 4:
                p = -1
                break
            delta, p = read_int(buf, p, end)
            if p < 0 or delta != i:
                p = -1
                break
            ts_delta, p = read_int(buf, p, end)
            if p < 0:
                break
            nhdr, p = read_array(buf, p, end)
            if p < 0:
                break
            keep = first <= i < last
            for _ in range(nhdr):
                k, p = read_array(buf, p, end)
                if p < 0 or k != 2:
                    p = -1
                    break
                ns, nl, p = read_bytes(buf, p, end)
                if p < 0:
                    break
                vs, vl, p = read_bytes(buf, p, end)
                if p < 0:
                    break
                if keep:
                    if nh + 2 > name_offsets.size:
                        name_offsets = grow(name_offsets, nh + 2)
                        value_offsets = grow(value_offsets, nh + 2)
                    if name_used + nl > name_data.size:
                        name_data = grow(name_data, name_used + nl)
                    if value_used + vl > value_data.size:
                        value_data = grow(value_data, value_used + vl)
                    copy(name_data, name_used, buf, ns, nl)
                    copy(value_data, value_used, buf, vs, vl)
                    name_used += nl
                    value_used += vl
                    nh += 1
                    name_offsets[nh] = name_used
                    value_offsets[nh] = value_used
            if p < 0:
                break
            bs, bl, p = read_bytes(buf, p, end)
            if p < 0:
                break
            if keep:
                offsets[r] = base + i
                timestamps[r] = (base_ts + ts_delta) * 1000
                copy(body_data, body_used, buf, bs, bl)
                body_used += bl
                r += 1
                body_offsets[r] = body_used
                list_offsets[r] = nh
        if p != end:
            status = FALLBACK  # a malformed record, or bytes after the last one (msgpack's ExtraData)
    return (status, next_offset, r, offsets, timestamps, body_offsets, body_data, list_offsets,
            nh, name_offsets, name_data, value_offsets, value_data)
