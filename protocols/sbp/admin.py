"""SBP placement-driver and range administration (CONTRACT §3): heartbeats, ids, streams, ranges,
metrics reports and the cluster description, over ``store.log`` and ``store.meta``.

``RangeAdmin`` is the boundary: one per connection, built by the factory's ``admin_class``; the
connection decodes a frame's header, calls ``admin.handle(opcode, request)`` and encodes what it
returns (a response object, or a Deferred of one). Nothing here touches frames or the transport.
"""

import json
import time

from twisted.internet import defer
from twisted.logger import Logger

from protocols.sbp import codec
from protocols.sbp.codec import T
from protocols.sbp.status import status_for_error, status_for_failure
from storage import block_check, errors
from storage import sha256 as multi_sha256


class RangeAdmin:
    """The single-node placement driver: every stream and range lives on this node.

    ``conn`` gives the in-flight throttle for replies (``throttle_time_ms``); ``factory`` gives the
    node (``this_server``, ``node``, ``reported`` metrics)."""

    log = Logger()

    def __init__(self, conn):
        self.conn = conn
        self.factory = conn.factory
        self.store = conn.store

    def handles(self, opcode):
        return opcode in self.HANDLERS

    def handle(self, opcode, req):
        """The response to ``req`` (decoded from an ``opcode`` frame), or a Deferred of it."""
        return self.HANDLERS[opcode](self, req)

    def throttle_time_ms(self):
        return self.conn.throttle_time_ms()

    # -- conversions -----------------------------------------------------------------------------

    def range(self, sid, r):
        servers = [T.RangeReplica(T.RangeServer(s, a), bool(p)) for s, a, p in (r.replicas or ())]
        if not servers:
            servers = [T.RangeReplica(self.factory.this_server(), True)]
        return T.Range(sid, r.range_index, r.start_offset, r.next_offset, r.end_offset, servers)

    @staticmethod
    def stream(meta):
        return T.Stream(meta.stream_id, meta.replica_nums, meta.retention_period_ms)

    def owned(self, sid):
        """StreamMeta of a stream this node may mutate; raises StreamNotFound / ReadOnlyStream."""
        meta = self.store.log.stream(sid)
        if meta.origin is not None:
            raise errors.ReadOnlyStream(meta.origin)
        return meta

    @staticmethod
    def each(items, fn):
        """Run ``fn(item) -> result | Deferred`` for each item; a Deferred of the results list."""
        ds = []
        for item in items:
            try:
                ds.append(defer.maybeDeferred(fn, item))
            except Exception as e:  # pragma: no cover (maybeDeferred catches)
                ds.append(defer.fail(e))
        return defer.gatherResults(ds, consumeErrors=True)

    # -- handlers (each returns a response object or a Deferred of one) --------------------------

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
                    out.append(T.ListRangesResult(owner.stream_id, status_for_error(e), []))
                    continue
                out.append(T.ListRangesResult(meta.stream_id, codec.status(), [self.range(meta.stream_id, r) for r in meta.ranges]))
            elif owner.range_server is not None:
                # CONTRACT §3: by range_server, one result per stream hosted here
                wanted = owner.range_server.server_id
                me = self.factory.node.node_id
                for meta in log.streams():
                    if wanted not in (0, me) and not any(
                        rep[0] == wanted for r in meta.ranges for rep in (r.replicas or ())
                    ):
                        continue
                    out.append(T.ListRangesResult(meta.stream_id, codec.status(), [self.range(meta.stream_id, r) for r in meta.ranges]))
            else:
                out.append(T.ListRangesResult(-1, codec.status(codec.INVALID_REQUEST, "range owner has neither stream_id nor range_server"), []))
        return T.ListRangesResponse(self.throttle_time_ms(), codec.status(), out)

    def do_seal_ranges(self, req):
        def one(rid):
            try:
                self.owned(rid.stream_id)
            except errors.StoreError as e:
                return T.SealRangesResult(rid.stream_id, status_for_error(e), None)
            d = self.store.log.seal_range(rid.stream_id, rid.range_index)
            # CONTRACT §3: the result's range is the newly writable range
            d.addCallback(lambda pair: T.SealRangesResult(rid.stream_id, codec.status(), self.range(rid.stream_id, pair[1])))
            d.addErrback(lambda f: T.SealRangesResult(rid.stream_id, status_for_failure(f, self.log, "SEAL_RANGES"), None))
            return d

        return self.each(req.ranges, one).addCallback(
            lambda rs: T.SealRangesResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_sync_ranges(self, req):
        log = self.store.log

        @defer.inlineCallbacks
        def one(sr):
            sid = sr.stream_id
            try:
                self.owned(sid)
                for r in sr.ranges:
                    replicas = [
                        (rep.server.server_id if rep.server else 0, (rep.server.advertise_addr or "") if rep.server else "", bool(rep.is_primary))
                        for rep in r.servers
                    ]
                    yield log.set_range_replicas(sid, r.range_index, replicas)
                meta = log.stream(sid)
            except Exception as e:
                return T.SyncRangesResult(sid, status_for_error(e), [])
            return T.SyncRangesResult(sid, codec.status(), [self.range(sid, r) for r in meta.ranges])

        return self.each(req.stream_ranges, one).addCallback(
            lambda rs: T.SyncRangesResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_create_range(self, req):
        r = req.range
        if r is None:
            return T.CreateRangeResponse(0, codec.status(codec.INVALID_REQUEST, "range is required"), None)
        sid = r.stream_id
        try:
            self.owned(sid)
        except errors.StoreError as e:
            return T.CreateRangeResponse(0, status_for_error(e), None)
        d = self.store.log.create_range(sid)
        d.addCallback(lambda rm: T.CreateRangeResponse(self.throttle_time_ms(), codec.status(), self.range(sid, rm)))
        d.addErrback(lambda f: T.CreateRangeResponse(0, status_for_failure(f, self.log, "CREATE_RANGE"), None))
        return d

    def do_describe_ranges(self, req):
        out = []
        for rid in req.ranges:
            try:
                meta = self.store.log.stream(rid.stream_id)
            except errors.StoreError as e:
                out.append(T.DescribeRangesResult(rid.stream_id, status_for_error(e), None))
                continue
            found = [r for r in meta.ranges if r.range_index == rid.range_index]
            if found:
                out.append(T.DescribeRangesResult(rid.stream_id, codec.status(), self.range(rid.stream_id, found[0])))
            else:
                out.append(T.DescribeRangesResult(rid.stream_id, codec.status(codec.RANGE_NOT_FOUND, "no range %d" % rid.range_index), None))
        return T.DescribeRangesResponse(self.throttle_time_ms(), codec.status(), out)

    def do_create_streams(self, req):
        def one(s):
            d = self.store.log.create_stream(replica_nums=s.replica_nums or 1, retention_period_ms=s.retention_period_ms)
            d.addCallback(lambda meta: T.CreateStreamResult(self.stream(meta), codec.status()))
            d.addErrback(lambda f: T.CreateStreamResult(None, status_for_failure(f, self.log, "CREATE_STREAMS")))
            return d

        return self.each(req.streams, one).addCallback(
            lambda rs: T.CreateStreamsResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_delete_streams(self, req):
        def one(s):
            try:
                self.owned(s.stream_id)
            except errors.StoreError as e:
                return T.DeleteStreamResult(T.Stream(s.stream_id, 0, 0), status_for_error(e))
            d = self.store.log.delete_stream(s.stream_id)
            d.addCallback(lambda meta: T.DeleteStreamResult(self.stream(meta), codec.status()))
            d.addErrback(lambda f: T.DeleteStreamResult(T.Stream(s.stream_id, 0, 0), status_for_failure(f, self.log, "DELETE_STREAMS")))
            return d

        return self.each(req.streams, one).addCallback(
            lambda rs: T.DeleteStreamsResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_update_streams(self, req):
        def one(s):
            try:
                self.owned(s.stream_id)
            except errors.StoreError as e:
                return T.UpdateStreamResult(T.Stream(s.stream_id, 0, 0), status_for_error(e))
            # FlatBuffers omits default values, so 0 means "unchanged" here; use a negative
            # retention_period_ms for infinite (CONTRACT §2: <= 0 is infinite).
            d = self.store.log.update_stream(
                s.stream_id,
                replica_nums=s.replica_nums or None,
                retention_period_ms=s.retention_period_ms if s.retention_period_ms else None,
            )
            d.addCallback(lambda meta: T.UpdateStreamResult(self.stream(meta), codec.status()))
            d.addErrback(lambda f: T.UpdateStreamResult(T.Stream(s.stream_id, 0, 0), status_for_failure(f, self.log, "UPDATE_STREAMS")))
            return d

        return self.each(req.streams, one).addCallback(
            lambda rs: T.UpdateStreamsResponse(self.throttle_time_ms(), codec.status(), rs))

    def do_describe_streams(self, req):
        out = []
        for sid in req.stream_ids:
            try:
                out.append(T.DescribeStreamResult(self.stream(self.store.log.stream(sid)), codec.status()))
            except errors.StoreError as e:
                out.append(T.DescribeStreamResult(T.Stream(sid, 0, 0), status_for_error(e)))
        return T.DescribeStreamsResponse(self.throttle_time_ms(), codec.status(), out)

    def do_trim_streams(self, req):
        def one(ts):
            try:
                self.owned(ts.stream_id)
            except errors.StoreError as e:
                return T.TrimStreamResult(T.Stream(ts.stream_id, 0, 0), status_for_error(e), None)
            d = self.store.log.trim(ts.stream_id, ts.trim_offset)

            def done(meta):
                # CONTRACT §3: the first remaining range, starting at the trim point
                first = self.range(meta.stream_id, meta.ranges[0]) if meta.ranges else None
                return T.TrimStreamResult(self.stream(meta), codec.status(), first)

            d.addCallback(done)
            d.addErrback(lambda f: T.TrimStreamResult(T.Stream(ts.stream_id, 0, 0), status_for_failure(f, self.log, "TRIM_STREAMS"), None))
            return d

        return self.each(req.trimmed_streams, one).addCallback(
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
        # The node's metrics view (sbpctl status): node.metrics, including the values kept from
        # REPORT_METRICS, as JSON in status.detail ("additional information").
        try:
            streams = len(self.store.log.streams())
        except Exception:
            streams = None
        view = {"node_id": me.server_id, "sbp": me.advertise_addr, "streams": streams, "metrics": self.factory.node.metrics,
                "append_check": block_check.state, "chunk_hash": multi_sha256.state}
        detail = json.dumps(view, sort_keys=True, default=str).encode()
        return T.DescribePdClusterResponse(codec.status(codec.OK, None, detail), T.PlacementDriverCluster([node]))

    HANDLERS = {
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
