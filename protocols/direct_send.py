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

import os
import socket

from protocols.tcp_internals import idle_socket

__all__ = ["idle_socket", "send_file_now", "send_now", "send_parts_now"]


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
    (or all of it, joined) through ``transport.write``, which takes bytes only."""
    sock = idle_socket(transport)
    if sock is None:
        transport.write(b"".join(parts))
        return
    try:
        sent = sock.sendmsg(parts)
    except OSError:
        sent = 0
    if sent < sum(len(p) for p in parts):
        transport.write(b"".join(parts)[sent:])


def send_file_now(transport, head, fd, offset, count) -> bool:
    """Write ``head`` then ``count`` bytes of file ``fd`` from ``offset`` with ``sendfile`` (the
    file's pages go to the socket with no copy through this process) when :func:`idle_socket`
    allows; False, having written nothing, when it does not or the socket takes none of ``head``.
    What the socket does not take is read with ``pread`` and queued through ``transport.write``:
    the caller makes sure the range is in the page cache, as neither call may wait for the disk on
    the reactor thread."""
    sock = idle_socket(transport)
    if sock is None:
        return False
    try:
        sent = sock.send(head, socket.MSG_MORE)  # the data follows: one segment, not two
    except OSError:
        return False
    if sent < len(head):
        if not sent:
            return False
        transport.write(bytes(head[sent:]) + _pread_all(fd, count, offset))
        return True
    try:
        done = os.sendfile(sock.fileno(), fd, offset, count)
    except OSError:  # BlockingIOError; a broken connection is reported by transport.write
        done = 0
    if done < count:
        transport.write(_pread_all(fd, count - done, offset + done))
    return True


def _pread_all(fd, count, offset):
    data = os.pread(fd, count, offset)
    if len(data) != count:  # the bytes promised in the header are gone: the stream is broken
        raise OSError("file ended %d bytes early" % (count - len(data)))
    return data
