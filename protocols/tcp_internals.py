"""The one door to Twisted's TCP transport internals (``twisted.internet.tcp.Connection``, a
``twisted.internet.abstract.FileDescriptor``); nothing else in the node reads or replaces them.

What goes through it, and why:

- ``has_unsent``/``idle_socket`` read the transport's buffer (``dataBuffer``, ``offset``,
  ``_tempDataLen``) and state (``connected``, ``disconnecting``, ``_writeDisconnected``, ``TLS``)
  so a reply may go straight to the socket when Twisted holds none of the connection's bytes
  (``direct_send``);
- ``take_over_writes`` stands in for the transport's ``doWrite`` (the reactor calls the instance
  attribute) so the SBP ``FileSender`` can ``sendfile`` after Twisted's own buffer;
- ``set_read_size``/``set_send_limit`` set ``bufferSize`` (bytes per ``recv``) and ``SEND_LIMIT``
  (bytes per ``send``).

At import it checks, on a throwaway ``tcp.Connection`` over a socketpair, that every attribute it
relies on exists. If one is missing (a Twisted upgrade changed them; Twisted is pinned in
setup.cfg) the door stays shut: ``AVAILABLE`` is False, ``MISSING`` names them, a warning is logged,
and every caller takes Twisted's plain ``transport.write`` path (slower, never wrong).
tests/test_tcp_internals.py fails loudly in that case.
"""

import socket

from twisted.internet import main, tcp
from twisted.logger import Logger

log = Logger()

# (what, attribute): read on a tcp.Connection instance
RELIED_ON = (
    "dataBuffer", "offset", "_tempDataLen", "_writeDisconnected", "connected", "disconnecting", "TLS",
    "socket", "doWrite", "startWriting", "SEND_LIMIT", "bufferSize",
)
CONNECTION_LOST = main.CONNECTION_LOST  # what doWrite returns when the connection is gone


def _missing():
    a, b = socket.socketpair()
    try:
        # a truthy reactor: FileDescriptor.__init__ must not import (and install) the global one
        conn = tcp.Connection(a, None, reactor=object())
        return [name for name in RELIED_ON if not hasattr(conn, name)]
    except Exception as e:  # the constructor itself changed
        return ["tcp.Connection(socket, protocol, reactor): %s" % e]
    finally:
        a.close()
        b.close()


MISSING = _missing()
AVAILABLE = not MISSING
if MISSING:
    log.warn("Twisted's TCP transport lacks {missing}: direct sends and sendfile are off", missing=MISSING)


def is_plain_tcp(transport) -> bool:
    """A plain TCP (or UNIX) socket transport, not TLS, whose internals this door knows."""
    return AVAILABLE and isinstance(transport, tcp.Connection) and not transport.TLS


def has_unsent(transport) -> bool:
    """True while Twisted holds bytes of this (plain TCP) transport not yet sent."""
    return bool(transport._tempDataLen) or len(transport.dataBuffer) > transport.offset


def unsent_bytes(transport) -> int:
    """Bytes Twisted holds for a plain TCP transport (under TLS too: the one under the TLS layer)
    not yet taken by the kernel; 0 if this door does not know the transport."""
    try:
        return transport._tempDataLen + len(transport.dataBuffer) - transport.offset
    except (AttributeError, TypeError):
        return 0


def cap_accepts(port, most: int) -> None:
    """Cap a listening ``tcp.Port``'s accepts per reactor pass. Twisted starts at 100 and adds 20
    each time a pass takes them all (``numberAccepts``), so under a connection flood one pass can
    build hundreds of protocols while established connections wait. The reactor calls the
    instance attribute ``doRead``."""
    if not isinstance(getattr(port, "numberAccepts", None), int):
        return
    do_read = port.doRead

    def doRead():
        if port.numberAccepts > most:
            port.numberAccepts = most
        return do_read()

    port.doRead = doRead


def idle_socket(transport):
    """The transport's socket when it is a plain TCP or UNIX connection, open, not TLS, holding no
    unsent bytes; None otherwise."""
    if (
        not is_plain_tcp(transport)
        or has_unsent(transport)
        or not transport.connected
        or transport.disconnecting
        or transport._writeDisconnected
    ):
        return None
    return transport.socket


def take_over_writes(transport, do_write):
    """Make the reactor call ``do_write()`` when the socket is writable; returns the transport's
    own ``doWrite`` (``do_write`` calls it to flush Twisted's buffer and finish as usual)."""
    original = transport.doWrite
    transport.doWrite = do_write
    return original


def set_no_delay(transport) -> None:
    """TCP_NODELAY where the transport has it (small replies leave at once; UNIX sockets and test
    transports have no such option)."""
    try:
        transport.setTcpNoDelay(True)
    except Exception:
        pass


def set_read_size(transport, nbytes: int) -> None:
    """Read up to ``nbytes`` per ``recv`` (Twisted's default is 64 KiB)."""
    if hasattr(transport, "bufferSize"):
        transport.bufferSize = nbytes


def set_send_limit(transport, nbytes: int) -> None:
    """Hand the kernel up to ``nbytes`` per ``send`` (Twisted's default is 128 KiB)."""
    if getattr(transport, "SEND_LIMIT", None) is not None:
        transport.SEND_LIMIT = nbytes
