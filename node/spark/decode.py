"""A FETCH result (CONTRACT §3 record batches) to Arrow column buffers in one compiled pass.

``_kernel.decode_fetch`` walks the batch headers and every records block byte by byte and writes the
CONTRACT §8 columns straight into numpy arrays that become Arrow buffers without a copy: int64
offsets and timestamps, int32 value offsets plus data for the bodies, int32 list offsets for the
headers and offsets plus data for their names and values. No Python object is made per record.

It accepts only the exact shape CONTRACT §3 allows: a msgpack array of ``record_count`` records
``[offset_delta = i, timestamp_delta_ms (int64), [[name, value], ...], body]`` with name, value and
body bin or str, and no bytes after the last record. Anything else (a malformed batch header too)
makes it report ``FALLBACK``, and the caller decodes that FETCH result with msgpack, which reads it
as it always did or raises ``InvalidBatch``.

The kernel is compiled with numba once per machine (about 10 s) and cached on disk
(``storage.jit`` says where); without a cache (or without numba) every FETCH result goes through
msgpack, as compiling in each Spark worker would cost more than it saves. A new
process pays ``import numba`` and loading the cache once (about 0.5-1 s, see docs/spark.md).
"""

import logging

import numpy as np

from storage.jit import import_compiled

log = logging.getLogger("sbpnode.spark")

# The kernel's status codes.
OK = 0
FALLBACK = 1

_loaded = None


def load_kernel():
    """The compiled kernel, or None if numba is missing, broken or can cache nowhere (callers then
    decode with msgpack: compiling in every Spark worker would cost seconds per worker)."""
    global _loaded
    if _loaded is None:
        try:
            _loaded = _import() or False
        except Exception as e:  # a broken numba/llvmlite install must not break reads
            log.warning("sbp: compiled decoder unavailable (%r); decoding with msgpack", e)
            _loaded = False
    return _loaded or None


def _import():
    k, why = import_compiled("node.spark._kernel")
    if k is None:
        log.warning("sbp: compiled decoder unavailable: %s; decoding with msgpack", why)
        return None
    return k.decode_fetch


def warm_up():
    """Load (or compile) the kernel and run it once, so the first FETCH result is not slower."""
    kernel = load_kernel()
    if kernel is not None:
        kernel(np.frombuffer(b"", np.uint8), 0, 0)  # read-only, as FETCH results are: same signature
    return kernel
