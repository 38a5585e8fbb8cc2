"""CRC-32 helpers shared by the store and the SBP codec (pure functions, no I/O).

``crc32(data, value=0)`` is zlib's CRC-32 (same polynomial, same values, same running-value
argument). It comes from zlib-ng's Python binding when installed (a setup.cfg dependency): zlib-ng
computes CRC-32 with carry-less multiplication (PCLMULQDQ / VPCLMULQDQ / ARMv8 CRC), about 18 us
per MiB against the system zlib's 245 us on this project's machine. Every checksum the node, its
clients and the Spark source compute over records goes through it; ``zlib.crc32`` is the fallback.

``crc32_combine(crc1, crc2, len2)`` is zlib's: the CRC-32 of A + B from crc32(A), crc32(B) and
len(B), in O(log len) without touching the bytes (zlib-ng's binding; else libz through ctypes;
else Python). The store uses it to check a WAL entry's CRC
from its header bytes and the record batch's stored records-block CRC (the zero-copy read path);
the SBP server derives frame CRCs from stored batch CRCs with it.
"""

import zlib

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a declared dependency
    crc32 = zlib.crc32
try:
    # zlib-ng's binding has crc32_combine too: a plain C-extension call that keeps the GIL, about
    # 5x cheaper than the ctypes call into libz below (the FETCH path makes 32 per 1 MiB reply)
    from zlib_ng.zlib_ng import crc32_combine as _crc32_combine_ng
except ImportError:  # pragma: no cover - zlib-ng is a declared dependency
    _crc32_combine_ng = None

# Both bindings release the GIL for inputs above 5 KiB (``data.len > 1024*5`` in CPython's zlibmodule.c
# and in python-zlib-ng's copy of it). On the node's reactor and writer threads that costs more than
# the CRC: the thread then waits for the GIL behind the other one, up to the 5 ms switch interval
# (py-spy on APPEND showed the writer waiting there for most of the CRC's samples). crc32_held takes
# such inputs in slices of exactly 5 KiB, the largest that keeps the GIL: 13 calls per 64 KiB batch
# instead of 16 with 4 KiB slices, whose per-call cost (a memoryview slice and a call, ~0.3-0.6 us)
# was more than half of crc32_held's time (docs/benchmarks.md, issue 17 part 9)
_HELD_SLICE = 5 * 1024


def crc32_held(data, value=0):
    """``crc32(data, value)``, without releasing the GIL."""
    n = len(data)
    if n <= _HELD_SLICE:
        return crc32(data, value)
    view = memoryview(data)
    for i in range(0, n, _HELD_SLICE):
        value = crc32(view[i:i + _HELD_SLICE], value)
    return value


def _load_crc32_combine():
    """zlib's crc32_combine(crc1, crc2, len2) through ctypes (about 0.7 us); None without libz.
    Loaded with PyDLL, so the call keeps the GIL: a CDLL call releases it, and taking it back
    behind the store's threads cost more than the sub-microsecond combine (py-spy on FETCH)."""
    try:
        import ctypes
        import ctypes.util

        lib = ctypes.PyDLL(ctypes.util.find_library("z") or "libz.so.1")
        fn = lib.crc32_combine
        fn.restype = ctypes.c_ulong
        fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
        if fn(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) != zlib.crc32(b"abcd"):
            return None
        return fn
    except Exception:
        return None


_crc32_combine = _crc32_combine_ng or _load_crc32_combine()
# zlib-ng's or zlib's combine takes ~1 us; the pure-Python fallback ~2 ms: callers that could
# instead read the bytes again (the WAL's entry CRC) only combine when it is native
COMBINE_IS_NATIVE = _crc32_combine is not None


def _gf2_times(mat, vec):
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat):
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _crc32_combine_py(crc1, crc2, len2):
    """zlib's crc32_combine in Python (the fallback when libz cannot be loaded; slow): apply to
    crc1 the operator for len2 zero bytes, built by squaring, then add crc2."""
    if len2 <= 0:
        return crc1
    op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    op = _gf2_square(_gf2_square(op))  # four zero bits
    while len2:
        op = _gf2_square(op)  # 1, 2, 4, ... zero bytes
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
    return crc1 ^ crc2


def crc32_combine(crc1, crc2, len2):
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B)."""
    if _crc32_combine is not None:
        return _crc32_combine(crc1, crc2, len2)
    return _crc32_combine_py(crc1, crc2, len2)


if _crc32_combine is not None:
    # the native call itself, without a Python frame on the way (a FETCH reply makes 32)
    crc32_combine = _crc32_combine  # noqa: F811
