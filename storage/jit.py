"""Importing a module of numba-compiled functions (``cache=True``), so that a new process loads the
machine code compiled before instead of compiling it again (seconds).

numba keeps its cache in ``__pycache__`` beside the module if that is writable, else in the user's
cache directory (``~/.cache/numba``), or in ``NUMBA_CACHE_DIR`` when set. If none of them is
writable, a per-user directory under the system temp dir is tried. Callers keep a pure-Python path
for when this returns None (numba missing or broken, or no cache anywhere).

``BackgroundLoad`` runs such an import (and its warm-up) once per process on its own thread, and
tells reactors when it has finished: importing numba holds the GIL for most of a second, so a node
writes its ready file only after it (node/service.py ``before_ready``).
"""

import importlib
import os
import tempfile
import threading


def import_compiled(name: str):
    """``(module, None)``, or ``(None, why)`` when it cannot be had. (A module whose import raised
    is not left in ``sys.modules``, so the retry runs it again.)"""
    try:
        return importlib.import_module(name), None
    except ImportError as e:
        return None, "not importable (%s)" % e
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        pass
    try:
        import numba

        numba.config.CACHE_DIR = os.path.join(tempfile.gettempdir(), "numba-cache-%d" % os.getuid())
        return importlib.import_module(name), None
    except Exception as e:
        return None, "no writable cache for compiled code (%s)" % e


class BackgroundLoad:
    """``load()`` run once per process on a thread named ``name`` (``start``); ``on_start()`` runs
    when it starts (under the lock, so no caller sees it start twice), ``result()`` is what the
    Deferreds fire with once it has finished, whatever the outcome."""

    def __init__(self, name, load, on_start=None, result=lambda: None):
        self.name = name
        self._load = load
        self._on_start = on_start
        self._result = result
        self._lock = threading.Lock()
        self._started = False
        self._waiters = []  # (reactor, Deferred) told when loading has finished
        self.finished = threading.Event()

    def start(self, reactor=None):
        """Start loading unless started. With a reactor, returns a Deferred fired (with
        ``result()``) on that reactor's thread once loading has finished; None without one."""
        d = None
        with self._lock:
            if reactor is not None:
                from twisted.internet import defer

                d = defer.Deferred()
                if self.finished.is_set():
                    reactor.callFromThread(self._tell, d)
                else:
                    self._waiters.append((reactor, d))
            if self._started:
                return d
            self._started = True
            if self._on_start is not None:
                self._on_start()
        threading.Thread(target=self._run, name=self.name, daemon=True).start()
        return d

    def wait(self, timeout=None) -> bool:
        """For benchmarks and tests: block until loading has finished (whatever the outcome)."""
        return self.finished.wait(timeout)

    def _run(self):
        try:
            self._load()
        finally:
            with self._lock:
                self.finished.set()
                waiters = self._waiters[:]
                del self._waiters[:]
            for reactor, d in waiters:
                reactor.callFromThread(self._tell, d)

    def _tell(self, d):
        if not d.called:  # a caller may have given up waiting (cancelled it)
            d.callback(self._result())
