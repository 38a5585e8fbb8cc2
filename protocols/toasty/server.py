"""Toasty metadata server (``--meta``) and chunk server (``--chunks``), CONTRACT §5.

Both frame the same way (``protocols/framing.Framer`` with ``codec.Layout``): the 8-byte header
checked (version 1, 8 <= length <= 16 MiB, a request type of *this* listener) before the body is
buffered, the body decoded to exactly its length. Anything else closes the connection with no reply, logged once at
warn. Replies leave in request order (the protocol has no request id): each request owns a slot in
an ordered queue, and the head is written as soon as it is ready.

Metadata requests run against ``storage.file_tree.FileTree``; pipelined requests take effect in arrival
order (CONTRACT §5). A read (LIST, READ) with no unacknowledged mutation (CREATE, DELETE, WRITE) of
its connection ahead of it is answered at once from the committed state. One behind such a mutation
joins the tree's mutation batch as an entry of its own, so it sees the mutations sent before it and
none sent after it, while pipelined mutations keep sharing one transaction. In cluster mode
(CONTRACT §9) the metadata requests go instead to the cluster's tree in etcd and its chunk
holders (``node.cluster.toasty``, node/cluster/toasty_tree.py and toasty_chunks.py), one request
of a connection at a time. Chunk requests run
against ``store.chunks`` (content addressed, SHA-256 of the zero-padded chunk).
"""

import struct
import time
from collections import deque

from twisted.internet import defer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from protocols import tcp_internals
from protocols.direct_send import idle_socket, send_parts_now
from protocols.framing import Framer
from protocols.read_gate import BUDGET, ReadGate
from protocols.toasty import codec, file_tree, paths
from protocols.toasty.codec import HEADER, HEADER_LEN
from protocols.toasty.errors import ErrorCode
from storage import errors
from storage import sha256 as multi_sha256

MAX_IN_FLIGHT = 256  # requests executing per connection before we stop reading
MAX_IN_FLIGHT_BYTES = 32 * 1024 * 1024
READ_SIZE = 1024 * 1024
DIRECT_SEND_MIN = 32 * 1024  # replies this big go straight to the socket when nothing is queued
# Whole-chunk downloads answered at once during one pass over the received bytes are sent
# together: one sendmsg per this many bytes (or parts, under the kernel's IOV_MAX of 1024).
DIRECT_BATCH_BYTES = 1024 * 1024
DIRECT_BATCH_PARTS = 512
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

# requests timed for sbpnode_request_duration_seconds (node/metrics.py)
_LATENCY_NAMES = {codec.READ: "toasty.read", codec.WRITE: "toasty.write"}


# sbpnode_responses_total (node/metrics.py): replies counted by reply type << 8 | status, the
# status 0 for a success and, for an error reply, 1 + the index of its ErrorCode (ERROR_STATUS_OTHER:
# a text naming none). Int keys: node.metrics is dumped as JSON.
ERROR_CODES = tuple(ErrorCode)
ERROR_STATUS_OTHER = 255
_ERROR_REPLIES = frozenset((codec.CREATE_ERROR, codec.DELETE_ERROR, codec.LIST_ERROR, codec.READ_ERROR,
                            codec.WRITE_ERROR, codec.CREATE_CHUNK_ERROR, codec.UPLOAD_CHUNK_ERROR,
                            codec.DOWNLOAD_CHUNK_ERROR))


_ERROR_TEXTS = tuple((code.value, 1 + i) for i, code in enumerate(ERROR_CODES))


def _error_status(message):
    """ErrorCode.of's match without its walk over the enum (10x slower)."""
    for text, status in _ERROR_TEXTS:
        if message.startswith(text):
            return status
    return ERROR_STATUS_OTHER


_REPLY_OPERATIONS = {
    codec.CREATE_SUCCESS: "create", codec.CREATE_ERROR: "create",
    codec.DELETE_SUCCESS: "delete", codec.DELETE_ERROR: "delete",
    codec.LIST_SUCCESS: "list", codec.LIST_ERROR: "list",
    codec.READ_SUCCESS: "read", codec.READ_ERROR: "read",
    codec.WRITE_SUCCESS: "write", codec.WRITE_ERROR: "write",
    codec.CREATE_CHUNK_SUCCESS: "create_chunk", codec.CREATE_CHUNK_ERROR: "create_chunk",
    codec.UPLOAD_CHUNK_SUCCESS: "upload_chunk", codec.UPLOAD_CHUNK_ERROR: "upload_chunk",
    codec.DOWNLOAD_CHUNK_SUCCESS: "download_chunk", codec.DOWNLOAD_CHUNK_ERROR: "download_chunk",
}


def response_labels(key):
    """(operation, status, ok) of a key of the ``responses`` counts (node/metrics.py): status
    "ok" or the error reply's ErrorCode name."""
    kind, status = key >> 8, key & 0xFF
    operation = _REPLY_OPERATIONS.get(kind, "unknown")
    if status == 0:
        return operation, "ok", True
    if status == ERROR_STATUS_OTHER or status > len(ERROR_CODES):
        return operation, "other", False
    return operation, ERROR_CODES[status - 1].name, False


def _observed(result, observe, operation, t0):
    observe(operation, time.perf_counter() - t0)
    return result


class _Slot:
    __slots__ = ("data", "ready")

    def __init__(self):
        self.data = None
        self.ready = False


class _ToastyServerProtocol(Protocol):
    """Framing, ordered replies and backpressure shared by both listeners."""

    log = Logger()
    allowed = frozenset()

    def __init__(self, node):
        self.node = node
        # replies by status, wire bytes in and out (node/metrics.py)
        self.stats = node.metrics.setdefault("toasty", {"responses": {}, "bytes_in": 0, "bytes_out": 0})
        self._frames_in = Framer(codec.Layout(self.allowed))
        self._closed = False
        self._slots = deque()
        self._in_flight = 0
        self._in_flight_bytes = 0
        self.gate = None  # the ReadGate, once connected
        self._framing = False

    # -- connection ---------------------------------------------------------------------------

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        # Read in 1 MiB steps: a 64 KiB chunk message is one read, not two.
        tcp_internals.set_read_size(self.transport, READ_SIZE)
        self.gate = ReadGate(self.transport, self._frames_again)
        self.transport.registerProducer(self.gate, True)
        connections = getattr(getattr(self, "factory", None), "connections", None)
        if connections is not None:
            connections.add(self)  # sbpnode_connections (node/metrics.py)

    def connectionLost(self, reason):
        connections = getattr(getattr(self, "factory", None), "connections", None)
        if connections is not None:
            connections.discard(self)
        self._closed = True
        if self.gate is not None:
            self.gate.stop()
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

    # -- backpressure ----------------------------------------------------------------------------

    def _update_reading(self):
        # Hysteresis: pause at the budget, resume at half of it (not one epoll change per request).
        gate = self.gate
        div = 2 if BUDGET in gate.reasons else 1
        gate.set(BUDGET, self._in_flight >= MAX_IN_FLIGHT // div or self._in_flight_bytes >= MAX_IN_FLIGHT_BYTES // div)
        # The store's write queue is over its high-water mark: stop reading until it drains.
        gate.watch_store(self.node.store)

    def _frames_again(self):
        """The gate opened: frame what was received meanwhile."""
        if not self._closed and not self._framing:  # else the running _frames loop carries on
            self._frames()

    # -- framing ------------------------------------------------------------------------------

    def dataReceived(self, data):
        if self._closed:
            return
        self._frames_in.feed(data)
        self.stats["bytes_in"] += len(data)
        if not self._framing:
            self._frames()

    def _frames(self):
        self._framing = True
        try:
            self._frame_loop()
        finally:
            self._framing = False
            self.frames_done()

    def _frame_loop(self):
        # The framer hands out spans of immutable received bytes, so message data can be handed
        # on as views of them without a copy.
        framer = self._frames_in
        charged = None  # the read already charged for a message holding a view of it
        gate = self.gate
        while not self._closed and gate.reading:
            try:
                span = framer.next()
            except codec.CodecError as e:
                self._drop(str(e))
                return
            if span is None:
                break
            buf, pos, end = span
            length = end - pos
            mtype = HEADER.unpack_from(buf, pos)[1]
            msg = None
            extra = 0
            if mtype == codec.CREATE_CHUNK and length >= HEADER_LEN + 12:
                # The bulk message: its data is a view of the received bytes (no copy). The view
                # keeps the whole read alive until the chunk is stored, so the in-flight budget
                # counts the read's size too (on the first such message of the read).
                chunk_size, off, n = _CREATE_CHUNK_HEAD.unpack_from(buf, pos + HEADER_LEN)
                if n == length - HEADER_LEN - 12:
                    msg = codec.CreateChunk(chunk_size, off, memoryview(buf)[pos + HEADER_LEN + 12 : end])
                    if buf is not charged:
                        extra, charged = len(buf), buf
            if msg is None:
                body = buf[pos + HEADER_LEN : end]
                try:
                    msg = codec.decode_request(mtype, body)
                except codec.CodecError as e:
                    self._drop(str(e))
                    return
            self._start(msg, self.cost(msg, length) + extra)

    # -- ordered replies ----------------------------------------------------------------------

    def _count(self, mtype):
        metrics = self.node.metrics
        key = _METRIC_NAMES[mtype]
        metrics[key] = metrics.get(key, 0) + 1

    def _start(self, msg, size):
        t0 = time.perf_counter()
        self._count(msg.TYPE)
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
        if msg.TYPE in _LATENCY_NAMES and hasattr(self.node, "observe_latency"):
            d.addBoth(_observed, self.node.observe_latency, _LATENCY_NAMES[msg.TYPE], t0)

    def _internal_error(self, failure, msg):
        if failure.check(errors.StoreError):  # busy, closing, or failed after an I/O error
            if not failure.check(errors.DiskFault):  # a disk fault is logged once, by the store
                self.log.warn("toasty request {type} refused by the store: {error}", type=type(msg).__name__, error=failure.value)
            return self.error_reply(msg, ErrorCode.IO_ERROR.message(failure.value))
        self.log.failure("toasty request {type} failed", failure, type=type(msg).__name__)
        return self.error_reply(msg, ErrorCode.IO_ERROR.message())

    def _finish(self, reply, slot, size):
        if self._ready(reply, slot, size):
            self._flush_ready()

    def _ready(self, reply, slot, size):
        """Fill a request's slot with its reply (written by _flush_ready); False once closed."""
        self._in_flight -= 1
        self._in_flight_bytes -= size
        if self._closed:
            return False
        kind = reply.TYPE
        key = (kind << 8 | _error_status(reply.message)) if kind in _ERROR_REPLIES else kind << 8
        responses = self.stats["responses"]
        responses[key] = responses.get(key, 0) + 1
        slot.data = codec.encode_parts(reply)
        slot.ready = True
        return True

    def _flush_ready(self):
        """Write the replies at the head of the queue that are ready, small ones in one write."""
        small = []
        slots = self._slots
        sent = 0
        while slots and slots[0].ready:
            parts = slots.popleft().data
            size = sum(len(p) for p in parts) if len(parts) > 1 else 0
            if size >= DIRECT_SEND_MIN:
                if small:
                    data = b"".join(small)
                    sent += len(data)
                    self.transport.write(data)
                    small = []
                sent += size
                self._send(parts)
            else:
                small.extend(parts)
        if small:
            data = b"".join(small)
            sent += len(data)
            self.transport.write(data)
        self.stats["bytes_out"] += sent
        self._update_reading()

    def _send(self, parts):
        """Write one reply (a list of buffers): a big one of few parts goes straight to the socket
        with one sendmsg (no copy into the transport's buffer, no wait for the next reactor turn)
        when nothing is queued before it; what the socket does not take is queued behind."""
        if len(parts) <= 64 and sum(len(p) for p in parts) >= DIRECT_SEND_MIN:
            send_parts_now(self.transport, parts)
        else:
            self.transport.write(b"".join(parts))  # Twisted takes bytes only

    def frames_done(self):
        """Called after each pass over the received bytes (subclasses flush batches here)."""

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
        self._writes = 0  # unacknowledged mutations of this connection
        self._order = defer.DeferredLock()  # cluster mode: one request of this connection at a time

    def error_reply(self, msg, text):
        if msg.TYPE == codec.READ:
            return codec.ReadError(text, self.factory.write_locations())
        return codec.ErrorReply(_ERROR_TYPE[msg.TYPE], text)

    def handle(self, msg):
        if self.factory.clustered:
            return self._cluster_op(msg)
        if msg.TYPE in (codec.LIST, codec.READ):
            return self._read_op(msg)
        self._writes += 1
        d = self._write_op(msg)
        d.addBoth(self._write_done)
        return d

    def _write_done(self, result):
        self._writes -= 1
        return result

    def _read_op(self, msg):
        # CONTRACT §5: a read sees exactly the requests sent before it on its connection. With
        # none of them unacknowledged, that is the committed state; else the read takes its place
        # in the mutation batch behind them, ahead of any mutation sent after it.
        queued = self._writes > 0
        tree = self.tree
        try:
            if msg.TYPE == codec.LIST:
                components, after = paths.split_list_path(msg.path)
                args = (components, msg.expect_gen, after, codec.MAX_LIST_ITEMS)
                if not queued:
                    return defer.succeed(self._list_reply(tree.list(*args)))
                d = tree.list_queued(*args)
                d.addCallback(self._list_reply)
            else:
                components = paths.normalize(msg.path)
                args = (components, msg.expect_gen, msg.offset, msg.length, codec.MAX_READ_CHUNKS)
                if not queued:
                    return defer.succeed(self._read_reply(tree.read(*args)))
                d = tree.read_queued(*args)
                d.addCallback(self._read_reply)
        except (paths.InvalidPath, file_tree.FsError) as e:
            return defer.succeed(self.error_reply(msg, str(e)))
        d.addErrback(self._fs_error, msg)
        return d

    @staticmethod
    def _list_reply(result):
        gen, truncated, items = result
        return codec.ListSuccess(gen, truncated, [codec.ListItem(g, d, n) for n, g, d in items])

    def _read_reply(self, r):
        holders = self.factory.holders()
        chunks = [codec.ReadChunk(h, [] if h == codec.ZERO_HASH else holders) for h in r.hashes]
        return codec.ReadSuccess(r.gen, r.chunk_size, r.file_length, chunks, self.factory.write_locations())

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

    # -- cluster mode (CONTRACT §9): the tree in etcd, chunks on R nodes -----------------------

    def _cluster_op(self, msg):
        """Requests of one connection run one after another (CONTRACT §5: each sees exactly the
        ones sent before it); each is linearizable at its etcd transaction."""
        return self._order.run(self._cluster_run, msg)

    def _cluster_run(self, msg):
        cluster = self.factory.cluster()
        if cluster is None:
            return defer.succeed(self.error_reply(msg, ErrorCode.IO_ERROR.message("the node has not joined its cluster yet")))
        tree = cluster.tree
        t = msg.TYPE
        try:
            if t == codec.LIST:
                components, after = paths.split_list_path(msg.path)
                d = tree.list(components, msg.expect_gen, after, codec.MAX_LIST_ITEMS)
                d.addCallback(self._list_reply)
            else:
                components = paths.normalize(msg.path)
                if t == codec.READ:
                    d = tree.read(components, msg.expect_gen, msg.offset, msg.length, codec.MAX_READ_CHUNKS)
                    d.addCallback(self._cluster_read_reply, cluster)
                elif t == codec.CREATE:
                    d = tree.create(components, msg.is_dir, msg.chunk_size)
                    d.addCallback(codec.CreateSuccess)
                elif t == codec.DELETE:
                    d = tree.delete(components, msg.expect_gen)
                    d.addCallback(lambda _: codec.DeleteSuccess())
                else:
                    d = cluster.confirm_holders(msg.chunks)
                    d.addCallback(lambda holders: tree.write(components, msg.expect_gen, msg.flags, msg.offset,
                                                             msg.length, [c.hash for c in msg.chunks], holders))
                    d.addCallback(codec.WriteSuccess)
        except paths.InvalidPath as e:
            return defer.succeed(self.error_reply(msg, str(e)))
        d.addErrback(self._cluster_error, msg, cluster)
        return d

    def _cluster_read_reply(self, r, cluster):
        lists = {}  # one AddrList per distinct holder set
        chunks = []
        for h, ids in zip(r.hashes, r.holders):
            key = tuple(ids)
            if key not in lists:
                lists[key] = [codec.AddrList.of([a]) for a in cluster.holder_addresses(ids)]
            chunks.append(codec.ReadChunk(h, [] if h == codec.ZERO_HASH else lists[key]))
        return codec.ReadSuccess(r.gen, r.chunk_size, r.file_length, chunks, self.factory.write_locations())

    def _cluster_error(self, failure, msg, cluster):
        if failure.check(file_tree.FsError):
            return self.error_reply(msg, str(failure.value))
        if failure.check(*cluster.unavailable):
            self.log.warn("toasty request {type} failed on etcd: {error}", type=type(msg).__name__, error=failure.value)
            return self.error_reply(msg, ErrorCode.IO_ERROR.message("cluster metadata store: %s" % failure.value))
        return failure

    def _fs_error(self, failure, msg):
        failure.trap(file_tree.FsError)
        return self.error_reply(msg, str(failure.value))


class MetaServerFactory(Factory):
    log = Logger()

    def __init__(self, node):
        self.node = node
        self.connections = set()
        self.tree = file_tree.FileTree(node.store)
        self.replication_factor = max(1, int(getattr(node.config, "replication_factor", 1) or 1))
        self._locations = None
        # CONTRACT §9: with --cluster every request goes to the cluster's tree (node/cluster/toasty_*)
        self.clustered = bool(getattr(node.config, "cluster", None))

    def cluster(self):
        """The cluster's Toasty part (node.cluster.toasty), None until the node has joined."""
        c = getattr(self.node, "cluster", None)
        return getattr(c, "toasty", None) if c is not None else None

    def startFactory(self):
        if self.clustered:
            return  # the root is implicit in the cluster's tree
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
        """CONTRACT §5: this node's chunk listener (empty when --chunks is none); in a cluster
        (CONTRACT §9) R distinct live members' chunk listeners."""
        if self.clustered:
            cluster = self.cluster()
            return [codec.AddrList.of([a]) for a in cluster.write_locations()] if cluster is not None else []
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

    def __init__(self, node):
        super().__init__(node)
        self._puts = []  # CREATE_CHUNK / UPLOAD_CHUNK data of this pass: [(data, Deferred)]
        self._direct = []  # parts of the downloads of this pass answered at once, not sent yet
        self._direct_bytes = 0

    def cost(self, msg, length):
        # A CREATE_CHUNK of part of a chunk builds a chunk_size chunk (a whole one is stored
        # from the received frame itself: no second copy); a patch or a download loads a stored
        # chunk (its size unknown until then: counted as 1 MiB) -- so a peer cannot make us hold
        # gigabytes with small requests.
        if msg.TYPE == codec.CREATE_CHUNK:
            if msg.offset == 0 and len(msg.data) == msg.chunk_size:
                return length
            return length + msg.chunk_size
        return length + 1024 * 1024

    def error_reply(self, msg, text):
        return codec.ErrorReply(_ERROR_TYPE[msg.TYPE], text)

    def _start(self, msg, size):
        t = msg.TYPE
        # A whole-chunk download with no reply queued ahead of it and an empty send buffer is
        # answered at once: the chunk is read from the page cache (never waiting for the disk)
        # and its reply goes straight to the socket -- no thread hop, no Deferred, no slot. The
        # replies of one pass over the received bytes leave together (one sendmsg for the
        # pipelined requests of one read: fewer system calls here, fewer wake-ups and bigger
        # reads in the client).
        if t == codec.DOWNLOAD_CHUNK and msg.full and not self._slots and (self._direct or idle_socket(self.transport) is not None):
            try:
                data = self.node.store.chunks.get_cached(msg.hash)
            except Exception:
                data = None  # the ordinary path answers errors
            if data is not None:
                self._count(t)
                parts = codec.encode_parts(codec.DownloadChunkSuccess(data))
                self._direct.extend(parts)
                self._direct_bytes += sum(len(p) for p in parts)
                if self._direct_bytes >= DIRECT_BATCH_BYTES or len(self._direct) >= DIRECT_BATCH_PARTS:
                    self._send_direct()
                return
        self._send_direct()  # replies keep request order: the ones answered at once go first
        # A CREATE_CHUNK joins this pass's batch of chunks to store; its reply is written when
        # the batch is stored (no Deferred per chunk).
        if t == codec.CREATE_CHUNK:
            chunk_size, off, n = msg.chunk_size, msg.offset, len(msg.data)
            if 0 < chunk_size <= file_tree.MAX_CHUNK_SIZE and off + n <= chunk_size:
                self._count(t)
                slot = _Slot()
                self._slots.append(slot)
                self._in_flight += 1
                self._in_flight_bytes += size
                self._update_reading()
                if off == 0 and n == chunk_size:
                    data = msg.data
                else:
                    data = b"".join((bytes(off), msg.data, bytes(chunk_size - off - n)))
                self._puts.append((data, (slot, size, msg)))
                return
        super()._start(msg, size)

    def _load(self, addr):
        """Deferred[chunk bytes]: from the page cache at once when it is there, else read by the
        store's thread pool."""
        chunks = self.node.store.chunks
        try:
            data = chunks.get_cached(addr)
        except Exception:
            return defer.fail()
        if data is not None:
            return defer.succeed(data)
        return chunks.get(addr)

    def _put(self, data):
        """Deferred[address]: chunks to store from one pass over the received bytes go to the
        store together (one transaction, see frames_done)."""
        d = defer.Deferred()
        self._puts.append((data, d))
        if not self._framing:
            self.frames_done()
        return d

    def _send_direct(self):
        if self._direct:
            parts, self._direct, self._direct_bytes = self._direct, [], 0
            send_parts_now(self.transport, parts)

    def _drop(self, why):
        self._send_direct()  # the replies to the requests before the malformed one
        super()._drop(why)

    def connectionLost(self, reason):
        self._direct, self._direct_bytes = [], 0
        super().connectionLost(reason)

    def frames_done(self):
        self._send_direct()
        if not self._puts:
            return
        puts, self._puts = self._puts, []

        def stored(addrs):
            flush = False
            for (_, target), addr in zip(puts, addrs):
                if isinstance(target, defer.Deferred):
                    target.callback(addr)
                else:
                    slot, size, _ = target
                    flush = self._ready(codec.CreateChunkSuccess(addr), slot, size)
            if flush:
                self._flush_ready()  # the batch's replies in one write

        def failed(failure):
            flush = False
            for _, target in puts:
                if isinstance(target, defer.Deferred):
                    target.errback(failure)
                else:
                    slot, size, msg = target
                    flush = self._ready(self._internal_error(failure, msg), slot, size)
            if flush:
                self._flush_ready()

        # more chunks of a pipelined upload are already arriving: the store may wait a moment to
        # hash them together with these (storage.sha256.Gatherer)
        more = self._frames_in.buffered() > 0 and BUDGET not in self.gate.reasons
        self.node.store.chunks.put_many([data for data, _ in puts], more=more).addCallbacks(stored, failed)

    def handle(self, msg):
        t = msg.TYPE
        if t == codec.CREATE_CHUNK:
            size, off, n = msg.chunk_size, msg.offset, len(msg.data)
            if not 0 < size <= file_tree.MAX_CHUNK_SIZE or off + n > size:
                return defer.succeed(self.error_reply(msg, ErrorCode.INVALID_RANGE.message()))
            if off == 0 and n == size:
                data = msg.data
            else:
                data = b"".join((bytes(off), msg.data, bytes(size - off - n)))
            d = self._put(data)
            d.addCallback(codec.CreateChunkSuccess)
        elif t == codec.UPLOAD_CHUNK:
            d = self._load(msg.hash)
            d.addCallback(self._patch, msg)
        else:
            d = self._load(msg.hash)
            d.addCallback(self._download, msg)
        d.addErrback(self._chunk_error, msg)
        return d

    def _patch(self, data, msg):
        off, n = msg.offset, len(msg.data)
        if off + n > len(data):
            return self.error_reply(msg, ErrorCode.INVALID_RANGE.message())
        patched = b"".join((data[:off], msg.data, data[off + n :]))
        d = self._put(patched)
        d.addCallback(codec.UploadChunkSuccess)
        return d

    def _download(self, data, msg):
        if msg.full:
            return codec.DownloadChunkSuccess(data)
        if msg.offset + msg.length > len(data):
            return self.error_reply(msg, ErrorCode.INVALID_RANGE.message())
        return codec.DownloadChunkSuccess(data[msg.offset : msg.offset + msg.length])

    def _chunk_error(self, failure, msg):
        failure.trap(errors.ChunkNotFound)
        return self.error_reply(msg, ErrorCode.CHUNK_NOT_FOUND.message())


class ChunkServerFactory(Factory):
    def __init__(self, node):
        self.node = node
        self.connections = set()
        # CREATE_CHUNK / UPLOAD_CHUNK addresses are hashed by the store (chunks.put_many) with the
        # multi-buffer SHA-256 once it is loaded (storage/sha256.py); the ready file waits for it
        reactor = getattr(node, "reactor", None)
        if reactor is not None and hasattr(node, "before_ready"):
            node.before_ready(multi_sha256.start_loading(reactor), "multi-buffer SHA-256")
        else:
            multi_sha256.start_loading()

    def buildProtocol(self, addr):
        p = ChunkServerProtocol(self.node)
        p.factory = self
        return p


def build_chunk_factory(node):
    return ChunkServerFactory(node)
