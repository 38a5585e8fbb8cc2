"""Toasty metadata and chunk servers over StringTransport, on a real store in tmp_path (CONTRACT §5)
with the inline writer of tests/storage_helpers/inline.py, time on a ``task.Clock`` (the file
tree's one-turn write batching is the clock's ``callLater(0)``)."""

import hashlib
import os

import pytest
import pytest_twisted
from hypothesis import HealthCheck, given, settings, strategies as st
from twisted.internet import defer, task
from twisted.internet.testing import StringTransport

from protocols.toasty import codec, server
from protocols.toasty.codec import (
    CREATE_IF_MISSING,
    MISSING_GENERATION as MISSING,
    TRUNCATE_AFTER,
    Create,
    CreateChunk,
    Delete,
    DownloadChunk,
    List_,
    Read,
    UploadChunk,
    Write,
    WriteChunk,
)
from tests.storage_helpers.inline import close, open_inline

CHUNK_ADDR = ("127.0.0.1", 7703)


class FakeConfig:
    replication_factor = 1


class Node:
    """The NodeContext surface the servers use, around a real store."""

    def __init__(self, store, chunks_on=True):
        self.store = store
        self.config = FakeConfig()
        self.node_id = 1
        self.reactor = store.reactor
        self.metrics = {}
        self.chunks_on = chunks_on

    def advertised(self, name):
        return "%s:%d" % CHUNK_ADDR if (name == "chunks" and self.chunks_on) else None

    def on_shutdown(self, fn):
        pass


@pytest.fixture
def store(tmp_path):
    s = open_inline(tmp_path / "store", task.Clock(), node_id=1)
    yield s
    close(s)


class Conn:
    def __init__(self, factory):
        self.clock = factory.node.reactor
        self.proto = factory.buildProtocol(None)
        self.tr = StringTransport()
        self.proto.makeConnection(self.tr)
        self.seen = 0

    def send(self, *msgs):
        for m in msgs:
            self.proto.dataReceived(codec.encode(m) if not isinstance(m, bytes) else m)

    def _parse(self):
        data = self.tr.value()
        out, pos = [], 0
        while len(data) - pos >= 8:
            _, mtype, length = codec.HEADER.unpack_from(data, pos)
            if len(data) - pos < length:
                break
            out.append(codec.decode_reply(mtype, data[pos + 8 : pos + length]))
            pos += length
        return out

    async def replies(self, n, timeout=10.0):
        """The next ``n`` replies; while they are not all in, the clock moves on to its next timer
        (up to ``timeout`` seconds of it)."""
        deadline = self.clock.seconds() + timeout
        while len(self._parse()) < self.seen + n:
            due = [c.getTime() for c in self.clock.getDelayedCalls() if c.getTime() <= deadline]
            if due:
                self.clock.advance(max(0.0, min(due) - self.clock.seconds()))
            else:
                raise AssertionError("only %d replies: %r" % (len(self._parse()) - self.seen, self._parse()[self.seen :]))
        got = self._parse()[self.seen : self.seen + n]
        self.seen += n
        return got

    async def call(self, msg):
        self.send(msg)
        return (await self.replies(1))[0]


@pytest.fixture
def meta(store):
    f = server.build_meta_factory(Node(store))
    f.doStart()
    return Conn(f)


@pytest.fixture
def chunks(store):
    return Conn(server.build_chunk_factory(Node(store)))


async def put_chunk(chunks, data, cs):
    r = await chunks.call(CreateChunk(cs, 0, data))
    assert r.TYPE == codec.CREATE_CHUNK_SUCCESS, r
    assert r.hash == hashlib.sha256(data + bytes(cs - len(data))).digest()
    return r.hash


def wc(h):
    return WriteChunk(h, [CHUNK_ADDR])


@pytest_twisted.ensureDeferred
async def test_root_create_list_generations(meta):
    r = await meta.call(List_(0, b"/"))
    assert (r.TYPE, r.gen, r.truncated, r.items) == (codec.LIST_SUCCESS, 1, False, [])
    d = await meta.call(Create(b"/d", True))
    f = await meta.call(Create(b"d/f", False, 4096))
    assert d.TYPE == f.TYPE == codec.CREATE_SUCCESS and 1 < d.gen < f.gen
    r = await meta.call(List_(0, b"/d/"))
    assert [(i.name, i.gen, i.is_dir) for i in r.items] == [(b"f", f.gen, False)]
    assert r.gen == d.gen  # a directory keeps its generation when children change
    r = await meta.call(List_(0, b""))
    assert [(i.name, i.gen, i.is_dir) for i in r.items] == [(b"d", d.gen, True)]


@pytest_twisted.ensureDeferred
async def test_create_errors(meta):
    await meta.call(Create(b"/f", False, 4096))
    for msg, text in [
        (Create(b"/f", True), "already exists"),
        (Create(b"/", True), "already exists"),
        (Create(b"/nope/x", True), "No such file"),
        (Create(b"/f/x", True), "not a directory"),
        (Create(b"/a/../b", True), "Invalid path"),
        (Create(b"a//b", True), "Invalid path"),
        (Create(b"/g", False, 0), "chunk_size"),
    ]:
        r = await meta.call(msg)
        assert r.TYPE == codec.CREATE_ERROR and text in r.message, (msg, r)


@pytest_twisted.ensureDeferred
async def test_list_and_read_type_errors(meta):
    await meta.call(Create(b"/f", False, 4096))
    r = await meta.call(List_(0, b"/f"))
    assert r.TYPE == codec.LIST_ERROR and "not a directory" in r.message
    r = await meta.call(Read(0, b"/", 0, 10))
    assert r.TYPE == codec.READ_ERROR and "is a directory" in r.message
    assert r.write_locations == [codec.AddrList([CHUNK_ADDR])]
    r = await meta.call(Read(0, b"/missing", 0, 10))
    assert r.TYPE == codec.READ_ERROR and r.message.startswith("No such file")


@pytest_twisted.ensureDeferred
async def test_generation_checks_on_every_message(meta):
    d = (await meta.call(Create(b"/d", True))).gen
    f = (await meta.call(Create(b"/f", False, 4096))).gen
    bad = f + 1000
    assert (await meta.call(List_(bad, b"/d"))).TYPE == codec.LIST_ERROR
    assert (await meta.call(List_(MISSING, b"/d"))).TYPE == codec.LIST_ERROR
    assert (await meta.call(List_(d, b"/d"))).TYPE == codec.LIST_SUCCESS
    assert (await meta.call(List_(1, b"/"))).TYPE == codec.LIST_SUCCESS
    assert (await meta.call(Read(bad, b"/f", 0, 1))).TYPE == codec.READ_ERROR
    assert (await meta.call(Read(MISSING, b"/f", 0, 1))).TYPE == codec.READ_ERROR
    r = await meta.call(Read(f, b"/f", 0, 1))
    assert (r.TYPE, r.gen, r.chunk_size, r.file_length, r.chunks) == (codec.READ_SUCCESS, f, 4096, 0, [])
    r = await meta.call(Write(0, 0, b"/f", 0, 0, []))
    assert r.TYPE == codec.WRITE_ERROR and "Generation" in r.message  # WRITE refuses expect_gen 0
    assert (await meta.call(Write(bad, 0, b"/f", 0, 0, []))).TYPE == codec.WRITE_ERROR
    assert (await meta.call(Write(MISSING, CREATE_IF_MISSING, b"/f", 0, 0, []))).TYPE == codec.WRITE_ERROR
    assert (await meta.call(Write(MISSING, 0, b"/new", 0, 0, []))).TYPE == codec.WRITE_ERROR
    assert (await meta.call(Delete(bad, b"/f"))).TYPE == codec.DELETE_ERROR
    assert (await meta.call(Delete(MISSING, b"/f"))).TYPE == codec.DELETE_ERROR
    assert (await meta.call(Delete(0, b"/missing"))).TYPE == codec.DELETE_ERROR
    assert (await meta.call(Delete(5, b"/missing"))).TYPE == codec.DELETE_ERROR
    assert (await meta.call(Delete(MISSING, b"/missing"))).TYPE == codec.DELETE_SUCCESS
    assert (await meta.call(Delete(MISSING, b"/nodir/missing"))).TYPE == codec.DELETE_SUCCESS
    assert (await meta.call(Delete(f, b"/f"))).TYPE == codec.DELETE_SUCCESS
    await meta.call(Create(b"/d/x", True))
    r = await meta.call(Delete(0, b"/d"))
    assert r.TYPE == codec.DELETE_ERROR and "not empty" in r.message
    assert (await meta.call(Delete(0, b"/"))).TYPE == codec.DELETE_ERROR


@pytest_twisted.ensureDeferred
async def test_write_read_download(meta, chunks):
    cs = 4096
    gen = (await meta.call(Create(b"/f", False, cs))).gen
    a, b = b"a" * cs, b"b" * 100
    ha, hb = await put_chunk(chunks, a, cs), await put_chunk(chunks, b, cs)
    r = await meta.call(Write(gen, 0, b"/f", 0, cs + 100, [wc(ha), wc(hb)]))
    assert r.TYPE == codec.WRITE_SUCCESS and r.gen > gen
    gen2 = r.gen
    r = await meta.call(Read(gen2, b"/f", 10, 10_000))
    assert (r.gen, r.chunk_size, r.file_length) == (gen2, cs, cs + 90)
    assert [c.hash for c in r.chunks] == [ha, hb]
    assert r.chunks[0].holders == [codec.AddrList([CHUNK_ADDR])] and r.write_locations == r.chunks[0].holders
    # past the end: file_length 0, no hashes (CONTRACT §5)
    r = await meta.call(Read(0, b"/f", 50_000, 10))
    assert (r.file_length, r.chunks) == (0, [])
    d = await chunks.call(DownloadChunk(hb, True))
    assert d.data == b + bytes(cs - 100)
    d = await chunks.call(DownloadChunk(hb, False, 98, 4))
    assert d.data == b"bb\x00\x00"
    d = await chunks.call(DownloadChunk(hb, False, 4000, 200))
    assert d.TYPE == codec.DOWNLOAD_CHUNK_ERROR and d.message == "Invalid range"
    # a patch makes a new chunk
    u = await chunks.call(UploadChunk(hb, 100, b"c"))
    assert u.TYPE == codec.UPLOAD_CHUNK_SUCCESS and u.hash == hashlib.sha256(b + b"c" + bytes(cs - 101)).digest()
    u = await chunks.call(UploadChunk(hashlib.sha256(b"nothing").digest(), 0, b"x"))
    assert u.TYPE == codec.UPLOAD_CHUNK_ERROR
    e = await chunks.call(CreateChunk(10, 8, b"abc"))
    assert e.TYPE == codec.CREATE_CHUNK_ERROR


@pytest_twisted.ensureDeferred
async def test_write_refusals(meta, chunks):
    gen = (await meta.call(Create(b"/f", False, 4096))).gen
    h = await put_chunk(chunks, b"x", 4096)
    unknown = hashlib.sha256(b"never uploaded").digest()
    r = await meta.call(Write(gen, 0, b"/f", 0, 10, [wc(unknown)]))
    assert r.TYPE == codec.WRITE_ERROR and "Chunk not found" in r.message
    r = await meta.call(Write(gen, 0, b"/f", 4090, 10, [wc(h)]))  # spans 2 chunks
    assert r.TYPE == codec.WRITE_ERROR and "spans 2" in r.message
    r = await meta.call(Write(gen, 0, b"/f", 0, 10, [WriteChunk(h, [])]))
    assert r.TYPE == codec.WRITE_ERROR and "replication factor" in r.message
    r = await meta.call(Write(gen, 0, b"/", 0, 10, [wc(h)]))
    assert r.TYPE == codec.WRITE_ERROR
    r = await meta.call(Write(gen, 0, b"/f/../g", 0, 10, [wc(h)]))
    assert r.TYPE == codec.WRITE_ERROR and "Invalid path" in r.message
    assert (await meta.call(Read(gen, b"/f", 0, 10))).gen == gen  # nothing changed


@pytest_twisted.ensureDeferred
async def test_create_if_missing_and_truncate(meta, chunks):
    h = await put_chunk(chunks, b"y" * 4096, 4096)
    r = await meta.call(Write(MISSING, CREATE_IF_MISSING, b"/auto", 0, 4096 * 3, [wc(h)] * 3))
    assert r.TYPE == codec.WRITE_SUCCESS
    g = r.gen
    r = await meta.call(Read(0, b"/auto", 0, 1 << 20))
    assert (r.gen, r.chunk_size, r.file_length, len(r.chunks)) == (g, 4096, 3 * 4096, 3)
    # truncate to 5000 with a zero-length write; the kept chunk's tail becomes zeros
    r = await meta.call(Write(g, TRUNCATE_AFTER, b"/auto", 5000, 0, []))
    assert r.TYPE == codec.WRITE_SUCCESS
    g = r.gen
    r = await meta.call(Read(g, b"/auto", 0, 1 << 20))
    assert r.file_length == 5000 and len(r.chunks) == 2 and r.chunks[0].hash == h and r.chunks[1].hash != h
    tail = await chunks.call(DownloadChunk(r.chunks[1].hash, True))
    assert tail.data == b"y" * (5000 - 4096) + bytes(4096 * 2 - 5000)
    # grow again with a write far past the end: the gap reads as zeros, holes are zero hashes
    h2 = await put_chunk(chunks, b"z", 4096)
    r = await meta.call(Write(g, 0, b"/auto", 5 * 4096, 1, [wc(h2)]))
    assert r.TYPE == codec.WRITE_SUCCESS
    r = await meta.call(Read(0, b"/auto", 0, 1 << 20))
    assert r.file_length == 5 * 4096 + 1
    assert [c.hash for c in r.chunks][2:5] == [codec.ZERO_HASH] * 3
    assert r.chunks[2].holders == []


@pytest_twisted.ensureDeferred
async def test_list_pagination(meta):
    await meta.call(Create(b"/many", True))
    names = sorted(b"n%04d" % i for i in range(300))
    for n in reversed(names):
        meta.send(Create(b"/many/" + n, True))
    assert all(r.TYPE == codec.CREATE_SUCCESS for r in await meta.replies(300))
    got, after = [], None
    while True:
        r = await meta.call(List_(0, b"/many" if after is None else b"/many/\x00" + after))
        assert len(r.items) <= 128
        got += [i.name for i in r.items]
        if not r.truncated:
            break
        after = r.items[-1].name
    assert got == names


@pytest_twisted.ensureDeferred
async def test_pipelined_write_then_read_sees_the_write(meta, chunks):
    h = await put_chunk(chunks, b"p", 4096)
    meta.send(Write(MISSING, CREATE_IF_MISSING, b"/p", 0, 1, [wc(h)]), Read(0, b"/p", 0, 10), List_(0, b"/"))
    w, r, ls = await meta.replies(3)
    assert w.TYPE == codec.WRITE_SUCCESS and r.TYPE == codec.READ_SUCCESS and r.gen == w.gen
    assert [i.name for i in ls.items] == [b"p"]


@pytest_twisted.ensureDeferred
async def test_pipelined_list_sees_only_the_requests_before_it(meta):
    """CONTRACT §5: a LIST pipelined between CREATEs sees the ones before it, not the one after."""
    msgs = [Create(b"/v", True), Create(b"/v/x", False, 4096), List_(0, b"/v"), Create(b"/v/y", False, 4096)]
    meta.send(b"".join(codec.encode(m) for m in msgs))  # one read on the server's side
    cv, cx, ls, cy = await meta.replies(4)
    assert cv.TYPE == cx.TYPE == cy.TYPE == codec.CREATE_SUCCESS
    assert ls.TYPE == codec.LIST_SUCCESS and ls.gen == cv.gen
    assert [(i.name, i.gen) for i in ls.items] == [(b"x", cx.gen)]
    assert [i.name for i in (await meta.call(List_(0, b"/v"))).items] == [b"x", b"y"]


@pytest_twisted.ensureDeferred
async def test_pipelined_read_before_a_write_sees_the_old_content(meta, chunks):
    """READ /w; WRITE /w sent together: the READ answers with the content and generation before
    the WRITE -- with nothing else pending, and behind an unacknowledged mutation of the same
    connection (which it does see)."""
    old = await put_chunk(chunks, b"o", 4096)
    new = await put_chunk(chunks, b"n", 4096)
    g = (await meta.call(Write(MISSING, CREATE_IF_MISSING, b"/w", 0, 1, [wc(old)]))).gen
    meta.send(b"".join(codec.encode(m) for m in [Read(0, b"/w", 0, 10), Write(g, 0, b"/w", 0, 1, [wc(new)])]))
    r, w = await meta.replies(2)
    assert w.TYPE == codec.WRITE_SUCCESS and w.gen > g
    assert (r.TYPE, r.gen, [c.hash for c in r.chunks]) == (codec.READ_SUCCESS, g, [old])
    msgs = [
        Write(MISSING, CREATE_IF_MISSING, b"/w0", 0, 1, [wc(new)]),  # pending when the READ comes
        Read(0, b"/w", 0, 10),
        List_(0, b"/"),
        Write(w.gen, TRUNCATE_AFTER, b"/w", 0, 2, [wc(old)]),
        Write(MISSING, CREATE_IF_MISSING, b"/w2", 0, 1, [wc(new)]),
        Read(w.gen, b"/w", 0, 10),  # refused: the WRITE before it moved the generation on
        Read(0, b"/w", 0, 10),
    ]
    meta.send(b"".join(codec.encode(m) for m in msgs))
    w0, r1, ls, w1, w2, stale, r2 = await meta.replies(7)
    assert w0.TYPE == w1.TYPE == w2.TYPE == codec.WRITE_SUCCESS
    assert (r1.TYPE, r1.gen, r1.file_length, [c.hash for c in r1.chunks]) == (codec.READ_SUCCESS, w.gen, 1, [new])
    assert [(i.name, i.gen) for i in ls.items] == [(b"w", w.gen), (b"w0", w0.gen)]
    assert stale.TYPE == codec.READ_ERROR and "Generation" in stale.message
    assert (r2.gen, r2.file_length, [c.hash for c in r2.chunks]) == (w1.gen, 2, [old])


@pytest_twisted.ensureDeferred
async def test_unreferenced_chunks_are_reclaimed(store, meta, chunks):
    h1 = await put_chunk(chunks, b"1", 4096)
    h2 = await put_chunk(chunks, b"2", 4096)
    g = (await meta.call(Write(MISSING, CREATE_IF_MISSING, b"/r", 0, 1, [wc(h1)]))).gen
    g = (await meta.call(Write(g, 0, b"/r", 0, 1, [wc(h2)]))).gen
    await store.chunks.sweep_now(0)
    assert not store.chunks.has(h1) and store.chunks.has(h2)
    assert (await meta.call(Delete(g, b"/r"))).TYPE == codec.DELETE_SUCCESS
    await store.chunks.sweep_now(0)
    assert not store.chunks.has(h2)


def test_byte_at_a_time_and_many_at_once(store):
    f = server.build_meta_factory(Node(store))
    c = Conn(f)
    raw = codec.encode(List_(0, b"/")) * 3
    for i in range(len(raw)):
        c.proto.dataReceived(raw[i : i + 1])
    assert len(c._parse()) == 3 and not c.tr.disconnecting


@pytest.mark.parametrize("port", ["meta", "chunks"])
def test_oversize_and_wrong_port_close_without_reply(store, port):
    f = server.build_meta_factory(Node(store)) if port == "meta" else server.build_chunk_factory(Node(store))
    for raw in [
        codec.HEADER.pack(1, 3 if port == "meta" else 7, 16 * 1024 * 1024 + 1),  # oversize: no body needed
        codec.HEADER.pack(2, 0, 8),  # version
        codec.HEADER.pack(1, 9, 16),  # a reply type
        codec.HEADER.pack(1, 5 if port == "meta" else 0, 20) + bytes(12),  # the other port's request
        codec.HEADER.pack(1, 99, 8),
        codec.HEADER.pack(1, 0, 7),
    ]:
        c = Conn(f)
        c.proto.dataReceived(raw)
        assert c.tr.disconnecting and c.tr.value() == b"", raw


def _fuzz_conn(store_, port):
    f = server.build_meta_factory(Node(store_)) if port == "meta" else server.build_chunk_factory(Node(store_))
    return Conn(f)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(port=st.sampled_from(["meta", "chunks"]), mtype=st.integers(0, 7), body=st.binary(max_size=120), cut=st.integers(0, 200))
def test_fuzz_garbage_bodies_close_cleanly(store, port, mtype, body, cut):
    allowed = codec.META_REQUESTS if port == "meta" else codec.CHUNK_REQUESTS
    try:
        codec.decode_request(mtype, body)
        return  # a well-formed request: not garbage
    except codec.CodecError:
        pass
    raw = codec.HEADER.pack(1, mtype, 8 + len(body)) + body
    c = _fuzz_conn(store, port)
    c.proto.dataReceived(raw[:cut])  # truncated: no reply, still waiting
    assert c.tr.value() == b""
    c.proto.dataReceived(raw[cut:])
    assert c.tr.value() == b""
    if mtype in allowed or True:
        assert c.tr.disconnecting


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(port=st.sampled_from(["meta", "chunks"]), data=st.binary(min_size=8, max_size=200))
def test_fuzz_random_headers(store, port, data):
    version, mtype, length = codec.HEADER.unpack_from(data, 0)
    allowed = codec.META_REQUESTS if port == "meta" else codec.CHUNK_REQUESTS
    if version == 1 and mtype in allowed and 8 <= length <= 16 * 1024 * 1024:
        return  # covered by the body fuzz
    c = _fuzz_conn(store, port)
    c.proto.dataReceived(data)
    assert c.tr.disconnecting and c.tr.value() == b""


@pytest_twisted.ensureDeferred
async def test_a_chunk_with_bytes_past_the_end_is_zero_tailed(meta, chunks):
    """CONTRACT §5: bytes past the end of file read as zeros when the file grows again, even when a
    client's chunk carried garbage there."""
    dirty = await put_chunk(chunks, b"k" * 4096, 4096)
    w = await meta.call(Write(MISSING, CREATE_IF_MISSING, b"/z", 0, 10, [wc(dirty)]))
    assert w.TYPE == codec.WRITE_SUCCESS
    r = await meta.call(Read(0, b"/z", 0, 4096))
    assert r.file_length == 10 and r.chunks[0].hash != dirty
    d = await chunks.call(DownloadChunk(r.chunks[0].hash, True))
    assert d.data == b"k" * 10 + bytes(4086)
    clean = r.chunks[0].hash
    w = await meta.call(Write(w.gen, 0, b"/z", 0, 10, [wc(clean)]))  # already clean: kept as is
    r = await meta.call(Read(0, b"/z", 0, 4096))
    assert r.chunks[0].hash == clean


@pytest_twisted.ensureDeferred
async def test_writes_batched_in_one_turn_succeed_or_fail_alone(meta, chunks):
    h = await put_chunk(chunks, b"a", 4096)
    g = (await meta.call(Create(b"/b", False, 4096))).gen
    unknown = hashlib.sha256(b"absent").digest()
    meta.send(
        Write(g, 0, b"/b", 0, 1, [wc(h)]),  # ok
        Write(g, 0, b"/b", 0, 1, [wc(h)]),  # same expect_gen: the first moved it on
        Write(MISSING, CREATE_IF_MISSING, b"/c", 0, 1, [wc(unknown)]),  # chunk not held
        Write(MISSING, CREATE_IF_MISSING, b"/d", 0, 1, [wc(h)]),  # ok
    )
    r1, r2, r3, r4 = await meta.replies(4)
    assert r1.TYPE == codec.WRITE_SUCCESS and r4.TYPE == codec.WRITE_SUCCESS
    assert r2.TYPE == codec.WRITE_ERROR and "Generation" in r2.message
    assert r3.TYPE == codec.WRITE_ERROR and "Chunk not found" in r3.message
    ls = await meta.call(List_(0, b"/"))
    assert [i.name for i in ls.items] == [b"b", b"d"]  # the refused create left no trace
    assert (await meta.call(Read(0, b"/b", 0, 10))).gen == r1.gen


@pytest_twisted.ensureDeferred
async def test_pipelined_writes_apply_in_arrival_order_when_one_needs_a_tail_check(meta, chunks):
    """The first WRITE ends inside a chunk (its tail must be checked for zeros), the second is
    chunk-aligned (no check): on one connection they still apply in the order they arrived, so the
    first succeeds and the second, with the same expect_gen, is refused."""
    partial = await put_chunk(chunks, b"a", 4096)
    full = await put_chunk(chunks, b"f" * 4096, 4096)
    g = (await meta.call(Create(b"/o", False, 4096))).gen
    meta.send(Write(g, 0, b"/o", 0, 1, [wc(partial)]), Write(g, 0, b"/o", 0, 4096, [wc(full)]))
    r1, r2 = await meta.replies(2)
    assert r1.TYPE == codec.WRITE_SUCCESS, r1
    assert r2.TYPE == codec.WRITE_ERROR and "has generation %d, not %d" % (r1.gen, g) in r2.message, r2
    r = await meta.call(Read(0, b"/o", 0, 4096))
    assert (r.gen, r.file_length, [c.hash for c in r.chunks]) == (r1.gen, 1, [partial])


@pytest_twisted.ensureDeferred
async def test_pipelined_create_and_delete_wait_for_an_earlier_write(meta, chunks):
    """CREATE and DELETE pipelined behind a WRITE on one connection do not overtake it."""
    h = await put_chunk(chunks, b"w" * 4096, 4096)
    meta.send(
        Write(MISSING, CREATE_IF_MISSING, b"/x", 0, 4096, [wc(h)]),  # creates /x
        Create(b"/x", False, 4096),  # so this one finds it
        Delete(0, b"/x"),  # and this one deletes the written file
        Write(MISSING, CREATE_IF_MISSING, b"/x", 0, 10, [wc(h)]),  # and this recreates it
    )
    w1, c, d, w2 = await meta.replies(4)
    assert w1.TYPE == codec.WRITE_SUCCESS, w1
    assert c.TYPE == codec.CREATE_ERROR and "already exists" in c.message, c
    assert d.TYPE == codec.DELETE_SUCCESS, d
    assert w2.TYPE == codec.WRITE_SUCCESS and w2.gen > w1.gen, w2
    r = await meta.call(Read(0, b"/x", 0, 4096))
    assert (r.gen, r.file_length) == (w2.gen, 10)


@pytest_twisted.ensureDeferred
async def test_generations_survive_reopening_the_store(tmp_path):
    """Generations handed out by batched CREATEs and WRITEs (some refused) are the stored ones
    after the store is closed and opened again, and the counter goes on from the last one."""
    path = tmp_path / "store"
    s = open_inline(path, task.Clock(), fsync="always", node_id=1)
    try:
        f = server.build_meta_factory(Node(s))
        f.doStart()
        meta, chunks = Conn(f), Conn(server.build_chunk_factory(Node(s)))
        h = await put_chunk(chunks, b"r", 4096)
        meta.send(
            Create(b"/d", True),
            Create(b"/d", True),  # refused: exists
            Write(MISSING, CREATE_IF_MISSING, b"/d/f", 0, 5, [wc(h)]),
            Write(MISSING, CREATE_IF_MISSING, b"/d/f", 0, 5, [wc(h)]),  # refused: exists now
            Create(b"/g", False, 4096),
        )
        d, d2, w, w2, g = await meta.replies(5)
        assert (d.TYPE, d2.TYPE, w.TYPE, w2.TYPE, g.TYPE) == (
            codec.CREATE_SUCCESS, codec.CREATE_ERROR, codec.WRITE_SUCCESS, codec.WRITE_ERROR, codec.CREATE_SUCCESS)
        assert 1 < d.gen < w.gen < g.gen
        w3 = await meta.call(Write(g.gen, 0, b"/g", 0, 4096, [wc(h)]))
        assert w3.TYPE == codec.WRITE_SUCCESS and w3.gen > g.gen
    finally:
        await s.close()
    s = open_inline(path, task.Clock(), fsync="always", node_id=1)
    try:
        f = server.build_meta_factory(Node(s))
        f.doStart()
        meta = Conn(f)
        ls = await meta.call(List_(0, b"/"))
        assert (ls.gen, [(i.name, i.gen) for i in ls.items]) == (1, [(b"d", d.gen), (b"g", w3.gen)])
        ls = await meta.call(List_(d.gen, b"/d"))
        assert [(i.name, i.gen) for i in ls.items] == [(b"f", w.gen)]
        r = await meta.call(Read(w.gen, b"/d/f", 0, 10))
        assert (r.TYPE, r.file_length) == (codec.READ_SUCCESS, 5)
        again = await meta.call(Create(b"/h", True))
        assert again.gen == w3.gen + 1  # no generation reused, none skipped
    finally:
        await s.close()


def _create_chunk_reply_hash(data, cs):
    return hashlib.sha256(bytes(data) + bytes(cs - len(data))).digest()


@pytest_twisted.ensureDeferred
async def test_create_chunks_in_one_read_are_stored_together_and_answered_in_order(store, chunks):
    """Many CREATE_CHUNKs in one read (one store transaction for all): each reply in order, a
    refused one in the middle, a duplicate within the batch, every chunk stored."""
    datas = [bytes([i]) * (1000 + i) for i in range(40)]
    msgs = [CreateChunk(4096, 0, d) for d in datas]
    msgs.insert(17, CreateChunk(10, 8, b"abc"))  # off + len > chunk_size: refused
    msgs.append(CreateChunk(4096, 0, datas[3]))  # the same chunk again
    chunks.proto.dataReceived(b"".join(codec.encode(m) for m in msgs))
    replies = await chunks.replies(len(msgs))
    assert replies[17].TYPE == codec.CREATE_CHUNK_ERROR and replies[17].message == "Invalid range"
    del replies[17]
    expected = [_create_chunk_reply_hash(d, 4096) for d in datas + [datas[3]]]
    assert [r.TYPE for r in replies] == [codec.CREATE_CHUNK_SUCCESS] * len(expected)
    assert [r.hash for r in replies] == expected
    assert all(store.chunks.has(h) for h in expected)
    got = await store.chunks.get(expected[5])
    assert got == datas[5] + bytes(4096 - len(datas[5]))


@pytest_twisted.ensureDeferred
async def test_messages_cut_anywhere_between_reads(store, chunks):
    """Big and small messages split at random points (headers cut too) frame exactly as whole."""
    import random

    rnd = random.Random(7)
    datas = [rnd.randbytes(n) for n in (200_000, 65_536, 5, 100_000, 1)]
    raw = b"".join(codec.encode(CreateChunk(256 * 1024, 0, d)) for d in datas)
    pos = 0
    while pos < len(raw):
        n = rnd.choice([1, 3, 7, 8, 9, 100, 4096, 70_000])
        chunks.proto.dataReceived(raw[pos : pos + n])
        pos += n
    replies = await chunks.replies(len(datas))
    assert [r.hash for r in replies] == [_create_chunk_reply_hash(d, 256 * 1024) for d in datas]
    assert not chunks.tr.disconnecting
    r = await chunks.call(DownloadChunk(replies[2].hash, False, 0, 5))
    assert r.TYPE == codec.DOWNLOAD_CHUNK_SUCCESS and bytes(r.data) == datas[2]


@pytest_twisted.ensureDeferred
async def test_chunk_server_over_a_real_socket_keeps_reply_order(store):
    """Over loopback TCP, downloads answered at once from the page cache (straight to the socket)
    and those queued behind a full send buffer, errors and partial reads stay in request order."""
    from twisted.internet import reactor

    from protocols.toasty.client import open_connection as _connect

    port = reactor.listenTCP(0, server.build_chunk_factory(Node(store)), interface="127.0.0.1")
    client = await _connect(reactor, "127.0.0.1", port.getHost().port)
    try:
        cs = 64 * 1024
        datas = [bytes([i % 251]) * 7 + hashlib.sha256(b"%d" % i).digest() * (cs // 32 - 1) for i in range(48)]
        ups = await defer.gatherResults([client.request(CreateChunk(cs, 0, d)) for d in datas])
        hashes = [u.hash for u in ups]
        assert hashes == [_create_chunk_reply_hash(d, cs) for d in datas]
        unknown = hashlib.sha256(b"nowhere").digest()
        for _ in range(3):  # ~3 MiB asked at once: more than a loopback send buffer takes
            reqs, want = [], []
            for i, h in enumerate(hashes):
                reqs.append(DownloadChunk(h, True))
                want.append(datas[i] + bytes(cs - len(datas[i])))
                if i % 16 == 5:
                    reqs.append(DownloadChunk(unknown, True))
                    want.append(None)
                if i % 16 == 9:
                    reqs.append(DownloadChunk(h, False, 3, 10))
                    want.append(want[-1][3:13])
            replies = await defer.gatherResults([client.request(r) for r in reqs])
            for reply, expect in zip(replies, want):
                if expect is None:
                    assert reply.TYPE == codec.DOWNLOAD_CHUNK_ERROR and reply.message == "Chunk not found"
                else:
                    assert reply.TYPE == codec.DOWNLOAD_CHUNK_SUCCESS and bytes(reply.data) == expect
    finally:
        client.transport.loseConnection()
        await port.stopListening()


@pytest_twisted.ensureDeferred
async def test_chunk_store_get_cached_checks_the_crc(store):
    from storage import errors

    data = b"cached" * 1000
    addr = (await store.chunks.put_many([data]))[0]
    assert addr == hashlib.sha256(data).digest()
    got = store.chunks.get_cached(addr)
    if got is None:
        pytest.skip("no RWF_NOWAIT reads here")
    assert bytes(got) == data
    with pytest.raises(errors.ChunkNotFound):
        store.chunks.get_cached(hashlib.sha256(b"absent").digest())
    pack_id, pos = store.chunks._lookup(addr)[:2]
    fd = store.packs.fds[pack_id]
    os.pwrite(fd, b"X", pos + 40 + 100)  # one byte of the data, in the page cache
    with pytest.raises(errors.DataCorrupted):
        store.chunks.get_cached(addr)
