"""The compiled records-block check behind APPEND validation (``storage/msgpack_scan.py``).

``record_batch.validate_count`` (what the SBP server's APPEND runs) must know that a records block decodes as CONTRACT §3 describes. With
msgpack that means building every record as Python objects, about 25 us per batch of 64 records on
the reactor thread: a third of its time under interval appends. The compiled check walks the same
bytes in about 1 us and builds nothing.

numba takes about half a second to import and compiles once per machine (seconds; then cached, see
``storage/jit.py``): ``start_loading()`` loads it on a thread, and both of its signatures (read-only
and writable buffers) are compiled there, never on the reactor. That thread holds the GIL for most
of that time, so the node writes its ready file only once it has finished (the Deferred that
``start_loading`` returns; node/service.py): a client told "ready" never meets the reactor stalled
behind an import. Until then (and for good without numba) APPEND runs the msgpack check. The
compiled check only says yes to the exact shape; for anything else it says no and the msgpack
check, which has the last word, decides.
"""

from twisted.logger import Logger

from storage.jit import BackgroundLoad, import_compiled

log = Logger()

# (batch, start, record_count) -> True if batch[start:] is exactly a well-formed records block;
# None until loaded (or for good, without numba).
records_block_ok = None
# What APPEND validation runs on: "msgpack", "loading" (msgpack meanwhile), "compiled"; shown in
# the node's status (sbpctl status: append_check).
state = "msgpack"


def start_loading(reactor=None):
    """Load the compiled check on a thread (once per process). With a reactor, returns a Deferred
    that fires (with ``state``) on that reactor's thread once loading has finished, whatever the
    outcome; None without one."""
    return _loader.start(reactor)


def _loading():
    global state
    state = "loading"


def load():
    """Import (or compile) the check and publish it in ``records_block_ok``."""
    global records_block_ok, state
    try:
        mod, why = import_compiled("storage.msgpack_scan")
        if mod is None:
            state = "msgpack"
            log.info("APPEND validation stays with msgpack: {why}", why=why)
            return
        import numpy as np

        block_ok = mod.records_block_ok
        frombuffer, u8 = np.frombuffer, np.uint8
        for buf in (b"\x90", bytearray(b"\x90")):
            block_ok(frombuffer(buf, u8), 0, 1, 0)

        def check(batch, start, count):
            return block_ok(frombuffer(batch, u8), start, len(batch), count)

        records_block_ok = check
        state = "compiled"
    except Exception as e:  # a broken numba/llvmlite install must not stop the node
        state = "msgpack"
        log.warn("APPEND validation stays with msgpack: compiled check failed to load: {error!r}", error=e)


_loader = BackgroundLoad("block-check", load, _loading, lambda: state)
