"""The compiled scan of a read's run of SET or GET messages (``frame_kernel.scan_run``), loaded off
the reactor.

The key-value server's hot path (issue 19's speed target) takes every whole SET or GET of a read as
one batch: one compiled call finds the messages and their fields (client_id, key and value spans),
so the server's Python builds only what the store and the replies need (the keys, the values, one
store call, one reply buffer), not a header decode and bounds checks per message.

numba takes about half a second to import and compiles once per machine (then cached,
``storage/jit.py``): ``start_loading`` does it on a thread, and the node writes its ready file
once it has finished (``NodeContext.before_ready``), as the compiled APPEND check does
(``storage/block_check.py``). Until then, and for good without numba, ``scan_run`` is None and the
server runs its Python loops (same answers; ``tests/test_kv_protocol.py`` runs both).
"""

import threading

from twisted.internet import defer
from twisted.logger import Logger

from storage.jit import import_compiled

log = Logger()

# (buf, pos, n, cmd, max_items, max_value_bytes) -> (cids, key starts, key ends, value starts,
# value ends, end) or None (not even one):
# the run of whole GET (cmd 2) or SET (cmd 3) messages of buf[pos:n] (see frame_kernel), as lists;
# None until loaded (or for good, without numba).
scan_run = None
state = "python"  # "python", "loading", "compiled"

_lock = threading.Lock()
_started = False
_done = False
_waiters = []  # (reactor, Deferred)
MAX_RUN = 1024  # messages per call (the server's request budget is 1024)


def start_loading(reactor=None):
    """Load the compiled scan on a thread (once per process). With a reactor, a Deferred fired on
    its thread once loading has finished, whatever the outcome."""
    global _started, state
    d = None
    with _lock:
        if reactor is not None:
            d = defer.Deferred()
            if _done:
                reactor.callFromThread(_tell, d, state)
            else:
                _waiters.append((reactor, d))
        if _started:
            return d
        _started = True
        state = "loading"
    threading.Thread(target=_load_and_tell, name="kv-frame-scan", daemon=True).start()
    return d


def _load_and_tell():
    global _done
    try:
        load()
    finally:
        with _lock:
            _done = True
            waiters = _waiters[:]
            del _waiters[:]
        for reactor, d in waiters:
            reactor.callFromThread(_tell, d, state)


def _tell(d, result):
    if not d.called:
        d.callback(result)


def load():
    """Import (or compile) the kernel and publish ``scan_run``."""
    global scan_run, state
    try:
        mod, why = import_compiled("protocols.partition.frame_kernel")
        if mod is None:
            state = "python"
            log.info("the kv server's frame scan stays in Python: {why}", why=why)
            return
        import numpy as np

        kernel = mod.scan_run
        frombuffer, u8 = np.frombuffer, np.uint8
        out = np.zeros((5, MAX_RUN), np.uint64)  # reactor thread only, once loaded
        kernel(frombuffer(b"\x00" * 28, u8), 0, 28, 3, MAX_RUN, 1, out)  # compile (or load) now

        def scan(buf, pos, n, cmd, max_items, max_value_bytes):
            count, end = kernel(frombuffer(buf, u8), pos, n, cmd, min(max_items, MAX_RUN), max_value_bytes, out)
            if not count:
                return None
            cids, kstarts, kends, vstarts, vends = out[:, :count].tolist()
            return cids, kstarts, kends, vstarts, vends, end

        scan_run = scan
        state = "compiled"
    except Exception as e:  # a broken numba/llvmlite install must not stop the node
        state = "python"
        log.warn("the kv server's frame scan stays in Python: {error!r}", error=e)
