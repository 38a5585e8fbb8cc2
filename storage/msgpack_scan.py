"""Compiled (numba) readers of the msgpack in CONTRACT §3 records blocks, and the check of a whole
block. Imported lazily through ``storage.jit.import_compiled`` (numba is slow to import and compiles
on first use): callers keep a pure-Python path for when it is absent.

Every position is checked against the end of its block before it is read, so nothing here reads
past the buffer, whatever the bytes say. Arrays are indexed with unsigned integers: numba then skips
its negative-index wraparound (node/spark/_kernel.py explains why that matters).
"""

import numpy as np
from numba import njit

JIT = dict(cache=True, nogil=True)


@njit(**JIT)
def byte(buf, p):
    return np.int64(buf[np.uint64(p)])


@njit(**JIT)
def be_uint(buf, p, n):
    """``n`` bytes big-endian at ``p`` (8 bytes wrap to a two's complement int64)."""
    v = np.int64(0)
    for k in range(n):
        v = (v << 8) | byte(buf, p + k)
    return v


@njit(**JIT)
def read_int(buf, p, end):
    """A msgpack int that fits int64 at ``p``: (value, next position); next = -1 if there is none."""
    if p >= end:
        return 0, -1
    b = byte(buf, p)
    if b <= 0x7F:
        return b, p + 1
    if b >= 0xE0:
        return b - 256, p + 1
    if b == 0xCC or b == 0xD0:
        n = 1
    elif b == 0xCD or b == 0xD1:
        n = 2
    elif b == 0xCE or b == 0xD2:
        n = 4
    elif b == 0xCF or b == 0xD3:
        n = 8
    else:
        return 0, -1
    if p + 1 + n > end:
        return 0, -1
    if b == 0xCF and byte(buf, p + 1) >= 0x80:
        return 0, -1  # a uint64 above int64's range
    v = be_uint(buf, p + 1, n)
    if b >= 0xD0 and n < 8:
        half = np.int64(1) << (8 * n - 1)
        if v >= half:
            v -= half << 1
    return v, p + 1 + n


@njit(**JIT)
def read_array(buf, p, end):
    """A msgpack array header at ``p``: (length, next position); next = -1 if there is none."""
    if p >= end:
        return 0, -1
    b = byte(buf, p)
    if 0x90 <= b <= 0x9F:
        return b & 0x0F, p + 1
    if b == 0xDC:
        n = 2
    elif b == 0xDD:
        n = 4
    else:
        return 0, -1
    if p + 1 + n > end:
        return 0, -1
    return be_uint(buf, p + 1, n), p + 1 + n


@njit(**JIT)
def read_bytes(buf, p, end):
    """A msgpack bin or str at ``p``: (start, length, next position); next = -1 if there is none."""
    if p >= end:
        return 0, 0, -1
    b = byte(buf, p)
    if 0xA0 <= b <= 0xBF:
        n = 0
        length = b & 0x1F
    elif b == 0xC4 or b == 0xD9:
        n = 1
    elif b == 0xC5 or b == 0xDA:
        n = 2
    elif b == 0xC6 or b == 0xDB:
        n = 4
    else:
        return 0, 0, -1
    if n:
        if p + 1 + n > end:
            return 0, 0, -1
        length = be_uint(buf, p + 1, n)
    start = p + 1 + n
    if start + length > end:
        return 0, 0, -1
    return start, length, start + length


@njit(**JIT)
def records_block_ok(buf, p, end, count):
    """True if ``buf[p:end]`` is exactly a msgpack array of ``count`` records
    ``[i, int64, [[bin|str, bin|str], ...], bin|str]`` (CONTRACT §3), with ``i`` = 0..count-1.

    False means "not that exact shape", not "invalid": an int beyond int64, a record given as a map
    and such are left to the caller's full (msgpack) check, which has the last word.
    """
    n, p = read_array(buf, p, end)
    if p < 0 or n != count:
        return False
    for i in range(count):
        k, p = read_array(buf, p, end)
        if p < 0 or k != 4:
            return False
        delta, p = read_int(buf, p, end)
        if p < 0 or delta != i:
            return False
        _ts, p = read_int(buf, p, end)
        if p < 0:
            return False
        headers, p = read_array(buf, p, end)
        if p < 0:
            return False
        for _ in range(headers):
            k, p = read_array(buf, p, end)
            if p < 0 or k != 2:
                return False
            _s, _n, p = read_bytes(buf, p, end)
            if p < 0:
                return False
            _s, _n, p = read_bytes(buf, p, end)
            if p < 0:
                return False
        _s, _n, p = read_bytes(buf, p, end)
        if p < 0:
            return False
    return p == end
