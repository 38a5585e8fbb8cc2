"""Pipelined SBP requests on one connection (issue 24): a real node, raw loopback sockets, every
request of a test sent in one write so the node takes them in from one read; and the store's
held writer wake-ups (``CommitCore.hold_wakeups``) that such a read runs under."""

import socket
import time

import pytest_twisted
from twisted.internet import defer, reactor

from protocols.sbp import codec
from protocols.sbp.client import BlockingSbpClient
from storage import FsyncPolicy, Store
from storage import record_batch
from tests.storage_helpers.util import batch as store_batch


def batch(n, tag):
    return record_batch.encode([(1000 + i, [], tag + b"-%d-" % i + b"." * 200) for i in range(n)])


def append_frame(rid, sid, b):
    header = codec.encode_table("AppendRequest", codec.T.AppendRequest(0, [codec.T.AppendInfo(sid, 0, len(b))]))
    return codec.encode_frame(codec.APPEND, 0, rid, header, b)


def fetch_frame(rid, sid, offset, max_bytes=1 << 20, max_wait_ms=0):
    header = codec.encode_table("FetchRequest", codec.T.FetchRequest(max_wait_ms, 1, [codec.T.FetchInfo(sid, 0, offset, max_bytes)]))
    return codec.encode_frame(codec.FETCH, 0, rid, header)


def exchange(node, frames, timeout=30.0):
    """Send ``frames`` in one write; the replies, in the order they arrived, once there is one
    with flags 0x03 per request."""
    s = socket.create_connection(("127.0.0.1", node.ports["sbp"]), timeout=timeout)
    fb = codec.FrameBuffer()
    replies = []
    deadline = time.monotonic() + timeout
    try:
        s.sendall(b"".join(frames))
        while sum(1 for f in replies if f.is_end) < len(frames):
            assert time.monotonic() < deadline, "replies did not all arrive"
            data = s.recv(1 << 20)
            assert data, "the node closed the connection"
            fb.feed(data)
            while (f := fb.next()) is not None:
                replies.append(f)
    finally:
        s.close()
    return replies


def appended(reply):
    assert reply.opcode == codec.APPEND and reply.flags == codec.RESPONSE_LAST
    (r,) = codec.decode_header(reply).append_responses
    assert r.status.code == codec.OK, r.status
    return r.base_offset


def fetched(reply):
    """The batches of a one-entry FETCH reply (its payload CRC was checked by the framer)."""
    assert reply.opcode == codec.FETCH and reply.flags == codec.RESPONSE_LAST
    (r,) = codec.decode_header(reply).fetch_responses
    assert r.status.code == codec.OK, r.status
    assert r.batch_length == len(reply.payload)
    return list(record_batch.split(reply.payload))


def records(batches):
    """(offset, body) of every record in ``batches``."""
    return [(r.offset, r.body) for b in batches for r in record_batch.decode(b)[1]]


def bodies(batches):
    return [r.body for b in batches for r in record_batch.decode(b)[1]]


def test_pipelined_appends_are_answered_in_order(node_factory):
    node = node_factory(fsync="interval:1000")
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"]) as c:
        a = c.create_stream()["stream_id"]
        b = c.create_stream()["stream_id"]
    # 60 APPENDs, two streams interleaved, sizes varying, all in one write
    frames, expect = [], []
    nexts = {a: 0, b: 0}
    for k in range(60):
        sid = a if k % 3 else b
        n = 1 + k % 7
        frames.append(append_frame(k + 1, sid, batch(n, b"p%d" % k)))
        expect.append(nexts[sid])
        nexts[sid] += n
    replies = exchange(node, frames)
    # one stream's APPENDs are sequenced in arrival order, and the node answers in that order
    assert [f.stream_id for f in replies] == list(range(1, 61))
    assert [appended(f) for f in replies] == expect
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"]) as c:
        got = bodies(record_batch.split(c.fetch(a, 0, 16 << 20)))
    assert got == bodies(batch(1 + k % 7, b"p%d" % k) for k in range(60) if k % 3)


def test_mixed_pipelined_append_and_fetch_on_one_connection(node_factory):
    node = node_factory(fsync="interval:1000")
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"]) as c:
        sid = c.create_stream()["stream_id"]
        base = c.append(sid, batch(4, b"old"))
    b1, b2 = batch(3, b"one"), batch(5, b"two")
    frames = [
        fetch_frame(1, sid, 0),  # data that exists: answered now
        append_frame(2, sid, b1),
        fetch_frame(3, sid, 4, max_wait_ms=20000),  # b1's offset: answered once b1 is in
        append_frame(4, sid, b2),
        fetch_frame(5, sid, 4, max_bytes=1, max_wait_ms=20000),  # b1 again, one batch only
        codec.encode_frame(codec.PING, 0, 6, b"", b"ping"),
        fetch_frame(7, sid, 99),  # past the end: OFFSET_OUT_OF_RANGE, not a hang
    ]
    replies = {f.stream_id: f for f in exchange(node, frames)}
    assert sorted(replies) == [1, 2, 3, 4, 5, 6, 7]
    assert base == 0 and appended(replies[2]) == 4 and appended(replies[4]) == 7
    first = fetched(replies[1])
    assert record_batch.read_header(first[0]).base_offset == 0 and bodies(first[:1]) == bodies([batch(4, b"old")])
    got3 = fetched(replies[3])
    assert record_batch.read_header(got3[0]).base_offset == 4 and bodies(got3[:1]) == bodies([b1])
    got5 = fetched(replies[5])
    assert [record_batch.read_header(b).base_offset for b in got5] == [4] and bodies(got5) == bodies([b1])
    assert replies[6].opcode == codec.PING and replies[6].payload == b"ping"
    (r7,) = codec.decode_header(replies[7]).fetch_responses
    assert r7.status.code == codec.OFFSET_OUT_OF_RANGE  # an offset past the stream's end
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"]) as c:
        assert bodies(record_batch.split(c.fetch(sid, 0, 1 << 20))) == bodies([batch(4, b"old"), b1, b2])


def test_pipelined_fetches_each_get_their_own_batches(node_factory):
    node = node_factory(fsync="interval:1000")
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"]) as c:
        sid = c.create_stream()["stream_id"]
        sent = [batch(8, b"s%d" % k) for k in range(48)]
        for b in sent:
            c.append(sid, b)
    # 12 FETCHes of 4 batches each (the size of one batch times 3.5: whole batches until the
    # bytes reach it), in one write, as a pipelining reader asks for offsets it computed
    size = len(sent[0])
    frames = [fetch_frame(k + 1, sid, k * 32, max_bytes=size * 3 + size // 2) for k in range(12)]
    replies = exchange(node, frames)
    assert sorted(f.stream_id for f in replies) == list(range(1, 13))  # replies may pass each other
    for f in replies:
        k = f.stream_id - 1
        got = fetched(f)
        assert [record_batch.read_header(b).base_offset for b in got] == [k * 32 + 8 * j for j in range(4)]
        assert bodies(got) == bodies(sent[4 * k:4 * k + 4])
        assert [o for o, _ in records(got)] == list(range(k * 32, k * 32 + 32))


# -- the store's held wake-ups ----------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_held_writer_wakeups_lose_no_append(tmp_path):
    st = Store.open(str(tmp_path), fsync=FsyncPolicy.parse("interval:1000"), reactor=reactor, node_id=7)
    try:
        sid = (await st.log.create_stream(replica_nums=1, retention_period_ms=0, attrs={})).stream_id
        core = st.core
        bases = []
        for rounds in range(20):
            # nested holds, as a re-entered _process would take them; the writer wakes once the
            # outermost is released, whatever it was doing when the appends were queued
            core.hold_wakeups()
            core.hold_wakeups()
            ds = [st.log.append(sid, store_batch(2, 30, rounds * 10 + i)) for i in range(5)]
            core.release_wakeups()
            ds.append(st.log.append(sid, store_batch(2, 30, rounds * 10 + 5)))
            core.release_wakeups()
            timeout = reactor.callLater(30, lambda: [d.cancel() for d in ds if not d.called])
            bases += await defer.gatherResults(ds)
            if timeout.active():
                timeout.cancel()
        assert bases == list(range(0, 240, 2))
        assert st.log.stream(sid).next_offset == 240
    finally:
        await st.close()
