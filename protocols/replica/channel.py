"""The node-to-node replica channel (CONTRACT §9): frames replica messages (protocols/replica/
codec.py) and hands each to its handler; nothing else. One connection per (primary node, replica
node) pair, opened by the primary; with the cluster TLS options both ends are mutual TLS.

A frame is a 4-byte big-endian length and the message. Record batches are most of the bytes, so
they are not copied on the way: ``queue_batch`` collects the batches of one reactor turn per
stream into one ``B`` message whose batches go to the socket as they are (no re-encoding, no
join), and the receiving side reads up to ``READ_SIZE`` bytes at a time and decodes each message
where it lies (``framing.Framer``; a ``B`` message's batches are views of the received bytes,
stored without a copy; of a ``B`` message cut by a read's end only the batch cut is joined,
``codec.decode_pieces``, other messages cut so are joined once). Everything a channel
is given in one reactor turn (``B`` messages, acks, confirms) leaves at the turn's end in the
order given, with one ``sendmsg`` when the socket holds nothing unsent: one system call per peer
per turn, not one per message.
"""

import struct
from collections import deque
from itertools import islice

from twisted.internet import protocol
from twisted.internet import reactor as default_reactor
from twisted.logger import Logger

from protocols import framing, tcp_internals
from protocols.direct_send import send_parts_now
from protocols.replica import codec

_LEN = struct.Struct(">I")
READ_SIZE = 1 << 20  # bytes read from the socket at once (Twisted's default is 64 KiB: one batch)
MAX_QUEUED = 8 << 20  # a B message is sent once it holds this much (codec.MAX_MESSAGE is the hard limit)
_MAX_PARTS = 1024  # buffers per sendmsg (Linux's IOV_MAX)


class ReplicaChannel(protocol.Protocol):
    """``handler.message(channel, msg)`` for every message; ``handler.connected(channel)`` /
    ``handler.disconnected(channel)`` around the connection; ``handler.around_read(True)`` /
    ``(False)`` (optional) around the messages of one read."""

    MAX_LENGTH = codec.MAX_MESSAGE
    log = Logger()

    def __init__(self, handler, reactor=None):
        self.handler = handler
        self.reactor = reactor or default_reactor
        self.lost = False
        self._framer = framing.Framer(framing.Layout(_LEN, 0, 4, 0, self.MAX_LENGTH))  # the reads, kept as they came
        self._out = []  # the parts of this reactor turn's messages, in order (sent at its end)
        self._batches = None  # the B message being filled (see queue_batch)
        self._flush_call = None
        self._last = None  # ((kind, stream id), its index in _out) of the last send_latest message
        # plain TCP: what the socket did not take yet, as the parts were given (views of the
        # batches: not joined, not copied), sent with sendmsg when it is writable again; None
        # (TLS, test transports): Twisted's buffer (which joins everything it holds on each pass)
        self._unsent = None
        self._orig_do_write = None

    def connectionMade(self):
        # small acks and confirms must not wait for Nagle's algorithm (40 ms with delayed ACKs)
        nodelay = getattr(self.transport, "setTcpNoDelay", None)
        if nodelay is not None:
            try:
                nodelay(True)
            except Exception:
                pass
        tcp_internals.set_read_size(self.transport, READ_SIZE)
        tcp_internals.set_send_limit(self.transport, READ_SIZE)  # (Twisted's 128 KiB: two batches per send())
        if tcp_internals.is_plain_tcp(self.transport):
            self._unsent = deque()
            self._orig_do_write = tcp_internals.take_over_writes(self.transport, self._do_write)
        self.handler.connected(self)

    def connectionLost(self, reason=None):
        self.lost = True
        self._out, self._batches, self._last = [], None, None
        if self._unsent is not None:
            self._unsent.clear()
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        self.handler.disconnected(self)

    def dataReceived(self, data):
        framer = self._framer
        framer.feed(data)
        around = getattr(self.handler, "around_read", None)
        if around is not None:
            around(True)
        try:
            while not self.lost:
                try:
                    span = framer.next_pieces()
                except framing.FrameRefused as e:
                    self.log.warn("replica channel: message of {n} bytes; closing", n=e.length)
                    self._close()
                    return
                if span is None:
                    return
                buf, start, end = span
                try:
                    # (in place: a B message's batches are views of the read, which stays as it is;
                    # one cut by a read's end is taken in its pieces, only a batch cut is joined)
                    if buf is not None:
                        msg = codec.decode(memoryview(buf)[start + 4:end])
                    else:
                        msg = codec.decode_pieces(_skip_prefix(start))
                except codec.BadMessage as e:
                    self.log.warn("replica channel: {error}; closing", error=str(e))
                    self._close()
                    return
                self.handler.message(self, msg)
        finally:
            if around is not None:
                around(False)

    def _close(self):
        self.transport.loseConnection()
        self.lost = True
        self._framer.clear()

    def send(self, *fields):
        """Send a message at the end of this reactor turn, after everything given before it."""
        if self.lost:
            return
        self.send_encoded(codec.encode(*fields))

    def send_encoded(self, payload, flushed=False):
        """``send`` of a message encoded already (``codec.encode``: one encoding for several
        peers); ``flushed`` as for ``queue_run``."""
        if self.lost:
            return
        self._close_batches()
        self._out.append(_LEN.pack(len(payload)) + payload)
        self._last = None
        if self._flush_call is None and not flushed:
            self._flush_call = self.reactor.callLater(0, self._flush_now)

    def send_latest(self, *fields):
        """``send`` for a message that supersedes one of the same kind and stream given just
        before it in this turn (nothing between them): that one is replaced, not followed (a
        replica's acks, whose durable end only grows: one per stream per turn is enough)."""
        if self.lost:
            return
        key = (fields[0], fields[1])
        last = self._last
        if last is not None and last[0] == key and last[1] == len(self._out) - 1 and self._batches is None:
            payload = codec.encode(*fields)
            self._out[-1] = _LEN.pack(len(payload)) + payload
            return
        self.send(*fields)
        self._last = (key, len(self._out) - 1)

    def queue_batch(self, sid, epoch, batch, base=None):
        """Send ``batch`` (of stream ``sid``, epoch ``epoch``) at the end of this reactor turn,
        with the stream's other batches of the turn, in one ``B`` message; with ``base``, as if
        its base offset were ``base`` (``codec.batch_parts``: the batch is not copied)."""
        self.queue_parts(sid, epoch, codec.batch_parts(batch, base))

    def queue_parts(self, sid, epoch, parts):
        """``queue_batch`` of a batch given as ``codec.batch_parts`` gives it (the primary makes
        them once for all of a batch's replicas)."""
        if self.lost:
            return
        head, body = parts
        size = len(head) + len(body)
        q = self._batches
        if q is not None and (q[0] != sid or q[1] != epoch or q[4] + size > MAX_QUEUED):
            full = q[4] + size > MAX_QUEUED
            self._close_batches()
            if full:
                self.flush()
            q = None
        if q is None:
            self._last = None
            # [stream id, epoch, where its prefix goes in _out, batches, bytes of the batches' parts]
            self._batches = q = [sid, epoch, len(self._out), 0, 0]
            self._out.append(None)
        self._out.append(head)
        self._out.append(body)
        q[3] += 1
        q[4] += size
        if self._flush_call is None:
            self._flush_call = self.reactor.callLater(0, self._flush_now)

    def queue_run(self, sid, epoch, parts, size, flushed=False):
        """``queue_parts`` of consecutive batches of one stream (``parts``, as ``codec.batch_parts``
        gives each; ``size``: their bytes), with one call: the primary's run of one read.
        ``flushed``: the caller calls ``flush`` itself before the reactor turn ends (no timer)."""
        if self.lost:
            return
        q = self._batches
        if size > MAX_QUEUED or (q is not None and q[4] + size > MAX_QUEUED):
            for p in parts:
                self.queue_parts(sid, epoch, p)
            return
        if q is not None and (q[0] != sid or q[1] != epoch):
            self._close_batches()
            q = None
        if q is None:
            self._last = None
            self._batches = q = [sid, epoch, len(self._out), 0, 0]
            self._out.append(None)
        out = self._out
        for head, body in parts:
            out.append(head)
            out.append(body)
        q[3] += len(parts)
        q[4] += size
        if self._flush_call is None and not flushed:
            self._flush_call = self.reactor.callLater(0, self._flush_now)

    def _close_batches(self):
        q, self._batches = self._batches, None
        if q is not None:
            head = codec.batches_prefix(q[0], q[1]) + codec.array_head(q[3])
            self._out[q[2]] = _LEN.pack(len(head) + q[4]) + head

    def _flush_now(self):
        self._flush_call = None
        self.flush()

    def flush(self):
        """Send what this turn gave now: the parts of its messages with one ``sendmsg`` when the
        socket is idle (no join into Twisted's buffer, protocols/direct_send.py), else through
        the transport."""
        self._close_batches()
        out = self._out
        if not out or self.lost:
            return
        self._out = []
        self._last = None
        unsent = self._unsent
        if unsent is not None:
            # behind what the socket has not taken yet, else straight to it (no copy either way)
            pending = bool(unsent) or tcp_internals.idle_socket(self.transport) is None
            unsent.extend(out)
            if not pending and not self._drain():
                self.transport.abortConnection()
                return
            if unsent:
                self.transport.startWriting()
            return
        if len(out) <= _MAX_PARTS:
            send_parts_now(self.transport, out)
            return
        for i in range(0, len(out), _MAX_PARTS):
            send_parts_now(self.transport, out[i:i + _MAX_PARTS])

    def _drain(self) -> bool:
        """Send the unsent parts until they are all sent or the socket is full (one sendmsg per
        up to _MAX_PARTS of them); False if the connection failed (the parts are dropped)."""
        q = self._unsent
        sock = self.transport.socket
        while q:
            parts = list(islice(q, 0, _MAX_PARTS)) if len(q) > _MAX_PARTS else list(q)
            try:
                n = sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                self.log.debug("replica channel send failed: {error}", error=e)
                q.clear()
                return False
            if len(parts) == len(q) and n == sum(map(len, parts)):
                q.clear()  # (the usual case: all of it taken)
                return True
            for p in parts:
                size = len(p)
                if n >= size:
                    q.popleft()
                    n -= size
                    continue
                q[0] = memoryview(p)[n:]  # the socket is full: the rest of this part waits
                return True
        return True

    def _do_write(self):
        """The reactor found the socket writable: Twisted's own buffer first (bytes written to the
        transport directly), then the unsent parts; once both are empty Twisted's doWrite stops
        writing (or completes a loseConnection) as usual."""
        q = self._unsent
        if not q or tcp_internals.has_unsent(self.transport):
            result = self._orig_do_write()
            if result is not None or not q or tcp_internals.has_unsent(self.transport):
                return result
        if not self._drain():
            return tcp_internals.CONNECTION_LOST
        if q:
            self.transport.startWriting()
            return None
        return self._orig_do_write()


def _skip_prefix(pieces):
    """The pieces of a message without its 4-byte length prefix."""
    n = 4
    while n:
        first = pieces[0]
        if len(first) > n:
            pieces[0] = first[n:]
            break
        n -= len(first)
        del pieces[0]
    return pieces


class ReplicaChannelFactory(protocol.Factory):
    noisy = False

    def __init__(self, handler):
        self.handler = handler

    def buildProtocol(self, addr):
        return ReplicaChannel(self.handler)
