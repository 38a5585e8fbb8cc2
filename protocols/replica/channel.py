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
from protocols.replica import codec

_LEN = struct.Struct(">I")
READ_SIZE = 1 << 20  # bytes read from the socket at once (Twisted's default is 64 KiB: one batch)
MAX_QUEUED = 8 << 20  # a B message is sent once it holds this much (codec.MAX_MESSAGE is the hard limit)


class ReplicaChannel(protocol.Protocol):
    """``handler.message(channel, msg)`` for every message; ``handler.connected(channel)`` /
    ``handler.disconnected(channel)`` around the connection."""

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

    def send(self, *fields):
        if not self.lost:
            self.flush()
            payload = codec.encode(*fields)
            self.transport.write(_LEN.pack(len(payload)) + payload)

    def queue_batch(self, sid, epoch, batch):
        """Send ``batch`` (of stream ``sid``, epoch ``epoch``) at the end of this reactor turn,
        with the stream's other batches of the turn, in one ``B`` message."""
        if self.lost:
            return
        q = self._queued
        if q is not None and (q[0] != sid or q[1] != epoch or self._queued_bytes + len(batch) > MAX_QUEUED):
            self.flush()
            q = None
        if q is None:
            self._queued = q = (sid, epoch, [])
            self._queued_bytes = 0
        q[2].append(batch)
        self._queued_bytes += len(batch)
        if self._flush_call is None:
            self._flush_call = self.reactor.callLater(0, self._flush_now)

    def _flush_now(self):
        self._flush_call = None
        self.flush()

    def flush(self):
        """Send the queued batches now."""
        q, self._queued = self._queued, None
        if q is None or self.lost:
            return
        parts = codec.encode_batches(q[0], q[1], q[2])
        size = sum(len(p) for p in parts)
        parts[0] = _LEN.pack(size) + parts[0]
        self.transport.writeSequence(parts)


class ReplicaChannelFactory(protocol.Factory):
    noisy = False

    def __init__(self, handler):
        self.handler = handler

    def buildProtocol(self, addr):
        return ReplicaChannel(self.handler)
