"""Toasty clients: a Twisted one (``ToastyClient``) and a blocking one (``BlockingToastyClient``).

Both implement the file protocol on top of the two wire protocols (CONTRACT §5):

write: READ(path, offset, length) for the generation, chunk size, current hashes and their holders
  and the write locations -> per chunk the range touches: CREATE_CHUNK to every write location (a
  whole or a new chunk) or UPLOAD_CHUNK to every holder of the current chunk (a patch), several in
  flight -> WRITE(expect_gen, hashes + locations). A generation conflict (someone wrote in between),
  a file created or deleted meanwhile, or a chunk reclaimed meanwhile restarts from the READ. A
  missing file is created by WRITE with CREATE_IF_MISSING and expect_gen 2^64-1 (4096-byte chunks),
  or by CREATE first when another chunk size is asked for. Writes larger than 1024 chunks go as
  several WRITEs (each atomic).
read: READ (at most 1024 chunks at a time, the later pieces pinned to the first piece's generation)
  -> DOWNLOAD_CHUNK from a holder, checked against its SHA-256 address; holes read as zeros.

The planning (which chunk gets which message) is shared; only the I/O differs.
"""

import hashlib
import random
import socket
import time
from collections import deque

from twisted.internet import defer, endpoints, protocol, task
from twisted.logger import Logger

from protocols import client_socket
from protocols.toasty import codec, paths
from protocols.toasty.codec import HEADER, HEADER_LEN

MISSING = codec.MISSING_GENERATION
DEFAULT_CHUNK_SIZE = 4096
UPLOADS_IN_FLIGHT = 16
MAX_ATTEMPTS = 30
MAX_PIECE_CHUNKS = 1024

# The server's error texts (storage/files.py) a client reacts to.
E_NOENT = "No such file or directory"
_RETRY_PREFIXES = (
    "Generation counter mismatch",
    "File or directory already exists",
    E_NOENT,
    "Chunk not found",
)


class ToastyError(Exception):
    """The server refused a request (``message`` is its text) or a check failed."""

    def __init__(self, message, reply=None):
        super().__init__(message)
        self.message = message
        self.reply = reply


class NotFoundError(ToastyError):
    pass


def _error_of(reply):
    if isinstance(reply, (codec.ErrorReply, codec.ReadError)):
        cls = NotFoundError if reply.message.startswith(E_NOENT) else ToastyError
        return cls(reply.message, reply)
    return None


def _raise_for(reply):
    err = _error_of(reply)
    if err is not None:
        raise err
    return reply


def _path_bytes(path) -> bytes:
    if isinstance(path, str):
        path = path.encode("utf-8")
    paths.normalize(path)  # the one rule; raises InvalidPath before anything is sent
    return bytes(path)


def _server_address(addr_list):
    addresses = addr_list.addresses()
    return addresses[0] if addresses else None


# -- planning (shared by both clients) ----------------------------------------------------------


class Upload:
    __slots__ = ("index", "msg", "targets", "expected", "hash", "locations")

    def __init__(self, index, msg, targets, expected):
        self.index = index
        self.msg = msg
        self.targets = targets  # [(host, port)]
        self.expected = expected  # sha256 of the whole new chunk when we know it
        self.hash = None
        self.locations = []


class FileState:
    """What a READ told us (or what a fresh CREATE implies)."""

    __slots__ = ("gen", "chunk_size", "first", "hashes", "holders", "write_locations", "exists")

    def __init__(self, gen, chunk_size, first=0, hashes=(), holders=(), write_locations=(), exists=True):
        self.gen = gen
        self.chunk_size = chunk_size
        self.first = first
        self.hashes = list(hashes)
        self.holders = list(holders)
        self.write_locations = list(write_locations)
        self.exists = exists

    @classmethod
    def from_read(cls, offset, rs):
        first = offset // rs.chunk_size if rs.chunk_size else 0
        return cls(
            rs.gen,
            rs.chunk_size,
            first,
            [c.hash for c in rs.chunks],
            [[a for a in (_server_address(h) for h in c.holders) if a] for c in rs.chunks],
            [a for a in (_server_address(w) for w in rs.write_locations) if a],
        )


def _chunk_digest(in_off, piece, tail):
    h = hashlib.sha256()
    if in_off:
        h.update(bytes(in_off))
    h.update(piece)
    if tail:
        h.update(bytes(tail))
    return h.digest()


def plan_uploads(state, offset, length, read, truncate, submit=None):
    """Yield the chunk messages that write ``length`` bytes at ``offset`` (CONTRACT §5), lazily;
    ``read(lo, hi)`` returns the new bytes for the absolute range [lo, hi), called in order."""
    cs = state.chunk_size
    first, count = codec.chunk_span(offset, length, cs)
    end = offset + length
    for index in range(first, first + count):
        start = index * cs
        lo, hi = max(offset, start), min(end, start + cs)
        piece = read(lo, hi)
        in_off = lo - start
        k = index - state.first
        old = state.hashes[k] if 0 <= k < len(state.hashes) else codec.ZERO_HASH
        whole = in_off == 0 and hi - lo == cs
        # The new chunk's bytes are fully known (so we can check the returned address) when it is
        # written whole, replaces a hole, or starts at 0 and is the truncated end of the file.
        known = whole or old == codec.ZERO_HASH or (in_off == 0 and truncate and hi == end)
        if known:
            if not state.write_locations:
                raise ToastyError("the metadata server offered no chunk server to write to")
            tail = cs - in_off - len(piece)
            # ``submit`` hashes on a helper thread (a Future); record_upload waits for it.
            expected = submit(_chunk_digest, in_off, piece, tail) if submit else _chunk_digest(in_off, piece, tail)
            yield Upload(index, codec.CreateChunk(cs, in_off, piece), state.write_locations, expected)
        else:
            patch = bytes(piece)
            if truncate and hi == end:
                # Bytes past the new end must read as zeros later (CONTRACT §5).
                patch += bytes(cs - in_off - len(piece))
            holders = state.holders[k] if 0 <= k < len(state.holders) else []
            if not holders:
                raise ToastyError("chunk %d has no holder to patch" % index)
            yield Upload(index, codec.UploadChunk(old, in_off, patch), holders, None)


def bytes_reader(data, offset):
    view = memoryview(data)
    return lambda lo, hi: view[lo - offset : hi - offset]


def record_upload(up, target, reply):
    """Check one upload's reply; remember the hash and the location."""
    err = _error_of(reply)
    if err is not None:
        raise ToastyError("chunk server %s:%d refused chunk %d: %s" % (target[0], target[1], up.index, err.message), reply)
    h = reply.hash
    if up.expected is not None and not isinstance(up.expected, bytes):
        up.expected = up.expected.result()
    if up.expected is not None and h != up.expected:
        raise ToastyError("chunk server %s:%d returned hash %s for chunk %d, expected %s" % (target[0], target[1], h.hex(), up.index, up.expected.hex()))
    if up.hash is not None and up.hash != h:
        raise ToastyError("replicas of chunk %d disagree on its hash" % up.index)
    up.hash = h
    up.locations.append(target)


def write_message(state, path, offset, length, flags, uploads):
    return codec.Write(state.gen, flags, path, offset, length, [codec.WriteChunk(u.hash, u.locations) for u in uploads])


def should_retry(reply) -> bool:
    return isinstance(reply, (codec.ErrorReply, codec.ReadError)) and reply.message.startswith(_RETRY_PREFIXES)


def pieces(offset, length, chunk_size):
    """Split [offset, offset+length) at chunk boundaries into ranges of <= 1024 chunks."""
    span_bytes = MAX_PIECE_CHUNKS * chunk_size
    pos, end = offset, offset + length
    while pos < end:
        piece_end = min(end, (pos // chunk_size) * chunk_size + span_bytes)
        yield pos, piece_end - pos
        pos = piece_end


def aligned(offset, length, chunk_size):
    """The chunk-aligned range around [offset, offset+length): a write's READ must return the
    current hash of every chunk it touches, including one that holds data only before ``offset``
    or the end of file before ``offset+length`` (READ reports only readable bytes)."""
    if not chunk_size:
        return offset, length
    lo = offset // chunk_size * chunk_size
    hi = -(-(offset + length) // chunk_size) * chunk_size
    return lo, hi - lo


def backoff(attempt):
    """Randomised, growing pause before retrying a conflicting WRITE (so racing writers spread out)."""
    return random.uniform(0, 0.002 * 2 ** min(attempt, 8)) if attempt else 0.0


def _sha256(data):
    return hashlib.sha256(data).digest()


def _run_batch(jobs):
    return [fn(*args) for fn, args in jobs]


class _Digest:
    """A digest being computed in a batch: ``result()`` waits for it (flushing the batch first)."""

    __slots__ = ("batcher", "future", "index")

    def __init__(self, batcher):
        self.batcher = batcher
        self.future = None
        self.index = 0

    def result(self):
        if self.future is None:
            self.batcher.flush()
        return self.future.result()[self.index]


class HashBatcher:
    """``submit(fn, *args)`` like an executor's, but jobs go to the helper threads several at a
    time: one thread hop per batch, not per chunk (SHA-256 releases the GIL, so the helpers hash
    while the caller keeps sending and receiving)."""

    def __init__(self, pool, per_job=8):
        self.pool = pool
        self.per_job = per_job
        self.open = []

    def submit(self, fn, *args):
        digest = _Digest(self)
        self.open.append((fn, args, digest))
        if len(self.open) >= self.per_job:
            self.flush()
        return digest

    def flush(self):
        if self.open:
            batch, self.open = self.open, []
            future = self.pool.submit(_run_batch, [(fn, args) for fn, args, _ in batch])
            for i, (_, _, digest) in enumerate(batch):
                digest.future, digest.index = future, i


def verify_chunk(h, data):
    if hashlib.sha256(data).digest() != h:
        raise ToastyError("chunk %s failed its hash check" % h.hex())


# -- Twisted client ----------------------------------------------------------------------------


class ToastyClientProtocol(protocol.Protocol):
    """One connection to either listener: ``request(msg) -> Deferred[reply]`` (replies in order)."""

    log = Logger()

    def __init__(self):
        self._buf = bytearray()
        self._pos = 0
        self._pending = deque()
        self._lost = None

    def connectionMade(self):
        try:
            self.transport.setTcpNoDelay(True)
        except Exception:
            pass

    def request(self, msg):
        if self._lost is not None:
            return defer.fail(ConnectionError("toasty connection lost: %s" % self._lost))
        d = defer.Deferred()
        self._pending.append((msg.TYPE, d))
        self.transport.write(codec.encode(msg))
        return d

    def dataReceived(self, data):
        self._buf += data
        buf = self._buf
        while True:
            avail = len(buf) - self._pos
            if avail < HEADER_LEN:
                break
            version, mtype, length = HEADER.unpack_from(buf, self._pos)
            if not self._pending:
                return self._fail("reply with no request outstanding")
            req_type, d = self._pending[0]
            try:
                codec.check_header(version, mtype, length, codec.REPLIES[req_type])
            except codec.CodecError as e:
                return self._fail(str(e))
            if avail < length:
                break
            body = bytes(buf[self._pos + HEADER_LEN : self._pos + length])
            self._pos += length
            try:
                reply = codec.decode_reply(mtype, body)
            except codec.CodecError as e:
                return self._fail(str(e))
            self._pending.popleft()
            d.callback(reply)
        if self._pos:
            del buf[: self._pos]
            self._pos = 0

    def _fail(self, why):
        self.log.warn("bad toasty reply: {why}", why=why)
        self.transport.loseConnection()
        self.connectionLost(ConnectionError(why))

    def connectionLost(self, reason=None):
        if self._lost is None:
            self._lost = getattr(reason, "value", reason)
        pending, self._pending = self._pending, deque()
        for _, d in pending:
            d.errback(ConnectionError("toasty connection lost: %s" % self._lost))


class ToastyClient:
    """The file protocol over Twisted: ``yield ToastyClient.connect(reactor, host, port)``."""

    def __init__(self, reactor, meta, parallel=UPLOADS_IN_FLIGHT):
        self.reactor = reactor
        self.meta = meta
        self.parallel = parallel
        self._chunk_conns = {}
        self._connecting = {}

    @classmethod
    @defer.inlineCallbacks
    def connect(cls, reactor, host, port, **kw):
        meta = yield _connect(reactor, host, port)
        return cls(reactor, meta, **kw)

    def close(self):
        for p in self._chunk_conns.values():
            p.transport.loseConnection()
        self._chunk_conns.clear()
        self.meta.transport.loseConnection()

    def _chunk(self, address):
        p = self._chunk_conns.get(address)
        if p is not None and p._lost is None:
            return defer.succeed(p)
        d = defer.Deferred()
        waiters = self._connecting.get(address)
        if waiters is not None:
            waiters.append(d)
            return d
        self._connecting[address] = [d]

        def done(result):
            for w in self._connecting.pop(address, []):
                if isinstance(result, ToastyClientProtocol):
                    w.callback(result)
                else:
                    w.errback(result)
            if isinstance(result, ToastyClientProtocol):
                self._chunk_conns[address] = result

        _connect(self.reactor, *address).addBoth(done)
        return d

    @defer.inlineCallbacks
    def chunk_request(self, address, msg):
        p = yield self._chunk(address)
        reply = yield p.request(msg)
        return reply

    # -- metadata operations --

    @defer.inlineCallbacks
    def create(self, path, is_dir=False, chunk_size=DEFAULT_CHUNK_SIZE):
        reply = yield self.meta.request(codec.Create(_path_bytes(path), is_dir, 0 if is_dir else chunk_size))
        return _raise_for(reply).gen

    def mkdir(self, path):
        return self.create(path, True)

    @defer.inlineCallbacks
    def delete(self, path, expect_gen=0):
        reply = yield self.meta.request(codec.Delete(expect_gen, _path_bytes(path)))
        _raise_for(reply)

    @defer.inlineCallbacks
    def list(self, path, expect_gen=0):
        """-> (dir gen, [ListItem]) with LIST continuation followed to the end."""
        base = _path_bytes(path)
        items, after = [], None
        while True:
            wire = base if after is None else base.rstrip(b"/") + b"/\x00" + after
            reply = _raise_for((yield self.meta.request(codec.List_(expect_gen, wire))))
            items.extend(reply.items)
            if not reply.truncated or not reply.items:
                return reply.gen, items
            after = reply.items[-1].name

    @defer.inlineCallbacks
    def read_raw(self, path, offset, length, expect_gen=0):
        reply = yield self.meta.request(codec.Read(expect_gen, _path_bytes(path), offset, length))
        return _raise_for(reply)

    # -- file data --

    @defer.inlineCallbacks
    def write(self, path, data, offset=0, truncate=False, create=True, chunk_size=None):
        """Write ``data`` at ``offset``; -> the file's new generation."""
        path = _path_bytes(path)
        data = bytes(data)
        gen = None
        first_piece = True
        total = len(data)
        cs = None
        if total == 0:
            gen = yield self._write_piece(path, b"", offset, truncate, create, chunk_size)
            return gen
        pos = 0
        while pos < total:
            if cs is None:
                try:
                    cs = (yield self.read_raw(path, offset, 0)).chunk_size
                except NotFoundError:
                    cs = chunk_size or DEFAULT_CHUNK_SIZE
            piece_len = min(total - pos, MAX_PIECE_CHUNKS * cs - (offset + pos) % cs)
            last = pos + piece_len == total
            gen = yield self._write_piece(path, data[pos : pos + piece_len], offset + pos, truncate and (first_piece or last), create, chunk_size, cs)
            first_piece = False
            pos += piece_len
        return gen

    @defer.inlineCallbacks
    def _state(self, path, offset, length, create, chunk_size, cs_hint=None):
        """READ -> FileState; a missing file (with ``create``) is created by CREATE when a chunk
        size other than the default is asked for, else left to WRITE's CREATE_IF_MISSING."""
        lo, n = aligned(offset, length, cs_hint)
        reply = yield self.meta.request(codec.Read(0, path, lo, n))
        if isinstance(reply, codec.ReadSuccess):
            if aligned(offset, length, reply.chunk_size) != (lo, n):
                lo, n = aligned(offset, length, reply.chunk_size)
                reply = yield self.meta.request(codec.Read(reply.gen, path, lo, n))
                if not isinstance(reply, codec.ReadSuccess):
                    return None  # changed meanwhile: start again
            return FileState.from_read(lo, reply)
        if not (create and reply.message.startswith(E_NOENT)):
            raise _error_of(reply)
        locations = [a for a in (_server_address(w) for w in reply.write_locations) if a]
        if chunk_size is None or chunk_size == DEFAULT_CHUNK_SIZE:
            return FileState(MISSING, DEFAULT_CHUNK_SIZE, write_locations=locations, exists=False)
        created = yield self.meta.request(codec.Create(path, False, chunk_size))
        if isinstance(created, codec.ErrorReply):
            if should_retry(created):
                return None  # created by someone else meanwhile: READ again
            raise _error_of(created)
        return FileState(created.gen, chunk_size, write_locations=locations)

    @defer.inlineCallbacks
    def _write_piece(self, path, data, offset, truncate, create, chunk_size, cs_hint=None):
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                yield task.deferLater(self.reactor, backoff(attempt), lambda: None)
            state = yield self._state(path, offset, len(data), create, chunk_size, cs_hint)
            if state is None:
                continue
            flags = (codec.TRUNCATE_AFTER if truncate else 0) | (codec.CREATE_IF_MISSING if not state.exists else 0)
            uploads = list(plan_uploads(state, offset, len(data), bytes_reader(data, offset), truncate))
            yield self._upload_all(uploads)
            reply = yield self.meta.request(write_message(state, path, offset, len(data), flags, uploads))
            if isinstance(reply, codec.WriteSuccess):
                return reply.gen
            if not should_retry(reply):
                raise _error_of(reply)
        raise ToastyError("WRITE of %r kept conflicting after %d attempts" % (path, MAX_ATTEMPTS))

    def _upload_all(self, uploads):
        sem = defer.DeferredSemaphore(self.parallel)
        ds = []
        for up in uploads:
            for target in up.targets:
                d = sem.run(self.chunk_request, target, up.msg)
                d.addCallback(lambda reply, up=up, target=target: record_upload(up, target, reply))
                ds.append(d)
        return defer.gatherResults(ds, consumeErrors=True).addErrback(_first_error)

    @defer.inlineCallbacks
    def read(self, path, offset=0, length=None, verify=True):
        """-> bytes of [offset, offset+length) (to the end of file when length is None)."""
        out = []
        yield self.read_into(path, out.append, offset, length, verify)
        return b"".join(out)

    @defer.inlineCallbacks
    def read_into(self, path, sink, offset=0, length=None, verify=True):
        path = _path_bytes(path)
        first = yield self.read_raw(path, offset, 0)
        gen, cs = first.gen, first.chunk_size
        end = offset + length if length is not None else None
        pos = offset
        while end is None or pos < end:
            want = MAX_PIECE_CHUNKS * cs - pos % cs
            if end is not None:
                want = min(want, end - pos)
            rs = yield self.read_raw(path, pos, want, expect_gen=gen)
            if rs.file_length == 0:
                break
            datas = yield self._download_all(rs, pos, verify)
            for piece in datas:
                sink(piece)
            pos += rs.file_length
            if rs.file_length < want:
                break
        return pos - offset

    def _download_all(self, rs, offset, verify):
        sem = defer.DeferredSemaphore(self.parallel)
        ds = []
        cs = rs.chunk_size
        for i, c in enumerate(rs.chunks):
            index = offset // cs + i
            start = index * cs
            lo = max(offset, start) - start
            hi = min(offset + rs.file_length, start + cs) - start
            if c.hash == codec.ZERO_HASH:
                ds.append(defer.succeed(bytes(hi - lo)))
                continue
            holders = [a for a in (_server_address(h) for h in c.holders) if a]
            ds.append(sem.run(self._download_one, c.hash, holders, lo, hi, verify))
        return defer.gatherResults(ds, consumeErrors=True).addErrback(_first_error)

    @defer.inlineCallbacks
    def _download_one(self, h, holders, lo, hi, verify):
        last = None
        for address in holders:
            try:
                reply = yield self.chunk_request(address, codec.DownloadChunk(h, True))
            except ConnectionError as e:
                last = ToastyError(str(e))
                continue
            if isinstance(reply, codec.ErrorReply):
                last = _error_of(reply)
                continue
            data = reply.data
            if verify:
                verify_chunk(h, data)
            piece = data[lo:hi]
            return piece + bytes(hi - lo - len(piece))
        raise last or ToastyError("no holder for chunk %s" % h.hex())


def _first_error(failure):
    if isinstance(failure.value, defer.FirstError):
        return failure.value.subFailure
    return failure


def _connect(reactor, host, port):
    ep = endpoints.TCP4ClientEndpoint(reactor, host, port) if ":" not in host else endpoints.TCP6ClientEndpoint(reactor, host, port)
    return endpoints.connectProtocol(ep, ToastyClientProtocol())


# -- blocking client ---------------------------------------------------------------------------


class BlockingConnection:
    """One socket to either listener; ``send`` then ``recv`` replies in request order."""

    def __init__(self, host, port, timeout=30.0, tls_ca=None):
        self.sock = client_socket.connect(host, port, timeout, tls_ca)
        self.tls = client_socket.is_tls(self.sock)  # no sendmsg, no MSG_WAITALL
        self.pending = deque()
        self.address = (host, port)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, msg):
        if self.sock.fileno() < 0:
            raise ConnectionError("toasty connection to %s:%d is closed" % self.address)
        parts = codec.encode_parts(msg)
        self.pending.append(msg.TYPE)
        if len(parts) > 8 or self.tls:  # many small fields: one buffer (sendmsg takes at most IOV_MAX)
            self.sock.sendall(b"".join(parts))
            return
        total = sum(len(p) for p in parts)
        sent = self.sock.sendmsg(parts)
        if sent < total:  # a partial send: finish from where it stopped
            rest = memoryview(b"".join(parts))[sent:]
            self.sock.sendall(rest)

    def send_many(self, msgs):
        """Send several messages with as few calls as possible (big data is not copied)."""
        if self.sock.fileno() < 0:
            raise ConnectionError("toasty connection to %s:%d is closed" % self.address)
        parts = []
        for msg in msgs:
            parts.extend(codec.encode_parts(msg))
        self.pending.extend(msg.TYPE for msg in msgs)
        total = sum(len(p) for p in parts)
        if total < 65536 or self.tls:
            self.sock.sendall(b"".join(parts))
            return
        views = [memoryview(p) for p in parts]
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i : i + 512])  # IOV_MAX is 1024
            while sent:
                n = len(views[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    def _exact(self, n):
        # MSG_WAITALL: one call, one allocation, no zero-fill (headers and bodies alike).
        data = self.sock.recv(n) if self.tls else self.sock.recv(n, socket.MSG_WAITALL)
        if len(data) == n:
            return data
        if not data:
            raise ConnectionError("toasty server %s:%d closed the connection" % self.address)
        return data + bytes(self._exact(n - len(data)))

    def recv(self):
        try:
            return self._recv()
        except BaseException:
            # A reply we could not read leaves the stream out of step: never reuse it.
            self.close()
            raise

    def _recv(self):
        if self.sock.fileno() < 0:
            raise ConnectionError("toasty connection to %s:%d is closed" % self.address)
        req_type = self.pending.popleft()
        version, mtype, length = HEADER.unpack(self._exact(HEADER_LEN))
        try:
            codec.check_header(version, mtype, length, codec.REPLIES[req_type])
            body = self._exact(length - HEADER_LEN)
            if mtype == codec.DOWNLOAD_CHUNK_SUCCESS and len(body) >= 4 and int.from_bytes(body[:4], "little") == len(body) - 4:
                return codec.DownloadChunkSuccess(memoryview(body)[4:])  # no copy of the data
            return codec.decode_reply(mtype, body)
        except codec.CodecError as e:
            self.close()
            raise ConnectionError("bad reply from toasty server %s:%d: %s" % (self.address + (e,)))

    def call(self, msg):
        self.send(msg)
        return self.recv()

    def pipeline(self, msgs, window=64):
        """Send ``msgs`` keeping up to ``window`` outstanding; yield replies in order."""
        outstanding = 0
        for msg in msgs:
            self.send(msg)
            outstanding += 1
            if outstanding >= window:
                yield self.recv()
                outstanding -= 1
        for _ in range(outstanding):
            yield self.recv()


class BlockingToastyClient:
    """The file protocol over plain sockets (for sbpctl, scripts and benchmarks)."""

    tls_ca = None  # PEM CA file when the listeners are TLS (protocols.client_socket)

    def __init__(self, host, port, timeout=30.0, parallel=UPLOADS_IN_FLIGHT, tls_ca=None):
        self.tls_ca = tls_ca  # chunk servers are reached the same way as the metadata server
        self.meta = BlockingConnection(host, port, timeout, tls_ca)
        self._pool = None
        self.timeout = timeout
        self.parallel = parallel
        self._chunk_conns = {}

    def close(self):
        self.meta.close()
        for c in self._chunk_conns.values():
            c.close()
        self._chunk_conns.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _hasher(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            # One helper: hashing runs beside this thread's sends and receives (a second one
            # measured no faster on 2 cores and cost more CPU in thread switches).
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="toasty-verify")
        return HashBatcher(self._pool)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def chunk_conn(self, address):
        c = self._chunk_conns.get(address)
        if c is None or c.sock.fileno() < 0:
            c = self._chunk_conns[address] = BlockingConnection(address[0], address[1], self.timeout, self.tls_ca)
        return c

    # -- metadata operations --

    def create(self, path, is_dir=False, chunk_size=DEFAULT_CHUNK_SIZE):
        return _raise_for(self.meta.call(codec.Create(_path_bytes(path), is_dir, 0 if is_dir else chunk_size))).gen

    def mkdir(self, path):
        return self.create(path, True)

    def delete(self, path, expect_gen=0):
        _raise_for(self.meta.call(codec.Delete(expect_gen, _path_bytes(path))))

    def list(self, path, expect_gen=0):
        base = _path_bytes(path)
        items, after = [], None
        while True:
            wire = base if after is None else base.rstrip(b"/") + b"/\x00" + after
            reply = _raise_for(self.meta.call(codec.List_(expect_gen, wire)))
            items.extend(reply.items)
            if not reply.truncated or not reply.items:
                return reply.gen, items
            after = reply.items[-1].name

    def read_raw(self, path, offset, length, expect_gen=0):
        return _raise_for(self.meta.call(codec.Read(expect_gen, _path_bytes(path), offset, length)))

    def stat(self, path):
        """-> dict(gen, chunk_size, size) for a file; dict(gen, is_dir=True) for a directory."""
        path = _path_bytes(path)
        reply = self.meta.call(codec.Read(0, path, 0, 0))
        if isinstance(reply, codec.ReadError):
            if reply.message.startswith("Entity is a directory"):
                gen, items = self.list(path)
                return {"is_dir": True, "gen": gen, "entries": len(items)}
            raise _error_of(reply)
        gen, cs = reply.gen, reply.chunk_size
        size, span = 0, MAX_PIECE_CHUNKS * cs
        while True:
            rs = self.read_raw(path, size, span, expect_gen=gen)
            size += rs.file_length
            if rs.file_length < span:
                return {"is_dir": False, "gen": gen, "chunk_size": cs, "size": size}

    # -- file data --

    def write(self, path, data, offset=0, truncate=False, create=True, chunk_size=None, progress=None):
        """Write ``data`` (bytes, or a file object with ``size``) at ``offset`` -> new generation."""
        path = _path_bytes(path)
        return self.write_stream(path, _BytesSource(data), len(data), offset, truncate, create, chunk_size, progress)

    def write_stream(self, path, source, size, offset=0, truncate=False, create=True, chunk_size=None, progress=None):
        """``source.read(n)`` supplies ``size`` bytes, written piece by piece (<= 1024 chunks each)
        and read chunk by chunk as the uploads go (memory stays bounded). A retried piece is read
        again after ``source.seek``."""
        path = _path_bytes(path)
        if size == 0:
            return self._write_piece(path, None, offset, 0, truncate, create, chunk_size)
        probe = self.meta.call(codec.Read(0, path, offset, 0))
        if isinstance(probe, codec.ReadSuccess):
            cs, probe = probe.chunk_size, None
        elif probe.message.startswith(E_NOENT):
            cs = chunk_size or DEFAULT_CHUNK_SIZE  # the probe doubles as the first piece's READ
        else:
            raise _error_of(probe)
        base = source.tell() if hasattr(source, "tell") else 0
        pos, gen, first_piece = 0, None, True
        while pos < size:
            piece_len = min(size - pos, MAX_PIECE_CHUNKS * cs - (offset + pos) % cs)
            last = pos + piece_len == size
            # TRUNCATE_AFTER on the first piece drops old bytes past it; later pieces extend.
            reported = [0]

            def report(n, reported=reported, piece_len=piece_len):
                n = min(n, piece_len - reported[0])  # a retried piece is not counted twice
                if n > 0 and progress is not None:
                    reported[0] += n
                    progress(n)

            gen = self._write_piece(path, _SourceReader(source, base + pos, offset + pos), offset + pos, piece_len,
                                    truncate and (first_piece or last), create, chunk_size, cs, probe, report)
            report(piece_len)
            first_piece, probe = False, None
            pos += piece_len
        return gen

    def _state(self, path, offset, length, create, chunk_size, cs_hint=None, probe=None):
        lo, n = aligned(offset, length, cs_hint)
        reply = probe if probe is not None else self.meta.call(codec.Read(0, path, lo, n))
        if isinstance(reply, codec.ReadSuccess):
            if aligned(offset, length, reply.chunk_size) != (lo, n):
                lo, n = aligned(offset, length, reply.chunk_size)
                reply = self.meta.call(codec.Read(reply.gen, path, lo, n))
                if not isinstance(reply, codec.ReadSuccess):
                    return None  # changed meanwhile: start again
            return FileState.from_read(lo, reply)
        if not (create and reply.message.startswith(E_NOENT)):
            raise _error_of(reply)
        locations = [a for a in (_server_address(w) for w in reply.write_locations) if a]
        if chunk_size is None or chunk_size == DEFAULT_CHUNK_SIZE:
            return FileState(MISSING, DEFAULT_CHUNK_SIZE, write_locations=locations, exists=False)
        created = self.meta.call(codec.Create(path, False, chunk_size))
        if isinstance(created, codec.ErrorReply):
            if should_retry(created):
                return None
            raise _error_of(created)
        return FileState(created.gen, chunk_size, write_locations=locations)

    def _write_piece(self, path, reader, offset, length, truncate, create, chunk_size, cs_hint=None, probe=None, report=None):
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                time.sleep(backoff(attempt))
            state = self._state(path, offset, length, create, chunk_size, cs_hint, probe if not attempt else None)
            if state is None:
                continue
            flags = (codec.TRUNCATE_AFTER if truncate else 0) | (codec.CREATE_IF_MISSING if not state.exists else 0)
            uploads = []
            if length:
                reader.rewind()
                self._upload_all(plan_uploads(state, offset, length, reader.read, truncate, self._hasher().submit), uploads, report if not attempt else None)
            reply = self.meta.call(write_message(state, path, offset, length, flags, uploads))
            if isinstance(reply, codec.WriteSuccess):
                return reply.gen
            if not should_retry(reply):
                raise _error_of(reply)
        raise ToastyError("WRITE of %r kept conflicting after %d attempts" % (path, MAX_ATTEMPTS))

    def _run_pipelined(self, jobs, on_reply):
        """``jobs``: iterable of (address, msg or (type, raw bytes), context). Keeps up to
        ``parallel`` outstanding across connections; replies are handled in send order."""
        try:
            self._pipelined(jobs, on_reply)
        except BaseException:
            # Replies still on the wire would be read as answers to later requests: start afresh.
            for c in self._chunk_conns.values():
                c.close()
            self._chunk_conns.clear()
            raise

    def _pipelined(self, jobs, on_reply):
        # Requests go out a quarter window at a time, several per send call.
        window = self.parallel
        refill = max(1, window // 4)
        outstanding = deque()
        jobs = iter(jobs)
        more = True
        while True:
            if more and len(outstanding) <= window - refill:
                sends = {}
                while len(outstanding) < window:
                    job = next(jobs, None)
                    if job is None:
                        more = False
                        break
                    address, msg, ctx = job
                    conn = self.chunk_conn(address)
                    sends.setdefault(conn, []).append(msg)
                    outstanding.append((conn, ctx))
                for conn, msgs in sends.items():
                    conn.send_many(msgs)
            if not outstanding:
                return
            conn0, ctx0 = outstanding.popleft()
            on_reply(ctx0, conn0.recv())

    def _upload_all(self, planned, uploads, report=None):
        def jobs():
            for up in planned:
                uploads.append(up)
                for target in up.targets:
                    yield target, up.msg, (up, target)

        def done(ctx, reply):
            up = ctx[0]
            record_upload(up, ctx[1], reply)
            if report is not None and up.msg is not None:
                report(len(up.msg.data))
            up.msg = None  # the data may go

        self._run_pipelined(jobs(), done)

    def read(self, path, offset=0, length=None, verify=True):
        out = []
        self.read_into(path, out.append, offset, length, verify)
        return b"".join(out)

    def read_into(self, path, sink, offset=0, length=None, verify=True, progress=None):
        """Stream [offset, offset+length) into ``sink(bytes)`` -> bytes read. Pieces after the
        first are pinned to the first READ's generation (a concurrent write fails the read)."""
        path = _path_bytes(path)
        first = self.read_raw(path, offset, 0)
        gen, cs = first.gen, first.chunk_size
        end = offset + length if length is not None else None
        pos = offset
        while end is None or pos < end:
            want = MAX_PIECE_CHUNKS * cs - pos % cs
            if end is not None:
                want = min(want, end - pos)
            rs = self.read_raw(path, pos, want, expect_gen=gen)
            if rs.file_length == 0:
                break
            self._download_piece(rs, pos, sink, verify, progress)
            pos += rs.file_length
            if rs.file_length < want:
                break
        return pos - offset

    def _download_piece(self, rs, offset, sink, verify, progress=None):
        cs = rs.chunk_size
        out = [None] * len(rs.chunks)
        jobs = []
        holder_lists = {}  # the decoder shares AddrList objects: resolve each distinct list once
        for i, c in enumerate(rs.chunks):
            index = offset // cs + i
            start = index * cs
            lo = max(offset, start) - start
            hi = min(offset + rs.file_length, start + cs) - start
            if c.hash == codec.ZERO_HASH:
                out[i] = bytes(hi - lo)
                continue
            key = tuple(map(id, c.holders))
            holders = holder_lists.get(key)
            if holders is None:
                holders = holder_lists[key] = [a for a in (_server_address(h) for h in c.holders) if a]
            if not holders:
                raise ToastyError("no chunk server holds chunk %s" % c.hash.hex())
            jobs.append((holders[0], codec.DownloadChunk(c.hash, True), (i, c.hash, lo, hi, holders)))

        checks = []
        hasher = self._hasher() if verify else None

        def got(ctx, reply):
            i, h, lo, hi, holders = ctx
            if isinstance(reply, codec.ErrorReply):
                data = self._download_fallback(h, holders[1:], reply)
            else:
                data = reply.data
                if verify:
                    # SHA-256 releases the GIL: hash on a helper thread while we keep receiving.
                    checks.append((h, hasher.submit(_sha256, data)))
            piece = data[lo:hi]
            out[i] = bytes(piece) + bytes(hi - lo - len(piece)) if len(piece) < hi - lo else piece
            if progress is not None:
                progress(hi - lo)

        self._run_pipelined(jobs, got)
        if hasher is not None:
            hasher.flush()
        for h, digest in checks:
            if digest.result() != h:
                raise ToastyError("chunk %s failed its hash check" % h.hex())
        if progress is not None:
            progress(sum(len(p) for p, c in zip(out, rs.chunks) if c.hash == codec.ZERO_HASH))
        for piece in out:
            sink(piece)

    def _download_fallback(self, h, holders, first_error):
        for address in holders:
            # A connection of its own: the pooled ones have pipelined requests outstanding.
            conn = BlockingConnection(address[0], address[1], self.timeout, self.tls_ca)
            try:
                reply = conn.call(codec.DownloadChunk(h, True))
            finally:
                conn.close()
            if isinstance(reply, codec.DownloadChunkSuccess):
                verify_chunk(h, reply.data)
                return reply.data
        raise _error_of(first_error)


class _BytesSource:
    def __init__(self, data):
        self.view = memoryview(data)
        self.pos = 0

    def tell(self):
        return self.pos

    def seek(self, pos):
        self.pos = pos

    def read(self, n):
        out = self.view[self.pos : self.pos + n]
        self.pos += len(out)
        return out


class _SourceReader:
    """``read(lo, hi)`` for plan_uploads over a sequential source, from source position ``start``
    (file offset ``offset``); ``rewind`` seeks back for a retried piece."""

    def __init__(self, source, start, offset):
        self.source, self.start, self.offset = source, start, offset
        self.next = None

    def rewind(self):
        if self.next is not None and self.next != self.offset:
            if not hasattr(self.source, "seek"):
                raise ToastyError("the source cannot be re-read for a retried WRITE")
            self.source.seek(self.start)
        self.next = self.offset

    def read(self, lo, hi):
        if lo != self.next:
            raise AssertionError("chunks are read in order")
        data = self.source.read(hi - lo)
        if len(data) != hi - lo:
            raise ToastyError("source ended early (%d bytes short)" % (hi - lo - len(data)))
        self.next = hi
        return data
