"""The node-to-node replica channel (CONTRACT §9): frames replica messages (protocols/replica/
codec.py) and hands each to its handler; nothing else. One connection per (primary node, replica
node) pair, opened by the primary; with the cluster TLS options both ends are mutual TLS.

A frame is a 4-byte big-endian length and the message. Record batches are most of the bytes, so
they are not copied on the way: ``queue_batch`` collects the batches of one reactor turn per
stream into one ``B`` message whose batches go to the transport as they are (no re-encoding), and
the receiving side reads up to ``READ_SIZE`` bytes at a time into one buffer and decodes each
message in place. Every other message first sends the queued batches, so the peer sees the
messages in the order they were given.
"""

import struct

from twisted.internet import protocol
from twisted.internet import reactor as default_reactor
from twisted.logger import Logger

from protocols import tcp_internals
from protocols.direct_send import send_now, send_parts_now
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
        self._buf = bytearray()
        self._queued = None  # (stream id, epoch, [batch, ...]) waiting for the end of the reactor turn
        self._queued_bytes = 0
        self._flush_call = None

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
        self.handler.connected(self)

    def connectionLost(self, reason=None):
        self.lost = True
        self._queued = None
        if self._flush_call is not None and self._flush_call.active():
            self._flush_call.cancel()
        self._flush_call = None
        self.handler.disconnected(self)

    def dataReceived(self, data):
        buf = self._buf
        buf += data
        off, end = 0, len(buf)
        around = getattr(self.handler, "around_read", None)
        if around is not None:
            around(True)
        try:
            while end - off >= 4 and not self.lost:
                (length,) = _LEN.unpack_from(buf, off)
                if length > self.MAX_LENGTH:
                    self.log.warn("replica channel: message of {n} bytes; closing", n=length)
                    self.transport.loseConnection()
                    self.lost = True
                    return
                if end - off - 4 < length:
                    break
                with memoryview(buf) as whole, whole[off + 4:off + 4 + length] as view:
                    try:
                        msg = codec.decode(view)
                    except codec.BadMessage as e:
                        msg = None
                        error = e
                off += 4 + length
                if msg is None:
                    self.log.warn("replica channel: {error}; closing", error=str(error))
                    self.transport.loseConnection()
                    self.lost = True
                    return
                self.handler.message(self, msg)
        finally:
            if off:
                del buf[:off]
            if around is not None:
                around(False)

    def send(self, *fields):
        if not self.lost:
            self.flush()
            payload = codec.encode(*fields)
            # (small: acks, confirms; straight to an idle socket, no reactor pass before it leaves)
            send_now(self.transport, _LEN.pack(len(payload)) + payload)

    def queue_batch(self, sid, epoch, batch, base=None):
        """Send ``batch`` (of stream ``sid``, epoch ``epoch``) at the end of this reactor turn,
        with the stream's other batches of the turn, in one ``B`` message; with ``base``, as if
        its base offset were ``base`` (``codec.batch_parts``: the batch is not copied)."""
        if self.lost:
            return
        q = self._queued
        if q is not None and (q[0] != sid or q[1] != epoch or self._queued_bytes + len(batch) > MAX_QUEUED):
            self.flush()
            q = None
        if q is None:
            self._queued = q = (sid, epoch, [])
            self._queued_bytes = 0
        head, body = codec.batch_parts(batch, base)
        q[2].append(head)
        q[2].append(body)
        self._queued_bytes += len(head) + len(body)
        if self._flush_call is None:
            self._flush_call = self.reactor.callLater(0, self._flush_now)

    def _flush_now(self):
        self._flush_call = None
        self.flush()

    def flush(self):
        """Send the queued batches now: one ``sendmsg`` of the parts when the socket is idle (no
        join into Twisted's buffer; protocols/direct_send.py), else through the transport."""
        q, self._queued = self._queued, None
        if q is None or self.lost:
            return
        sid, epoch, parts = q
        head = codec.batches_prefix(sid, epoch) + codec.array_head(len(parts) // 2)
        parts.insert(0, _LEN.pack(len(head) + self._queued_bytes) + head)
        for i in range(0, len(parts), _MAX_PARTS):
            send_parts_now(self.transport, parts[i:i + _MAX_PARTS])


class ReplicaChannelFactory(protocol.Factory):
    noisy = False

    def __init__(self, handler):
        self.handler = handler

    def buildProtocol(self, addr):
        return ReplicaChannel(self.handler)
