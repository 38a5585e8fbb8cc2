"""The compiled pass behind the key-value server's run of SETs from a read
(``protocols/partition/sets_kernel.py``), loaded on a thread as ``gets_compiled`` loads the GET
passes (importing numba holds the GIL for most of a second; the node's ready file waits for it).
Until then (and for good without numba) the server takes SETs with its Python loop
(``_write_run``), to the same replies and the same store contents.

The pass also takes the GETs among the SETs of keys the run set (``SET k; GET k`` pipelined:
issue 19's tenth pass), their replies written in order among the SETs'.

Why (docs/benchmarks.md, issue 19's ninth pass): with the merge in a worker process the node's
one serial part is the reactor, ~5 us of CPU per SET, a third of it per-SET Python (header
unpack, key and value slices, the stored value's ``b"\\x00" +`` copy, three dict inserts, the
reply's pack) and the writer thread's ``msgpack.packb`` of the run under the GIL.
"""

from twisted.logger import Logger

from storage.jit import BackgroundLoad, import_compiled

log = Logger()

# The loaded kernel (sets_kernel.set_run); None until loaded (or for good, without numba).
run = None
# "python" (the server's loop), "loading" (the loop meanwhile), "compiled"
state = "python"


def start_loading(reactor=None):
    """Load the kernel on a thread (once per process). With a reactor, returns a Deferred that
    fires (with ``state``) on that reactor's thread once loading has finished, whatever the
    outcome; None without one."""
    return _loader.start(reactor)


def wait(timeout=None) -> bool:
    """For benchmarks and tests: block until loading has finished (whatever the outcome)."""
    return _loader.wait(timeout)


def _loading():
    global state
    state = "loading"


def load():
    global run, state
    try:
        mod, why = import_compiled("protocols.partition.sets_kernel")
        if mod is None:
            state = "python"
            log.info("kv SETs stay with the Python loop: {why}", why=why)
            return
        import msgpack

        from protocols.partition import codec
        from storage.index import KV, OP_PUTS

        set_run = mod.set_run
        # compile (or load from the cache) the signature the server calls, here and not on the
        # reactor: a read (bytes) of one SET and a GET of its key, the budget, the payload, reply
        # and position buffers
        import numpy

        probe = codec.encode_set(7, b"k", b"v") + codec.encode_get(8, b"k")
        payload = bytearray(len(probe) + 16)
        replies = bytearray(codec.HEADER_LEN + 34)
        where = numpy.empty(8, numpy.int64)
        got = set_run(probe, 1024, 1 << 26, payload, replies, where)
        if tuple(got[:2]) + tuple(got[3:]) != (1, len(probe), 1, 1, 0, 2, len(replies), 0) \
                or bytes(payload[: got[2]]) != msgpack.packb([OP_PUTS, KV, [b"k"], [b"\x00v"]], use_bin_type=True) \
                or bytes(replies) != codec.encode_status(7, codec.OK) + codec.encode_get_reply(8, b"k", b"v"):
            raise AssertionError("the compiled SET pass answered a probe wrongly")
        run = set_run
        state = "compiled"
    except Exception as e:  # a broken numba/llvmlite install must not stop the node
        state = "python"
        log.warn("kv SETs stay with the Python loop: the compiled pass failed to load: {error!r}", error=e)


_loader = BackgroundLoad("kv-sets", load, _loading, lambda: state)
