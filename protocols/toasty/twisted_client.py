"""The Toasty file protocol over Twisted: ``ToastyClient`` (one connection per listener,
``ToastyClientProtocol`` framing with ``protocols/framing.Framer``); the planning is in
``planning``."""

from collections import deque

from twisted.internet import defer, endpoints, error, protocol, task
from twisted.logger import Logger

from protocols import tcp_internals
from protocols.framing import Framer
from protocols.toasty import codec
from protocols.toasty.codec import HEADER, HEADER_LEN
from protocols.toasty.planning import (
    DEFAULT_CHUNK_SIZE,
    MAX_ATTEMPTS,
    MAX_PIECE_CHUNKS,
    UPLOADS_IN_FLIGHT,
    NotFoundError,
    ToastyError,
    backoff,
    bytes_reader,
    error_of,
    file_state_steps,
    path_bytes,
    plan_uploads,
    raise_for,
    record_upload,
    server_address,
    should_retry,
    verify_chunk,
    write_message,
)


class _ExpectedReplies:
    """The reply types the oldest outstanding request may get (``codec.Layout``'s ``allowed``)."""

    __slots__ = ("pending",)

    def __init__(self, pending):
        self.pending = pending

    def __contains__(self, mtype):
        if not self.pending:
            raise codec.CodecError("reply with no request outstanding")
        return mtype in codec.REPLIES[self.pending[0][0]]


class ToastyClientProtocol(protocol.Protocol):
    """One connection to either listener: ``request(msg) -> Deferred[reply]`` (replies in order)."""

    log = Logger()

    def __init__(self):
        self._pending = deque()
        self._frames = Framer(codec.Layout(_ExpectedReplies(self._pending)))
        self._lost = None

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)

    def request(self, msg):
        if self._lost is not None:
            return defer.fail(ConnectionError("toasty connection lost: %s" % self._lost))
        d = defer.Deferred()
        self._pending.append((msg.TYPE, d))
        self.transport.write(codec.encode(msg))
        return d

    def dataReceived(self, data):
        self._frames.feed(data)
        try:
            for buf, pos, end in self._frames.spans():
                reply = codec.decode_reply(HEADER.unpack_from(buf, pos)[1], buf[pos + HEADER_LEN : end])
                _, d = self._pending.popleft()
                d.callback(reply)
        except codec.CodecError as e:
            return self._fail(str(e))

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
        meta = yield open_connection(reactor, host, port)
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

        open_connection(self.reactor, *address).addBoth(done)
        return d

    @defer.inlineCallbacks
    def chunk_request(self, address, msg):
        p = yield self._chunk(address)
        reply = yield p.request(msg)
        return reply

    # -- metadata operations --

    @defer.inlineCallbacks
    def create(self, path, is_dir=False, chunk_size=DEFAULT_CHUNK_SIZE):
        reply = yield self.meta.request(codec.Create(path_bytes(path), is_dir, 0 if is_dir else chunk_size))
        return raise_for(reply).gen

    def mkdir(self, path):
        return self.create(path, True)

    @defer.inlineCallbacks
    def delete(self, path, expect_gen=0):
        reply = yield self.meta.request(codec.Delete(expect_gen, path_bytes(path)))
        raise_for(reply)

    @defer.inlineCallbacks
    def list(self, path, expect_gen=0):
        """-> (dir gen, [ListItem]) with LIST continuation followed to the end."""
        base = path_bytes(path)
        items, after = [], None
        while True:
            wire = base if after is None else base.rstrip(b"/") + b"/\x00" + after
            reply = raise_for((yield self.meta.request(codec.List_(expect_gen, wire))))
            items.extend(reply.items)
            if not reply.truncated or not reply.items:
                return reply.gen, items
            after = reply.items[-1].name

    @defer.inlineCallbacks
    def read_raw(self, path, offset, length, expect_gen=0):
        reply = yield self.meta.request(codec.Read(expect_gen, path_bytes(path), offset, length))
        return raise_for(reply)

    # -- file data --

    @defer.inlineCallbacks
    def write(self, path, data, offset=0, truncate=False, create=True, chunk_size=None):
        """Write ``data`` at ``offset``; -> the file's new generation."""
        path = path_bytes(path)
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
        """``planning.file_state_steps`` over this client's metadata connection."""
        steps = file_state_steps(path, offset, length, create, chunk_size, cs_hint)
        try:
            request = next(steps)
            while True:
                request = steps.send((yield self.meta.request(request)))
        except StopIteration as done:
            return done.value

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
            try:
                yield self._upload_all(uploads)
            except (ConnectionError, error.ConnectError):
                continue  # a write location is down: READ again for live ones (as the blocking client)
            reply = yield self.meta.request(write_message(state, path, offset, len(data), flags, uploads))
            if isinstance(reply, codec.WriteSuccess):
                return reply.gen
            if not should_retry(reply):
                raise error_of(reply)
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
        path = path_bytes(path)
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
            holders = [a for a in (server_address(h) for h in c.holders) if a]
            ds.append(sem.run(self._download_one, c.hash, holders, lo, hi, verify))
        return defer.gatherResults(ds, consumeErrors=True).addErrback(_first_error)

    @defer.inlineCallbacks
    def _download_one(self, h, holders, lo, hi, verify):
        last = None
        for address in holders:
            try:
                reply = yield self.chunk_request(address, codec.DownloadChunk(h, True))
            except (ConnectionError, error.ConnectError) as e:  # a dead holder: try the next (CONTRACT §9)
                last = ToastyError(str(e))
                continue
            if isinstance(reply, codec.ErrorReply):
                last = error_of(reply)
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


def open_connection(reactor, host, port):
    ep = endpoints.TCP4ClientEndpoint(reactor, host, port) if ":" not in host else endpoints.TCP6ClientEndpoint(reactor, host, port)
    return endpoints.connectProtocol(ep, ToastyClientProtocol())
