"""SBP in cluster mode (CONTRACT §9): the placement-driver opcodes answered from etcd through the
node's PlacementDriver, and APPEND / FETCH routed to the node that serves the stream.

With ``--cluster`` the server's factory takes ``ClusterAdmin`` as its ``admin_class`` (the
placement-driver opcodes) and hands APPEND and FETCH frames to ``ClusterRouter.route`` first;
without it this module is never loaded and nothing changes.

Routing: APPEND and TRIM_STREAMS are served by the stream's open range's primary (its sequencer,
node/cluster/replication.py); FETCH by any node holding a replica of the stream, up to the confirm
offset it has learned. Another node answers each entry with
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
from protocols.sbp.admin import RangeAdmin
from protocols.sbp.codec import T
from protocols.sbp.status import status_for_failure


# what the node's cluster says an error is (ClusterNode.classify) -> SBP status code
_CODES = {
    "no_available_rs": codec.NO_AVAILABLE_RS,
    "stream_not_found": codec.STREAM_NOT_FOUND,
    "not_here": codec.PD_NOT_LEADER,
    "unavailable": codec.UNKNOWN,
    "error": codec.UNKNOWN,
}


def _open_range(rec):
    return next((r for r in reversed(rec.get("ranges", [])) if r["end"] < 0), None)


def _status_of(cluster, failure, log):
    kind = cluster.classify(failure.value)
    if kind is None:
        return status_for_failure(failure, log, "placement driver")
    name, message = kind
    return codec.status(_CODES[name], message)


class ClusterRouter:
    """APPEND / FETCH routing, one per server factory."""

    log = Logger()

    def __init__(self, cluster, factory):
        self.cluster = cluster
        self.factory = factory

    @property
    def pd(self):
        return self.cluster.pd

    def route(self, proto, frame) -> bool:
        """True if the frame is taken care of here (answered now or later); False: serve it."""
        gate = getattr(proto, "cluster_gate", None)
        if gate is not None:
            # an earlier frame of this connection waits on etcd: keep the order
            gate.addCallback(lambda _: self._route_now(proto, frame, True))
            return True
        return self._route_now(proto, frame, False)

    def appends_here(self, sid) -> bool:
        """An APPEND to ``sid`` is served by this node now, as ``route`` would find in its usual
        case (no side effects): the connection's APPEND run may take it (protocols/sbp/append.py);
        False: the frame goes through ``route``."""
        pd = self.pd
        return pd is not None and pd.appends_here(sid)

    def _route_now(self, proto, frame, deferred):
        if proto.lost:
            return True
        where = {}
        waits = []
        if frame.opcode == codec.APPEND:
            req = codec.request_of(frame, "AppendRequest")
            infos = req.append_requests
            if len(infos) == 1:
                # the usual APPEND, one stream: no per-frame sets and maps on the way
                sid = infos[0].stream_id
                w = self.pd.route(sid, False, None, False)
                if w is None and not deferred:
                    return False  # served here, by the caller, at once
                routes = ((sid, w),)
            else:
                routes = [(sid, self.pd.route(sid, False, None, False)) for sid in set(i.stream_id for i in infos)]
        else:
            req = codec.request_of(frame, "FetchRequest")
            # the lowest offset read of each stream: a replica still catching up sends a read
            # it does not hold to the primary (PlacementDriver.route)
            offsets = {}
            for i in req.fetch_requests:
                o = offsets.get(i.stream_id)
                offsets[i.stream_id] = i.fetch_offset if o is None else min(o, i.fetch_offset)
            wait = req.max_wait_ms > 0
            routes = [(sid, self.pd.route(sid, True, offset, wait)) for sid, offset in offsets.items()]
        for sid, w in routes:
            if isinstance(w, defer.Deferred):
                waits.append(w.addCallback(lambda a, sid=sid: where.__setitem__(sid, a)))
            else:
                where[sid] = w
        if not waits:
            return self._decide(proto, frame, req, where, deferred)
        d = defer.gatherResults(waits, consumeErrors=True)
        gate = defer.Deferred()
        proto.cluster_gate = gate
        proto.begin()

        def go(_):
            self._decide(proto, frame, req, where, True)

        def failed(f):
            f = f.value.subFailure if isinstance(f.value, defer.FirstError) else f
            st = _status_of(self.cluster, f, self.log)
            self._answer_all(proto, frame, req, lambda sid: st)

        def release(_):
            proto.end()
            if proto.cluster_gate is gate:
                proto.cluster_gate = None
            gate.callback(None)

        d.addCallbacks(go, failed).addErrback(lambda f: self.log.failure("routing failed", f)).addBoth(release)
        return True

    def _decide(self, proto, frame, req, where, deferred):
        if all(a is None for a in where.values()):
            if not deferred:
                return False  # served here, by the caller, at once
            if not proto.lost:
                proto._dispatch(frame, routed=True)
                proto.appends.flush()  # (an APPEND taken into the run: outside a read, it goes now)
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


class ClusterAdmin(RangeAdmin):
    """The placement driver of a cluster node: stream and range metadata from etcd (through the
    node's PlacementDriver); heartbeats and metrics reports stay as on a single node."""

    def __init__(self, conn):
        super().__init__(conn)
        self.cluster = self.factory.node.cluster

    @property
    def pd(self):
        return self.cluster.pd

    def handle(self, opcode, req):
        if opcode not in self.CLUSTER_HANDLERS:
            return super().handle(opcode, req)
        d = defer.maybeDeferred(self.CLUSTER_HANDLERS[opcode], self, req)
        resp_name = codec.OPCODES[opcode][2]

        def failed(f):
            # the whole request failed (etcd unreachable, ...): a response with that status
            fields = dict((name, default) for name, _, default in codec.SCHEMA[resp_name])
            fields["status"] = _status_of(self.cluster, f, self.log)
            return fields

        return d.addErrback(failed)

    # -- conversions ----------------------------------------------------------------------------

    @staticmethod
    def _stream_of(rec):
        return T.Stream(rec["stream_id"], rec["replica_nums"], rec["retention_period_ms"])

    def _range_of(self, rec, rng):
        servers = [T.RangeReplica(T.RangeServer(s["id"], self.pd.address(s)), bool(s.get("primary"))) for s in rng["servers"]]
        return T.Range(rec["stream_id"], rng["index"], rng["start"], self.pd.next_offset(rec, rng), rng["end"], servers)

    def _ranges(self, rec):
        return [self._range_of(rec, r) for r in rec["ranges"]]

    def _each_entry(self, items, fn, on_error):
        """``fn(item)`` for each item (Deferreds); a failed item becomes ``on_error(item, status)``."""
        ds = []
        for item in items:
            d = defer.maybeDeferred(fn, item)
            d.addErrback(lambda f, item=item: on_error(item, _status_of(self.cluster, f, self.log)))
            ds.append(d)
        return defer.gatherResults(ds)

    # -- placement-driver opcodes ----------------------------------------------------------------

    def do_create_streams(self, req):
        def one(s):
            d = self.pd.create_stream(s.replica_nums, s.retention_period_ms)
            return d.addCallback(lambda rec: T.CreateStreamResult(self._stream_of(rec), codec.status()))

        d = self._each_entry(req.streams, one, lambda s, st: T.CreateStreamResult(None, st))
        return d.addCallback(lambda rs: T.CreateStreamsResponse(0, codec.status(), rs))

    def do_describe_streams(self, req):
        def one(sid):
            return self.pd.get(sid).addCallback(lambda rec: T.DescribeStreamResult(self._stream_of(rec), codec.status()))

        d = self._each_entry(req.stream_ids, one, lambda sid, st: T.DescribeStreamResult(T.Stream(sid, 0, 0), st))
        return d.addCallback(lambda rs: T.DescribeStreamsResponse(0, codec.status(), rs))

    def do_update_streams(self, req):
        def one(s):
            # as on a single node: 0 means unchanged (FlatBuffers omits defaults)
            d = self.pd.update_stream(s.stream_id, replica_nums=s.replica_nums or None,
                                      retention_period_ms=s.retention_period_ms if s.retention_period_ms else None)
            return d.addCallback(lambda rec: T.UpdateStreamResult(self._stream_of(rec), codec.status()))

        d = self._each_entry(req.streams, one, lambda s, st: T.UpdateStreamResult(T.Stream(s.stream_id, 0, 0), st))
        return d.addCallback(lambda rs: T.UpdateStreamsResponse(0, codec.status(), rs))

    def do_delete_streams(self, req):
        def one(s):
            return self.pd.delete_stream(s.stream_id).addCallback(
                lambda rec: T.DeleteStreamResult(self._stream_of(rec), codec.status()))

        d = self._each_entry(req.streams, one, lambda s, st: T.DeleteStreamResult(T.Stream(s.stream_id, 0, 0), st))
        return d.addCallback(lambda rs: T.DeleteStreamsResponse(0, codec.status(), rs))

    def do_trim_streams(self, req):
        def one(ts):
            def done(pair):
                rec, _meta = pair
                first = self._range_of(rec, rec["ranges"][0]) if rec["ranges"] else None
                return T.TrimStreamResult(self._stream_of(rec), codec.status(), first)

            return self.pd.trim_stream(ts.stream_id, ts.trim_offset).addCallback(done)

        d = self._each_entry(req.trimmed_streams, one,
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

                    out.append(T.ListRangesResult(owner.stream_id, _status_of(self.cluster, Failure(e), self.log), []))
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
                        # per-replica progress (issue 17) as this node knows it: status.detail JSON
                        detail = self.cluster.replicator.progress_json(rid.stream_id) if r["end"] < 0 else b""
                        return T.DescribeRangesResult(rid.stream_id, codec.status(codec.OK, None, detail), self._range_of(rec, r))
                return T.DescribeRangesResult(rid.stream_id, codec.status(codec.RANGE_NOT_FOUND, "no range %d" % rid.range_index), None)

            return self.pd.get(rid.stream_id).addCallback(found)

        d = self._each_entry(req.ranges, one, lambda rid, st: T.DescribeRangesResult(rid.stream_id, st, None))
        return d.addCallback(lambda rs: T.DescribeRangesResponse(0, codec.status(), rs))

    def do_allocate_id(self, req):
        return self.pd.allocate_id().addCallback(lambda n: T.IdAllocationResponse(int(n), codec.status()))

    @defer.inlineCallbacks
    def do_describe_pd_cluster(self, req):
        try:
            members, leader = yield self.cluster.describe()
        except Exception as e:
            if self.cluster.classify(e) is None or self.cluster.classify(e)[0] != "unavailable":
                raise
            # etcd unreachable: answer from what the watches last saw (status shows it stale)
            members, leader = dict(self.cluster.membership.members), self.cluster.election.leader_id
        nodes = [T.PlacementDriverNode(str(nid), rec.get("sbp") or "", nid == leader) for nid, rec in sorted(members.items())]
        # the node's own view as on a single node (status.detail JSON), with the cluster's
        single = RangeAdmin.do_describe_pd_cluster(self, req)
        local = json.loads(single.status.detail)
        view = self.cluster.status()
        view.pop("ranges", None)  # one entry per range: the metrics' business, not this reply's
        # the live members this node's own membership watch holds (may trail etcd for a moment)
        view["watched_members"] = view.get("live_members", [])
        # members and leader as etcd says now
        view["members"] = [{"node_id": nid, "sbp": rec.get("sbp"), "http": rec.get("http"), "alive": True}
                           for nid, rec in sorted(members.items())]
        view["live_members"] = sorted(members)
        view["leader"] = leader
        local["cluster"] = view
        view["ranges_per_node"] = self._ranges_per_node()
        detail = json.dumps(local, sort_keys=True, default=str).encode()
        return T.DescribePdClusterResponse(codec.status(codec.OK, None, detail), T.PlacementDriverCluster(nodes))

    def _ranges_per_node(self):
        """Open ranges held and led per node, as this node's watch knows them."""
        return {str(nid): {"ranges": n, "primaries": self.pd.led(nid)} for nid, n in self.pd.held().items() if n}

    def do_seal_ranges(self, req):
        # CONTRACT §3/§9: the open range is sealed the failover way (its replicas fenced, the
        # largest end taken) and range index+1 opened on the same replicas; the result's range is
        # the newly writable one. Any node does it: the etcd compare-and-swap on the stream's
        # epoch makes a concurrent failover or seal lose cleanly (UNKNOWN "... kept changing").
        def one(rid):
            d = self.cluster.failover.seal_range(rid.stream_id, rid.range_index)
            return d.addCallback(lambda rec: T.SealRangesResult(
                rid.stream_id, codec.status(), self._range_of(rec, _open_range(rec))))

        d = self._each_entry(req.ranges, one, lambda rid, st: T.SealRangesResult(rid.stream_id, st, None))
        return d.addCallback(lambda rs: T.SealRangesResponse(0, codec.status(), rs))

    @defer.inlineCallbacks
    def do_create_range(self, req):
        # CONTRACT §3: CREATE_RANGE opens range last+1 only when the last range is sealed, and in
        # a cluster a seal always opens the next range in the same etcd transaction (failover,
        # re-replication, SEAL_RANGES): the last range is open, so INVALID_REQUEST, naming it
        r = req.range
        if r is None:
            return T.CreateRangeResponse(0, codec.status(codec.INVALID_REQUEST, "range is required"), None)
        rec = yield self.pd.get(r.stream_id)
        rng = _open_range(rec)
        return T.CreateRangeResponse(0, codec.status(
            codec.INVALID_REQUEST, "range %d of stream %d is open: in a cluster a seal opens the next range itself"
            % (rng["index"] if rng else -1, r.stream_id)), self._range_of(rec, rng) if rng else None)

    def do_sync_ranges(self, req):
        # a cluster's replica assignments are the placement driver's (etcd): they are not taken
        # from a client. Each stream gets INVALID_REQUEST and its ranges as etcd holds them, so a
        # client syncing its view learns the real one.
        def one(sr):
            st = codec.status(codec.INVALID_REQUEST, "replica assignments are the placement driver's in a cluster")
            return self.pd.get(sr.stream_id).addCallback(lambda rec: T.SyncRangesResult(sr.stream_id, st, self._ranges(rec)))

        d = self._each_entry(req.stream_ranges, one, lambda sr, st: T.SyncRangesResult(sr.stream_id, st, []))
        return d.addCallback(lambda rs: T.SyncRangesResponse(0, codec.status(), rs))

    CLUSTER_HANDLERS = {
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
