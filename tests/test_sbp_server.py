"""SBP server protocol units: the real store in a temp dir with the inline writer of
tests/storage_helpers/inline.py, the protocol over a StringTransport, time on a ``task.Clock``:
a reply is there as soon as the request is in, and a long poll's wait is the clock's."""

import msgpack
import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, task
from twisted.internet.testing import StringTransport

from protocols.sbp import codec, server
from protocols.sbp.codec import T
from storage import record_batch
from tests.storage_helpers.inline import close, complete, congest, hold, open_inline


class FakeConfig:
    max_batch_bytes = 16 * 1024 * 1024 - 64 * 1024


class Node:
    """The NodeContext surface the SBP server uses, over a real store."""

    def __init__(self, store, clock=None):
        self.store = store
        self.config = FakeConfig()
        self.node_id = 7
        self.reactor = store.reactor if clock is None else clock
        self.metrics = {}
        self.hooks = []

    def advertised(self, name):
        return "127.0.0.1:7700"

    def on_shutdown(self, fn):
        self.hooks.append(fn)


@pytest.fixture
def clock():
    return task.Clock()


@pytest.fixture
def store(tmp_path, clock):
    s = open_inline(tmp_path / "store", clock, node_id=7)
    yield s
    close(s)


@pytest.fixture
def node(store, clock):
    return Node(store, clock)


class Conn:
    def __init__(self, node, budget=None):
        self.clock = node.reactor
        self.factory = server.SbpServerFactory(node) if budget is None else server.SbpServerFactory(node, inflight_budget=budget)
        self.proto = self.factory.buildProtocol(None)
        self.tr = StringTransport()
        self.proto.makeConnection(self.tr)
        self.frames = codec.FrameBuffer()
        self.got = []
        self.sid = 0

    def send(self, data, one_byte=False):
        if one_byte:
            for i in range(len(data)):
                self.proto.dataReceived(data[i:i + 1])
        else:
            self.proto.dataReceived(data)

    def request(self, opcode, table=None, obj=None, payload=b"", send=True):
        self.sid += 1
        header = codec.encode_table(table, obj) if table else b""
        wire = codec.encode_frame(opcode, 0, self.sid, header, payload)
        if send:
            self.send(wire)
        return self.sid, wire

    def poll(self):
        self.frames.feed(self.tr.value())
        self.tr.clear()
        while (f := self.frames.next()) is not None:
            self.got.append(f)
        return self.got

    async def reply(self, sid, timeout=5.0):
        """All frames of the response to ``sid`` (until the end flag). The clock moves on to its
        next timer while the reply is incomplete, up to ``timeout`` seconds of it."""
        deadline = self.clock.seconds() + timeout
        out = []
        while True:
            self.poll()
            for f in list(self.got):
                if f.stream_id == sid:
                    self.got.remove(f)
                    out.append(f)
                    if f.flags & codec.FLAG_END:
                        return out
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= deadline]
            if not due:
                raise AssertionError("no complete reply to %d (have %r)" % (sid, out))
            self.clock.advance(max(0.0, min(due) - self.clock.seconds()))

    async def call(self, opcode, table, obj, payload=b""):
        sid, _ = self.request(opcode, table, obj, payload)
        frames = await self.reply(sid)
        assert len(frames) == 1 and frames[0].flags == codec.RESPONSE_LAST
        return codec.decode_header(frames[0]), frames[0]


def batch(n=3, body=b"x" * 10):
    return record_batch.encode([(1000 + i, [(b"h", b"v")], body + b"%d" % i) for i in range(n)])


async def create(conn, n=1):
    resp, _ = await conn.call(codec.CREATE_STREAMS, "CreateStreamsRequest", T.CreateStreamsRequest(0, [T.Stream(0, 1, 0)] * n))
    assert all(r.status.code == 0 for r in resp.create_responses)
    return [r.stream.stream_id for r in resp.create_responses]


async def append(conn, entries):
    infos = [T.AppendInfo(sid, i, len(b)) for i, (sid, b) in enumerate(entries)]
    resp, _ = await conn.call(codec.APPEND, "AppendRequest", T.AppendRequest(0, infos), b"".join(b for _, b in entries))
    return sorted(resp.append_responses, key=lambda r: r.request_index)


def fetch_req(items, max_wait_ms=0, min_bytes=0):
    return T.FetchRequest(max_wait_ms, min_bytes, [T.FetchInfo(sid, i, off, mb) for i, (sid, off, mb) in enumerate(items)])


# -- framing ---------------------------------------------------------------------------------------


def test_ping_echo_one_byte_at_a_time(node):
    c = Conn(node)
    wire = codec.encode_frame(codec.PING, 0, 42, b"hdr", b"payload")
    c.send(wire * 3, one_byte=True)
    frames = c.poll()
    assert len(frames) == 3
    for f in frames:
        assert (f.opcode, f.flags, f.stream_id, f.header, f.payload) == (codec.PING, 0x03, 42, b"hdr", b"payload")


def test_rejections_keep_or_close_as_the_contract_says(node):
    c = Conn(node)
    good = codec.encode_frame(codec.PING, 0, 1)
    unknown = codec.encode_frame(0x7777, 0, 2)
    bad_magic = bytearray(codec.encode_frame(codec.PING, 0, 3))
    bad_magic[4] = 0
    bad_crc = bytearray(codec.encode_frame(codec.PING, 0, 4, b"", b"abc"))
    bad_crc[-1] ^= 1
    fmt2 = codec.encode_frame(codec.PING, 0, 5, b"h", header_format=2)
    bad_header = codec.encode_frame(codec.APPEND, 0, 6, b"\xff" * 3)
    c.send(unknown + bytes(bad_magic) + bytes(bad_crc) + fmt2 + bad_header + good)
    frames = c.poll()
    assert [(f.stream_id, f.flags) for f in frames] == [(4, 0x07), (5, 0x07), (6, 0x07), (1, 0x03)]
    assert codec.decode_header(frames[0]).status.code == codec.INVALID_REQUEST
    assert codec.decode_header(frames[1]).status.code == codec.UNSUPPORTED_VERSION
    assert codec.decode_header(frames[2]).status.code == codec.INVALID_REQUEST
    assert frames[0].opcode == codec.PING and frames[2].opcode == codec.APPEND
    assert not c.tr.disconnecting
    # frame_length out of bounds: GOAWAY, then close
    c.send(b"\x02\x00\x00\x00" + b"\x17")
    frames = c.poll()
    assert frames[-1].opcode == codec.GOAWAY and frames[-1].flags == 0 and frames[-1].stream_id == 0
    assert c.tr.disconnecting


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(garbage=st.binary(max_size=300))
def test_garbage_never_raises(garbage):
    node = Node(None, task.Clock())
    c = Conn(node)
    c.send(b"\x00\x00\x00\x30\x17" + garbage)
    c.send(garbage)


# -- data path -------------------------------------------------------------------------------------


@pytest_twisted.ensureDeferred
async def test_append_multi_stream_per_entry_results(node):
    c = Conn(node)
    a, b = await create(c, 2)
    corrupt = bytearray(batch(2))
    corrupt[-1] ^= 0x55
    node.config.max_batch_bytes = 4096
    big = batch(1, b"y" * 5000)
    rs = await append(c, [(a, batch(3)), (b, batch(2)), (a, bytes(corrupt)), (a, batch(4)), (99, batch(1)), (b, big)])
    assert [r.request_index for r in rs] == list(range(6))
    assert [r.status.code for r in rs] == [0, 0, codec.CORRUPT_BATCH, 0, codec.STREAM_NOT_FOUND, codec.PAYLOAD_TOO_LARGE]
    assert (rs[0].base_offset, rs[1].base_offset, rs[3].base_offset) == (0, 0, 3)
    assert rs[0].stream_id == a and rs[1].stream_id == b
    # lengths that do not add up: system error
    sid, _ = c.request(codec.APPEND, "AppendRequest", T.AppendRequest(0, [T.AppendInfo(a, 0, 10)]), b"x" * 11)
    (f,) = await c.reply(sid)
    assert f.flags == 0x07 and codec.decode_header(f).status.code == codec.INVALID_REQUEST
    # many frames in one read keep payload order per stream
    wires = []
    sids = []
    for i in range(5):
        s, w = c.request(codec.APPEND, "AppendRequest", T.AppendRequest(0, [T.AppendInfo(a, 0, len(batch(2)))]), batch(2), send=False)
        wires.append(w)
        sids.append(s)
    c.send(b"".join(wires))
    bases = []
    for s in sids:
        (f,) = await c.reply(s)
        bases.append(codec.decode_header(f).append_responses[0].base_offset)
    assert bases == [7, 9, 11, 13, 15]


@pytest_twisted.ensureDeferred
async def test_fetch_whole_batches_and_errors(node):
    c = Conn(node)
    (a,) = await create(c)
    b1, b2, b3 = batch(3), batch(2), batch(4)
    await append(c, [(a, b1), (a, b2), (a, b3)])
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 4, 1), (a, 0, 1 << 20), (a, 10, 100), (a, 9, 100), (12345, 0, 10)]))
    frames = await c.reply(sid)
    results = {}
    for f in frames:
        hdr = codec.decode_header(f)
        pos = 0
        for r in hdr.fetch_responses:
            results[r.request_index] = (r, f.payload[pos:pos + r.batch_length])
            pos += r.batch_length
    assert frames[-1].flags == 0x03
    r0, d0 = results[0]
    assert r0.status.code == 0 and d0 == record_batch.with_base_offset(b2, 3)  # the batch holding 4, whole
    r1, d1 = results[1]
    assert d1 == record_batch.with_base_offset(b1, 0) + record_batch.with_base_offset(b2, 3) + record_batch.with_base_offset(b3, 5)
    assert results[2][0].status.code == codec.OFFSET_OUT_OF_RANGE
    assert results[3][0].status.code == codec.NO_NEW_RECORD and results[3][0].batch_length == 0
    assert results[4][0].status.code == codec.STREAM_NOT_FOUND


@pytest_twisted.ensureDeferred
async def test_fetch_long_poll_streams_ready_results_first(node):
    c = Conn(node)
    a, b = await create(c, 2)
    await append(c, [(a, batch(2))])
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 0, 1000), (b, 0, 1000)], max_wait_ms=5000))
    # the ready result goes out at once with flags 0x01
    frames = [f for f in c.poll() if f.stream_id == sid]
    assert frames
    assert frames[0].flags == codec.FLAG_RESPONSE
    assert [r.request_index for r in codec.decode_header(frames[0]).fetch_responses] == [0]
    c.got.clear()
    t0 = c.clock.seconds()
    await append(c, [(b, batch(1))])
    rest = await c.reply(sid)
    assert c.clock.seconds() - t0 < 2
    assert rest[-1].flags == 0x03
    hdr = codec.decode_header(rest[-1])
    assert hdr.fetch_responses[0].request_index == 1 and hdr.fetch_responses[0].status.code == 0
    assert record_batch.read_header(rest[-1].payload).record_count == 1


@pytest_twisted.ensureDeferred
async def test_fetch_long_poll_timeout_and_min_bytes(node):
    c = Conn(node)
    (a,) = await create(c)
    t0 = c.clock.seconds()
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 0, 1000)], max_wait_ms=200))
    c.clock.advance(0.15)
    assert not [f for f in c.poll() if f.stream_id == sid]
    (f,) = await c.reply(sid)
    assert 0.15 < c.clock.seconds() - t0 < 3
    r = codec.decode_header(f).fetch_responses[0]
    assert r.status.code == codec.NO_NEW_RECORD and r.batch_length == 0 and f.payload == b""
    # min_bytes: a small append does not complete the wait; the timeout returns what exists
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 0, 1 << 20)], max_wait_ms=400, min_bytes=100000))
    await append(c, [(a, batch(1))])
    c.clock.advance(0.1)
    assert not [f for f in c.poll() if f.stream_id == sid]
    (f,) = await c.reply(sid)
    r = codec.decode_header(f).fetch_responses[0]
    assert r.status.code == 0 and r.batch_length == len(f.payload) > 0


@pytest_twisted.ensureDeferred
async def test_shutdown_goaway_and_parked_fetch(node):
    c = Conn(node)
    (a,) = await create(c)
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 0, 1000)], max_wait_ms=30000))
    c.clock.advance(0.02)
    d = defer.ensureDeferred(defer.maybeDeferred(node.hooks[0]))
    frames = c.poll()
    assert frames[0].opcode == codec.GOAWAY and frames[0].flags == 0 and frames[0].stream_id == 0
    (f,) = await c.reply(sid)
    assert codec.decode_header(f).fetch_responses[0].status.code == codec.NO_NEW_RECORD
    assert c.tr.disconnecting
    c.proto.connectionLost(None)
    await d


@pytest_twisted.ensureDeferred
async def test_backpressure_pauses_reading(node):
    c = Conn(node, budget=1000)
    (a,) = await create(c)
    big = batch(1, b"z" * 5000)
    hold(node.store)  # the APPEND stays in flight until the writer commits it
    sid, _ = c.request(codec.APPEND, "AppendRequest", T.AppendRequest(0, [T.AppendInfo(a, 0, len(big))]), big)
    assert c.tr.producerState == "paused"
    hold(node.store, False)
    (f,) = await c.reply(sid)
    assert codec.decode_header(f).throttle_time_ms > 0
    assert c.tr.producerState == "producing"
    # a full send buffer (slow reader) also stops reading
    c.proto.gate.pauseProducing()
    assert c.tr.producerState == "paused"
    c.proto.gate.resumeProducing()
    assert c.tr.producerState == "producing"


@pytest_twisted.ensureDeferred
async def test_append_stops_reading_while_the_store_is_congested(node, store):
    """The SBP connection honours the store's congestion like the kv and Toasty servers: with
    APPENDs of its own in flight it stops reading until the write queue drains."""
    c = Conn(node)
    (a,) = await create(c)
    other = (await store.log.create_stream()).stream_id
    hold(store)  # the queue only shrinks when the test lets the writer commit
    queued = [congest(store), store.log.append(other, batch(1, b"f" * (1 << 20)))]
    assert store.congested
    b = batch(1)
    sid, _ = c.request(codec.APPEND, "AppendRequest", T.AppendRequest(0, [T.AppendInfo(a, 0, len(b))]), b)
    assert c.tr.producerState == "paused" and not c.proto.gate.reading
    assert c.proto.gate.reasons == {"store congestion"}
    complete(store, None)
    (f,) = await c.reply(sid)
    assert codec.decode_header(f).append_responses[0].status.code == codec.OK
    await defer.gatherResults(queued)
    await store.when_drained()
    assert c.tr.producerState == "producing" and c.proto.gate.reading


@pytest_twisted.ensureDeferred
async def test_placement_driver_operations(node):
    c = Conn(node)
    (a,) = await create(c)
    await append(c, [(a, batch(3))])
    resp, _ = await c.call(codec.LIST_RANGES, "ListRangesRequest", T.ListRangesRequest(0, [T.RangeOwner(a, None)]))
    (lr,) = resp.list_responses
    assert lr.stream_id == a and [(r.range_index, r.start_offset, r.next_offset, r.end_offset) for r in lr.ranges] == [(0, 0, 3, -1)]
    assert lr.ranges[0].servers[0].server.server_id == 7
    resp, _ = await c.call(codec.SEAL_RANGES, "SealRangesRequest", T.SealRangesRequest(0, [T.RangeId(a, 0)]))
    r = resp.seal_responses[0]
    assert r.status.code == 0 and (r.range.range_index, r.range.start_offset, r.range.end_offset) == (1, 3, -1)
    resp, _ = await c.call(codec.SEAL_RANGES, "SealRangesRequest", T.SealRangesRequest(0, [T.RangeId(a, 0), T.RangeId(a, 9)]))
    assert [x.status.code for x in resp.seal_responses] == [codec.RANGE_ALREADY_SEALED, codec.RANGE_NOT_FOUND]
    resp, _ = await c.call(codec.CREATE_RANGE, "CreateRangeRequest", T.CreateRangeRequest(0, T.Range(a, 0, 0, 0, -1, [])))
    assert resp.status.code == codec.INVALID_REQUEST  # last range is open
    resp, _ = await c.call(codec.DESCRIBE_RANGES, "DescribeRangesRequest", T.DescribeRangesRequest(0, [T.RangeId(a, 0), T.RangeId(a, 5)]))
    assert resp.describe_responses[0].range.end_offset == 3 and resp.describe_responses[1].status.code == codec.RANGE_NOT_FOUND
    rs = await append(c, [(a, batch(2))])
    assert rs[0].base_offset == 3
    resp, _ = await c.call(codec.TRIM_STREAMS, "TrimStreamsRequest", T.TrimStreamsRequest(0, [T.TrimmedStream(a, 4)]))
    r = resp.streams[0]
    assert r.status.code == 0 and r.range.start_offset == 4 and r.trimmed_stream.stream_id == a
    resp, _ = await c.call(codec.DESCRIBE_STREAMS, "DescribeStreamsRequest", T.DescribeStreamsRequest(0, [a, 5]))
    assert resp.describe_responses[0].stream.replica_nums == 1 and resp.describe_responses[1].status.code == codec.STREAM_NOT_FOUND
    resp, _ = await c.call(codec.UPDATE_STREAMS, "UpdateStreamsRequest", T.UpdateStreamsRequest(0, [T.Stream(a, 0, 60000)]))
    assert resp.update_responses[0].updated_stream.retention_period_ms == 60000
    resp, _ = await c.call(codec.ALLOCATE_ID, "IdAllocationRequest", T.IdAllocationRequest(0, "h"))
    resp2, _ = await c.call(codec.ALLOCATE_ID, "IdAllocationRequest", T.IdAllocationRequest(0, "h"))
    assert 1 <= resp.id < resp2.id
    hb = T.HeartbeatRequest("cli", codec.CLIENT_ROLE_CLIENT, T.RangeServer(3, "h:1"))
    resp, _ = await c.call(codec.HEARTBEAT, "HeartbeatRequest", hb)
    assert (resp.client_id, resp.client_role, resp.range_server.server_id, resp.status.code) == ("cli", 2, 3, 0)
    rm = T.ReportMetricsRequest(T.RangeServer(3, "h:1"), *([0] * 5), 11, *([0] * 11))
    resp, _ = await c.call(codec.REPORT_METRICS, "ReportMetricsRequest", rm)
    assert resp.range_server.server_id == 7 and node.metrics["sbp_reported_metrics"]["3"]["uring_task_rate"] == 11
    resp, _ = await c.call(codec.DESCRIBE_PD_CLUSTER, "DescribePdClusterRequest", T.DescribePdClusterRequest(None, 0))
    assert resp.cluster.nodes[0].is_leader and resp.cluster.nodes[0].advertise_addr == "127.0.0.1:7700"
    resp, _ = await c.call(codec.LIST_RANGES, "ListRangesRequest", T.ListRangesRequest(0, [T.RangeOwner(-1, T.RangeServer(7, None))]))
    assert [x.stream_id for x in resp.list_responses] == [a]
    rr = T.Range(a, 1, 0, 0, -1, [T.RangeReplica(T.RangeServer(9, "peer:1"), True)])
    resp, _ = await c.call(codec.SYNC_RANGES, "SyncRangesRequest", T.SyncRangesRequest(0, [T.StreamRanges(a, [rr])]))
    assert resp.sync_responses[0].ranges[-1].servers[0].server.server_id == 9
    resp, _ = await c.call(codec.DELETE_STREAMS, "DeleteStreamsRequest", T.DeleteStreamsRequest(0, [T.Stream(a, 0, 0)]))
    assert resp.responses[0].status.code == 0
    rs = await append(c, [(a, batch(1))])
    assert rs[0].status.code == codec.STREAM_NOT_FOUND


@pytest_twisted.ensureDeferred
async def test_replica_stream_refuses_mutations(node, store):
    sid = (99 << 32) | 1
    await store.log.create_replica_stream(sid, "10.0.0.1:7704", 1, 0)
    c = Conn(node)
    rs = await append(c, [(sid, batch(1))])
    assert rs[0].status.code == codec.PD_NOT_LEADER and rs[0].status.message == "10.0.0.1:7704"
    resp, _ = await c.call(codec.TRIM_STREAMS, "TrimStreamsRequest", T.TrimStreamsRequest(0, [T.TrimmedStream(sid, 0)]))
    assert resp.streams[0].status.code == codec.PD_NOT_LEADER
    resp, _ = await c.call(codec.SEAL_RANGES, "SealRangesRequest", T.SealRangesRequest(0, [T.RangeId(sid, 0)]))
    assert resp.seal_responses[0].status.message == "10.0.0.1:7704"


# -- the fast batch validator agrees with record_batch.validate ---------------------------------------


records = st.lists(st.tuples(st.integers(0, 2**40), st.lists(st.tuples(st.binary(max_size=5), st.binary(max_size=5)), max_size=2),
                             st.binary(max_size=20)), min_size=1, max_size=5)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(recs=records, flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
def test_validate_batch_agrees(recs, flips):
    import zlib

    b = bytearray(record_batch.encode(recs))
    for pos, val in flips:
        b[pos % len(b)] = val
    # also fix the CRC sometimes so the block checks are reached
    if flips and flips[0][1] & 1 and len(b) >= 29:
        b[21:25] = zlib.crc32(bytes(b[29:])).to_bytes(4, "big")
    b = bytes(b)
    try:
        expect = record_batch.validate(b).record_count
    except record_batch.InvalidBatch:
        expect = None
    from storage import block_check

    compiled, block_check.records_block_ok = block_check.records_block_ok, None
    try:
        got = server.validate_batch(b)
    except record_batch.InvalidBatch:
        got = None
    finally:
        block_check.records_block_ok = compiled
    assert got == expect
    # and with the compiled records-block check in front (its no goes to msgpack)
    if compiled_block_check() is not None:
        try:
            got = server.validate_batch(b)
        except record_batch.InvalidBatch:
            got = None
        assert got == expect
        assert block_check.records_block_ok is not None


def compiled_block_check():
    from storage import block_check

    if block_check.records_block_ok is None:
        block_check.load()
    return block_check.records_block_ok


def test_compiled_block_check_takes_the_contract_shape():
    check = compiled_block_check()
    if check is None:
        pytest.skip("numba unavailable")
    recs = [(0, [(b"k", b"v"), (b"n", b"")], b"body"), (1, [], b""), (2, [], b"x" * 70000)]
    b = record_batch.encode(recs)
    assert check(b, 29, 3) and server.validate_batch(b) == 3
    assert not check(b, 29, 2)  # record_count disagrees
    assert not check(b + b"\x00", 29, 3)  # a byte after the last record
    for cut in (30, len(b) // 2, len(b) - 1):
        assert not check(b[:cut], 29, 3)  # never reads past the end
    swapped = msgpack.packb([[1, 0, [], b""], [0, 0, [], b""]])
    assert not check(b"\0" * 29 + swapped, 29, 2)  # offset_delta out of order


@pytest_twisted.ensureDeferred
async def test_many_entry_replies_are_split_into_frames(node):
    c = Conn(node)
    (a,) = await create(c)
    n = server.RESULTS_PER_FRAME * 2 + 10
    infos = [T.AppendInfo(a, i, 0) for i in range(n - 1)] + [T.AppendInfo(a, n - 1, len(batch(1)))]
    sid, _ = c.request(codec.APPEND, "AppendRequest", T.AppendRequest(0, infos), batch(1))
    frames = await c.reply(sid)
    assert [f.flags for f in frames] == [1, 1, 3]
    results = [r for f in frames for r in codec.decode_header(f).append_responses]
    assert sorted(r.request_index for r in results) == list(range(n))
    assert sum(r.status.code == codec.CORRUPT_BATCH for r in results) == n - 1
    from protocols.sbp.client import ReplyAssembler, call_append_many

    asm = ReplyAssembler(codec.APPEND)
    assert [asm.add(f) for f in frames] == [False, False, True]
    assert len(asm.header.append_responses) == n


@pytest_twisted.ensureDeferred
async def test_append_with_bad_payload_crc_is_refused_whole(node, store):
    c = Conn(node)
    (a,) = await create(c)
    b1, b2 = batch(2), batch(3)
    hdr = codec.encode_table("AppendRequest", T.AppendRequest(0, [T.AppendInfo(a, 0, len(b1)), T.AppendInfo(a, 1, len(b2))]))
    for flip in (5, 40, len(b1) + 3):  # in a batch header, in a block, in the second batch
        wire = bytearray(codec.encode_frame(codec.APPEND, 0, 99, hdr, b1 + b2))
        wire[-4:] = (int.from_bytes(wire[-4:], "big") ^ (1 << flip % 32)).to_bytes(4, "big")
        c.send(bytes(wire))
        (f,) = await c.reply(99)
        assert f.flags == 0x07 and codec.decode_header(f).status.code == codec.INVALID_REQUEST
    assert store.log.stream(a).next_offset == 0
    rs = await append(c, [(a, b1), (a, b2)])
    assert [r.base_offset for r in rs] == [0, 2]
    # a short entry (under 29 bytes) still counts toward the frame CRC
    rs = await append(c, [(a, b"\x22\x00"), (a, b1)])
    assert [r.status.code for r in rs] == [codec.CORRUPT_BATCH, 0]


@pytest_twisted.ensureDeferred
async def test_fetch_replies_never_exceed_16_mib(node):
    c = Conn(node)
    a, b = await create(c, 2)
    big = record_batch.encode([(1, [], b"m" * (1 << 20))])  # one ~1 MiB record per batch
    for _ in range(9):
        await append(c, [(a, big), (b, big)])
    # two results of ~9 MiB each cannot share a frame: 0x01 then 0x03, batches whole
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 0, 1 << 30), (b, 0, 1 << 30)]))
    frames = await c.reply(sid, timeout=20)
    assert [f.flags for f in frames] == [0x01, 0x03]
    for f in frames:
        assert len(codec.encode(f)) - 4 <= codec.MAX_FRAME_LENGTH
        (r,) = codec.decode_header(f).fetch_responses
        assert r.status.code == 0 and r.batch_length == len(f.payload) == 9 * len(big)
        assert [record_batch.read_header(x).base_offset for x in record_batch.split(f.payload)] == list(range(9))
    # one stream holding more than a frame: the result stops at a batch boundary under 16 MiB
    for _ in range(9):
        await append(c, [(a, big)])
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 0, 1 << 30)]))
    (f,) = await c.reply(sid, timeout=20)
    (r,) = codec.decode_header(f).fetch_responses
    assert f.flags == 0x03 and r.batch_length % len(big) == 0 and 14 * len(big) <= r.batch_length <= server.FRAME_PAYLOAD_CAP


async def fetch_one(c, sid, offset, max_bytes):
    rid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(sid, offset, max_bytes)]))
    (f,) = await c.reply(rid)
    (r,) = codec.decode_header(f).fetch_responses
    return r.status.code, f.payload


@pytest_twisted.ensureDeferred
async def test_read_ahead_serves_sequential_readers_exactly(node, store):
    c = Conn(node)
    (a,) = await create(c)
    bs = [batch(4, b"b%02d" % i + b"." * 300) for i in range(12)]
    await append(c, [(a, b) for b in bs])
    one = len(bs[0])
    # sequential reader, 3 batches per FETCH: each reply equals a fresh store read
    off = 0
    while off < 48:
        code, data = await fetch_one(c, a, off, 3 * one)
        assert code == 0 and data == b"".join(await store.log.read(a, off, 3 * one))
        off = records_end(data)
    assert off == 48
    assert node.metrics["sbp"]["read_ahead_hits"] == 3  # every FETCH after the first
    # a read-ahead that stopped at the tail is not served once the stream has grown
    code, data = await fetch_one(c, a, 40, 1 << 20)  # read-ahead none (reached the tail)
    await append(c, [(a, batch(4))])
    code, data = await fetch_one(c, a, 36, 2 * one)  # reads ahead from 44: [44, 48, 52) exists
    await append(c, [(a, batch(4))])
    code, data = await fetch_one(c, a, 44, 2 * one)
    # the read-ahead from 44 saw [44, 52) under max_bytes; the stream grew to 56 since
    assert records_end(data) == 56 and data == b"".join(await store.log.read(a, 44, 2 * one))
    await fetch_one(c, a, 44, 10 * one)  # read-ahead from 56 would be at the tail: none
    code, data = await fetch_one(c, a, 0, one)  # reads ahead from 4 ...
    await store.log.trim(a, 9)
    assert (await fetch_one(c, a, 4, one))[0] == codec.OFFSET_OUT_OF_RANGE  # ... but 4 is trimmed now
    code, data = await fetch_one(c, a, 9, one)
    assert code == 0 and record_batch.read_header(data).base_offset == 8
    # a different batch_max_bytes is a fresh read
    code, data = await fetch_one(c, a, 12, one)
    code, data2 = await fetch_one(c, a, 16, 2 * one)
    assert data2 == b"".join(await store.log.read(a, 16, 2 * one))


def records_end(data):
    last = list(record_batch.split(data))[-1]
    h = record_batch.read_header(last)
    return h.base_offset + h.record_count


@pytest_twisted.ensureDeferred
async def test_client_goaway_finishes_in_flight_then_closes(node):
    c = Conn(node)
    (a,) = await create(c)
    sid, _ = c.request(codec.FETCH, "FetchRequest", fetch_req([(a, 0, 1000)], max_wait_ms=5000))
    c.clock.advance(0.02)
    c.send(codec.encode_frame(codec.GOAWAY, 0, 0) + codec.encode_frame(codec.PING, 0, 5))
    c.clock.advance(0.05)
    assert not [f for f in c.poll() if f.stream_id in (5, 0)]  # no reply to GOAWAY, no new requests
    assert not c.tr.disconnecting
    await node.store.log.append(a, batch(1))
    (f,) = await c.reply(sid)
    assert codec.decode_header(f).fetch_responses[0].status.code == 0
    c.clock.advance(0.01)
    assert c.tr.disconnecting


def test_import_compiled_reports_what_it_cannot_import():
    from storage.jit import import_compiled

    mod, why = import_compiled("storage.no_such_compiled_module")
    assert mod is None and "not importable" in why
    mod, why = import_compiled("storage.msgpack_scan")
    assert why is None and mod.records_block_ok is not None
