"""Toasty metadata server (``--meta``) and chunk server (``--chunks``), CONTRACT §5.

Both frame the same way: a bytearray with a read offset, the 8-byte header checked (version 1,
8 <= length <= 16 MiB, a request type of *this* listener) before the body is buffered, the body
decoded to exactly its length. Anything else closes the connection with no reply, logged once at
warn. Replies leave in request order (the protocol has no request id): each request owns a slot in
an ordered queue, and the head is written as soon as it is ready.

Metadata requests run against ``storage.files.FileTree``. A read (LIST, READ) that arrives behind an
unacknowledged write (CREATE, DELETE, WRITE) of the same connection waits for it, so a pipelined
``WRITE; READ`` sees its own write. Chunk requests run against ``store.chunks`` (content addressed,
SHA-256 of the zero-padded chunk).
"""

import struct
from collections import deque

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from zope.interface import implementer

from protocols.toasty import codec, paths
from protocols.toasty.codec import HEADER, HEADER_LEN
from storage import files

MAX_IN_FLIGHT = 256  # requests executing per connection before we stop reading
MAX_IN_FLIGHT_BYTES = 32 * 1024 * 1024
READ_SIZE = 256 * 1024
_CREATE_CHUNK_HEAD = struct.Struct("<III")


_METRIC_NAMES = {
    codec.CREATE: "toasty_create",
    codec.DELETE: "toasty_delete",
    codec.LIST: "toasty_list",
    codec.READ: "toasty_read",
    codec.WRITE: "toasty_write",
    codec.CREATE_CHUNK: "toasty_create_chunk",
    codec.UPLOAD_CHUNK: "toasty_upload_chunk",
    codec.DOWNLOAD_CHUNK: "toasty_download_chunk",
}


class _Slot:
    __slots__ = ("data", "ready")

    def __init__(self):
        self.data = None
        self.ready = False


@implementer(IPushProducer)
class _ToastyServerProtocol(Protocol):
    """Framing, ordered replies and backpressure shared by both listeners."""

    log = Logger()
    allowed = frozenset()

    def __init__(self, node):
        self.node = node
        self._buf = bytearray()
        self._pos = 0
        self._closed = False
        self._slots = deque()
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._out_paused = False
        self._in_paused = False
        self._framing = False
        self._drain_wait = False

    # -- connection ---------------------------------------------------------------------------

    def connectionMade(self):
        try:
            self.transport.setTcpNoDelay(True)
        except Exception:
            pass
        if hasattr(self.transport, "bufferSize"):
            # Read (and buffer replies) in 256 KiB steps: a 64 KiB chunk message is one read, not two.
            self.transport.bufferSize = READ_SIZE
        self.transport.registerProducer(self, True)

    def connectionLost(self, reason):
        self._closed = True
        self._slots.clear()
        try:
            self.transport.unregisterProducer()
        except Exception:
            pass

    def _peer(self):
        try:
            return str(self.transport.getPeer())
        except Exception:
            return "?"

    def _drop(self, why):
        # CONTRACT §5: a malformed message closes the connection with no reply.
        if not self._closed:
            self.log.warn("closing toasty connection from {peer}: {why}", peer=self._peer(), why=why)
            self._closed = True
            self._slots.clear()
            self.transport.loseConnection()

    # -- IPushProducer: the transport tells us its send buffer is full ---------------------------

    def pauseProducing(self):
        self._out_paused = True
        self._update_reading()

    def resumeProducing(self):
        self._out_paused = False
        self._update_reading()

    def stopProducing(self):
        self._closed = True

    def _update_reading(self):
        # Hysteresis: pause at the budget, resume at half of it (not one epoll change per request).
        div = 2 if self._in_paused else 1
        want_pause = (
            self._out_paused
            or self._in_flight >= MAX_IN_FLIGHT // div
            or self._in_flight_bytes >= MAX_IN_FLIGHT_BYTES // div
            or self._store_congested()
        )
        if want_pause and not self._in_paused:
            self._in_paused = True
            self.transport.pauseProducing()
        elif not want_pause and self._in_paused and not self._closed:
            self._in_paused = False
            self.transport.resumeProducing()
            if not self._framing:  # else the running _frames loop carries on
                self._frames()

    def _store_congested(self):
        """The store's write queue is over its high-water mark: stop reading until it drains."""
        store = self.node.store
        if not getattr(store, "congested", False):
            return False
        if not self._drain_wait:
            self._drain_wait = True

            def drained(_):
                self._drain_wait = False
                if not self._closed:
                    self._update_reading()

            store.when_drained().addBoth(drained)
        return True

    # -- framing ------------------------------------------------------------------------------

    def dataReceived(self, data):
        if self._closed:
            return
        self._buf += data
        self._frames()

    def _frames(self):
        self._framing = True
        try:
            self._frame_loop()
        finally:
            self._framing = False

    def _frame_loop(self):
        buf = self._buf
        while not self._closed and not self._in_paused:
            avail = len(buf) - self._pos
            if avail < HEADER_LEN:
                break
            version, mtype, length = HEADER.unpack_from(buf, self._pos)
            try:
                codec.check_header(version, mtype, length, self.allowed)
            except codec.CodecError as e:
                self._drop(str(e))
                return
            if avail < length:
                break
            pos = self._pos
            self._pos += length
            msg = None
            if mtype == codec.CREATE_CHUNK and length >= HEADER_LEN + 12:
                # The bulk message: slice its data straight out of the buffer (one copy).
                chunk_size, off, n = _CREATE_CHUNK_HEAD.unpack_from(buf, pos + HEADER_LEN)
                if n == length - HEADER_LEN - 12:
                    with memoryview(buf) as view:
                        msg = codec.CreateChunk(chunk_size, off, view[pos + HEADER_LEN + 12 : pos + length].tobytes())
            if msg is None:
                with memoryview(buf) as view:
                    body = view[pos + HEADER_LEN : pos + length].tobytes()
                try:
                    msg = codec.decode_request(mtype, body)
                except codec.CodecError as e:
                    self._drop(str(e))
                    return
            self._start(msg, self.cost(msg, length))
        if self._pos and not self._closed:
            del buf[: self._pos]
            self._pos = 0

    # -- ordered replies ----------------------------------------------------------------------

    def _start(self, msg, size):
        metrics = self.node.metrics
        key = _METRIC_NAMES[msg.TYPE]
        metrics[key] = metrics.get(key, 0) + 1
        slot = _Slot()
        self._slots.append(slot)
        self._in_flight += 1
        self._in_flight_bytes += size
        self._update_reading()
        try:
            d = self.handle(msg)
        except Exception:  # a bug in a handler must not escape dataReceived
            d = defer.fail()
        d.addErrback(self._internal_error, msg)
        d.addCallback(self._finish, slot, size)

    def _internal_error(self, failure, msg):
        from storage import errors

        if failure.check(errors.StoreError):  # busy, closing, or failed after an I/O error
            self.log.warn("toasty request {type} refused by the store: {error}", type=type(msg).__name__, error=failure.value)
            return self.error_reply(msg, "I/O error: %s" % (failure.value,))
        self.log.failure("toasty request {type} failed", failure, type=type(msg).__name__)
        return self.error_reply(msg, "I/O error")

    def _finish(self, reply, slot, size):
        self._in_flight -= 1
        self._in_flight_bytes -= size
        if self._closed:
            return
        slot.data = codec.encode(reply)
        slot.ready = True
        while self._slots and self._slots[0].ready:
            self.transport.write(self._slots.popleft().data)
        self._update_reading()

    # -- subclass API -------------------------------------------------------------------------

    def cost(self, msg, length):
        """Bytes a request may hold in memory while it runs (the in-flight budget counts these)."""
        return length

    def handle(self, msg):
        raise NotImplementedError

    def error_reply(self, msg, text):
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# metadata server


_ERROR_TYPE = {
    codec.CREATE: codec.CREATE_ERROR,
    codec.DELETE: codec.DELETE_ERROR,
    codec.LIST: codec.LIST_ERROR,
    codec.WRITE: codec.WRITE_ERROR,
    codec.CREATE_CHUNK: codec.CREATE_CHUNK_ERROR,
    codec.UPLOAD_CHUNK: codec.UPLOAD_CHUNK_ERROR,
    codec.DOWNLOAD_CHUNK: codec.DOWNLOAD_CHUNK_ERROR,
}


class MetaServerProtocol(_ToastyServerProtocol):
    allowed = codec.META_REQUESTS

    def __init__(self, node, tree, factory):
        super().__init__(node)
        self.tree = tree
        self.factory = factory
        self._writes = 0  # unacknowledged writes of this connection
        self._waiting = deque()  # reads parked behind them: (msg, Deferred)

    def error_reply(self, msg, text):
        if msg.TYPE == codec.READ:
            return codec.ReadError(text, self.factory.write_locations())
        return codec.ErrorReply(_ERROR_TYPE[msg.TYPE], text)

    def handle(self, msg):
        t = msg.TYPE
        if t in (codec.LIST, codec.READ):
            if self._writes or self._waiting:
                d = defer.Deferred()
                self._waiting.append((msg, d))
                return d
            return defer.succeed(self._read_op(msg))
        self._writes += 1
        d = self._write_op(msg)
        d.addBoth(self._write_done)
        return d

    def _write_done(self, result):
        self._writes -= 1
        while self._waiting and not self._writes:
            msg, d = self._waiting.popleft()
            d.callback(self._read_op(msg))
        return result

    def _read_op(self, msg):
        try:
            if msg.TYPE == codec.LIST:
                components, after = paths.split_list_path(msg.path)
                gen, truncated, items = self.tree.list(components, msg.expect_gen, after, codec.MAX_LIST_ITEMS)
                return codec.ListSuccess(gen, truncated, [codec.ListItem(g, d, n) for n, g, d in items])
            components = paths.normalize(msg.path)
            r = self.tree.read(components, msg.expect_gen, msg.offset, msg.length, codec.MAX_READ_CHUNKS)
            holders = self.factory.holders()
            chunks = [codec.ReadChunk(h, [] if h == codec.ZERO_HASH else holders) for h in r.hashes]
            return codec.ReadSuccess(r.gen, r.chunk_size, r.file_length, chunks, self.factory.write_locations())
        except (paths.InvalidPath, files.FsError) as e:
            return self.error_reply(msg, str(e))

    def _write_op(self, msg):
        try:
            components = paths.normalize(msg.path)
        except paths.InvalidPath as e:
            return defer.succeed(self.error_reply(msg, str(e)))
        t = msg.TYPE
        if t == codec.CREATE:
            d = self.tree.create(components, msg.is_dir, msg.chunk_size)
            d.addCallback(codec.CreateSuccess)
        elif t == codec.DELETE:
            d = self.tree.delete(components, msg.expect_gen)
            d.addCallback(lambda _: codec.DeleteSuccess())
        else:
            problem = self.factory.check_locations(msg)
            if problem:
                return defer.succeed(self.error_reply(msg, problem))
            d = self.tree.write(components, msg.expect_gen, msg.flags, msg.offset, msg.length, [c.hash for c in msg.chunks])
            d.addCallback(codec.WriteSuccess)
        d.addErrback(self._fs_error, msg)
        return d

    def _fs_error(self, failure, msg):
        failure.trap(files.FsError)
        return self.error_reply(msg, str(failure.value))


class MetaServerFactory(Factory):
    log = Logger()

    def __init__(self, node):
        self.node = node
        self.tree = files.FileTree(node.store)
        self.replication_factor = max(1, int(getattr(node.config, "replication_factor", 1) or 1))
        self._locations = None

    def startFactory(self):
        d = self.tree.ensure_root()
        d.addErrback(lambda f: self.log.failure("could not create the toasty root", f))

    def buildProtocol(self, addr):
        p = MetaServerProtocol(self.node, self.tree, self)
        p.factory = self
        return p

    def _chunk_server(self):
        if self._locations is None:
            advertised = self.node.advertised("chunks")
            if advertised is None:
                return None
            self._locations = codec.AddrList.of([codec.parse_host_port(advertised)])
        return self._locations

    def write_locations(self):
        """CONTRACT §5: this node's chunk listener (empty when --chunks is none). With peers, the
        chunk servers they advertise would join this list, up to the replication factor."""
        a = self._chunk_server()
        return [a] if a is not None else []

    def holders(self):
        a = self._chunk_server()
        return [a] if a is not None else []

    def check_locations(self, msg):
        """A WRITE must name, for every chunk, as many locations as the replication factor asks
        for, capped by the chunk servers this node knows (one: itself)."""
        known = len(self.write_locations())
        need = min(self.replication_factor, known)
        for i, c in enumerate(msg.chunks):
            if len(c.locations) < need:
                return "chunk %d lists %d locations; the replication factor needs %d" % (i, len(c.locations), need)
        return None


def build_meta_factory(node):
    return MetaServerFactory(node)


# --------------------------------------------------------------------------------------------
# chunk server


class ChunkServerProtocol(_ToastyServerProtocol):
    allowed = codec.CHUNK_REQUESTS

    def cost(self, msg, length):
        # A CREATE_CHUNK builds a chunk_size chunk; a patch or a download loads a stored chunk
        # (its size unknown until then: counted as 1 MiB) -- so a peer cannot make us hold
        # gigabytes with small requests.
        if msg.TYPE == codec.CREATE_CHUNK:
            return length + msg.chunk_size
        return length + 1024 * 1024

    def error_reply(self, msg, text):
        return codec.ErrorReply(_ERROR_TYPE[msg.TYPE], text)

    def handle(self, msg):
        chunks = self.node.store.chunks
        t = msg.TYPE
        if t == codec.CREATE_CHUNK:
            size, off, n = msg.chunk_size, msg.offset, len(msg.data)
            if not 0 < size <= files.MAX_CHUNK_SIZE or off + n > size:
                return defer.succeed(self.error_reply(msg, "Invalid range"))
            if off == 0 and n == size:
                data = msg.data
            else:
                data = b"".join((bytes(off), msg.data, bytes(size - off - n)))
            d = chunks.put(data)
            d.addCallback(codec.CreateChunkSuccess)
        elif t == codec.UPLOAD_CHUNK:
            d = chunks.get(msg.hash)
            d.addCallback(self._patch, msg)
        else:
            d = chunks.get(msg.hash)
            d.addCallback(self._download, msg)
        d.addErrback(self._chunk_error, msg)
        return d

    def _patch(self, data, msg):
        off, n = msg.offset, len(msg.data)
        if off + n > len(data):
            return self.error_reply(msg, "Invalid range")
        patched = b"".join((data[:off], msg.data, data[off + n :]))
        d = self.node.store.chunks.put(patched)
        d.addCallback(codec.UploadChunkSuccess)
        return d

    def _download(self, data, msg):
        if msg.full:
            return codec.DownloadChunkSuccess(data)
        if msg.offset + msg.length > len(data):
            return self.error_reply(msg, "Invalid range")
        return codec.DownloadChunkSuccess(data[msg.offset : msg.offset + msg.length])

    def _chunk_error(self, failure, msg):
        from storage import errors

        failure.trap(errors.ChunkNotFound)
        return self.error_reply(msg, "Chunk not found")


class ChunkServerFactory(Factory):
    def __init__(self, node):
        self.node = node

    def buildProtocol(self, addr):
        p = ChunkServerProtocol(self.node)
        p.factory = self
        return p


def build_chunk_factory(node):
    return ChunkServerFactory(node)
