"""The node-to-node replica channel (CONTRACT §9): frames replica messages (protocols/replica/
codec.py) and hands each to its handler; nothing else. One connection per (primary node, replica
node) pair, opened by the primary; with the cluster TLS options both ends are mutual TLS.
"""

from twisted.internet import protocol
from twisted.logger import Logger
from twisted.protocols.basic import Int32StringReceiver

from protocols.replica import codec


class ReplicaChannel(Int32StringReceiver):
    """``handler.message(channel, msg)`` for every message; ``handler.connected(channel)`` /
    ``handler.disconnected(channel)`` around the connection."""

    MAX_LENGTH = codec.MAX_MESSAGE
    log = Logger()

    def __init__(self, handler):
        self.handler = handler
        self.lost = False

    def connectionMade(self):
        # small acks and confirms must not wait for Nagle's algorithm (40 ms with delayed ACKs)
        nodelay = getattr(self.transport, "setTcpNoDelay", None)
        if nodelay is not None:
            try:
                nodelay(True)
            except Exception:
                pass
        self.handler.connected(self)

    def connectionLost(self, reason=None):
        self.lost = True
        self.handler.disconnected(self)

    def stringReceived(self, data):
        try:
            msg = codec.decode(data)
        except codec.BadMessage as e:
            self.log.warn("replica channel: {error}; closing", error=str(e))
            self.transport.loseConnection()
            return
        self.handler.message(self, msg)

    def lengthLimitExceeded(self, length):
        self.log.warn("replica channel: message of {n} bytes; closing", n=length)
        self.transport.loseConnection()

    def send(self, *fields):
        if not self.lost:
            self.sendString(codec.encode(*fields))


class ReplicaChannelFactory(protocol.Factory):
    noisy = False

    def __init__(self, handler):
        self.handler = handler

    def buildProtocol(self, addr):
        return ReplicaChannel(self.handler)
