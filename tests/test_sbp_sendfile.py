"""FETCH replies sent straight from the WAL files (os.sendfile) over a real TCP connection: the
server in this process over a real store, clients on plain sockets (in a thread) and the SBP
clients. Ordering with other replies, multi-segment and mixed small/big results, backpressure
for a reader that does not read, GOAWAY after queued replies, and corruption."""

import glob
import os
import socket
import threading
import time

import pytest
import pytest_twisted
from twisted.internet import reactor, threads

from protocols.sbp import codec, server
from protocols.sbp.client import BlockingSbpClient, SbpClient, SbpError
from protocols.sbp.codec import T
from protocols.sbp.sendfile import FileSender
from storage import Store, record_batch
from storage import wal as wal_module
from tests.storage_helpers.util import entry_positions
from tests.test_sbp_server import Node  # the NodeContext surface over a real store
from tests.waiting import reactor_until

BIG = 64  # 1 KiB records per big batch (~66 KB: sent with sendfile)


@pytest.fixture
def store(tmp_path):
    s = Store.open(str(tmp_path / "store"), fsync="never", reactor=reactor, node_id=7,
                   segment_bytes=512 << 10, retention_check_s=0)
    yield s
    pytest_twisted.blockon(s.close())


class Server:
    def __init__(self, store, zero_copy=True):
        self.factory = server.SbpServerFactory(Node(store, reactor))
        self.factory.zero_copy = zero_copy
        self.port = reactor.listenTCP(0, self.factory, interface="127.0.0.1")
        self.address = ("127.0.0.1", self.port.getHost().port)

    def conn(self):
        (p,) = self.factory.connections
        return p

    def stop(self):
        for p in list(self.factory.connections):
            p.transport.abortConnection()
        return self.port.stopListening()


@pytest.fixture
def srv(store):
    s = Server(store)
    yield s
    pytest_twisted.blockon(s.stop())


def big(i):
    return record_batch.encode([(1000 + k, [], (b"%d:%d:" % (i, k)).ljust(1024, b"r")) for k in range(BIG)])


def small(i):
    return record_batch.encode([(1000, [(b"h", b"v")], b"small %d" % i)])


async def fill(store, n=40):
    """A stream of big batches with a small one every seventh, over several WAL segments."""
    sid = (await store.log.create_stream()).stream_id
    for i in range(n):
        await store.log.append(sid, small(i) if i % 7 == 6 else big(i))
    return sid


def fetch_frame(rid, sid, offset, max_bytes):
    header = codec.encode_table("FetchRequest", T.FetchRequest(0, 1, [T.FetchInfo(sid, 0, offset, max_bytes)]))
    return codec.encode_frame(codec.FETCH, 0, rid, header)


def read_frames(sock, n, timeout=30.0):
    """n whole frames from a blocking socket (the FrameBuffer checks every frame's CRC)."""
    fb = codec.FrameBuffer()
    out = []
    sock.settimeout(timeout)
    while len(out) < n:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("closed after %d frames" % len(out))
        fb.feed(data)
        while (f := fb.next()) is not None:
            out.append(f)
    return out


def payload_of(store_batches):
    return b"".join(store_batches)


@pytest_twisted.ensureDeferred
async def test_fetch_replies_from_files_in_order_with_other_replies(store, srv):
    sid = await fill(store)
    assert len(glob.glob(os.path.join(store.path, "wal", "*.wal"))) >= 4
    end = store.log.stream(sid).next_offset
    # what the copying read returns, for every request below
    asks = [(0, 1), (0, 100_000), (BIG * 3, 1 << 20), (BIG * 5, 4 << 20), (0, 16 << 20), (end - 1, 1)]
    want = [payload_of(await store.log.read(sid, off, mb)) for off, mb in asks]
    append_batch = big(999)
    append_header = codec.encode_table("AppendRequest", T.AppendRequest(0, [T.AppendInfo(sid, 0, len(append_batch))]))
    wire = []
    for k, (off, mb) in enumerate(asks):
        wire.append(fetch_frame(k + 1, sid, off, mb))
        if k == 2:
            wire.append(codec.encode_frame(codec.PING, 0, 100, b"hdr", b"ping payload"))
            wire.append(codec.encode_frame(codec.APPEND, 0, 101, append_header, append_batch))

    def client():
        with socket.create_connection(srv.address) as s:
            s.sendall(b"".join(wire))
            return read_frames(s, len(asks) + 2)

    frames = await threads.deferToThread(client)
    by_id = {f.stream_id: f for f in frames}
    assert len(by_id) == len(frames) == len(asks) + 2
    for k in range(len(asks)):
        f = by_id[k + 1]
        assert f.flags == codec.RESPONSE_LAST
        (r,) = codec.decode_header(f).fetch_responses
        assert r.status.code == 0 and r.batch_length == len(f.payload)
        assert f.payload == want[k], "reply %d differs" % (k + 1)
    assert by_id[100].payload == b"ping payload" and by_id[100].header == b"hdr"
    assert codec.decode_header(by_id[101]).append_responses[0].base_offset == end
    metrics = srv.factory.metrics
    assert metrics["fetch_sendfile_bytes"] > 0.9 * sum(len(w) for w in want)


@pytest_twisted.ensureDeferred
async def test_replies_cut_anywhere_by_a_full_socket_arrive_whole(store, srv):
    """A reader that is slow to start, with a small receive buffer: replies written straight to the socket
    (FileSender._send_now) stop part way (in the prefix and header, in a batch, in the CRC) and
    queue the rest; PINGs written meanwhile wait behind them. Every reply's payload is what the
    copying read returns, every frame's CRC checks out."""
    sid = await fill(store)
    end = store.log.stream(sid).next_offset
    asks = [((k * 37) % (end - 1), (1 << 20) if k % 3 else 70_000) for k in range(24)]
    want = [payload_of(await store.log.read(sid, off, mb)) for off, mb in asks]
    wire = []
    for k, (off, mb) in enumerate(asks):
        wire.append(fetch_frame(k + 1, sid, off, mb))
        if k % 5 == 4:
            wire.append(codec.encode_frame(codec.PING, 0, 1000 + k, b"hdr", b"p" * (k * 100)))

    def client():
        with socket.create_connection(srv.address) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            s.sendall(b"".join(wire))
            time.sleep(0.5)  # the server fills the socket and queues
            s.settimeout(30.0)
            fb = codec.FrameBuffer()
            out = []
            i = 0
            while len(out) < len(wire):
                data = s.recv(1 + (i * 7919) % 65536)  # reads of uneven sizes
                i += 1
                if not data:
                    raise ConnectionError("closed")
                fb.feed(data)
                while (f := fb.next()) is not None:
                    out.append(f)
            return out

    frames = await threads.deferToThread(client)
    by_id = {f.stream_id: f for f in frames}
    assert len(by_id) == len(frames) == len(wire)
    for k in range(len(asks)):
        f = by_id[k + 1]
        assert f.flags == codec.RESPONSE_LAST and f.payload == want[k], "reply %d differs" % (k + 1)
    for k in range(4, len(asks), 5):
        assert by_id[1000 + k].payload == b"p" * (k * 100)
    assert srv.factory.metrics["fetch_sendfile_short"] > 0  # the socket did fill


@pytest_twisted.ensureDeferred
async def test_copying_path_gives_the_same_replies(store):
    sid = await fill(store, 20)
    a, b = Server(store, zero_copy=True), Server(store, zero_copy=False)
    try:
        def client(address):
            with socket.create_connection(address) as s:
                s.sendall(b"".join(fetch_frame(k + 1, sid, k * BIG, 1 << 20) for k in range(10)))
                return [(f.stream_id, f.header, f.payload) for f in read_frames(s, 10)]

        got_a = await threads.deferToThread(client, a.address)
        got_b = await threads.deferToThread(client, b.address)
        assert sorted(got_a) == sorted(got_b)
        assert a.factory.metrics["fetch_sendfile_bytes"] > 0 and b.factory.metrics["fetch_sendfile_bytes"] == 0
    finally:
        await a.stop()
        await b.stop()


@pytest.mark.parametrize("mixed", [False, True])
@pytest_twisted.ensureDeferred
async def test_reader_that_does_not_read_stops_the_server_reading(store, srv, mixed):
    """Big batches only: each reply is ready at once (page cache), so the server stops taking
    requests once its send queue is over FileSender.HIGH. Mixed with small batches: replies come
    from the read pool, and the in-flight budget (64 MiB of reads) bounds what it takes."""
    if mixed:
        sid = await fill(store, 30)
    else:
        sid = (await store.log.create_stream()).stream_id
        for i in range(30):
            await store.log.append(sid, big(i))
    n = 150  # 2 MiB replies: 300 MiB if the server took every request
    s = socket.create_connection(srv.address)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    req = fetch_frame(1, sid, 0, 2 << 20)
    await threads.deferToThread(s.sendall, req * n)
    p = await reactor_until(lambda: (p := srv.conn()) is not None and p.sender is not None and not p.gate.reading and p,
                            what="the server to stop reading")
    assert p.sender is not None and not p.gate.reading
    fetched = srv.factory.metrics["fetches"]
    reply = 2 << 20
    if mixed:
        bound = (srv.factory.inflight_budget + FileSender.HIGH) // reply + 4
    else:
        bound = (FileSender.HIGH + (4 << 20)) // reply + 4  # + what the sockets hold
    assert fetched <= bound, "the server took %d requests from a reader that does not read" % fetched
    assert p.sender.queued <= bound * reply
    # the reader catches up: every reply arrives, whole
    frames = await threads.deferToThread(read_frames, s, n)
    s.close()
    assert len({len(f.payload) for f in frames}) == 1 and all(f.flags == codec.RESPONSE_LAST for f in frames)
    assert srv.factory.metrics["fetches"] == n


@pytest_twisted.ensureDeferred
async def test_goaway_closes_after_the_queued_replies(store, srv):
    sid = await fill(store, 30)
    s = socket.create_connection(srv.address)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    await threads.deferToThread(s.sendall, b"".join(fetch_frame(k + 1, sid, 0, 2 << 20) for k in range(3))
                                + codec.goaway_frame())
    await reactor_until(lambda: (p := srv.conn()) is not None and p.sender is not None and p.sender.busy,
                        what="replies queued behind the full socket")
    assert srv.conn().sender.busy  # replies still queued behind a full socket

    def drain():
        s.settimeout(30)
        data = bytearray()
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                return bytes(data)
            data += chunk

    data = await threads.deferToThread(drain)
    s.close()
    fb = codec.FrameBuffer()
    fb.feed(data)
    frames = []
    while (f := fb.next()) is not None:
        frames.append(f)
    # replies leave as they complete (read pool reads may finish in any order), each one whole
    assert sorted(f.stream_id for f in frames) == [1, 2, 3] and fb.buffered() == 0


def wal_entry(store, sid, index):
    """(file path, file offset, entry length) of the stream's ``index``-th batch entry."""
    from storage.index import INDEX, INDEX_KEY, INDEX_VAL

    with store.env.begin() as txn:
        cur = txn.cursor(db=store.dbs[INDEX])
        cur.set_range(INDEX_KEY.pack(sid, 0))
        for k, (key, value) in enumerate(cur):
            if k == index:
                pos, length = INDEX_VAL.unpack(value)[:2]
                break
    base = max(b for b in store.wal.bases if b <= pos)
    return os.path.join(store.path, "wal", "%020d.wal" % base), pos - base, length


def flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


@pytest_twisted.ensureDeferred
async def test_corrupt_records_block_fails_the_reply_crc(store, srv):
    sid = (await store.log.create_stream()).stream_id
    for i in range(4):
        await store.log.append(sid, big(i))
    path, off, length = wal_entry(store, sid, 1)
    flip(path, off + length - 500)  # inside batch 1's records block
    host, port = srv.address

    def blocking():
        c = BlockingSbpClient(host, port)
        try:
            with pytest.raises(SbpError) as e:
                c.fetch(sid, BIG, 1)
            assert e.value.code == codec.DATA_CORRUPTED
            # the connection goes on; the batches around it read fine
            assert record_batch.read_header(c.fetch(sid, 0, 1)).base_offset == 0
            assert record_batch.read_header(c.fetch(sid, 2 * BIG, 1)).base_offset == 2 * BIG
        finally:
            c.close()

    await threads.deferToThread(blocking)
    tc = SbpClient(reactor, host, port)
    try:
        with pytest.raises(SbpError) as e:
            await tc.fetch(sid, BIG, 1)
        assert e.value.code == codec.DATA_CORRUPTED
        assert record_batch.read_header(await tc.fetch(sid, 3 * BIG, 1)).base_offset == 3 * BIG
    finally:
        await tc.close()


@pytest_twisted.ensureDeferred
async def test_corrupt_batch_header_is_answered_data_corrupted(store, srv):
    sid = (await store.log.create_stream()).stream_id
    for i in range(4):
        await store.log.append(sid, big(i))
    path, off, _ = wal_entry(store, sid, 2)
    flip(path, off + 25 + 15)  # the batch's base_timestamp: checked on the server
    host, port = srv.address

    def blocking():
        c = BlockingSbpClient(host, port)
        try:
            with pytest.raises(SbpError) as e:
                c.fetch(sid, 2 * BIG, 1)
            assert e.value.code == codec.DATA_CORRUPTED
            with pytest.raises(SbpError):
                c.fetch(sid, 0, 1 << 20)  # a reply spanning it fails rather than skip it
            assert record_batch.read_header(c.fetch(sid, 3 * BIG, 1)).base_offset == 3 * BIG
        finally:
            c.close()

    await threads.deferToThread(blocking)


@pytest_twisted.ensureDeferred
async def test_sequential_reader_uses_read_ahead(store, srv):
    sid = await fill(store, 40)
    end = store.log.stream(sid).next_offset

    def reader():
        s = socket.create_connection(srv.address)
        offset, rid, n = 0, 0, 0
        while offset < end:
            rid += 1
            s.sendall(fetch_frame(rid, sid, offset, 1 << 20))
            (f,) = read_frames(s, 1)
            pos = 0
            while pos < len(f.payload):
                h = record_batch.read_header(f.payload, pos)
                pos += record_batch.HEADER_SIZE + h.records_len
                n += h.record_count
            offset = h.base_offset + h.record_count
        s.close()
        return rid, n

    requests, records = await threads.deferToThread(reader)
    assert records == end
    assert srv.factory.metrics["read_ahead_hits"] >= requests - 2


def test_file_sender_only_for_plain_sockets():
    from twisted.internet.testing import StringTransport

    assert FileSender.for_transport(StringTransport(), lambda full: None) is None


@pytest.mark.skipif(wal_module.cachestat is None, reason="no cachestat(2) here (Linux < 6.5)")
@pytest_twisted.ensureDeferred
async def test_sequential_reader_prefetch_keeps_it_off_the_read_pool(store, srv):
    """Data written a while ago may have left the page cache (memory reclaim): once a reader
    reads sequentially, the server asks for the WAL ahead of it, and its later FETCHes are
    answered from the page cache (no read-pool reads) instead of each waiting for the disk."""
    sid = (await store.log.create_stream()).stream_id
    for i in range(60):  # big batches only (a reply with a small batch is read by the pool anyway)
        await store.log.append(sid, big(i))
    end = store.log.stream(sid).next_offset
    wal = store.wal
    for fd in list(wal.fds.values()):
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if not wal.uncached(wal.bases[0], 4096):
        pytest.skip("cannot evict pages here")
    metrics = srv.factory.metrics
    go_on = threading.Event()
    s = socket.create_connection(srv.address)
    offsets = [0]
    pool_reads = []

    def fetch_one(rid):
        s.sendall(fetch_frame(rid, sid, offsets[-1], 128 << 10))
        (f,) = read_frames(s, 1)
        pos = 0
        while pos < len(f.payload):
            h = record_batch.read_header(f.payload, pos)
            pos += record_batch.HEADER_SIZE + h.records_len
        offsets.append(h.base_offset + h.record_count)

    def reader():
        fetch_one(1)
        fetch_one(2)  # the second reply proves a sequential reader: the prefetch starts
        go_on.wait(30)
        pool_reads.append(metrics["fetch_pool_reads"])
        rid = 2
        while offsets[-1] < end:
            rid += 1
            fetch_one(rid)
        s.close()

    done = threads.deferToThread(reader)
    await reactor_until(lambda: len(offsets) == 3, what="two replies")
    third = entry_positions(store, sid)[offsets[-1] // BIG][0]  # where the third FETCH's batches lie
    # the pages are in and their reads done (cachestat counts a page whose read is in flight)
    await reactor_until(lambda: not wal.uncached(third, 1 << 20) and not wal.fetching, what="the prefetched pages")
    go_on.set()
    await done
    assert offsets[-1] == end and len(offsets) > 10
    assert metrics["fetch_pool_reads"] == pool_reads[0]  # every later FETCH from the page cache
