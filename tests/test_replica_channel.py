"""The replica channel's framing (protocols/replica/channel.py): StringTransport and task.Clock."""

import struct

import pytest_twisted

from twisted.internet import task
from twisted.internet.testing import StringTransport

from protocols.replica import codec
from protocols.replica.channel import ReplicaChannel


class Recorder:
    def __init__(self):
        self.messages = []

    def connected(self, channel):
        pass

    def disconnected(self, channel):
        pass

    def message(self, channel, msg):
        self.messages.append(msg)


def channel():
    clock = task.Clock()
    rec = Recorder()
    ch = ReplicaChannel(rec, reactor=clock)
    tr = StringTransport()
    ch.makeConnection(tr)
    return ch, tr, rec, clock


def frames(data):
    out = []
    while data:
        (n,) = struct.unpack(">I", data[:4])
        out.append(codec.decode(data[4:4 + n]))
        data = data[4 + n:]
    return out


def test_batches_of_one_turn_go_in_one_message_in_order_with_other_messages():
    ch, tr, _, clock = channel()
    ch.queue_batch(5, 2, b"\x00first")
    ch.queue_batch(5, 2, b"\x00second")
    assert tr.value() == b""  # held to the end of the reactor turn
    ch.send(codec.CONFIRM, 5, 10)  # any other message sends the queued batches first
    ch.queue_batch(5, 2, b"\x00third")
    ch.queue_batch(6, 2, b"\x00other stream")
    clock.advance(0)
    assert frames(tr.value()) == [
        ["B", 5, 2, [b"\x00first", b"\x00second"]],
        ["C", 5, 10],
        ["B", 5, 2, [b"\x00third"]],
        ["B", 6, 2, [b"\x00other stream"]],
    ]


def test_messages_split_and_joined_across_reads_are_each_delivered_once():
    ch, _, rec, _ = channel()
    sent = [codec.encode(codec.SYNC, 1), b"".join(codec.encode_batches(1, 0, [b"\x01" * 70000, b"\x02" * 10])),
            codec.encode(codec.CONFIRM, 1, 99)]
    wire = b"".join(struct.pack(">I", len(m)) + m for m in sent)
    for i in range(0, len(wire), 4099):
        ch.dataReceived(wire[i:i + 4099])
    assert rec.messages == [["S", 1], ["B", 1, 0, [b"\x01" * 70000, b"\x02" * 10]], ["C", 1, 99]]
    ch.dataReceived(wire)  # all at once
    assert len(rec.messages) == 6


def test_a_batches_message_cut_by_reads_is_taken_in_its_pieces():
    ch, _, rec, _ = channel()
    batches = [bytes([i]) * 65536 for i in range(6)]
    msg = b"".join(codec.encode_batches(3, 1, batches))
    wire = struct.pack(">I", len(msg)) + msg + struct.pack(">I", 4) + codec.encode(codec.SYNC, 3)
    cut = 100000  # inside the second batch
    ch.dataReceived(wire[:cut])
    assert rec.messages == []
    ch.dataReceived(wire[cut:])
    assert rec.messages == [["B", 3, 1, batches], ["S", 3]]
    got = rec.messages[0][3]
    # the batches lie where they were received: only the one cut by the read's end was copied
    assert [type(b) for b in got] == [memoryview, bytes] + [memoryview] * 4


def test_a_bad_or_oversized_message_closes_the_connection():
    ch, tr, rec, _ = channel()
    ch.dataReceived(struct.pack(">I", 2) + b"\xc1\xc1")
    assert tr.disconnecting and rec.messages == []
    ch, tr, rec, _ = channel()
    ch.dataReceived(struct.pack(">I", codec.MAX_MESSAGE + 1))
    assert tr.disconnecting and rec.messages == []


def test_an_ack_given_right_after_another_of_its_stream_replaces_it():
    ch, tr, _, clock = channel()
    ch.send_latest(codec.ACK, 5, 10, 12)
    ch.send_latest(codec.ACK, 5, 12, 12)  # the durable end only grows: one ack per stream per turn
    ch.send_latest(codec.ACK, 6, 3, 3)
    ch.send(codec.CONFIRM, 6, 3)
    ch.send_latest(codec.ACK, 6, 4, 4)  # a message between them: both go
    ch.queue_batch(6, 1, b"\x00b")
    ch.send_latest(codec.ACK, 6, 5, 5)
    clock.advance(0)
    assert frames(tr.value()) == [["K", 5, 12, 12], ["K", 6, 3, 3], ["C", 6, 3], ["K", 6, 4, 4],
                                  ["B", 6, 1, [b"\x00b"]], ["K", 6, 5, 5]]


def test_a_run_queued_at_once_is_one_message_after_what_came_before():
    ch, tr, _, clock = channel()
    ch.queue_batch(5, 2, b"\x00first")
    parts = [codec.batch_parts(b, None) for b in (b"\x00second", b"\x00third")]
    ch.queue_run(5, 2, parts, sum(len(h) + len(b) for h, b in parts))
    ch.queue_run(6, 2, parts[:1], len(parts[0][0]) + len(parts[0][1]), flushed=True)
    clock.advance(0)
    assert frames(tr.value()) == [["B", 5, 2, [b"\x00first", b"\x00second", b"\x00third"]], ["B", 6, 2, [b"\x00second"]]]


@pytest_twisted.ensureDeferred
async def test_a_full_socket_keeps_the_rest_in_order_and_sends_it_when_writable():
    """Plain TCP: what the kernel does not take waits in the channel's own queue (views of the
    batches, not Twisted's buffer, which joins everything it holds) and leaves when the socket is
    writable again: every message arrives once, in order, byte for byte."""
    from twisted.internet import defer, endpoints, protocol, reactor

    rec = Recorder()
    got = defer.Deferred()
    big = [bytes([0]) + bytes([i % 251]) * (200 * 1024 + i) for i in range(40)]  # ~8 MiB: past the socket's buffers

    class Counting(Recorder):
        def message(self, channel, msg):
            rec.messages.append(msg)
            if msg[0] == codec.CONFIRM and msg[2] == len(big) and not got.called:
                got.callback(None)

    server = protocol.Factory.forProtocol(lambda: ReplicaChannel(Counting()))
    port = await endpoints.TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(server)
    try:
        client = await endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), ReplicaChannel(Recorder()))
        for i, b in enumerate(big):
            parts = [codec.batch_parts(b, 1000 + i)]
            client.queue_run(7, 1, parts, len(parts[0][0]) + len(parts[0][1]), flushed=True)
            client.send_encoded(codec.encode(codec.CONFIRM, 7, i + 1), flushed=True)
            client.flush()
        assert client._unsent, "the socket took everything: the test needs more bytes"
        assert not client.transport.dataBuffer and not client.transport._tempDataLen  # nothing in Twisted's buffer
        await got
        want = []
        for i, b in enumerate(big):
            want.append(["B", 7, 1, [b[:1] + (1000 + i).to_bytes(8, "big", signed=True) + b[9:]]])
            want.append(["C", 7, i + 1])
        assert [[m[0], m[1], m[2], [bytes(x) for x in m[3]]] if m[0] == "B" else m for m in rec.messages] == want
        assert not client._unsent
        client.transport.loseConnection()
    finally:
        await port.stopListening()
