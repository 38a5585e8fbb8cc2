"""Swarm stream! server and syncer units: StringTransport + task.Clock over the real store in
tmp_path with the inline writer of tests/storage_helpers/inline.py (every write and read is done
when its call returns, so the units stay synchronous)."""

import hashlib

import pytest
from twisted.internet import task
from twisted.internet.testing import StringTransport

from protocols.swarm import codec, server, syncer
from protocols.swarm.codec import (
    ID,
    BatchDone,
    ChunkDelivery,
    GetRange,
    OfferedHashes,
    StreamDescriptor,
    StreamInfoReq,
    StreamInfoRes,
    StreamState,
    WantedHashes,
)
from storage import errors, record_batch
from tests.storage_helpers.inline import close, open_inline

C = codec.CHUNKS_ID


def sha(b):
    return hashlib.sha256(b).digest()


class Wire:
    """One protocol instance on a StringTransport; decodes what it wrote."""

    def __init__(self, proto):
        self.proto = proto
        self.t = StringTransport()
        self.reader = codec.FrameReader()
        proto.makeConnection(self.t)

    def feed(self, *msgs):
        self.proto.dataReceived(b"".join(codec.encode(m) for m in msgs))

    def out(self):
        data = self.t.value()
        self.t.clear()
        return [codec.decode_body(b) for b in self.reader.feed(data)]


class Config:
    data_dir = None  # no swarm-peers.json snapshot


class Node:
    """The NodeContext surface swarm uses, over a real store on ``clock`` (its periodic retention
    and sweep off: a test's clock jumps must not reclaim the chunks it put)."""

    def __init__(self, path, clock, node_id=1):
        self.reactor = clock
        self.node_id = node_id
        self.store = open_inline(path, clock, node_id=node_id, retention_check_s=0)
        self.metrics = {}
        self.config = Config()
        self.hooks = []

    def on_shutdown(self, fn):
        self.hooks.append(fn)


@pytest.fixture
def clock():
    return task.Clock()


@pytest.fixture
def nodes(tmp_path, clock):
    """``nodes(node_id)``: a node with its own store; all closed at the end."""
    made = []

    def make(node_id=1):
        made.append(Node(tmp_path / ("store%d-%d" % (node_id, len(made))), clock, node_id))
        return made[-1]

    yield make
    for n in made:
        close(n.store)


@pytest.fixture
def node(nodes):
    return nodes(1)


def chunk_data(node, addr):
    """The bytes the store holds for ``addr``."""
    return bytes(node.store.chunks.get(addr).result)


def stored_batches(node, sid):
    """The stream's batches as the store holds them (base offsets written in)."""
    return [bytes(b) for b in node.store.log.read(sid, 0, 1 << 30).result]


def chunk_addrs(node):
    """Every chunk address, in arrival order."""
    return [a for _, a in node.store.chunks.by_seq(1, node.store.chunks.last_seq(), 1 << 30)]


def pinned(node, addr):
    return node.store.chunks.info(addr)[2]


def swarm_intervals(node):
    """The syncer's persisted intervals: {key: value} of metadata table ``swarm_iv``."""
    return dict(node.store.meta.read(lambda t: t.scan("swarm_iv")))


@pytest.fixture
def srv(node, clock):
    factory = server.build_factory(node)
    factory.clock = clock
    return Wire(factory.buildProtocol(None))


def put_chunks(node, n, size=64, tag=b"c"):
    out = []
    for i in range(n):
        data = (tag + b"%d-" % i) * (size // 4)
        node.store.chunks.put(data)
        out.append(sha(data))
    return out


def make_batch(i, n=1):
    return record_batch.encode([(1000 + i, [(b"h", b"v")], b"body-%d-%d" % (i, j)) for j in range(n)])


# ---------------------------------------------------------------------------------------------
# server


def test_stream_info(node, srv):
    put_chunks(node, 3)
    sid = node.store.log.create_stream().result.stream_id
    node.store.log.append(sid, make_batch(0, 3))
    node.store.log.append(sid, make_batch(1, 2))
    srv.feed(StreamInfoReq([C, codec.ALL_LOGS_ID, ID("LOG", "77"), ID("NOPE", ""), ID("LOG", "x")]))
    [res] = srv.out()
    # LOG index = base offset + 1: batches at 0 and 3 -> cursor 4; unknown IDs are left out
    assert res == StreamInfoRes([StreamDescriptor(C, 3, False), StreamDescriptor(ID("LOG", str(sid)), 4, False)])


def test_bounded_roundtrip(node, srv):
    addrs = put_chunks(node, 5)
    srv.feed(GetRange(7, C, 2, 4, 100, True))
    [offer] = srv.out()
    assert offer == OfferedHashes(7, 4, b"".join(addrs[1:4]))
    srv.feed(WantedHashes(7, codec.bitvector_encode([True, False, True])))
    msgs = srv.out()
    assert msgs[-1] == BatchDone(7, 4)
    delivered = [c for m in msgs[:-1] for c in m.chunks]
    assert delivered == [(addrs[1], chunk_data(node, addrs[1])), (addrs[3], chunk_data(node, addrs[3]))]
    assert msgs[0].last_index == 4


def test_first_group_read_with_the_offer_and_partial_wants(node, srv):
    """The server reads the first fetch group while its offer travels; whatever is wanted (inside
    that group and past it) is delivered in index order, exactly once, with the frame split per
    group."""
    addrs = put_chunks(node, 300, size=8)
    reads = []
    get_many = node.store.chunks.get_many
    node.store.chunks.get_many = lambda a: reads.append(len(a)) or get_many(a)
    srv.feed(GetRange(1, C, 1, 300, 1024, True))
    [offer] = srv.out()
    assert reads == [server.FETCH_GROUP]  # read before any WantedHashes
    want = [i % 3 == 0 or i > 250 for i in range(300)]
    srv.feed(WantedHashes(1, codec.bitvector_encode(want)))
    msgs = srv.out()
    assert msgs[-1] == BatchDone(1, 300)
    delivered = [a for m in msgs[:-1] for a, _ in m.chunks]
    assert delivered == [a for a, w in zip(addrs, want) if w]
    assert reads[0] == server.FETCH_GROUP and sum(reads[1:]) == sum(want[server.FETCH_GROUP:])
    assert max(m.last_index for m in msgs[:-1]) == 300

    # an offer answered with an empty vector drops its read; one wanting only later items skips it
    srv.feed(GetRange(2, C, 1, 300, 1024, True))
    srv.out()
    srv.feed(WantedHashes(2, b""))
    assert srv.out() == [BatchDone(2, 300)]
    srv.feed(GetRange(3, C, 1, 300, 1024, True))
    srv.out()
    srv.feed(WantedHashes(3, codec.bitvector_encode([i == 299 for i in range(300)])))
    msgs = srv.out()
    assert [c for m in msgs[:-1] for c in m.chunks] == [(addrs[299], chunk_data(node, addrs[299]))]


def test_one_offer_read_ahead_per_connection(node, srv):
    """Offers open on several streams hold at most one read-ahead group between them."""
    addrs = put_chunks(node, 3)
    sid = node.store.log.create_stream().result.stream_id
    for i in range(3):
        node.store.log.append(sid, make_batch(i))
    srv.feed(GetRange(1, C, 1, 3, 10, True), GetRange(2, codec.log_id(sid), 1, 3, 10, True))
    offers = srv.out()
    assert [type(m) for m in offers] == [OfferedHashes, OfferedHashes]
    proto = srv.proto
    assert [b.prefetch is not None for b in (proto.offers[1], proto.offers[2])] == [True, False]
    srv.feed(WantedHashes(2, codec.bitvector_encode([True] * 3)), WantedHashes(1, codec.bitvector_encode([True] * 3)))
    msgs = srv.out()
    assert BatchDone(1, 3) in msgs and BatchDone(2, 3) in msgs
    assert [a for m in msgs if isinstance(m, ChunkDelivery) and m.ruid == 1 for a, _ in m.chunks] == addrs
    assert len([c for m in msgs if isinstance(m, ChunkDelivery) and m.ruid == 2 for c in m.chunks]) == 3


def test_unreadable_chunk_skipped(node, srv):
    addrs = put_chunks(node, 3)
    get_many = node.store.chunks.get_many

    def corrupt(a):
        return get_many(a).addCallback(lambda got: [ValueError("failed its CRC") if x == addrs[1] else d
                                                    for x, d in zip(a, got)])

    node.store.chunks.get_many = corrupt
    srv.feed(GetRange(1, C, 1, 3, 10, False))
    msgs = srv.out()
    assert msgs[-1] == BatchDone(1, 3)
    assert [a for m in msgs[:-1] for a, _ in m.chunks] == [addrs[0], addrs[2]]


def test_empty_want_answered_at_once_and_no_stuck_stream(node, srv):
    put_chunks(node, 3)
    srv.feed(GetRange(1, C, 1, 3, 10, True))
    srv.out()
    srv.feed(WantedHashes(1, b""))
    assert srv.out() == [BatchDone(1, 3)]
    # the swarm bug: an empty batch left the stream's key set; ours accepts the next request
    srv.feed(GetRange(2, C, 10, 20, 10, True))
    assert srv.out() == [BatchDone(2, 20)]  # CONTRACT §6: bounded and empty -> last = to at once
    srv.feed(GetRange(3, C, 1, 2, 10, True))
    assert isinstance(srv.out()[0], OfferedHashes)


def test_batch_size_clamped_and_last_is_top_index(node, srv):
    addrs = put_chunks(node, 1030, size=8)
    srv.feed(GetRange(1, C, 1, None, 0, False))  # 0 -> 1
    msgs = srv.out()
    assert msgs == [ChunkDelivery(1, 1, [(addrs[0], chunk_data(node, addrs[0]))]), BatchDone(1, 1)]
    srv.feed(GetRange(2, C, 1, None, 5000, True))  # 5000 -> 1024
    [offer] = srv.out()
    assert len(offer.hashes) == 32 * 1024 and offer.last_index == 1024
    srv.feed(WantedHashes(2, b""))
    assert srv.out() == [BatchDone(2, 1024)]
    # bounded, batch full: last = the last item's index, not `to`
    srv.feed(GetRange(3, C, 1, 1030, 10, True))
    assert srv.out()[0].last_index == 10


def test_no_roundtrip_in_index_order(node, srv):
    addrs = put_chunks(node, 40)
    srv.feed(GetRange(5, C, 3, 30, 1024, False))
    msgs = srv.out()
    assert msgs[-1] == BatchDone(5, 30)
    got = [a for m in msgs[:-1] for a, _ in m.chunks]
    assert got == addrs[2:30]


def test_unbounded_waits_at_head(node, srv, clock):
    put_chunks(node, 2)
    srv.feed(GetRange(1, C, 3, None, 10, True))
    assert srv.out() == []  # parked, no timeout
    addrs = put_chunks(node, 2, tag=b"new")
    clock.advance(0)
    [offer] = srv.out()
    assert offer == OfferedHashes(1, 4, b"".join(addrs))


def test_stream_state_codes(node, srv):
    put_chunks(node, 2)
    srv.feed(GetRange(1, C, 0, 5, 10, True))
    srv.feed(GetRange(2, C, 6, 5, 10, True))
    srv.feed(GetRange(3, ID("LOG", "12345"), 1, None, 10, True))
    srv.feed(GetRange(4, ID("FOO", ""), 1, None, 10, True))
    assert [m.code_ for m in srv.out()] == [3, 3, 2, 2]
    srv.feed(GetRange(5, C, 1, 2, 10, True))
    srv.feed(GetRange(6, C, 1, 2, 10, True))  # same stream, batch open
    msgs = srv.out()
    assert isinstance(msgs[0], OfferedHashes)
    assert msgs[1] == StreamState(C, 4, "batch in progress")


def test_offer_expires(node, srv, clock):
    put_chunks(node, 2)
    srv.feed(GetRange(1, C, 1, 2, 10, True))
    srv.out()
    clock.advance(server.OFFER_TIMEOUT + 1)
    srv.feed(WantedHashes(1, b"\x03"))
    assert srv.out() == [BatchDone(1, 0)]  # unknown/expired offer: answered, nothing covered
    srv.feed(GetRange(2, C, 1, 2, 10, True))
    assert isinstance(srv.out()[0], OfferedHashes)


def test_log_provider(node, srv, clock):
    sid = node.store.log.create_stream().result.stream_id
    for i in range(4):
        node.store.log.append(sid, make_batch(i, 2))  # bases 0, 2, 4, 6 -> indexes 1, 3, 5, 7
    stored = stored_batches(node, sid)
    lid = ID("LOG", str(sid))
    srv.feed(GetRange(1, lid, 2, None, 2, True))  # from index 2: batches at 2 and 4
    [offer] = srv.out()
    assert offer == OfferedHashes(1, 5, sha(stored[1]) + sha(stored[2]))
    srv.feed(WantedHashes(1, b"\x02"))
    assert srv.out() == [ChunkDelivery(1, 5, [(sha(stored[2]), stored[2])]), BatchDone(1, 5)]
    srv.feed(GetRange(2, lid, 8, None, 10, False))
    assert srv.out() == []
    node.store.log.append(sid, make_batch(9))
    clock.advance(0)
    [d, done] = srv.out()
    assert d.chunks[0][1][1:9] == (8).to_bytes(8, "big") and done == BatchDone(2, 9)


def test_bad_frames_close(node, srv):
    srv.proto.dataReceived(b"\x00\x00\x00\x02\xc1\xc1")
    assert srv.t.disconnecting
    w = Wire(srv.proto.factory.buildProtocol(None))
    w.proto.dataReceived((16 * 1024 * 1024 + 1).to_bytes(4, "big"))
    assert w.t.disconnecting or getattr(w.t, "disconnected", False)


def test_shutdown_answers_parked(node, srv):
    srv.feed(GetRange(1, C, 1, None, 10, True))
    assert srv.out() == []
    for hook in node.hooks:
        hook()
    assert srv.out() == [StreamState(C, 1, "stream became bounded")]


# ---------------------------------------------------------------------------------------------
# syncer (client)


def client(node, clock, **kw):
    svc = syncer.PeerSyncService(node, "tcp:host=10.0.0.9:port=7704", clock=clock, endpoint=object(), **kw)
    return svc, Wire(syncer.SyncFactory(svc).buildProtocol(None))


def chunk(i):
    data = b"chunk-%d" % i * 10
    return sha(data), data


def test_client_pulls_only_wanted_and_persists(node, clock):
    svc, w = client(node, clock)
    assert w.out() == [StreamInfoReq([C, codec.ALL_LOGS_ID])]
    held = chunk(1)
    node.store.chunks.put(held[1])
    w.feed(StreamInfoRes([StreamDescriptor(C, 3, False)]))
    [req] = w.out()
    assert (req.stream, req.from_, req.to, req.roundtrip) == (C, 1, 3, True)
    items = [chunk(0), held, chunk(2)]
    w.feed(OfferedHashes(req.ruid, 3, b"".join(a for a, _ in items)))
    assert w.out() == [WantedHashes(req.ruid, b"\x05")]
    w.feed(ChunkDelivery(req.ruid, 3, [items[0], items[2]]), BatchDone(req.ruid, 3))
    [nxt] = w.out()
    assert (nxt.from_, nxt.to) == (4, None)  # caught up: unbounded at the head
    for a, _ in items:
        assert node.store.chunks.has(a)
    assert pinned(node, items[0][0]) and pinned(node, items[2][0])
    key = b"10.0.0.9:7704|CHUNKS|"
    assert swarm_intervals(node)[key] == [[1, 3]]
    assert node.metrics["peers"]["10.0.0.9:7704"]["items"] == 2

    # a new connection (restart) resumes from the persisted intervals
    svc2, w2 = client(node, clock)
    w2.out()
    w2.feed(StreamInfoRes([StreamDescriptor(C, 5, False)]))
    [req2] = w2.out()
    assert (req2.from_, req2.to) == (4, 5)


@pytest.mark.parametrize("bad", ["hash", "unsolicited", "second of a frame"])
def test_client_drops_bad_peer_and_stores_nothing(node, clock, bad):
    svc, w = client(node, clock)
    w.out()
    w.feed(StreamInfoRes([StreamDescriptor(C, 2, False)]))
    [req] = w.out()
    a0, d0 = chunk(0)
    a1, d1 = chunk(1)
    w.feed(OfferedHashes(req.ruid, 2, a0 + a1))
    assert w.out() == [WantedHashes(req.ruid, b"\x03")]
    if bad == "hash":
        w.feed(ChunkDelivery(req.ruid, 2, [(a0, d0 + b"x")]))
    elif bad == "second of a frame":
        w.feed(ChunkDelivery(req.ruid, 2, [(a0, d0), (a1, d1 + b"x")]))  # the frame is checked whole
    else:
        other = chunk(9)
        w.feed(ChunkDelivery(req.ruid, 2, [other]))
    assert w.t.disconnecting or w.proto.dead
    assert node.store.chunks.last_seq() == 0
    assert swarm_intervals(node) == {}


def test_client_drops_silent_peer(node, clock):
    svc, w = client(node, clock, timeout=5.0, info_interval=1.0)
    w.out()
    for _ in range(4):
        clock.advance(1.0)
    assert not w.proto.dead
    clock.advance(2.0)
    assert w.proto.dead  # StreamInfoReq unanswered past the timeout


def test_client_idle_at_head_is_not_silent(node, clock):
    svc, w = client(node, clock, timeout=5.0, info_interval=1.0)
    w.out()
    for _ in range(20):
        w.feed(StreamInfoRes([StreamDescriptor(C, 0, False)]))
        clock.advance(1.0)
    assert not w.proto.dead
    msgs = w.out()
    reqs = [m for m in msgs if isinstance(m, GetRange)]
    assert len(reqs) == 1 and reqs[0].to is None  # one parked unbounded request, never duplicated


def test_client_replicates_log_and_skips_own_streams(node, clock):
    svc, w = client(node, clock)
    w.out()
    foreign = (2 << 32) | 1
    own = (1 << 32) | 5
    w.feed(StreamInfoRes([StreamDescriptor(ID("LOG", str(own)), 3, False), StreamDescriptor(ID("LOG", str(foreign)), 3, False)]))
    [req] = w.out()
    assert req.stream == ID("LOG", str(foreign)) and (req.from_, req.to) == (1, 3)
    b0 = record_batch.with_base_offset(make_batch(0, 2), 0)
    b1 = record_batch.with_base_offset(make_batch(1, 1), 2)
    w.feed(OfferedHashes(req.ruid, 3, sha(b0) + sha(b1)))
    assert w.out() == [WantedHashes(req.ruid, b"\x03")]
    # out of order delivery is reordered before appending
    w.feed(ChunkDelivery(req.ruid, 3, [(sha(b1), b1)]), ChunkDelivery(req.ruid, 1, [(sha(b0), b0)]), BatchDone(req.ruid, 3))
    meta = node.store.log.stream(foreign)
    assert meta.origin == "10.0.0.9:7704" and meta.next_offset == 3
    assert stored_batches(node, foreign) == [b0, b1]
    [nxt] = w.out()
    assert (nxt.from_, nxt.to) == (4, None)


def test_client_drops_peer_sending_non_batch_on_log(node, clock):
    svc, w = client(node, clock)
    w.out()
    sid = (2 << 32) | 1
    w.feed(StreamInfoRes([StreamDescriptor(ID("LOG", str(sid)), 1, False)]))
    [req] = w.out()
    junk = b"not a batch"
    w.feed(OfferedHashes(req.ruid, 1, sha(junk)))
    w.out()
    w.feed(ChunkDelivery(req.ruid, 1, [(sha(junk), junk)]))
    assert w.proto.dead
    with pytest.raises(errors.StreamNotFound):
        node.store.log.stream(sid)


def test_client_without_roundtrip(node, clock):
    svc, w = client(node, clock, roundtrip=False)
    w.out()
    w.feed(StreamInfoRes([StreamDescriptor(C, 2, False)]))
    [req] = w.out()
    assert req.roundtrip is False
    w.feed(ChunkDelivery(req.ruid, 2, [chunk(0), chunk(1)]), BatchDone(req.ruid, 2))
    assert node.store.chunks.last_seq() == 2
    bad = chunk(5)
    [nxt] = w.out()
    w.feed(ChunkDelivery(nxt.ruid, 3, [(bad[0], b"forged")]))
    assert w.proto.dead and node.store.chunks.last_seq() == 2


def test_client_retries_after_batch_in_progress(node, clock):
    svc, w = client(node, clock)
    w.out()
    w.feed(StreamInfoRes([StreamDescriptor(C, 2, False)]))
    [req] = w.out()
    w.feed(StreamState(C, 4, "batch in progress"))
    assert w.out() == []
    clock.advance(syncer.RETRY_DELAY)
    msgs = [m for m in w.out() if isinstance(m, GetRange)]
    assert len(msgs) == 1 and msgs[0].from_ == 1


def test_server_and_client_end_to_end_in_memory(nodes, clock):
    """A syncer against a server over two StringTransports: 3000 chunks, then live ones."""
    a = nodes(1)
    b = nodes(2)
    put_chunks(a, 3000, size=32)
    factory = server.build_factory(a)
    factory.clock = clock
    s = Wire(factory.buildProtocol(None))
    svc, c = client(b, clock)

    def pump():
        for _ in range(1000):
            x, y = c.t.value(), s.t.value()
            if not x and not y:
                return
            c.t.clear()
            s.t.clear()
            if x:
                s.proto.dataReceived(x)
            if y:
                c.proto.dataReceived(y)

    pump()
    assert b.store.chunks.last_seq() == 3000
    put_chunks(a, 5, tag=b"live")
    clock.advance(0)
    pump()
    assert b.store.chunks.last_seq() == 3005
    assert set(chunk_addrs(b)) == set(chunk_addrs(a))
    assert node_lag(b) == 0


def node_lag(node):
    clockless = node.metrics["peers"]["10.0.0.9:7704"]
    return clockless["lag"]


def test_server_bytes_one_at_a_time(node, clock):
    addrs = put_chunks(node, 3)
    factory = server.build_factory(node)
    w = Wire(factory.buildProtocol(None))
    for b in codec.encode(GetRange(1, C, 1, 3, 10, False)) + codec.encode(StreamInfoReq([C])):
        w.proto.dataReceived(bytes([b]))
    msgs = w.out()
    assert [a for a, _ in msgs[0].chunks] == addrs and msgs[1] == BatchDone(1, 3)
    assert msgs[2] == StreamInfoRes([StreamDescriptor(C, 3, False)])


import msgpack  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_field = st.integers(0, 8) | st.binary(max_size=33) | st.none() | st.booleans() | st.text(max_size=6)
_arrays = st.lists(_field, max_size=8).map(lambda v: msgpack.packb(v, use_bin_type=True))


@pytest.fixture
def fuzz_pair(nodes, clock):
    n = nodes(1)
    put_chunks(n, 2)
    return n, nodes(2), clock


# one pair of stores serves every example: what a fuzzed frame may store does not matter here
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(max_size=40) | _arrays, max_size=6))
def test_fuzzed_frames_never_raise(fuzz_pair, bodies):
    n, n2, _ = fuzz_pair
    clock = task.Clock()  # the protocols' timers, fresh for each example
    factory = server.build_factory(n)
    factory.clock = clock
    s = Wire(factory.buildProtocol(None))
    svc, c = client(n2, clock)
    data = b"".join(len(b).to_bytes(4, "big") + b for b in bodies)
    s.proto.dataReceived(data)  # must answer or close cleanly, never raise
    c.proto.dataReceived(data)
    clock.advance(100)
