"""APPEND runs (issue 24): the one-batch APPENDs of one read go to the store as one operation and
are acknowledged together (protocols/sbp/append.py). Every request keeps its own reply and
status, offsets are assigned in frame order, and a buffer of pipelined requests gives the same
replies and the same stored log however it is cut into reads: as one read, one frame per read,
cut at every byte boundary, one byte at a time. The real store (inline writer), the protocol over
a StringTransport (tests/test_sbp_server.py's fixtures)."""

import pytest_twisted

from protocols.sbp import codec
from protocols.sbp.codec import T
from storage import errors, record_batch
from tests.storage_helpers.inline import complete, hold
from tests.test_sbp_server import Conn, clock, create, node, store  # noqa: F401 (fixtures)

MISSING = 0x7FFF_FFFF_0000_0001  # a stream that does not exist


def small(tag, n=1):
    return record_batch.encode([(1000 + i, [], tag + b"-%d" % i) for i in range(n)])


def append_wire(rid, entries, payload=None, header=None):
    if header is None:
        header = codec.encode_table("AppendRequest", T.AppendRequest(0, [T.AppendInfo(sid, i, len(b)) for i, (sid, b) in enumerate(entries)]))
    return codec.encode_frame(codec.APPEND, 0, rid, header, b"".join(b for _, b in entries) if payload is None else payload)


def corrupt_block(b):
    """The batch with a records-block byte changed (its stored CRC no longer matches)."""
    x = bytearray(b)
    x[-1] ^= 0x01
    return bytes(x)


def pipelined(sid):
    """A pipelined buffer's frames, with what each must be answered with, in frame order."""
    frames = []

    def add(wire):
        frames.append(wire)

    add(append_wire(1, [(sid, small(b"a", 2))]))
    add(append_wire(2, [(sid, small(b"b", 3))]))
    w = bytearray(append_wire(3, [(sid, small(b"x"))]))  # the frame's payload CRC is wrong
    w[-1] ^= 0x40
    add(bytes(w))
    add(append_wire(4, [(sid, small(b"c"))]))
    add(append_wire(5, [(sid, corrupt_block(small(b"y", 2)))]))  # CORRUPT_BATCH, frame CRC right
    add(append_wire(6, [(MISSING, small(b"z"))]))  # STREAM_NOT_FOUND, answered by the store
    add(append_wire(7, [(sid, small(b"d")), (sid, small(b"e", 2))]))  # two batches: the general path
    add(codec.encode_frame(codec.PING, 0, 8, b"", b"ping"))
    add(append_wire(9, [(sid, small(b"f"))]))
    hdr = codec.encode_table("AppendRequest", T.AppendRequest(0, [T.AppendInfo(sid, 0, 5)]))
    add(append_wire(10, [(sid, small(b"q"))], header=hdr))  # lengths do not add up: system error
    add(append_wire(11, [(sid, small(b"g"))], header=b"\xff" * 12))  # a header that does not decode
    bad_magic = bytearray(append_wire(12, [(sid, small(b"m"))]))
    bad_magic[4] = 99  # discarded, no reply
    add(bytes(bad_magic))
    add(append_wire(13, [(sid, b"\x22" * 10)]))  # a batch shorter than its header: CORRUPT_BATCH
    add(append_wire(14, [(sid, small(b"h", 4))]))
    add(append_wire(15, [(sid, small(b"i"))]))
    return frames


def normalized(reply, sid):
    """A reply without what differs between trials (stream ids, append times)."""
    name = lambda s: "S" if s == sid else ("MISSING" if s == MISSING else s)  # noqa: E731
    if reply.opcode == codec.PING:
        return ("ping", reply.stream_id, reply.flags, reply.payload)
    h = codec.decode_header(reply)
    if reply.is_system_error:
        return ("error", reply.stream_id, reply.flags, h.status.code)
    return ("append", reply.stream_id, reply.flags, h.throttle_time_ms,
            [(name(r.stream_id), r.request_index, r.base_offset, r.status.code) for r in h.append_responses])


def stored(store, sid):
    """Every record stored in the stream: (offset, body), in log order."""
    d = store.log.read(sid, 0, 1 << 20)
    got = []
    d.addCallback(got.append)
    assert got, "the inline store reads at once"
    out = []
    for b in got[0]:
        _, records = record_batch.decode(b)
        out.extend((r.offset, r.body) for r in records)
    return out


async def trial(node, feed):
    """A fresh connection and stream; ``feed(conn, wire_frames)`` sends the buffer; the replies
    (normalized, in the order they were written) and the stream's records."""
    c = Conn(node)
    (sid,) = await create(c)
    c.poll()
    c.got.clear()
    feed(c, pipelined(sid))
    replies = [normalized(f, sid) for f in c.poll()]
    return replies, stored(node.store, sid), node.store.log.durable_end(sid)


def one_read(c, frames):
    c.send(b"".join(frames))


def frame_per_read(c, frames):
    for w in frames:
        c.send(w)


@pytest_twisted.ensureDeferred
async def test_a_pipelined_buffer_gets_the_replies_of_one_frame_at_a_time(node):
    base_replies, base_records, base_end = await trial(node, frame_per_read)
    # what each request must get (frame order): its own reply and status
    assert [(r[0], r[1]) for r in base_replies] == [
        ("append", 1), ("append", 2), ("error", 3), ("append", 4), ("append", 5), ("append", 6), ("append", 7),
        ("ping", 8), ("append", 9), ("error", 10), ("error", 11), ("append", 13), ("append", 14), ("append", 15)]
    by_rid = {r[1]: r for r in base_replies}
    assert by_rid[1][4] == [("S", 0, 0, codec.OK)]
    assert by_rid[2][4] == [("S", 0, 2, codec.OK)]
    assert by_rid[3][3] == codec.INVALID_REQUEST
    assert by_rid[4][4] == [("S", 0, 5, codec.OK)]
    assert by_rid[5][4] == [("S", 0, 0, codec.CORRUPT_BATCH)]
    assert by_rid[6][4] == [("MISSING", 0, 0, codec.STREAM_NOT_FOUND)]
    assert by_rid[7][4] == [("S", 0, 6, codec.OK), ("S", 1, 7, codec.OK)]
    assert by_rid[9][4] == [("S", 0, 9, codec.OK)]
    assert by_rid[10][3] == by_rid[11][3] == codec.INVALID_REQUEST
    assert by_rid[13][4] == [("S", 0, 0, codec.CORRUPT_BATCH)]
    assert by_rid[14][4] == [("S", 0, 10, codec.OK)] and by_rid[15][4] == [("S", 0, 14, codec.OK)]
    assert base_end == 15
    assert [body for _, body in base_records] == [
        b"a-0", b"a-1", b"b-0", b"b-1", b"b-2", b"c-0", b"d-0", b"e-0", b"e-1", b"f-0",
        b"h-0", b"h-1", b"h-2", b"h-3", b"i-0"]
    assert [o for o, _ in base_records] == list(range(15))

    assert await trial(node, one_read) == (base_replies, base_records, base_end)

    def one_byte_at_a_time(c, frames):
        c.send(b"".join(frames), one_byte=True)

    assert await trial(node, one_byte_at_a_time) == (base_replies, base_records, base_end)
    n = len(b"".join(pipelined(1)))
    for cut in range(1, n):
        def two_reads(c, frames, cut=cut):
            buf = b"".join(frames)
            c.send(buf[:cut])
            c.send(buf[cut:])

        assert await trial(node, two_reads) == (base_replies, base_records, base_end), "cut at byte %d" % cut


@pytest_twisted.ensureDeferred
async def test_a_run_is_one_store_operation_acknowledged_together(node, store):
    c = Conn(node)
    (sid,) = await create(c)
    hold(store)
    c.send(b"".join(append_wire(k + 1, [(sid, small(b"r%d" % k, 2))]) for k in range(16)))
    assert store.core.queued() == 1  # one operation for the whole read
    assert c.poll() == []  # nothing acknowledged before it is durable
    assert complete(store, None) == 1
    replies = c.poll()
    assert [f.stream_id for f in replies] == list(range(1, 17))
    assert [codec.decode_header(f).append_responses[0].base_offset for f in replies] == list(range(0, 32, 2))
    assert all(f.flags == codec.RESPONSE_LAST for f in replies)
    # byte for byte what the one-APPEND ack renders
    for f in replies:
        r = codec.decode_header(f).append_responses[0]
        assert codec.encode(f) == codec.append_ack_frame(f.stream_id, 0, sid, 0, r.base_offset, r.stream_append_time_ms)
    hold(store, False)


@pytest_twisted.ensureDeferred
async def test_a_run_stops_reading_at_the_in_flight_budget(node, store):
    """As with one begin() per APPEND: the frame that takes the connection past its budget is
    taken, the ones after it wait in the buffer until replies give bytes back."""
    b = small(b"w" * 400)
    c = Conn(node, budget=3 * len(b) + 10)
    (sid,) = await create(c)
    hold(store)
    c.send(b"".join(append_wire(k + 1, [(sid, b)]) for k in range(8)))
    assert c.tr.producerState == "paused"
    assert store.log.assigned_end(sid) == 4  # 3 fit; the fourth crosses the budget and is taken
    complete(store, None)
    assert store.log.assigned_end(sid) == 8  # reading resumed: the rest (another run, past it again)
    complete(store, None)
    hold(store, False)
    replies = c.poll()
    assert [codec.decode_header(f).append_responses[0].base_offset for f in replies] == list(range(8))
    assert codec.decode_header(replies[0]).throttle_time_ms > 0  # as begin() per APPEND reports it
    assert c.tr.producerState == "producing"


@pytest_twisted.ensureDeferred
async def test_a_run_wakes_a_parked_fetch(node):
    c = Conn(node)
    (sid,) = await create(c)
    header = codec.encode_table("FetchRequest", T.FetchRequest(5000, 1, [T.FetchInfo(sid, 0, 0, 1 << 20)]))
    c.send(codec.encode_frame(codec.FETCH, 0, 50, header))
    assert c.poll() == []  # parked: nothing to read yet
    c.send(b"".join(append_wire(k + 1, [(sid, small(b"p%d" % k))]) for k in range(3)))
    frames = await c.reply(50)
    (r,) = codec.decode_header(frames[-1]).fetch_responses
    assert r.status.code == codec.OK
    assert [record_batch.read_header(x).base_offset for x in record_batch.split(b"".join(f.payload for f in frames))][0] == 0


def fired(d):
    """What an (inline store's) Deferred fired with: its result, or its failure's exception type."""
    got = []
    d.addCallbacks(got.append, lambda f: got.append(type(f.value)))
    assert got, "the inline store answers at once"
    return got[0]


def test_append_many_checks_each_batch_as_append_does(store):
    """``RecordLog.append_many``: per batch the verdict ``append`` gives it one at a time, offsets
    assigned in order; the refused ones take no offset and are left out of the one operation."""
    log = store.log
    a = fired(log.create_stream()).stream_id
    b = fired(log.create_stream()).stream_id
    replica = 0x0000_0009_0000_0001
    fired(log.create_replica_stream(replica, 9, 1, 0))
    zero = bytearray(small(b"0"))
    zero[9:13] = (0).to_bytes(4, "big")  # record_count 0
    cases = [(a, small(b"a", 2)), (MISSING, small(b"m")), (b, small(b"b", 3)), (a, b"\x22" * 10),
             (replica, small(b"r")), (a, bytes(zero)), (a, small(b"c"))]
    hold(store)
    d, outcome = log.append_many([sid for sid, _ in cases], [x for _, x in cases], [None] * len(cases))
    assert store.core.queued() == 1
    assert [x for x in outcome if type(x) is int] == [0, 0, 2]  # a: 0 (2 records), b: 0, a: 2
    assert log.durable_end(a) == 0
    complete(store, None)
    assert fired(d) is None
    assert log.durable_end(a) == 3 and log.durable_end(b) == 3
    # one at a time, on fresh streams, append gives the same verdicts
    hold(store, False)
    rename = {a: fired(log.create_stream()).stream_id, b: fired(log.create_stream()).stream_id}
    one_by_one = [fired(log.append(rename.get(sid, sid), x)) for sid, x in cases]
    assert one_by_one == [x if type(x) is int else type(x) for x in outcome]
    assert one_by_one[1] is errors.StreamNotFound and one_by_one[4] is errors.ReadOnlyStream
