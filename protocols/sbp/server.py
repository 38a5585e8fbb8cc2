"""The SBP server: range server and placement driver in one (CONTRACT §3) over the node's store.

One ``SbpServerProtocol`` per connection. It frames with ``codec.FrameBuffer``, decodes the extended
header with the codec, runs the request against ``store.log`` and writes the encoded reply. Requests
are independent (responses are matched by the frame's stream_id), so replies leave as they complete.

Backpressure: a connection may have at most ``inflight_budget`` bytes of APPEND payload and FETCH
reads outstanding; past it the server stops reading that connection (``transport.pauseProducing``)
and replies carry ``throttle_time_ms``. The protocol is also the transport's streaming producer: when
the socket's send buffer fills (a slow FETCH reader) the server stops reading new requests until it
drains, so the node never buffers more than the replies to requests already accepted.

Zero-copy FETCH: on a plain TCP/UNIX connection the store answers FETCH reads with
``log.read_spans`` (big batches as FileSpans: where they lie in the WAL files) and the reply goes
out through a ``sendfile.FileSender``: prefix and header as bytes, each such batch with
``os.sendfile`` from the file, then the CRC, derived from the stored batches' CRCs. The
FileSender's queue is a second send buffer: over its limit the server stops reading as well.
"""

import json
import time
from itertools import chain
from operator import itemgetter

import msgpack
from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from zope.interface import implementer

from protocols.sbp import block_check, codec
from protocols.sbp.codec import T
from protocols.sbp.sendfile import FileSender
from storage import errors, record_batch
from storage.crc import crc32_held
from storage.wal import FileSpan

_BATCH_HEADER = record_batch.HEADER
_BATCH_HEADER_SIZE = record_batch.HEADER_SIZE
# A FETCH reply frame carries at most this much payload so header + payload stay within 16 MiB.
FRAME_PAYLOAD_CAP = codec.MAX_FRAME_LENGTH - 64 * 1024
DEFAULT_INFLIGHT_BUDGET = 64 * 1024 * 1024
# Results per reply frame: keeps a reply's header well inside the 64 KiB left beside the payload
# cap (a result with its status is under 128 bytes unless its message is long).
RESULTS_PER_FRAME = 256
# Largest FETCH result read ahead for a sequential reader (one per connection).
READ_AHEAD_MAX = 4 * 1024 * 1024


_G0, _G1, _G2, _G3 = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)
_LIST, _INT, _BYTES, _FOUR, _TWO = {list}, {int}, {bytes}, {4}, {2}


def validate_batch(batch, block_crc=None) -> int:
    """CONTRACT §3 batch validity; returns record_count. ``block_crc``: CRC-32 of ``batch[29:]`` if
    the caller has it. The records block is checked by the compiled walker once it is loaded
    (``block_check``), and otherwise, or when that one says no, by msgpack with column-wise checks.

    Same verdicts as ``record_batch.validate`` (tests/test_sbp_server.py checks that).
    """
    if len(batch) < _BATCH_HEADER_SIZE:
        raise record_batch.InvalidBatch("shorter than the batch header")
    magic, _base, count, _ts, crc, records_len = _BATCH_HEADER.unpack_from(batch, 0)
    if magic != record_batch.MAGIC:
        raise record_batch.InvalidBatch("bad batch magic")
    if records_len < 0 or len(batch) != _BATCH_HEADER_SIZE + records_len:
        raise record_batch.InvalidBatch("batch length != 29 + records_len")
    if count < 1:
        raise record_batch.InvalidBatch("record_count must be >= 1")
    block = memoryview(batch)[_BATCH_HEADER_SIZE:]
    if (codec.crc32(block) if block_crc is None else block_crc) != crc:
        raise record_batch.InvalidBatch("records block CRC mismatch")
    block_ok = block_check.records_block_ok
    if block_ok is not None and block_ok(batch, count):
        return count
    try:
        raw = msgpack.unpackb(block, raw=True, use_list=True, strict_map_key=False)
    except Exception:
        raise record_batch.InvalidBatch("records block is not msgpack") from None
    if type(raw) is not list or len(raw) != count:
        raise record_batch.InvalidBatch("records block does not hold record_count records")
    # column-wise checks with map/itemgetter run in C: no per-record Python frame
    if set(map(type, raw)) != _LIST or set(map(len, raw)) != _FOUR:
        raise record_batch.InvalidBatch("a record is not [offset_delta, timestamp_delta_ms, headers, body]")
    if list(map(_G0, raw)) != list(range(count)):
        raise record_batch.InvalidBatch("offset_delta is not 0..n-1")
    if set(map(type, map(_G1, raw))) != _INT or set(map(type, map(_G3, raw))) != _BYTES:
        raise record_batch.InvalidBatch("malformed timestamp delta or body")
    headers = list(map(_G2, raw))
    if set(map(type, headers)) != _LIST:
        raise record_batch.InvalidBatch("malformed record headers")
    pairs = list(chain.from_iterable(headers))
    if pairs:
        if set(map(type, pairs)) != _LIST or set(map(len, pairs)) != _TWO:
            raise record_batch.InvalidBatch("malformed record header")
        if set(map(type, chain.from_iterable(pairs))) != _BYTES:
            raise record_batch.InvalidBatch("malformed record header")
    return count


def status_for_failure(failure, log=None, what="request"):
    """Map a store error to the contract's status (CONTRACT §3)."""
    e = failure.value
    if isinstance(e, errors.StreamNotFound):
        return codec.status(codec.STREAM_NOT_FOUND, str(e) or "stream not found")
    if isinstance(e, errors.ReadOnlyStream):
        # CONTRACT §2: a replica stream answers mutations with PD_NOT_LEADER, message = origin
        return codec.status(codec.PD_NOT_LEADER, e.origin)
    if isinstance(e, errors.OffsetOutOfRange):
        return codec.status(codec.OFFSET_OUT_OF_RANGE, str(e) or "offset out of range")
    if isinstance(e, errors.RangeAlreadySealed):
        return codec.status(codec.RANGE_ALREADY_SEALED, str(e) or "range already sealed")
    if isinstance(e, errors.RangeNotFound):
        return codec.status(codec.RANGE_NOT_FOUND, str(e) or "range not found")
    if isinstance(e, errors.InvalidRequest):
        return codec.status(codec.INVALID_REQUEST, str(e) or "invalid request")
    if isinstance(e, errors.DataCorrupted):
        return codec.status(codec.DATA_CORRUPTED, str(e) or "stored data failed its CRC")
    if isinstance(e, errors.PayloadTooLarge):
        return codec.status(codec.PAYLOAD_TOO_LARGE, str(e) or "payload too large")
    if isinstance(e, getattr(errors, "StoreBusy", ())):
        return codec.status(codec.TOO_MANY_REQUESTS, str(e) or "store busy")
    if isinstance(e, defer.CancelledError):
        return codec.status(codec.UNKNOWN, "cancelled")
    if log is not None:
        log.failure("unexpected error in {what}", failure, what=what)
    return codec.status(codec.UNKNOWN, "%s: %s" % (type(e).__name__, e))


def _fail_status(e):
    from twisted.python.failure import Failure

    return status_for_failure(Failure(e))


_DEFER_CRC = frozenset([codec.APPEND])


class SbpServerFactory(Factory):
    log = Logger()

    # FETCH replies send big stored batches straight from the WAL files (os.sendfile) on plain
    # TCP/UNIX connections; False: every reply is bytes read by the store's read pool.
    zero_copy = True

    def __init__(self, node, inflight_budget=DEFAULT_INFLIGHT_BUDGET):
        self.node = node
        self.store = node.store
        self.reactor = node.reactor
        self.inflight_budget = inflight_budget
        self.connections = set()
        self.shutting_down = False
        metrics = node.metrics.setdefault("sbp", {})
        for k in ("connections", "appends", "append_records", "append_bytes", "fetches", "fetch_bytes", "fetch_sendfile_bytes", "read_ahead_hits", "errors"):
            metrics.setdefault(k, 0)
        self.metrics = metrics
        self.reported = node.metrics.setdefault("sbp_reported_metrics", {})
        block_check.start_loading()
        # CONTRACT §9: with --cluster, placement-driver opcodes and routing go through the cluster
        self.cluster = None
        if getattr(node, "cluster", None) is not None:
            from protocols.sbp.cluster import ClusterSbp

            self.cluster = ClusterSbp(node.cluster, self)
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

    def describe_node_view(self):
        """The node's metrics view (sbpctl status): node.metrics, including the values kept from
        REPORT_METRICS; DESCRIBE_PD_CLUSTER carries it as JSON in status.detail."""
        me = self.this_server()
        try:
            streams = len(self.store.log.streams())
        except Exception:
            streams = None
        return {"node_id": me.server_id, "sbp": me.advertise_addr, "streams": streams, "metrics": self.node.metrics,
                "append_check": block_check.state}

    def shutdown(self):
        """CONTRACT §1: GOAWAY on every connection, parked FETCHes answered with NO_NEW_RECORD,
        in-flight requests finished; fires once every connection has closed."""
        self.shutting_down = True
        waits = [conn.go_away() for conn in list(self.connections)]
        return defer.DeferredList(waits, consumeErrors=True)


@implementer(IPushProducer)
class SbpServerProtocol(Protocol):
    log = Logger()

    def __init__(self, factory):
        self.factory = factory
        self.store = factory.store
        self.reactor = factory.reactor
        # APPEND's payload CRC is checked in do_append from the batches' own CRCs (one pass)
        self.frames = codec.FrameBuffer(defer_crc=_DEFER_CRC)
        self.peer = "?"
        self._inflight_bytes = 0
        self._inflight_ops = 0
        self._write_paused = False
        self._reading_paused = False
        self._closing = False  # GOAWAY sent or received: no new requests; close when idle
        self._lost = False
        self._close_sent = False
        self._processing = False
        self._read_ahead = None
        self._fetches = set()  # _FetchOp in progress
        self._idle_waiters = []
        self._sender = None  # FileSender: replies with batches sent from the WAL files
        self._send_backlog = False  # the FileSender's queue is over its limit
        self._out = None  # where replies are written: the FileSender, or the transport
        self._read = None  # store.log.read, or read_spans with a FileSender

    # -- connection ------------------------------------------------------------------------------

    def connectionMade(self):
        try:
            self.transport.setTcpNoDelay(True)
        except Exception:
            pass
        peer = self.transport.getPeer()
        self.peer = "%s:%s" % (getattr(peer, "host", "?"), getattr(peer, "port", "?"))
        self.transport.registerProducer(self, True)
        if hasattr(self.transport, "bufferSize"):
            self.transport.bufferSize = codec.READ_SIZE
        if self.factory.zero_copy:
            self._sender = FileSender.for_transport(self.transport, self._backlog)
        if self._sender is not None:
            self._out = self._sender
            self._read = self.store.log.read_spans
        else:
            self._out = self.transport
            self._read = self.store.log.read if self.store is not None else None
        # FETCH replies run to 16 MiB: hand the kernel up to 4 MiB per send() instead of Twisted's
        # 128 KiB (one reactor iteration each): fewer iterations per big reply.
        if getattr(self.transport, "SEND_LIMIT", None) is not None:
            self.transport.SEND_LIMIT = 4 << 20
        self.factory.connections.add(self)
        self.factory.metrics["connections"] += 1
        if self.factory.shutting_down:
            self.go_away()

    def connectionLost(self, reason=None):
        self._lost = True
        self.factory.connections.discard(self)
        self.factory.metrics["connections"] -= 1
        for op in list(self._fetches):
            op.cancel()
        self._fetches.clear()
        self._read_ahead = None
        if self._sender is not None:
            self._sender.discard()
        self.frames = codec.FrameBuffer()
        self._fire_idle()

    # IPushProducer: the transport's send buffer is full, or drained again
    def pauseProducing(self):
        self._write_paused = True
        self._update_reading()

    def resumeProducing(self):
        self._write_paused = False
        self._update_reading()
        if not self._reading_paused:
            self._process()

    def stopProducing(self):
        pass

    def _backlog(self, full):
        """The FileSender's queue went over its limit (full) or drained."""
        self._send_backlog = full
        self._update_reading()
        if not full and not self._reading_paused and not self._lost:
            self._process()

    def _lose(self):
        if self._sender is not None:
            self._sender.lose_connection()
        else:
            self.transport.loseConnection()

    def _update_reading(self):
        want = (self._write_paused or self._send_backlog or self._closing
                or self._inflight_bytes > self.factory.inflight_budget)
        if want != self._reading_paused and not self._lost:
            self._reading_paused = want
            if want:
                self.transport.pauseProducing()
            else:
                self.transport.resumeProducing()

    def throttle_time_ms(self):
        budget = self.factory.inflight_budget
        if self._inflight_bytes * 2 <= budget:
            return 0
        return min(1000, int(100 * self._inflight_bytes / budget))

    def _begin(self, nbytes=0):
        self._inflight_ops += 1
        self._inflight_bytes += nbytes
        if nbytes:
            self._update_reading()

    def _end(self, nbytes=0):
        self._inflight_ops -= 1
        self._inflight_bytes -= nbytes
        if nbytes:
            self._update_reading()
            if not self._reading_paused and not self._lost:
                self._process()
        if self._inflight_ops == 0 and not self._fetches:
            self._fire_idle()

    def _fire_idle(self):
        if self._inflight_ops or self._fetches:
            return
        if self._closing and not self._lost and not self._close_sent:
            self._close_sent = True
            self.transport.unregisterProducer()
            self._lose()  # after the buffered replies are written
        if self._lost:
            # only once the connection is really closed: our last replies have left
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def go_away(self):
        """Send GOAWAY, answer parked FETCHes, stop taking requests; fires when closed."""
        d = defer.Deferred()
        if self._lost:
            d.callback(None)
            return d
        self._idle_waiters.append(d)
        if not self._closing:
            self._closing = True
            self._update_reading()
            self._out.write(codec.goaway_frame())
            for op in list(self._fetches):
                op.shutdown()
        self._fire_idle()
        return d

    # -- frames ----------------------------------------------------------------------------------

    def dataReceived(self, data):
        if self._lost:
            return
        self.frames.feed(data)
        if not self._reading_paused:
            self._process()

    def _process(self):
        if self._processing:
            return  # re-entered from a callback that fired synchronously; the outer loop goes on
        self._processing = True
        try:
            self._process_frames()
        finally:
            self._processing = False

    def _process_frames(self):
        frames = self.frames
        while not self._lost and not self._closing:
            if self._reading_paused:
                return
            try:
                frame = frames.next()
            except codec.FrameLengthError as e:
                self._warn("frame refused, closing: {error}", e)
                self._out.write(codec.goaway_frame())
                self._lose()
                self._lost = True
                return
            except codec.FrameError as e:
                if e.action == "discard":
                    self._warn("frame discarded: {error}", e)
                else:
                    self._warn("bad frame: {error}", e)
                    self._out.write(codec.system_error_frame(e.opcode, e.stream_id, e.status, str(e)))
                continue
            if frame is None:
                return
            if frame.is_response:
                # Unsolicited responses (we never send requests) are ignored.
                continue
            try:
                self._dispatch(frame)
            except codec.HeaderDecodeError as e:
                self._warn("bad extended header: {error}", e)
                self._out.write(codec.system_error_frame(frame.opcode, frame.stream_id, codec.INVALID_REQUEST, str(e)))
            except Exception as e:  # a bug must not take the connection down
                self.log.failure("SBP request 0x{opcode:04x} failed", opcode=frame.opcode)
                self.factory.metrics["errors"] += 1
                self._out.write(codec.system_error_frame(frame.opcode, frame.stream_id, codec.UNKNOWN, str(e)))

    def _warn(self, fmt, e):
        self.factory.metrics["errors"] += 1
        self.log.warn(fmt + " (peer {peer})", error=str(e), peer=self.peer)

    def _reply(self, frame, table_name, obj):
        if self._lost:
            return
        self._out.write(codec.encode_frame(frame.opcode, codec.RESPONSE_LAST, frame.stream_id, codec.encode_table(table_name, obj)))

    def _dispatch(self, frame, routed=False):
        op = frame.opcode
        if self.factory.cluster is not None and not routed and self.factory.cluster.intercept(self, frame):
            return
        if op == codec.APPEND:
            return self.do_append(frame)
        if op == codec.FETCH:
            return self.do_fetch(frame)
        if op == codec.PING:
            # CONTRACT §3: echoed with flags 0x03, same header and payload
            self._out.writeSequence(codec.encode_frame_parts(
                codec.PING, codec.RESPONSE_LAST, frame.stream_id, frame.header, (frame.payload,) if frame.payload else ()))
            return
        if op == codec.GOAWAY:
            # CONTRACT §3: no reply; in-flight requests finish, then the server closes.
            self.log.info("peer {peer} sent GOAWAY", peer=self.peer)
            self.go_away_quietly()
            return
        handler = self._HANDLERS.get(op)
        req = codec.decode_table(codec.OPCODES[op][1], frame.header)
        resp_name = codec.OPCODES[op][2]
        result = handler(self, req)
        if isinstance(result, defer.Deferred):
            self._begin()

            def done(obj):
                self._reply(frame, resp_name, obj)

            def failed(f):
                self.log.failure("SBP {op} failed", f, op=codec.OPCODES[op][0])
                self._reply_status(frame, resp_name, status_for_failure(f))

            result.addCallbacks(done, failed)
            result.addBoth(lambda _: self._end())
        else:
            self._reply(frame, resp_name, result)

    def _reply_status(self, frame, resp_name, st):
        fields = dict((f, d) for f, _, d in codec.SCHEMA[resp_name])
        fields["status"] = st
        self._reply(frame, resp_name, fields)

    def go_away_quietly(self):
        """The client's GOAWAY: take no new requests; in-flight ones (parked FETCHes included,
        bounded by their max_wait_ms) finish, then the server closes (CONTRACT §3)."""
        if not self._closing:
            self._closing = True
            self._update_reading()
        self._fire_idle()

    # -- conversions -----------------------------------------------------------------------------

    def _range(self, sid, r):
        servers = [T.RangeReplica(T.RangeServer(s, a), bool(p)) for s, a, p in (r.replicas or ())]
        if not servers:
            servers = [T.RangeReplica(self.factory.this_server(), True)]
        return T.Range(sid, r.range_index, r.start_offset, r.next_offset, r.end_offset, servers)

    @staticmethod
    def _stream(meta):
        return T.Stream(meta.stream_id, meta.replica_nums, meta.retention_period_ms)

    def _owned(self, sid):
        """StreamMeta of a stream this node may mutate; raises StreamNotFound / ReadOnlyStream."""
        meta = self.store.log.stream(sid)
        if meta.origin is not None:
            raise errors.ReadOnlyStream(meta.origin)
        return meta

    def _each(self, items, fn):
        """Run ``fn(item) -> result | Deferred`` for each item; a Deferred of the results list."""
        ds = []
        for item in items:
            try:
                ds.append(defer.maybeDeferred(fn, item))
            except Exception as e:  # pragma: no cover (maybeDeferred catches)
                ds.append(defer.fail(e))
        return defer.gatherResults(ds, consumeErrors=True)

    # -- APPEND ----------------------------------------------------------------------------------

    def do_append(self, frame):
        req = codec.decode_table("AppendRequest", frame.header)
        infos = req.append_requests
        batches = codec.split_payload(frame.payload, [i.batch_length for i in infos])
        if batches is None:
            # CONTRACT §3: lengths that do not add up to the payload: system error INVALID_REQUEST
            self._warn("APPEND batch lengths do not add up: {error}", "%d entries" % len(infos))
            self._out.write(codec.system_error_frame(codec.APPEND, frame.stream_id, codec.INVALID_REQUEST,
                                                     "batch lengths do not add up to the payload"))
            return
        # CONTRACT §3: the frame's payload CRC, from each entry's header bytes and its records
        # block CRC (which validation needs anyway) combined: one pass over the payload, not two.
        block_crcs = []
        frame_crc = 0
        crc32, combine = crc32_held, codec.crc32_combine  # the reactor keeps the GIL (storage/crc.py)
        for batch in batches:
            n = len(batch)
            if n >= _BATCH_HEADER_SIZE:
                bcrc = crc32(memoryview(batch)[_BATCH_HEADER_SIZE:])
                frame_crc = combine(crc32(memoryview(batch)[:_BATCH_HEADER_SIZE], frame_crc), bcrc, n - _BATCH_HEADER_SIZE)
            else:
                bcrc = None
                frame_crc = crc32(batch, frame_crc)
            block_crcs.append(bcrc)
        if frame.crc is not None and frame_crc != frame.crc:
            self._warn("bad frame: {error}", "APPEND payload crc 0x%08x != 0x%08x" % (frame.crc, frame_crc))
            self._out.write(codec.system_error_frame(codec.APPEND, frame.stream_id, codec.INVALID_REQUEST,
                                                     "payload crc mismatch"))
            return
        nbytes = len(frame.payload)
        metrics = self.factory.metrics
        max_batch = self.factory.max_batch_bytes
        log = self.store.log
        now_ms = int(time.time() * 1000)
        if len(infos) == 1 and nbytes <= max_batch:
            # the common frame, one batch: no per-entry bookkeeping
            info = infos[0]
            try:
                count = validate_batch(frame.payload, block_crcs[0])
            except record_batch.InvalidBatch:
                pass  # answered by the general path below
            else:
                try:
                    d = log.append(info.stream_id, frame.payload)
                except Exception as e:
                    d = defer.fail(e)
                metrics["appends"] += 1
                metrics["append_records"] += count
                metrics["append_bytes"] += nbytes
                self._begin(nbytes)
                d.addCallbacks(self._appended_one, self._append_one_failed,
                               callbackArgs=(frame, info, now_ms, nbytes), errbackArgs=(frame, info, now_ms, nbytes))
                return
        results = [None] * len(infos)
        pending = []
        for k, (info, batch) in enumerate(zip(infos, batches)):
            sid = info.stream_id
            if len(batch) > max_batch:
                results[k] = T.AppendResult(sid, info.request_index, 0, now_ms,
                                            codec.status(codec.PAYLOAD_TOO_LARGE, "batch of %d bytes > %d" % (len(batch), max_batch)))
                continue
            try:
                count = validate_batch(batch, block_crcs[k])
            except record_batch.InvalidBatch as e:
                results[k] = T.AppendResult(sid, info.request_index, 0, now_ms, codec.status(codec.CORRUPT_BATCH, str(e)))
                continue
            try:
                d = log.append(sid, batch)
            except Exception as e:
                results[k] = T.AppendResult(sid, info.request_index, 0, now_ms, _fail_status(e))
                continue
            metrics["append_records"] += count
            metrics["append_bytes"] += len(batch)
            pending.append((k, d))
        metrics["appends"] += 1
        if not pending:
            self._send_append(frame, results)
            return
        self._begin(nbytes)

        def ok(base, k):
            info = infos[k]
            results[k] = T.AppendResult(info.stream_id, info.request_index, base, now_ms, codec.status())

        def err(f, k):
            info = infos[k]
            results[k] = T.AppendResult(info.stream_id, info.request_index, 0, now_ms, status_for_failure(f, self.log, "APPEND"))

        ds = []
        for k, d in pending:
            d.addCallbacks(ok, err, callbackArgs=(k,), errbackArgs=(k,))
            ds.append(d)
        # CONTRACT §3: the reply is sent once the entries are durable (each store Deferred fires
        # after the group commit that covers it).
        all_done = ds[0] if len(ds) == 1 else defer.DeferredList(ds)

        def send(_):
            self._send_append(frame, results)
            self._end(nbytes)

        all_done.addCallback(send)
        all_done.addErrback(lambda f: self.log.failure("APPEND reply failed", f))

    def _appended_one(self, base, frame, info, now_ms, nbytes):
        if not self._lost:
            header = codec.encode_append_response_one(self.throttle_time_ms(), info.stream_id, info.request_index, base, now_ms)
            self._out.write(codec.encode_frame(codec.APPEND, codec.RESPONSE_LAST, frame.stream_id, header))
        self._end(nbytes)

    def _append_one_failed(self, failure, frame, info, now_ms, nbytes):
        st = status_for_failure(failure, self.log, "APPEND")
        self._send_append(frame, [T.AppendResult(info.stream_id, info.request_index, 0, now_ms, st)])
        self._end(nbytes)

    def _send_append(self, frame, results):
        if self._lost:
            return
        if len(results) == 1 and results[0].status.code == codec.OK:
            r = results[0]
            header = codec.encode_append_response_one(self.throttle_time_ms(), r.stream_id, r.request_index,
                                                      r.base_offset, r.stream_append_time_ms)
            self._out.write(codec.encode_frame(codec.APPEND, codec.RESPONSE_LAST, frame.stream_id, header))
            return
        # a frame of many tiny entries could need a reply header over 16 MiB: split the results
        # over several frames (0x01 each, the last 0x03), as FETCH does
        chunks = [results[i:i + RESULTS_PER_FRAME] for i in range(0, len(results), RESULTS_PER_FRAME)] or [[]]
        for i, chunk in enumerate(chunks):
            flags = codec.RESPONSE_LAST if i == len(chunks) - 1 else codec.FLAG_RESPONSE
            header = codec.encode_table("AppendResponse", T.AppendResponse(self.throttle_time_ms(), codec.status(), chunk))
            self._out.write(codec.encode_frame(codec.APPEND, flags, frame.stream_id, header))

    # -- FETCH -----------------------------------------------------------------------------------

    def _start_read_ahead(self, sid, offset, max_bytes):
        """After a single-stream FETCH ending at ``offset`` below the stream's tail (and once its
        reply is written), read the next ``max_bytes`` while the reply travels, so a sequential
        reader's next FETCH finds it ready: in the store's read pool, or at once from the page
        cache (``read_spans``) while the reader is still busy with this reply. One per connection
        (the latest), at most READ_AHEAD_MAX bytes."""
        if max_bytes > READ_AHEAD_MAX or self._lost or self._closing:
            return
        try:
            meta = self.store.log.stream(sid)
        except errors.StoreError:
            return
        if offset >= meta.next_offset or offset < meta.trim_offset:
            return
        self._read_ahead = _ReadAhead(self._read, sid, offset, max_bytes, meta.next_offset)

    def _read_ahead_or_read(self, sid, offset, max_bytes):
        """``store.log.read(sid, offset, max_bytes)`` (``read_spans`` with a FileSender), served from
        the read-ahead when it matches.
        Stored batches never change, so a read-ahead result is what a read now would return,
        unless it stopped at the tail (under max_bytes) and the stream has grown since."""
        ra, self._read_ahead = self._read_ahead, None
        if ra is None or ra.key != (sid, offset, max_bytes):
            return self._read(sid, offset, max_bytes)
        out = defer.Deferred()

        def deliver(_):
            if out.called:  # cancelled (the connection went away)
                return
            try:
                grown = self.store.log.stream(sid).next_offset != ra.next_at_read
            except errors.StoreError as exc:
                out.errback(exc)
                return
            if ra.failure is None and (ra.nbytes >= max_bytes or not grown):
                self.factory.metrics["read_ahead_hits"] += 1
                out.callback(ra.batches)
            else:
                self._read(sid, offset, max_bytes).addBoth(lambda r: None if out.called else out.callback(r))

        ra.when_done(deliver)
        return out


    def do_fetch(self, frame):
        req = codec.decode_table("FetchRequest", frame.header)
        self.factory.metrics["fetches"] += 1
        op = _FetchOp(self, frame, req)
        if not req.fetch_requests:
            op.finish_empty()
            return
        self._fetches.add(op)
        op.start()

    def _fetch_done(self, op):
        self._fetches.discard(op)
        if not self._inflight_ops and not self._fetches:
            self._fire_idle()

    # -- small operations (each returns a response object or a Deferred of one) -----------------

    def do_heartbeat(self, req):
        return T.HeartbeatResponse(req.client_id, req.client_role, req.range_server, codec.status())

    def do_allocate_id(self, req):
        d = self.store.meta.next_id("sbp.allocate_id")
        return d.addCallback(lambda n: T.IdAllocationResponse(int(n), codec.status()))

    def do_list_ranges(self, req):
        log = self.store.log
        out = []
        for owner in req.range_owners:
            if owner.stream_id != -1:
                try:
                    meta = log.stream(owner.stream_id)
                except errors.StoreError as e:
                    out.append(T.ListRangesResult(owner.stream_id, _fail_status(e), []))
                    continue
                out.append(T.ListRangesResult(meta.stream_id, codec.status(), [self._range(meta.stream_id, r) for r in meta.ranges]))
            elif owner.range_server is not None:
                # CONTRACT §3: by range_server, one result per stream hosted here
                wanted = owner.range_server.server_id
                me = self.factory.node.node_id
                for meta in log.streams():
                    if wanted not in (0, me) and not any(
                        rep[0] == wanted for r in meta.ranges for rep in (r.replicas or ())
                    ):
                        continue
                    out.append(T.ListRangesResult(meta.stream_id, codec.status(), [self._range(meta.stream_id, r) for r in meta.ranges]))
            else:
                out.append(T.ListRangesResult(-1, codec.status(codec.INVALID_REQUEST, "range owner has neither stream_id nor range_server"), []))
        return T.ListRangesResponse(self.throttle_time_ms(), codec.status(), out)

    def do_seal_ranges(self, req):
        def one(rid):
            try:
                self._owned(rid.stream_id)
            except errors.StoreError as e:
                return T.SealRangesResult(rid.stream_id, _fail_status(e), None)
            d = self.store.log.seal_range(rid.stream_id, rid.range_index)
            # CONTRACT §3: the result's range is the newly writable range
            d.addCallback(lambda pair: T.SealRangesResult(rid.stream_id, codec.status(), self._range(rid.stream_id, pair[1])))
            d.addErrback(lambda f: T.SealRangesResult(rid.stream_id, status_for_failure(f, self.log, "SEAL_RANGES"), None))
            return d

        return self._each(req.ranges, one).addCallback(
            lambda rs: T.SealRangesResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_sync_ranges(self, req):
        log = self.store.log

        @defer.inlineCallbacks
        def one(sr):
            sid = sr.stream_id
            try:
                self._owned(sid)
                for r in sr.ranges:
                    replicas = [
                        (rep.server.server_id if rep.server else 0, (rep.server.advertise_addr or "") if rep.server else "", bool(rep.is_primary))
                        for rep in r.servers
                    ]
                    yield log.set_range_replicas(sid, r.range_index, replicas)
                meta = log.stream(sid)
            except Exception as e:
                return T.SyncRangesResult(sid, _fail_status(e), [])
            return T.SyncRangesResult(sid, codec.status(), [self._range(sid, r) for r in meta.ranges])

        return self._each(req.stream_ranges, one).addCallback(
            lambda rs: T.SyncRangesResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_create_range(self, req):
        r = req.range
        if r is None:
            return T.CreateRangeResponse(0, codec.status(codec.INVALID_REQUEST, "range is required"), None)
        sid = r.stream_id
        try:
            self._owned(sid)
        except errors.StoreError as e:
            return T.CreateRangeResponse(0, _fail_status(e), None)
        d = self.store.log.create_range(sid)
        d.addCallback(lambda rm: T.CreateRangeResponse(self.throttle_time_ms(), codec.status(), self._range(sid, rm)))
        d.addErrback(lambda f: T.CreateRangeResponse(0, status_for_failure(f, self.log, "CREATE_RANGE"), None))
        return d

    def do_describe_ranges(self, req):
        out = []
        for rid in req.ranges:
            try:
                meta = self.store.log.stream(rid.stream_id)
            except errors.StoreError as e:
                out.append(T.DescribeRangesResult(rid.stream_id, _fail_status(e), None))
                continue
            found = [r for r in meta.ranges if r.range_index == rid.range_index]
            if found:
                out.append(T.DescribeRangesResult(rid.stream_id, codec.status(), self._range(rid.stream_id, found[0])))
            else:
                out.append(T.DescribeRangesResult(rid.stream_id, codec.status(codec.RANGE_NOT_FOUND, "no range %d" % rid.range_index), None))
        return T.DescribeRangesResponse(self.throttle_time_ms(), codec.status(), out)

    def do_create_streams(self, req):
        def one(s):
            d = self.store.log.create_stream(replica_nums=s.replica_nums or 1, retention_period_ms=s.retention_period_ms)
            d.addCallback(lambda meta: T.CreateStreamResult(self._stream(meta), codec.status()))
            d.addErrback(lambda f: T.CreateStreamResult(None, status_for_failure(f, self.log, "CREATE_STREAMS")))
            return d

        return self._each(req.streams, one).addCallback(
            lambda rs: T.CreateStreamsResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_delete_streams(self, req):
        def one(s):
            try:
                self._owned(s.stream_id)
            except errors.StoreError as e:
                return T.DeleteStreamResult(T.Stream(s.stream_id, 0, 0), _fail_status(e))
            d = self.store.log.delete_stream(s.stream_id)
            d.addCallback(lambda meta: T.DeleteStreamResult(self._stream(meta), codec.status()))
            d.addErrback(lambda f: T.DeleteStreamResult(T.Stream(s.stream_id, 0, 0), status_for_failure(f, self.log, "DELETE_STREAMS")))
            return d

        return self._each(req.streams, one).addCallback(
            lambda rs: T.DeleteStreamsResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_update_streams(self, req):
        def one(s):
            try:
                self._owned(s.stream_id)
            except errors.StoreError as e:
                return T.UpdateStreamResult(T.Stream(s.stream_id, 0, 0), _fail_status(e))
            # FlatBuffers omits default values, so 0 means "unchanged" here; use a negative
            # retention_period_ms for infinite (CONTRACT §2: <= 0 is infinite).
            d = self.store.log.update_stream(
                s.stream_id,
                replica_nums=s.replica_nums or None,
                retention_period_ms=s.retention_period_ms if s.retention_period_ms else None,
            )
            d.addCallback(lambda meta: T.UpdateStreamResult(self._stream(meta), codec.status()))
            d.addErrback(lambda f: T.UpdateStreamResult(T.Stream(s.stream_id, 0, 0), status_for_failure(f, self.log, "UPDATE_STREAMS")))
            return d

        return self._each(req.streams, one).addCallback(
            lambda rs: T.UpdateStreamsResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_describe_streams(self, req):
        out = []
        for sid in req.stream_ids:
            try:
                out.append(T.DescribeStreamResult(self._stream(self.store.log.stream(sid)), codec.status()))
            except errors.StoreError as e:
                out.append(T.DescribeStreamResult(T.Stream(sid, 0, 0), _fail_status(e)))
        return T.DescribeStreamsResponse(self.throttle_time_ms(), codec.status(), out)

    def do_trim_streams(self, req):
        def one(ts):
            try:
                self._owned(ts.stream_id)
            except errors.StoreError as e:
                return T.TrimStreamResult(T.Stream(ts.stream_id, 0, 0), _fail_status(e), None)
            d = self.store.log.trim(ts.stream_id, ts.trim_offset)

            def done(meta):
                # CONTRACT §3: the first remaining range, starting at the trim point
                first = self._range(meta.stream_id, meta.ranges[0]) if meta.ranges else None
                return T.TrimStreamResult(self._stream(meta), codec.status(), first)

            d.addCallback(done)
            d.addErrback(lambda f: T.TrimStreamResult(T.Stream(ts.stream_id, 0, 0), status_for_failure(f, self.log, "TRIM_STREAMS"), None))
            return d

        return self._each(req.trimmed_streams, one).addCallback(
            lambda rs: T.TrimStreamsResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_report_metrics(self, req):
        # CONTRACT §3: the metrics are kept (sbpctl status shows node.metrics)
        rs = req.range_server
        key = str(rs.server_id if rs else 0)
        values = {f: getattr(req, f) for f, _, _ in codec.SCHEMA["ReportMetricsRequest"] if f != "range_server"}
        values["advertise_addr"] = rs.advertise_addr if rs else None
        values["reported_ms"] = int(time.time() * 1000)
        self.factory.reported[key] = values
        return T.ReportMetricsResponse(self.factory.this_server(), codec.status())

    def do_describe_pd_cluster(self, req):
        me = self.factory.this_server()
        node = T.PlacementDriverNode(str(me.server_id), me.advertise_addr, True)
        detail = json.dumps(self.factory.describe_node_view(), sort_keys=True, default=str).encode()
        return T.DescribePdClusterResponse(codec.status(codec.OK, None, detail), T.PlacementDriverCluster([node]))

    _HANDLERS = {
        codec.HEARTBEAT: do_heartbeat,
        codec.ALLOCATE_ID: do_allocate_id,
        codec.LIST_RANGES: do_list_ranges,
        codec.SEAL_RANGES: do_seal_ranges,
        codec.SYNC_RANGES: do_sync_ranges,
        codec.CREATE_RANGE: do_create_range,
        codec.DESCRIBE_RANGES: do_describe_ranges,
        codec.CREATE_STREAMS: do_create_streams,
        codec.DELETE_STREAMS: do_delete_streams,
        codec.UPDATE_STREAMS: do_update_streams,
        codec.DESCRIBE_STREAMS: do_describe_streams,
        codec.TRIM_STREAMS: do_trim_streams,
        codec.REPORT_METRICS: do_report_metrics,
        codec.DESCRIBE_PD_CLUSTER: do_describe_pd_cluster,
    }


class _ReadAhead:
    __slots__ = ("key", "next_at_read", "batches", "nbytes", "failure", "done", "_waiters")

    def __init__(self, read, sid, offset, max_bytes, next_at_read):
        self.key = (sid, offset, max_bytes)
        self.next_at_read = next_at_read
        self.batches = None
        self.nbytes = 0
        self.failure = None
        self.done = False
        self._waiters = []
        try:
            d = read(sid, offset, max_bytes)
        except Exception as e:  # pragma: no cover (the store returns failed Deferreds)
            d = defer.fail(e)
        d.addCallbacks(self._got, self._failed)

    def _got(self, batches):
        self.batches = batches
        self.nbytes = sum(len(b) for b in batches)
        self._finish()

    def _failed(self, f):
        self.failure = f
        self._finish()

    def _finish(self):
        self.done = True
        waiters, self._waiters = self._waiters, []
        for fn in waiters:
            fn(None)

    def when_done(self, fn):
        if self.done:
            fn(None)
        else:
            self._waiters.append(fn)


class _FetchEntry:
    __slots__ = ("info", "batches", "status", "nbytes", "wait", "done", "parked")

    def __init__(self, info):
        self.info = info
        self.parked = False
        self.batches = []
        self.status = None
        self.nbytes = 0
        self.wait = None  # the outstanding wait_for_data / read Deferred
        self.done = False


class _FetchOp:
    """One FETCH frame: each FetchInfo is read now, or parked at the tail until data (at least
    max(min_bytes, 1) bytes) arrives or max_wait_ms passes. Ready results are flushed in frames with
    flags 0x01 as they complete; the last frame has 0x03 (CONTRACT §3)."""

    def __init__(self, proto, frame, req):
        self.proto = proto
        self.frame = frame
        self.req = req
        self.log = proto.store.log
        self.reactor = proto.reactor
        self.min_bytes = max(req.min_bytes, 1)
        self.entries = [_FetchEntry(info) for info in req.fetch_requests]
        self.remaining = len(self.entries)
        self.ready = []
        self.timer = None
        self.flush_call = None
        self.reserved = 0
        self.finished = False

    def start(self):
        parked = False
        for e in self.entries:
            if not self._begin(e):
                parked = True
        if parked and not self.finished and self.timer is None:
            self.timer = self.reactor.callLater(max(self.req.max_wait_ms, 0) / 1000.0, self._timeout)
        self._flush()

    def _begin(self, e):
        """Start entry e; returns False if it is parked at the tail."""
        info = e.info
        try:
            meta = self.log.stream(info.stream_id)
        except errors.StoreError as exc:
            return self._complete(e, _fail_status(exc))
        off = info.fetch_offset
        if off < meta.trim_offset or off > meta.next_offset:
            return self._complete(e, codec.status(codec.OFFSET_OUT_OF_RANGE, "offset %d outside [%d, %d]" % (off, meta.trim_offset, meta.next_offset)))
        if off < meta.next_offset:
            self._read(e)
            return True
        if self.req.max_wait_ms <= 0 or self.proto._closing:
            return self._complete(e, codec.status(codec.NO_NEW_RECORD, "no new record"))
        self._park(e, off)
        return False

    def _park(self, e, offset):
        d = self.log.wait_for_data(e.info.stream_id, offset)
        e.wait = d
        e.parked = True
        d.addCallbacks(self._woken, self._wait_failed, callbackArgs=(e,), errbackArgs=(e,))

    def _woken(self, _, e):
        e.wait = None
        e.parked = False
        if e.done or self.finished:
            return
        try:
            meta = self.log.stream(e.info.stream_id)
        except errors.StoreError as exc:
            self._complete(e, _fail_status(exc))
            self._flush()
            return
        off = e.info.fetch_offset
        if meta.next_offset <= off:  # woken by a close or delete without data
            self._complete(e, codec.status(codec.NO_NEW_RECORD, "no new record"))
            self._flush()
            return
        # CONTRACT §3: wait for at least max(min_bytes, 1) bytes
        if self.min_bytes > 1:
            avail = 0
            try:
                for _base, _count, length in self.log.batches(e.info.stream_id, off, 4096):
                    avail += length
                    if avail >= self.min_bytes:
                        break
            except errors.StoreError:
                avail = self.min_bytes
            if avail < self.min_bytes:
                self._park(e, meta.next_offset)
                return
        self._read(e)

    def _wait_failed(self, f, e):
        e.wait = None
        e.parked = False
        if f.check(defer.CancelledError) or e.done or self.finished:
            return
        self._complete(e, status_for_failure(f, self.proto.log, "FETCH wait"))
        self._flush()

    def _read(self, e):
        info = e.info
        max_bytes = min(max(info.batch_max_bytes, 1), FRAME_PAYLOAD_CAP)
        self.reserved += max_bytes
        self.proto._begin(max_bytes)
        d = self.proto._read_ahead_or_read(info.stream_id, info.fetch_offset, max_bytes)
        e.wait = d
        ahead = []

        def got(batches):
            e.wait = None
            # a batch is never split; keep under one frame's payload
            taken = []
            total = 0
            for b in batches:
                if taken and (total >= info.batch_max_bytes or total + len(b) > FRAME_PAYLOAD_CAP):
                    break
                taken.append(b)
                total += len(b)
            e.batches = taken
            e.nbytes = total
            self._complete(e, codec.status() if taken else codec.status(codec.NO_NEW_RECORD, "no new record"))
            if taken and len(self.entries) == 1:
                # a sequential reader will ask for what follows: read it ahead (once this reply
                # is written: from the page cache that is done at once, on this thread)
                last = record_batch.read_header(_head(taken[-1]))
                ahead.append(last.base_offset + last.record_count)

        def failed(f):
            e.wait = None
            if f.check(defer.CancelledError):
                return
            self._complete(e, status_for_failure(f, self.proto.log, "FETCH read"))

        def release(_):
            # write first: a full send buffer pauses reading before the budget is released
            self.reserved -= max_bytes
            self._flush()
            if ahead:
                self.proto._start_read_ahead(info.stream_id, ahead[0], max_bytes)
            self.proto._end(max_bytes)

        d.addCallbacks(got, failed)
        d.addBoth(release)

    def _complete(self, e, st):
        if e.done:
            return True
        e.done = True
        e.status = st
        self.remaining -= 1
        self.ready.append(e)
        return True

    def _timeout(self):
        self.timer = None
        # max_wait_ms passed: parked entries return what exists (status 0) or NO_NEW_RECORD
        for e in self.entries:
            if e.done or not e.parked:
                continue
            w, e.wait, e.parked = e.wait, None, False
            w.cancel()
            try:
                meta = self.log.stream(e.info.stream_id)
                has_data = meta.next_offset > e.info.fetch_offset
            except errors.StoreError as exc:
                self._complete(e, _fail_status(exc))
                continue
            if has_data:
                self._read(e)
            else:
                self._complete(e, codec.status(codec.NO_NEW_RECORD, "no new record"))
        self._flush()

    def shutdown(self):
        """CONTRACT §1: parked FETCHes are answered with NO_NEW_RECORD."""
        for e in self.entries:
            if not e.done and e.parked:
                w, e.wait, e.parked = e.wait, None, False
                w.cancel()
                self._complete(e, codec.status(codec.NO_NEW_RECORD, "server shutting down"))
        self._flush()

    def cancel(self):
        """Connection lost: drop everything."""
        self.finished = True
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        for e in self.entries:
            if e.wait is not None:
                w, e.wait = e.wait, None
                w.cancel()

    def finish_empty(self):
        self.proto._out.write(codec.encode_frame(
            codec.FETCH, codec.RESPONSE_LAST, self.frame.stream_id,
            codec.encode_table("FetchResponse", T.FetchResponse(self.proto.throttle_time_ms(), codec.status(), []))))

    def _flush(self):
        if self.finished or not self.ready:
            return
        proto = self.proto
        ready, self.ready = self.ready, []
        last = self.remaining == 0
        if last:
            self.finished = True
            if self.timer is not None and self.timer.active():
                self.timer.cancel()
            self.timer = None
        if proto._lost:
            proto._fetch_done(self)
            return
        # split so no frame exceeds 16 MiB; a result's batches stay together
        groups = []
        cur = []
        cur_bytes = 0
        for e in ready:
            if cur and (cur_bytes + e.nbytes > FRAME_PAYLOAD_CAP or len(cur) >= RESULTS_PER_FRAME):
                groups.append(cur)
                cur, cur_bytes = [], 0
            cur.append(e)
            cur_bytes += e.nbytes
        groups.append(cur)
        metrics = proto.factory.metrics
        for gi, group in enumerate(groups):
            flags = codec.RESPONSE_LAST if (last and gi == len(groups) - 1) else codec.FLAG_RESPONSE
            if len(group) == 1 and group[0].status.code == codec.OK:
                e = group[0]
                header = codec.encode_fetch_response_one(proto.throttle_time_ms(), e.info.stream_id, e.info.request_index, e.nbytes)
            else:
                results = [T.FetchResult(e.info.stream_id, e.info.request_index, e.nbytes, e.status) for e in group]
                header = codec.encode_table("FetchResponse", T.FetchResponse(proto.throttle_time_ms(), codec.status(), results))
            parts = [b for e in group for b in e.batches]
            metrics["fetch_bytes"] += sum(e.nbytes for e in group)
            # the payload CRC from the stored batches' own CRCs (the store checked each batch's
            # head, and bytes batches whole, when reading it): no pass over the payload here
            crc = 0
            spans = 0
            for b in parts:
                if type(b) is FileSpan:
                    crc = codec.batch_crc_from_header(b.header, b.length, crc)
                    spans += b.length
                else:
                    try:
                        crc = codec.batches_crc(b, 0, len(b), crc)
                    except ValueError:
                        crc = codec.crc32(b, crc)
            frame_parts = codec.encode_frame_parts(codec.FETCH, flags, self.frame.stream_id, header, parts, payload_crc=crc)
            if spans:
                metrics["fetch_sendfile_bytes"] += spans
                proto._sender.send(frame_parts)
            else:
                proto._out.writeSequence(frame_parts)
            for e in group:
                e.batches = []
        if last:
            proto._fetch_done(self)


def _head(batch):
    """A batch's first bytes (its record batch header): bytes, or a FileSpan's copy of them."""
    return batch.header if type(batch) is FileSpan else batch


def build_factory(node):
    return SbpServerFactory(node)
