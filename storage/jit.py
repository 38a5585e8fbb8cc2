"""Importing a module of numba-compiled functions (``cache=True``), so that a new process loads the
machine code compiled before instead of compiling it again (seconds).

numba keeps its cache in ``__pycache__`` beside the module if that is writable, else in the user's
cache directory (``~/.cache/numba``), or in ``NUMBA_CACHE_DIR`` when set. If none of them is
writable, a per-user directory under the system temp dir is tried. Callers keep a pure-Python path
for when this returns None (numba missing or broken, or no cache anywhere).
"""

import importlib
import os
import tempfile


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
