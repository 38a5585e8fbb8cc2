"""The replica channel's framing (protocols/replica/channel.py): StringTransport and task.Clock."""

import struct

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
