"""Replies written straight to a plain TCP socket when Twisted holds none of the connection's bytes.

``transport.write`` only buffers: the bytes leave on the reactor's next pass, after an epoll_ctl to
watch for writability and before another to stop watching. For a pipelined client that is two
system calls and a reactor pass per batch of replies, more than the ``send`` itself, and a big
reply is copied into the transport's buffer first. When nothing of the connection is buffered, a
send on the socket itself keeps the byte order, and whatever the kernel does not take is queued
behind through ``transport.write``, so ordering and backpressure stay Twisted's.

Whether Twisted holds unsent bytes is read through ``protocols/tcp_internals.py`` (the one door to
Twisted's transport internals). Any other transport, TLS included (its bytes must go through the
encryption), takes the plain ``transport.write`` path.
"""

from protocols.tcp_internals import idle_socket

__all__ = ["idle_socket", "send_now", "send_parts_now"]


def send_now(transport, data):
    """Write ``data`` (bytes-like) now: straight to the socket when :func:`idle_socket` allows,
    the rest (or all of it) through ``transport.write``."""
    sock = idle_socket(transport)
    if sock is None:
        transport.write(data)
        return
    try:
        sent = sock.send(data)
    except OSError:  # BlockingIOError, or a broken connection that transport.write will report
        sent = 0
    if sent < len(data):
        transport.write(bytes(data[sent:]) if sent else data)


def send_parts_now(transport, parts):
    """Write a reply made of several buffers (at most the kernel's IOV_MAX, 1024 on Linux) with one
    ``sendmsg`` when :func:`idle_socket` allows (no join, no copy into Twisted's buffer); the rest
    (or all of it) through ``transport.writeSequence`` part by part, not joined first: Twisted
    joins what it holds when it sends, so a big reply queued behind others is copied once there,
    not also here (``transport.write`` takes bytes only: a part not sent whole is copied)."""
    sock = idle_socket(transport)
    sent = 0
    if sock is not None:
        try:
            sent = sock.sendmsg(parts)
        except OSError:
            sent = 0
    rest = []
    for p in parts:
        n = len(p)
        if sent >= n:
            sent -= n
            continue
        if sent:
            p, sent = memoryview(p)[sent:], 0
        rest.append(p if type(p) is bytes else bytes(p))
    if rest:
        transport.writeSequence(rest)
