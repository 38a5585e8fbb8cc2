"""The compiled passes behind the key-value server's run of GETs from a read
(``protocols/partition/gets_kernel.py``), loaded on a thread as ``storage/block_check.py`` loads the
APPEND check: importing numba holds the GIL for most of a second, so the node writes its ready file
only once it has finished (``start_loading``'s Deferred, node/service.py ``before_ready``). Until
then (and for good without numba) the server answers GETs with its Python loop.

Why (docs/benchmarks.md, issue 19's seventh pass): at 1M keys a GET costs LMDB's lookup (~1.5-1.9
us, a floor) plus ~1 us of per-GET Python (header unpack, key slice, reply pack, appends) and a
few us per read. With the frames found and the replies written by one compiled call each, the keys
made by one numpy ``tolist`` and looked up by one ``map``, no Python bytecode runs per GET.
"""

from twisted.logger import Logger

from storage.jit import BackgroundLoad, import_compiled

log = Logger()

# The loaded kernels (gets_kernel.get_frames, get_replies, and cached_replies and mixed_replies
# over the store's row cache, storage/kv_cache.py); None until loaded (or for good, without numba).
frames = None
replies = None
cached = None
mixed = None
# "python" (the server's loop), "loading" (the loop meanwhile), "compiled"
state = "python"


def start_loading(reactor=None):
    """Load the kernels on a thread (once per process). With a reactor, returns a Deferred that
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
    global frames, replies, cached, mixed, state
    try:
        mod, why = import_compiled("protocols.partition.gets_kernel")
        if mod is None:
            state = "python"
            log.info("kv GETs stay with the Python loop: {why}", why=why)
            return
        from protocols.partition import codec

        get_frames, get_replies = mod.get_frames, mod.get_replies
        # compile (or load from the cache) the signatures the server calls, here and not on the
        # reactor: a read (bytes), one GET of a 1-byte key, its stored value and length, the reply
        probe = codec.encode_get(7, b"k")
        count, end, frame_len = get_frames(probe)
        out = bytearray(count * (frame_len + 3) + 2)
        get_replies(probe, count, frame_len, b"\x00v", b"\x02\x00\x00\x00", out)
        if (count, end, frame_len) != (1, 29, 29) or bytes(out) != codec.encode_get_reply(7, b"k", b"v"):
            raise AssertionError("the compiled GET passes answered a probe wrongly")
        _probe_cache(mod, probe)
        frames, replies, cached, mixed = get_frames, get_replies, mod.cached_replies, mod.mixed_replies
        state = "compiled"
    except Exception as e:  # a broken numba/llvmlite install must not stop the node
        state = "python"
        log.warn("kv GETs stay with the Python loop: the compiled pass failed to load: {error!r}", error=e)


def _probe_cache(mod, probe):
    """Compile (or load) the row cache's kernels with the signatures the server and the store call:
    a merge's update, a read missed then found, then answered from the cache."""
    import numpy as np

    from protocols.partition import codec
    from storage import kv_cache
    from storage.index import KEY_KEEP

    cache = kv_cache.RowCache(kv_cache.MIN_BYTES, kv_cache.kernels())
    cache.merged({b"j": b"\x00w", b"i": None})
    import msgpack

    from storage.index import KV, OP_PUTS

    cache.merged([msgpack.packb([OP_PUTS, KV, [b"h"], [b"\x00x"]], use_bin_type=True)])  # a packed run's op
    if cache.k.find(cache.slots, cache.arena, cache.meta, b"h") < 0:
        raise AssertionError("the row cache's update from a packed op did not take it")
    where, missed, out = np.empty(4, np.int64), np.empty(4, np.int64), np.empty(64, np.uint8)
    args = (cache.slots, cache.arena, cache.meta)
    if mod.cached_replies(probe, *args, KEY_KEEP, where, missed, out)[3:] != (1, 0):
        raise AssertionError("the row cache answered a probe of an absent key")
    size, found = mod.mixed_replies(probe, 1, 29, where, *args, b"\x00v", np.array([2], np.int64), out)
    want = codec.encode_get_reply(7, b"k", b"v")
    if (size, found) != (len(want), 1) or out[:size].tobytes() != want:
        raise AssertionError("the row cache's mixed replies answered a probe wrongly")
    count, _end, _len, misses, size = mod.cached_replies(probe, *args, KEY_KEEP, where, missed, out)
    if (count, misses) != (1, 0) or out[:size].tobytes() != want:
        raise AssertionError("the row cache answered a probe wrongly")


_loader = BackgroundLoad("kv-gets", load, _loading, lambda: state)
