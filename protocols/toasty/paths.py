"""The one path rule for Toasty (CONTRACT §5), used by the server, the clients and the CLI.

A path is ``/``-separated bytes; a leading and a trailing ``/`` are optional; the root is ``b""`` or
``b"/"``. Empty, ``.`` and ``..`` components are invalid (so nothing can climb above the root), as
are NUL bytes (NUL is LIST's continuation separator) and components longer than 255 bytes.
"""

from typing import Optional, Tuple

from protocols.toasty.errors import ErrorCode

MAX_COMPONENT = 255
MAX_DEPTH = 256


class InvalidPath(ValueError):
    """``str(e)`` is the reply text (``ErrorCode.INVALID_PATH`` and the reason)."""

    code = ErrorCode.INVALID_PATH

    def __init__(self, reason):
        super().__init__(ErrorCode.INVALID_PATH.message(reason))


def normalize(path) -> Tuple[bytes, ...]:
    """Path bytes (or str) -> its components (``()`` for the root); InvalidPath with a reason."""
    if isinstance(path, str):
        path = path.encode("utf-8")
    path = bytes(path)
    if path in (b"", b"/"):
        return ()
    inner = path[1:] if path.startswith(b"/") else path
    if inner.endswith(b"/"):
        inner = inner[:-1]
    parts = tuple(inner.split(b"/"))
    if len(parts) > MAX_DEPTH:
        raise InvalidPath("more than %d components" % MAX_DEPTH)
    for part in parts:
        if part == b"":
            raise InvalidPath("empty component in %r" % _show(path))
        if part in (b".", b".."):
            raise InvalidPath("%r component in %r" % (part.decode(), _show(path)))
        if b"\x00" in part:
            raise InvalidPath("NUL byte in %r" % _show(path))
        if len(part) > MAX_COMPONENT:
            raise InvalidPath("a component is longer than %d bytes" % MAX_COMPONENT)
    return parts


def split_list_path(path: bytes) -> Tuple[Tuple[bytes, ...], Optional[bytes]]:
    """CONTRACT §5: LIST on ``dir/\\0after`` continues after the name ``after``."""
    path = bytes(path)
    nul = path.find(b"\x00")
    if nul < 0:
        return normalize(path), None
    return normalize(path[:nul]), path[nul + 1 :]


def join(components) -> bytes:
    return b"/" + b"/".join(components)


def _show(path: bytes) -> str:
    text = path.decode("utf-8", "replace")
    return text if len(text) <= 200 else text[:200] + "..."
