"""SBP in cluster mode (CONTRACT §9): the placement-driver opcodes answered from etcd through the
node's PlacementDriver, and APPEND / FETCH routed to the node that serves the stream.

The server hands every frame to ``ClusterSbp.intercept`` first when the node runs with
``--cluster``; without it this module is never loaded and nothing changes.

Routing (part 1, before replication): a stream's data lives on its open range's primary, so
APPEND, FETCH and TRIM_STREAMS are served there; another node answers each entry with
PD_NOT_LEADER and the primary's SBP ``host:port`` as the message (clients follow it). A frame
naming streams served on different nodes gets PD_NOT_LEADER for every entry, each naming the node
for its stream (this node's own address for its own streams), so a client resends entry by entry.
A node that has not heard of a stream yet (its watch is behind) reads it from etcd before answering;
frames of the connection behind such a read wait for it, so order is kept.
"""

import json

from twisted.internet import defer
from twisted.logger import Logger

from protocols.sbp import codec
from protocols.sbp.codec import T

_ROUTED = frozenset([codec.APPEND, codec.FETCH])


def _status_of(failure, log):
    from node.cluster import etcd, placement

    e = failure.value
    if isinstance(e, placement.NoAvailableRS):
        return codec.status(codec.NO_AVAILABLE_RS, str(e))
    if isinstance(e, placement.StreamGone):
        return codec.status(codec.STREAM_NOT_FOUND, str(e))
    if isinstance(e, placement.NotHere):
        return codec.status(codec.PD_NOT_LEADER, e.address)
    if isinstance(e, etcd.EtcdError):
        # etcd slow or unreachable: the request fails, the node keeps serving what it can
        return codec.status(codec.UNKNOWN, "placement driver unavailable: %s" % e)
    if isinstance(e, placement.PlacementError):
        return codec.status(codec.UNKNOWN, str(e))
    from protocols.sbp.server import status_for_failure

    return status_for_failure(failure, log, "placement driver")


class ClusterSbp:
    log = Logger()

    def __init__(self, cluster, factory):
        self.cluster = cluster
        self.factory = factory

    @property
    def pd(self):
        return self.cluster.pd

    # -- entry point ----------------------------------------------------------------------------

    def intercept(self, proto, frame) -> bool:
        """True if the frame is taken care of here (answered now or later)."""
        op = frame.opcode
        if op in _ROUTED:
            return self._route(proto, frame)
        handler = self._HANDLERS.get(op)
        if handler is None:
            return False
        table, resp_name = codec.OPCODES[op][1], codec.OPCODES[op][2]
        req = codec.decode_table(table, frame.header)
        d = defer.maybeDeferred(handler, self, req)
        proto._begin()

        def failed(f):
            st = _status_of(f, self.log)
            fields = dict((name, default) for name, _, default in codec.SCHEMA[resp_name])
            fields["status"] = st
            return fields

        d.addErrback(failed)
        d.addCallback(lambda obj: proto._reply(frame, resp_name, obj))
        d.addErrback(lambda f: self.log.failure("cluster reply failed", f))
        d.addBoth(lambda _: proto._end())
        return True

    # -- APPEND / FETCH routing -----------------------------------------------------------------

    def _route(self, proto, frame):
        gate = getattr(proto, "_cluster_gate", None)
        if gate is not None:
            # an earlier frame of this connection waits on etcd: keep the order
            gate.addCallback(lambda _: self._route_now(proto, frame))
            return True
        return self._route_now(proto, frame)

    def _route_now(self, proto, frame):
        if proto._lost:
            return True
        if frame.opcode == codec.APPEND:
            req = codec.decode_table("AppendRequest", frame.header)
            sids = [i.stream_id for i in req.append_requests]
        else:
            req = codec.decode_table("FetchRequest", frame.header)
            sids = [i.stream_id for i in req.fetch_requests]
        where = {}
        waits = []
        for sid in set(sids):
            w = self.pd.route(sid)
            if isinstance(w, defer.Deferred):
                waits.append(w.addCallback(lambda a, sid=sid: where.__setitem__(sid, a)))
            else:
                where[sid] = w
        if not waits:
            return self._decide(proto, frame, req, where)
        d = defer.gatherResults(waits, consumeErrors=True)
        gate = defer.Deferred()
        proto._cluster_gate = gate
        proto._begin()

        def go(_):
            self._decide(proto, frame, req, where)

        def failed(f):
            f = f.value.subFailure if isinstance(f.value, defer.FirstError) else f
            st = _status_of(f, self.log)
            self._answer_all(proto, frame, req, lambda sid: st)

        def release(_):
            proto._end()
            if proto._cluster_gate is gate:
                proto._cluster_gate = None
            gate.callback(None)

        d.addCallbacks(go, failed).addErrback(lambda f: self.log.failure("routing failed", f)).addBoth(release)
        return True

    def _decide(self, proto, frame, req, where):
        if all(a is None for a in where.values()):
            if proto._lost:
                return True
            proto._dispatch(frame, routed=True)
            return True
        me = self.factory.this_server().advertise_addr
        self._answer_all(proto, frame, req, lambda sid: codec.status(codec.PD_NOT_LEADER, where.get(sid) or me))
        return True

    def _answer_all(self, proto, frame, req, status_of):
        if frame.opcode == codec.APPEND:
            results = [T.AppendResult(i.stream_id, i.request_index, 0, 0, status_of(i.stream_id)) for i in req.append_requests]
            proto._reply(frame, "AppendResponse", T.AppendResponse(0, codec.status(), results))
        else:
            results = [T.FetchResult(i.stream_id, i.request_index, 0, status_of(i.stream_id)) for i in req.fetch_requests]
            proto._reply(frame, "FetchResponse", T.FetchResponse(0, codec.status(), results))

    # -- conversions ----------------------------------------------------------------------------

    @staticmethod
    def _stream(rec):
        return T.Stream(rec["stream_id"], rec["replica_nums"], rec["retention_period_ms"])

    def _range(self, rec, rng):
        servers = [T.RangeReplica(T.RangeServer(s["id"], self.pd.address(s)), bool(s.get("primary"))) for s in rng["servers"]]
        return T.Range(rec["stream_id"], rng["index"], rng["start"], self.pd.next_offset(rec, rng), rng["end"], servers)

    def _ranges(self, rec):
        return [self._range(rec, r) for r in rec["ranges"]]

    def _each(self, items, fn, on_error):
        """``fn(item)`` for each item (Deferreds); a failed item becomes ``on_error(item, status)``."""
        ds = []
        for item in items:
            d = defer.maybeDeferred(fn, item)
            d.addErrback(lambda f, item=item: on_error(item, _status_of(f, self.log)))
            ds.append(d)
        return defer.gatherResults(ds)

    # -- placement-driver opcodes ----------------------------------------------------------------

    def do_create_streams(self, req):
        def one(s):
            d = self.pd.create_stream(s.replica_nums, s.retention_period_ms)
            return d.addCallback(lambda rec: T.CreateStreamResult(self._stream(rec), codec.status()))

        d = self._each(req.streams, one, lambda s, st: T.CreateStreamResult(None, st))
        return d.addCallback(lambda rs: T.CreateStreamsResponse(0, codec.status(), rs))

    def do_describe_streams(self, req):
        def one(sid):
            return self.pd.get(sid).addCallback(lambda rec: T.DescribeStreamResult(self._stream(rec), codec.status()))

        d = self._each(req.stream_ids, one, lambda sid, st: T.DescribeStreamResult(T.Stream(sid, 0, 0), st))
        return d.addCallback(lambda rs: T.DescribeStreamsResponse(0, codec.status(), rs))

    def do_update_streams(self, req):
        def one(s):
            # as on a single node: 0 means unchanged (FlatBuffers omits defaults)
            d = self.pd.update_stream(s.stream_id, replica_nums=s.replica_nums or None,
                                      retention_period_ms=s.retention_period_ms if s.retention_period_ms else None)
            return d.addCallback(lambda rec: T.UpdateStreamResult(self._stream(rec), codec.status()))

        d = self._each(req.streams, one, lambda s, st: T.UpdateStreamResult(T.Stream(s.stream_id, 0, 0), st))
        return d.addCallback(lambda rs: T.UpdateStreamsResponse(0, codec.status(), rs))

    def do_delete_streams(self, req):
        def one(s):
            return self.pd.delete_stream(s.stream_id).addCallback(
                lambda rec: T.DeleteStreamResult(self._stream(rec), codec.status()))

        d = self._each(req.streams, one, lambda s, st: T.DeleteStreamResult(T.Stream(s.stream_id, 0, 0), st))
        return d.addCallback(lambda rs: T.DeleteStreamsResponse(0, codec.status(), rs))

    def do_trim_streams(self, req):
        def one(ts):
            def done(pair):
                rec, _meta = pair
                first = self._range(rec, rec["ranges"][0]) if rec["ranges"] else None
                return T.TrimStreamResult(self._stream(rec), codec.status(), first)

            return self.pd.trim_stream(ts.stream_id, ts.trim_offset).addCallback(done)

        d = self._each(req.trimmed_streams, one,
                       lambda ts, st: T.TrimStreamResult(T.Stream(ts.stream_id, 0, 0), st, None))
        return d.addCallback(lambda rs: T.TrimStreamsResponse(0, codec.status(), rs))

    @defer.inlineCallbacks
    def do_list_ranges(self, req):
        out = []
        everything = None
        for owner in req.range_owners:
            if owner.stream_id != -1:
                try:
                    rec = yield self.pd.get(owner.stream_id)
                except Exception as e:
                    from twisted.python.failure import Failure

                    out.append(T.ListRangesResult(owner.stream_id, _status_of(Failure(e), self.log), []))
                    continue
                out.append(T.ListRangesResult(rec["stream_id"], codec.status(), self._ranges(rec)))
            elif owner.range_server is not None:
                # one result per stream with a range on that server (0: this node)
                wanted = owner.range_server.server_id or self.cluster.node_id
                if everything is None:
                    everything = yield self.pd.list_streams()
                for rec in everything:
                    if any(s["id"] == wanted for r in rec["ranges"] for s in r["servers"]):
                        out.append(T.ListRangesResult(rec["stream_id"], codec.status(), self._ranges(rec)))
            else:
                out.append(T.ListRangesResult(-1, codec.status(codec.INVALID_REQUEST, "range owner has neither stream_id nor range_server"), []))
        return T.ListRangesResponse(0, codec.status(), out)

    def do_describe_ranges(self, req):
        def one(rid):
            def found(rec):
                for r in rec["ranges"]:
                    if r["index"] == rid.range_index:
                        return T.DescribeRangesResult(rid.stream_id, codec.status(), self._range(rec, r))
                return T.DescribeRangesResult(rid.stream_id, codec.status(codec.RANGE_NOT_FOUND, "no range %d" % rid.range_index), None)

            return self.pd.get(rid.stream_id).addCallback(found)

        d = self._each(req.ranges, one, lambda rid, st: T.DescribeRangesResult(rid.stream_id, st, None))
        return d.addCallback(lambda rs: T.DescribeRangesResponse(0, codec.status(), rs))

    def do_allocate_id(self, req):
        return self.pd.allocate_id().addCallback(lambda n: T.IdAllocationResponse(int(n), codec.status()))

    @defer.inlineCallbacks
    def do_describe_pd_cluster(self, req):
        members, leader = yield self.cluster.describe()
        nodes = [T.PlacementDriverNode(str(nid), rec.get("sbp") or "", nid == leader) for nid, rec in sorted(members.items())]
        # the node's own view as JSON in status.detail, as on a single node, with the cluster's
        local = self.factory.describe_node_view()
        local["cluster"] = self.cluster.status()
        local["cluster"]["members"] = {str(nid): rec for nid, rec in sorted(members.items())}
        local["cluster"]["leader"] = leader
        local["cluster"]["ranges_per_node"] = self._ranges_per_node()
        detail = json.dumps(local, sort_keys=True, default=str).encode()
        return T.DescribePdClusterResponse(codec.status(codec.OK, None, detail), T.PlacementDriverCluster(nodes))

    def _ranges_per_node(self):
        counts = {}
        for rec in self.pd.streams.values():
            for r in rec["ranges"]:
                if r["end"] >= 0:
                    continue
                for s in r["servers"]:
                    c = counts.setdefault(str(s["id"]), {"ranges": 0, "primaries": 0})
                    c["ranges"] += 1
                    c["primaries"] += bool(s.get("primary"))
        return counts

    def do_seal_ranges(self, req):
        st = codec.status(codec.INVALID_REQUEST, "SEAL_RANGES in cluster mode comes with replication (issue 17)")
        return T.SealRangesResponse(0, codec.status(), [T.SealRangesResult(r.stream_id, st, None) for r in req.ranges])

    def do_create_range(self, req):
        return T.CreateRangeResponse(0, codec.status(codec.INVALID_REQUEST, "CREATE_RANGE in cluster mode comes with replication (issue 17)"), None)

    def do_sync_ranges(self, req):
        st = codec.status(codec.INVALID_REQUEST, "SYNC_RANGES in cluster mode comes with replication (issue 17)")
        return T.SyncRangesResponse(0, codec.status(), [T.SyncRangesResult(sr.stream_id, st, []) for sr in req.stream_ranges])

    _HANDLERS = {
        codec.CREATE_STREAMS: do_create_streams,
        codec.DESCRIBE_STREAMS: do_describe_streams,
        codec.UPDATE_STREAMS: do_update_streams,
        codec.DELETE_STREAMS: do_delete_streams,
        codec.TRIM_STREAMS: do_trim_streams,
        codec.LIST_RANGES: do_list_ranges,
        codec.DESCRIBE_RANGES: do_describe_ranges,
        codec.ALLOCATE_ID: do_allocate_id,
        codec.DESCRIBE_PD_CLUSTER: do_describe_pd_cluster,
        codec.SEAL_RANGES: do_seal_ranges,
        codec.CREATE_RANGE: do_create_range,
        codec.SYNC_RANGES: do_sync_ranges,
    }
