"""Replies whose stored batches go from WAL segment files to the socket with ``os.sendfile``.

Twisted's TCP transport buffers bytes only, and every byte of a FETCH reply written through it is
copied by the read pool (``pread``), joined by Twisted and copied again by ``send()``. A
``FileSender`` sits beside the transport of one connection and keeps its output in order when part
of it is file ranges (``storage.wal.FileSpan``: the store says where a batch lies, the protocol
decides to sendfile it): the bytes already in Twisted's buffer go first, then the FileSender's
queue (the reply's prefix and header, each batch straight from the page cache, the CRC), and any
bytes written meanwhile wait behind it. So no thread touches reply data on its way out.

It drives the socket from the reactor's writability events by standing in for the transport's
``doWrite`` (``tcp_internals.take_over_writes``, the one door to Twisted's internals): Twisted's own buffer is flushed by the
original ``doWrite`` first, then the queue is sent until the socket is full, and once both are
empty the original ``doWrite`` runs again so Twisted stops writing, resumes a producer it paused
or finishes a ``loseConnection`` as usual. ``lose_connection()`` waits for the queue.

Backpressure: ``on_backlog(True)`` once more than ``HIGH`` bytes wait in the queue,
``on_backlog(False)`` once it is empty (the protocol stops and resumes reading requests, as it
does for Twisted's buffer). Queued file ranges hold no memory, only a duplicate fd per segment.

The store found the ranges' pages in the page cache (``Wal.cached_spans``) or brought them in from
its read pool (``Wal.warm``), so ``sendfile`` on the reactor thread copies from memory rather than
waiting for the disk.
"""

import os
import socket
import time
from collections import deque

from twisted.logger import Logger

from protocols import tcp_internals
from protocols.tcp_internals import has_unsent
from storage.wal import FileSpan


_MSG_MORE = getattr(socket, "MSG_MORE", 0)
# queued bytes items are joined up to this size (larger ones are not copied)
_COALESCE_MAX = 16 << 10


class FileSender:
    log = Logger()

    HIGH = 4 << 20  # queued bytes (file ranges included) above which on_backlog(True)
    STALL_S = 0.005

    def __init__(self, transport, on_backlog, counts=None):
        self.transport = transport
        self._sock = transport.socket
        self._fileno = transport.socket.fileno()
        self._queue = deque()  # bytes / memoryview, or [SegmentFile, offset, left]
        self.queued = 0
        self.sent_file_bytes = 0
        self._on_backlog = on_backlog
        self._backlogged = False
        self._lose_when_drained = False
        # counters added to (the server's metrics): sendfile calls, and those that could not send
        # all they were asked (the socket's buffer full: the rest waits for a writability event)
        self._counts = counts if counts is not None else {}
        self._counts.setdefault("fetch_sendfile_calls", 0)
        self._counts.setdefault("fetch_sendfile_short", 0)
        # wall time in the passes that called sendfile, and those passes over STALL_S: a sendfile
        # of cached pages takes microseconds; longer is the reactor waiting (for a page still
        # being read from disk, or for a CPU on a busy machine)
        self._counts.setdefault("fetch_send_wall_s", 0.0)
        self._counts.setdefault("fetch_send_stalls", 0)
        self._orig_do_write = tcp_internals.take_over_writes(transport, self._do_write)

    @classmethod
    def for_transport(cls, transport, on_backlog, counts=None):
        """A FileSender for a plain TCP (or UNIX) socket transport, else None (TLS, test
        transports): then replies are written as bytes. ``counts``: a dict the sendfile counters
        are added to."""
        if not tcp_internals.is_plain_tcp(transport):
            return None
        try:
            transport.socket.fileno()
        except Exception:
            return None
        return cls(transport, on_backlog, counts)

    # -- writing -----------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """True while queued output waits (later bytes must queue behind it)."""
        return bool(self._queue)

    def write(self, data):
        if self._queue:
            self._append_bytes(data)
            self._check_backlog()
        else:
            self.transport.write(data)

    def writeSequence(self, parts):
        if self._queue:
            for p in parts:
                self.write(p)
        else:
            self.transport.writeSequence(parts)

    def send(self, parts):
        """Send ``parts`` (bytes and FileSpans) in order after everything written before."""
        q = self._queue
        first = 0  # bytes of parts[0] already sent
        full = False
        if not q and not self._twisted_pending():
            # nothing waits before them: straight to the socket, queueing only what it cannot take
            done = self._send_now(parts)
            if done is None:
                self._abort()
                return
            parts, first = done
            if not parts:
                return
            full = True  # the rest waits for the socket to be writable again
        small = []  # consecutive bytes parts go out in one send()
        for p in parts:
            if type(p) is FileSpan:
                if small:
                    self._queue_bytes(small)
                    small = []
                if p.length > first:
                    q.append([p.file, p.offset + first, p.length - first])
                    self.queued += p.length - first
            elif p:
                small.append(memoryview(p)[first:] if first else p)
            first = 0
        if small:
            self._queue_bytes(small)
        if not q:
            return
        if not full and not self._twisted_pending():
            # the socket is probably writable now: send without waiting a reactor iteration
            if not self._drain():
                self._abort()
                return
        if q:
            self.transport.startWriting()
        self._drained_check()

    def _send_now(self, parts):
        """Send ``parts`` from the first until the socket is full: ``(rest, k)``, the parts not
        wholly sent (the first of them ``k`` bytes in), or None on a fatal error. Bytes parts
        before a FileSpan go in one ``send()`` with MSG_MORE (a reply's prefix and header), the
        last ones without it."""
        sock = self._sock
        out = self._fileno
        n_parts = len(parts)
        i = 0
        calls = 0
        t0 = time.perf_counter()
        try:
            while i < n_parts:
                p = parts[i]
                if type(p) is FileSpan:
                    left = p.length
                    if left:
                        calls += 1
                        n = os.sendfile(out, p.file.fd, p.offset, left)
                        if n <= 0:
                            # the file ends before the range the store named (truncated behind
                            # our back): this frame cannot be completed
                            self.log.error("WAL segment shorter than a FETCH reply's batch; closing the connection")
                            return None
                        self.sent_file_bytes += n
                        if n < left:
                            self._count(calls, 1, t0)  # the socket's buffer is full
                            return parts[i:], n
                    i += 1
                    continue
                j = i + 1  # the bytes parts up to the next FileSpan: one send()
                while j < n_parts and type(parts[j]) is not FileSpan:
                    j += 1
                if j > i + 1:
                    p = b"".join(parts[i:j])
                    parts = parts[:i] + [p] + parts[j:]
                    n_parts = len(parts)
                    j = i + 1
                if p:
                    n = sock.send(p, _MSG_MORE if j < n_parts else 0)
                    if n < len(p):
                        self._count(calls, 0, t0)
                        return parts[i:], n
                i = j
        except (BlockingIOError, InterruptedError):
            self._count(calls, 1 if type(parts[i]) is FileSpan else 0, t0)
            return parts[i:], 0
        except OSError as e:
            self.log.debug("send failed: {error}", error=e)
            return None
        self._count(calls, 0, t0)
        return (), 0

    def _queue_bytes(self, parts):
        self._append_bytes(parts[0] if len(parts) == 1 else b"".join(parts))

    def _append_bytes(self, data):
        """Queue ``data``; small bytes go out in the same ``send()`` as small bytes queued just
        before them (a reply's CRC and the next reply's prefix and header, acks queued behind a
        FETCH reply): one syscall, not one each."""
        q = self._queue
        if q and type(q[-1]) is not list and len(q[-1]) + len(data) <= _COALESCE_MAX:
            q[-1] = bytes(q[-1]) + data
        else:
            q.append(data)
        self.queued += len(data)

    def lose_connection(self):
        """``transport.loseConnection()`` once the queue has been sent."""
        if self._queue:
            self._lose_when_drained = True
        else:
            self.transport.loseConnection()

    def discard(self):
        """The connection is gone: drop the queue (its files are closed with the last reference)."""
        self._queue.clear()
        self.queued = 0

    # -- internals ---------------------------------------------------------------------------------

    def _twisted_pending(self) -> bool:
        return has_unsent(self.transport)

    def _check_backlog(self):
        if self._queue:
            if not self._backlogged and self.queued > self.HIGH:
                self._backlogged = True
                self._on_backlog(True)
        elif self._backlogged:
            self._backlogged = False
            self._on_backlog(False)

    def _drained_check(self):
        self._check_backlog()
        if self._lose_when_drained and not self._queue:
            self._lose_when_drained = False
            self.transport.loseConnection()

    def _drain(self) -> bool:
        """Send from the queue until it is empty or the socket is full; False on a fatal error."""
        q = self._queue
        sock = self._sock
        out = self._fileno
        calls = 0
        t0 = time.perf_counter()
        try:
            while q:
                item = q[0]
                if type(item) is list:
                    f, off, left = item
                    calls += 1
                    n = os.sendfile(out, f.fd, off, left)
                    if n <= 0:
                        # the file ends before the range the store named (truncated behind our
                        # back): this frame cannot be completed
                        self.log.error("WAL segment shorter than a FETCH reply's batch; closing the connection")
                        return False
                    self.queued -= n
                    self.sent_file_bytes += n
                    if n < left:
                        item[1] = off + n
                        item[2] = left - n
                        self._count(calls, 1, t0)
                        return True  # the socket's buffer is full
                else:
                    # MSG_MORE when more follows (a reply's prefix and header before its batches):
                    # no short segment of its own
                    n = sock.send(item, _MSG_MORE if len(q) > 1 else 0)
                    self.queued -= n
                    if n < len(item):
                        q[0] = memoryview(item)[n:]
                        return True
                q.popleft()
        except (BlockingIOError, InterruptedError):
            self._count(calls, 1 if calls and type(q[0]) is list else 0, t0)
            return True
        except OSError as e:
            self.log.debug("send failed: {error}", error=e)
            return False
        if calls:
            self._count(calls, 0, t0)
        return True

    def _count(self, calls, short, t0):
        if not calls:
            return
        counts = self._counts
        counts["fetch_sendfile_calls"] += calls
        counts["fetch_sendfile_short"] += short
        wall = time.perf_counter() - t0
        counts["fetch_send_wall_s"] += wall
        if wall > self.STALL_S:
            counts["fetch_send_stalls"] += 1

    def _abort(self):
        self.discard()
        self.transport.abortConnection()

    def _do_write(self):
        """The reactor found the socket writable."""
        if self._twisted_pending() or not self._queue:
            result = self._orig_do_write()
            if result is not None or not self._queue or self._twisted_pending():
                return result
            # Twisted's buffer is sent (and it stopped writing): the queue is next
        if not self._drain():
            self.discard()
            return tcp_internals.CONNECTION_LOST
        if self._queue:
            self.transport.startWriting()
            self._check_backlog()
            return None
        self._drained_check()  # may resume the protocol, which may queue more
        if self._queue or self._twisted_pending():
            self.transport.startWriting()
            return None
        # both empty: Twisted stops writing, resumes a producer it paused or closes as asked
        return self._orig_do_write()
