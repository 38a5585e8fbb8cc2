"""protocols/direct_send: straight-to-socket writes keep the connection's byte order."""

import pytest_twisted
from twisted.internet import defer, endpoints, protocol, reactor
from twisted.internet.testing import StringTransport

from protocols.direct_send import idle_socket, send_now, send_parts_now


def test_non_tcp_transports_take_the_plain_write_path():
    tr = StringTransport()
    assert idle_socket(tr) is None
    send_now(tr, b"abc")
    send_parts_now(tr, [b"de", b"f"])
    assert tr.value() == b"abcdef"


class _Writer(protocol.Protocol):
    """On connect: a big direct write the kernel cannot take at once, then writes mixing the
    direct and the buffered paths; the client must see them in call order."""

    def connectionMade(self):
        self.factory.sockets.append(idle_socket(self.transport))
        big = bytes(range(256)) * (32 * 1024)  # 8 MiB: more than the socket buffers hold
        send_now(self.transport, big)
        self.factory.sockets.append(idle_socket(self.transport))  # the rest is queued in Twisted
        send_parts_now(self.transport, [b"<", b"parts", b">"])
        self.transport.write(b"[buffered]")
        send_now(self.transport, b"(last)")
        self.transport.loseConnection()


class _Reader(protocol.Protocol):
    def connectionMade(self):
        self.got = bytearray()

    def dataReceived(self, data):
        self.got += data

    def connectionLost(self, reason):
        self.factory.done.callback(bytes(self.got))


@pytest_twisted.ensureDeferred
async def test_partial_direct_send_keeps_order_over_real_tcp():
    server = protocol.Factory.forProtocol(_Writer)
    server.sockets = []
    port = await endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(server)
    try:
        client = protocol.ClientFactory.forProtocol(_Reader)
        client.done = defer.Deferred()
        reactor.connectTCP("127.0.0.1", port.getHost().port, client)
        got = await client.done
    finally:
        await port.stopListening()
    big = bytes(range(256)) * (32 * 1024)
    assert got == big + b"<parts>[buffered](last)"
    assert server.sockets[0] is not None  # a fresh connection is idle: the direct path was taken
    assert server.sockets[1] is None  # after a partial send, writes go behind Twisted's buffer
