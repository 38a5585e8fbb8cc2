"""The SBP server: range server and placement driver in one (CONTRACT §3) over the node's store.

One ``SbpServerProtocol`` per connection. It frames with ``codec.FrameBuffer``, decodes the extended
header with the codec, runs the request against ``store.log`` and writes the encoded reply. Requests
are independent (responses are matched by the frame's stream_id), so replies leave as they complete.

Backpressure, through the connection's ``read_gate.ReadGate`` (the transport's streaming producer):
a connection may have at most ``inflight_budget`` bytes of APPEND payload and FETCH reads
outstanding; past it the server stops reading that connection (reason ``budget``) and replies carry
``throttle_time_ms``. When the socket's send buffer fills (a slow FETCH reader) it stops reading new
requests until it drains (``send buffer``), so the node never buffers more than the replies to
requests already accepted; likewise while the store's write queue is congested with APPENDs of this
connection in flight (``store congestion``), and for good once GOAWAY is sent or received
(``closing``).

Zero-copy FETCH: on a plain TCP/UNIX connection the store answers FETCH reads with
``log.read_spans`` (big batches as FileSpans: where they lie in the WAL files) and the reply goes
out through a ``sendfile.FileSender``: prefix and header as bytes, each such batch with
``os.sendfile`` from the file, then the CRC, derived from the stored batches' CRCs. The
FileSender's queue is a second send buffer: over its limit the server stops reading as well
(``send queue``).
"""

from twisted.internet import defer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from protocols import tcp_internals
from protocols.read_gate import BUDGET, CLOSING, SEND_QUEUE, ReadGate
from protocols.sbp import codec
from protocols.sbp.admin import RangeAdmin
from protocols.sbp.append import RESULTS_PER_FRAME, AppendHandler
from protocols.sbp.codec import T
from protocols.sbp.fetch import FRAME_PAYLOAD_CAP, PREFETCH_STEPS, READ_AHEAD_MAX, FetchHandler
from protocols.sbp.sendfile import FileSender
from protocols.sbp.status import status_for_failure
from storage import block_check, record_batch

DEFAULT_INFLIGHT_BUDGET = 64 * 1024 * 1024

# Names this module kept before the split (tests, benches and other modules import them from here).
validate_batch = record_batch.validate_count
__all__ = ["SbpServerFactory", "SbpServerProtocol", "build_factory", "validate_batch", "status_for_failure",
           "FRAME_PAYLOAD_CAP", "RESULTS_PER_FRAME", "READ_AHEAD_MAX", "DEFAULT_INFLIGHT_BUDGET"]

_DEFER_CRC = frozenset([codec.APPEND])


def _ignore_latency(operation, seconds):
    """A node without the latency hook (--metrics off, test doubles)."""


class SbpServerFactory(Factory):
    log = Logger()

    # FETCH replies send big stored batches straight from the WAL files (os.sendfile) on plain
    # TCP/UNIX connections; False: every reply is bytes read by the store's read pool.
    zero_copy = True
    # Steps of PREFETCH_STEP bytes a sequential FETCH reader's stream is kept asked into the page
    # cache ahead of it (protocols/sbp/fetch.py; 0: none).
    prefetch_steps = PREFETCH_STEPS
    # What answers the placement-driver and range-admin requests (protocols/sbp/admin.py).
    admin_class = RangeAdmin

    def __init__(self, node, inflight_budget=DEFAULT_INFLIGHT_BUDGET):
        self.node = node
        self.store = node.store
        self.reactor = node.reactor
        self.inflight_budget = inflight_budget
        self.connections = set()
        self.shutting_down = False
        metrics = node.metrics.setdefault("sbp", {})
        for k in ("connections", "appends", "append_records", "append_bytes", "fetches", "fetch_bytes", "fetch_sendfile_bytes", "read_ahead_hits", "fetch_pool_reads", "errors",
                  "fetch_sendfile_calls", "fetch_sendfile_short", "fetch_send_stalls", "prefetch_checks", "prefetch_pieces"):
            metrics.setdefault(k, 0)
        metrics.setdefault("fetch_send_wall_s", 0.0)
        self.metrics = metrics
        self.reported = node.metrics.setdefault("sbp_reported_metrics", {})
        # sbpnode_responses_total (node/metrics.py): replies by opcode << 16 | status code (int
        # keys: node.metrics is dumped as JSON by DESCRIBE_PD_CLUSTER)
        self.responses = node.metrics.setdefault("sbp_responses", {})
        self.observe_latency = getattr(node, "observe_latency", _ignore_latency)  # node/metrics.py
        if hasattr(node, "before_ready"):  # the node writes its ready file once it has loaded
            node.before_ready(block_check.start_loading(self.reactor), "compiled APPEND check")
        else:
            block_check.start_loading()
        # CONTRACT §9: with --cluster, the placement driver answers from etcd and APPEND / FETCH
        # are routed to the stream's node (protocols/sbp/cluster.py)
        self.router = None
        self.appender = None  # what APPEND writes through: None the store's log; in a cluster the replicator
        if getattr(node, "cluster", None) is not None:
            from protocols.sbp.cluster import ClusterAdmin, ClusterRouter

            self.admin_class = ClusterAdmin
            self.router = ClusterRouter(node.cluster, self)
            self.appender = getattr(node.cluster, "replicator", None)
        if hasattr(node, "on_shutdown"):
            node.on_shutdown(self.shutdown)

    @property
    def max_batch_bytes(self):
        return getattr(self.node.config, "max_batch_bytes", None) or codec.MAX_FRAME_LENGTH - 64 * 1024

    def buildProtocol(self, addr):
        p = SbpServerProtocol(self)
        p.factory = self
        return p

    def this_server(self):
        """CONTRACT §3: this node as a RangeServer."""
        addr = None
        try:
            addr = self.node.advertised("sbp")
        except Exception:
            pass
        return T.RangeServer(self.node.node_id or 0, addr or "")

    def shutdown(self):
        """CONTRACT §1: GOAWAY on every connection, parked FETCHes answered with NO_NEW_RECORD,
        in-flight requests finished; fires once every connection has closed."""
        self.shutting_down = True
        waits = [conn.go_away() for conn in list(self.connections)]
        return defer.DeferredList(waits, consumeErrors=True)


class SbpServerProtocol(Protocol):
    """One connection: frames in, dispatch to APPEND / FETCH / admin, backpressure, GOAWAY.

    What the handlers (append.py, fetch.py, admin.py) use of it: ``out``, ``sender``,
    ``read_batches``, ``read_now``, ``lost``, ``closing``, ``begin``/``end``, ``warn``, ``throttle_time_ms``,
    ``maybe_idle``, ``store``, ``factory``, ``reactor``, ``log``."""

    log = Logger()

    def __init__(self, factory):
        self.factory = factory
        self.store = factory.store
        self.reactor = factory.reactor
        # APPEND's payload CRC is checked by the AppendHandler from the batches' own CRCs (one pass);
        # its payload is a view of the received bytes: the store (and in a cluster the replicas)
        # take the batches as they came, no copy on the way
        self.frames = codec.FrameBuffer(defer_crc=_DEFER_CRC, view_payload=_DEFER_CRC)
        self.peer = "?"
        self._inflight_bytes = 0
        self._inflight_ops = 0
        self.gate = None  # the ReadGate, once connected
        self.closing = False  # GOAWAY sent or received: no new requests; close when idle
        self.lost = False
        self._close_sent = False
        self._processing = False
        self._idle_waiters = []
        self.sender = None  # FileSender: replies with batches sent from the WAL files
        self.out = None  # where replies are written: the FileSender, or the transport
        self.read_batches = None  # store.log.read, or read_spans with a FileSender
        self.read_now = None  # with a FileSender: store.log.read_spans_now (the page cache, no Deferred)
        self.appends = AppendHandler(self)
        self.fetches = FetchHandler(self)
        self.admin = factory.admin_class(self)
        self.cluster_gate = None  # cluster mode: a Deferred while a frame waits on etcd (cluster.py)

    # -- connection ------------------------------------------------------------------------------

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        peer = self.transport.getPeer()
        self.peer = "%s:%s" % (getattr(peer, "host", "?"), getattr(peer, "port", "?"))
        self.gate = ReadGate(self.transport, self._process)
        self.transport.registerProducer(self.gate, True)
        tcp_internals.set_read_size(self.transport, codec.READ_SIZE)
        if self.factory.zero_copy:
            self.sender = FileSender.for_transport(self.transport, self._backlog, self.factory.metrics)
        if self.sender is not None:
            self.out = self.sender
            self.read_batches = self.store.log.read_spans
            self.read_now = self.store.log.read_spans_now
        else:
            self.out = self.transport
            self.read_batches = self.store.log.read if self.store is not None else None
        # FETCH replies run to 16 MiB: hand the kernel up to 4 MiB per send() instead of Twisted's
        # 128 KiB (one reactor iteration each): fewer iterations per big reply.
        tcp_internals.set_send_limit(self.transport, 4 << 20)
        self.factory.connections.add(self)
        self.factory.metrics["connections"] += 1
        if self.factory.shutting_down:
            self.go_away()

    def connectionLost(self, reason=None):
        self.lost = True
        if self.gate is not None:
            self.gate.stop()
        self.factory.connections.discard(self)
        self.factory.metrics["connections"] -= 1
        self.fetches.cancel_all()
        if self.sender is not None:
            self.sender.discard()
        self.frames = codec.FrameBuffer()
        self.maybe_idle()

    def _backlog(self, full):
        """The FileSender's queue went over its limit (full) or drained."""
        self.gate.set(SEND_QUEUE, full)

    def _lose(self):
        if self.sender is not None:
            self.sender.lose_connection()
        else:
            self.transport.loseConnection()

    def throttle_time_ms(self, inflight=None):
        """The throttle_time_ms of a reply now (``inflight``: with that many bytes in flight instead)."""
        budget = self.factory.inflight_budget
        if inflight is None:
            inflight = self._inflight_bytes
        if inflight * 2 <= budget:
            return 0
        return min(1000, int(100 * inflight / budget))

    @property
    def inflight_bytes(self) -> int:
        """Bytes of APPEND payload and FETCH reads begun and not yet answered."""
        return self._inflight_bytes

    def over_budget(self, nbytes) -> bool:
        """Would ``begin(nbytes)`` take the connection past its in-flight budget (and stop reading)?"""
        return self._inflight_bytes + nbytes > self.factory.inflight_budget

    def begin(self, nbytes=0):
        """A request (holding ``nbytes`` of the in-flight budget) is in progress."""
        self._inflight_ops += 1
        self._inflight_bytes += nbytes
        if nbytes:
            self.gate.set(BUDGET, self._inflight_bytes > self.factory.inflight_budget)

    def end(self, nbytes=0):
        """A request begun with ``begin(nbytes)`` is answered."""
        self._inflight_ops -= 1
        self._inflight_bytes -= nbytes
        if nbytes and not self.lost:
            self.gate.set(BUDGET, self._inflight_bytes > self.factory.inflight_budget)
        if self._inflight_ops == 0 and not self.fetches.ops:
            self.maybe_idle()

    def maybe_idle(self):
        """Nothing in flight: close if closing; fire the go_away waiters once closed."""
        if self._inflight_ops or self.fetches.ops:
            return
        if self.closing and not self.lost and not self._close_sent:
            self._close_sent = True
            self.transport.unregisterProducer()
            self._lose()  # after the buffered replies are written
        if self.lost:
            # only once the connection is really closed: our last replies have left
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def go_away(self):
        """Send GOAWAY, answer parked FETCHes, stop taking requests; fires when closed."""
        d = defer.Deferred()
        if self.lost:
            d.callback(None)
            return d
        self._idle_waiters.append(d)
        if not self.closing:
            self.closing = True
            self.gate.hold(CLOSING)
            self.out.write(codec.goaway_frame())
            self.fetches.shutdown()
        self.maybe_idle()
        return d

    def go_away_quietly(self):
        """The client's GOAWAY: take no new requests; in-flight ones (parked FETCHes included,
        bounded by their max_wait_ms) finish, then the server closes (CONTRACT §3)."""
        if not self.closing:
            self.closing = True
            self.gate.hold(CLOSING)
        self.maybe_idle()

    # -- frames ----------------------------------------------------------------------------------

    def dataReceived(self, data):
        if self.lost:
            return
        self.frames.feed(data)
        if self.gate.reading:
            self._process()

    def _process(self):
        if self._processing:
            return  # re-entered from a callback that fired synchronously; the outer loop goes on
        self._processing = True
        # the frames of one read go to the store's writer together (one group, one wake-up)
        core = getattr(self.store, "core", None)
        if core is not None:
            core.hold_wakeups()
        try:
            self._process_frames()
        finally:
            try:
                self.appends.flush()  # the read's run of APPENDs, before the writer is woken
            finally:
                self._processing = False
                if core is not None:
                    core.release_wakeups()
        if self._inflight_ops and not self.lost:
            # APPENDs in flight and the store's write queue long: stop reading until it drains
            self.gate.watch_store(self.store)

    def _process_frames(self):
        frames = self.frames
        gate = self.gate
        # one-batch APPENDs are taken into the handler's run in place (append.py), the rest parsed
        take = self.appends.take if self.appends.runs else None
        while not self.lost and not self.closing:
            if not gate.reading:
                return
            try:
                if take is None:
                    frame = frames.next()
                else:
                    span = frames.next_span()
                    if span is None:
                        return
                    if take(*span):
                        continue
                    frame = frames.parse(span)
            except codec.FrameLengthError as e:
                self.appends.flush()
                self.warn("frame refused, closing: {error}", e)
                self.out.write(codec.goaway_frame())
                self._lose()
                self.lost = True
                return
            except codec.FrameError as e:
                self.appends.flush()  # replies sent at once leave in frame order
                if e.action == "discard":
                    self.warn("frame discarded: {error}", e)
                else:
                    self.warn("bad frame: {error}", e)
                    self.count_reply(e.opcode, e.status)
                    self.out.write(codec.system_error_frame(e.opcode, e.stream_id, e.status, str(e)))
                continue
            if frame is None:
                return
            if frame.is_response:
                # Unsolicited responses (we never send requests) are ignored.
                continue
            try:
                if frame.opcode != codec.APPEND:
                    self.appends.flush()  # the APPENDs before it go to the store first
                self._dispatch(frame)
            except codec.HeaderDecodeError as e:
                self.appends.flush()
                self.warn("bad extended header: {error}", e)
                self.count_reply(frame.opcode, codec.INVALID_REQUEST)
                self.out.write(codec.system_error_frame(frame.opcode, frame.stream_id, codec.INVALID_REQUEST, str(e)))
            except Exception as e:  # a bug must not take the connection down
                self.appends.flush()
                self.log.failure("SBP request 0x{opcode:04x} failed", opcode=frame.opcode)
                self.factory.metrics["errors"] += 1
                self.count_reply(frame.opcode, codec.UNKNOWN)
                self.out.write(codec.system_error_frame(frame.opcode, frame.stream_id, codec.UNKNOWN, str(e)))

    def warn(self, fmt, e):
        """A peer's error: counted, logged once at warn with the peer address."""
        self.factory.metrics["errors"] += 1
        self.log.warn(fmt + " (peer {peer})", error=str(e), peer=self.peer)

    def count_reply(self, opcode, code):
        """One reply (or one APPEND/FETCH entry's result) with this status, for
        sbpnode_responses_total; an opcode the server does not know counts as 0 (the labels stay
        bounded whatever a peer sends)."""
        responses = self.factory.responses
        key = (opcode if opcode in codec.OPCODES else 0) << 16 | code
        responses[key] = responses.get(key, 0) + 1

    def _reply(self, frame, table_name, obj):
        st = obj["status"] if obj.__class__ is dict else getattr(obj, "status", None)
        self.count_reply(frame.opcode, st.code if st is not None else codec.OK)
        if self.lost:
            return
        self.out.write(codec.encode_frame(frame.opcode, codec.RESPONSE_LAST, frame.stream_id, codec.encode_table(table_name, obj)))

    def _dispatch(self, frame, routed=False):
        op = frame.opcode
        if (op == codec.APPEND or op == codec.FETCH) and self.factory.router is not None and not routed:
            if self.factory.router.route(self, frame):
                return
        if op == codec.APPEND:
            return self.appends.handle(frame)
        if op == codec.FETCH:
            return self.fetches.handle(frame)
        if op == codec.PING:
            # CONTRACT §3: echoed with flags 0x03, same header and payload
            self.count_reply(codec.PING, codec.OK)
            self.out.writeSequence(codec.encode_frame_parts(
                codec.PING, codec.RESPONSE_LAST, frame.stream_id, frame.header, (frame.payload,) if frame.payload else ()))
            return
        if op == codec.GOAWAY:
            # CONTRACT §3: no reply; in-flight requests finish, then the server closes.
            self.log.info("peer {peer} sent GOAWAY", peer=self.peer)
            self.go_away_quietly()
            return
        req = codec.decode_table(codec.OPCODES[op][1], frame.header)
        resp_name = codec.OPCODES[op][2]
        result = self.admin.handle(op, req)
        if isinstance(result, defer.Deferred):
            self.begin()

            def done(obj):
                self._reply(frame, resp_name, obj)

            def failed(f):
                self.log.failure("SBP {op} failed", f, op=codec.OPCODES[op][0])
                self._reply_status(frame, resp_name, status_for_failure(f))

            result.addCallbacks(done, failed)
            result.addBoth(lambda _: self.end())
        else:
            self._reply(frame, resp_name, result)

    def _reply_status(self, frame, resp_name, st):
        fields = dict((f, d) for f, _, d in codec.SCHEMA[resp_name])
        fields["status"] = st
        self._reply(frame, resp_name, fields)


def response_labels(key):
    """(operation, status, ok) of a key of the factory's ``responses`` counts (node/metrics.py);
    NO_NEW_RECORD is a FETCH answered (nothing new yet), so it counts as ok."""
    op, code = key >> 16, key & 0xFFFF
    name = codec.OPCODES[op][0].lower() if op in codec.OPCODES else "unknown"
    return name, codec.STATUS_NAMES.get(code, str(code)), code == codec.OK or code == codec.NO_NEW_RECORD


def build_factory(node):
    return SbpServerFactory(node)
