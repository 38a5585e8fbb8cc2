"""Big-endian integer reads and writes over byte arrays, and the CONTRACT §4 frame header read with
them, for the key-value server's compiled passes (``gets_kernel``, ``sets_kernel``): numba
functions, inlined where they are called. Arrays are
indexed with unsigned integers: numba then skips its negative-index wraparound."""

import numpy as np
from numba import njit

JIT = dict(cache=True, nogil=True)


@njit(**JIT)
def be(buf, p, n):
    """The ``n``-byte big-endian unsigned integer at ``buf[p]``."""
    v = np.int64(0)
    for k in range(n):
        v = (v << 8) | np.int64(buf[np.uint64(p + k)])
    return v


@njit(**JIT)
def put_be(out, p, v, n):
    """``v`` as an ``n``-byte big-endian integer at ``out[p]``."""
    for k in range(n):
        out[np.uint64(p + n - 1 - k)] = np.uint8((v >> (8 * k)) & 0xFF)


@njit(**JIT)
def frame_head(buf, pos):
    """``(total_len, cmd, key_len)`` of the CONTRACT §4 header at ``buf[pos]`` (its 28 bytes there);
    total_len -1 when it is 2**32 or more (over any limit)."""
    if be(buf, pos, 4) != 0:
        return np.int64(-1), np.int64(0), np.int64(0)
    return be(buf, pos + 4, 4), be(buf, pos + 24, 2), be(buf, pos + 26, 2)
