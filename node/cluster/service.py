"""Cluster mode's part of the node (CONTRACT §9): etcd client, membership, election, placement.

``ClusterNode.start()`` runs once the listeners are bound (their ports go into the member record)
and before the ready file is written: check the prefix's layout version, register under the lease,
stand for placement-driver leader, load the stream records and watch them. It fails with
StartRefused (duplicate live node id, incompatible prefix) or EtcdUnavailable (no etcd answered
within START_DEADLINE seconds); the node then exits non-zero with that one line, having left
nothing registered.
"""

import hashlib

from twisted.internet import defer
from twisted.logger import Logger

from node.cluster import etcd, placement
from node.cluster.election import Election
from node.cluster.failover import Failover
from node.cluster.membership import Membership, StartRefused, load_or_create_incarnation, member_records
from node.cluster.placement import PlacementDriver
from node.cluster.replication import Replicator
from node.cluster.toasty_chunks import ToastyCluster
from node.cluster.s2_catalog import S2Catalog
from node.cluster.kv_partitions import KvPartitions
from protocols.partition import cluster_server

ETCD_OPERATION = "etcd"  # node.observe_latency's name for one etcd round trip (node/metrics.py)
START_DEADLINE = 10.0  # seconds of retrying etcd at start before giving up
LISTENER_KEYS = ("sbp", "kv", "meta", "chunks", "swarm", "http")


class ClusterNode:
    log = Logger()

    def __init__(self, node):
        self.node = node
        config = node.config
        self.prefix = config.cluster_prefix
        tls = None
        if config.cluster_tls_cert:
            tls = (config.cluster_tls_cert, config.cluster_tls_key, config.cluster_tls_ca)
        observe = getattr(node, "observe_latency", None)
        self.client = etcd.EtcdClient(config.cluster, reactor=node.reactor, tls=tls, deadline=START_DEADLINE,
                                      observe=(lambda seconds: observe(ETCD_OPERATION, seconds)) if observe else None)
        self.membership = None
        self.election = None
        self.pd = None
        self.tls = tls
        self.replicator = Replicator(node, tls=tls, reactor=node.reactor)
        self.kv = None  # node.cluster.kv_partitions.KvPartitions once started (issue 20)
        self.failover = None
        self.toasty = None  # the Toasty file tree and chunk holders of the cluster (toasty_chunks.py)
        # the S2 API's basins, stream names and access tokens (protocols/s2/cluster.py uses it)
        self.s2_catalog = S2Catalog(self)
        self.started = False

    @property
    def node_id(self):
        return self.node.node_id

    @defer.inlineCallbacks
    def start(self):
        node = self.node
        addresses = {name: node.advertised(name) for name in LISTENER_KEYS}
        # the replica channel (node/cluster/replication.py): a port of its own, beside the SBP
        # listener's interface, mutual TLS with the cluster TLS options; named in the member record
        sbp = node.ports.get("sbp")
        interface = getattr(sbp.getHost(), "host", "127.0.0.1") if sbp is not None else "127.0.0.1"
        port = self.replicator.listen(interface)
        advertised = node.config.advertise or (interface if interface not in ("", "0.0.0.0", "::") else "127.0.0.1")
        at = "%s:%d" if ":" not in advertised else "[%s]:%d"
        addresses["replica"] = at % (advertised, port)
        # the kv peer port (node/cluster/kv_partitions.py): requests forwarded to a partition's leader
        kv = KvPartitions(node, self)
        peer_factory = cluster_server.ClusterKvFactory(lambda: self.kv, node.metrics.setdefault("kv_peer", {}))
        peer_factory.protocol = cluster_server.ClusterKvPeerProtocol
        port = kv.listen(interface, peer_factory)
        addresses["kv_peer"] = at % (advertised, port)
        # the S2 forwarding port (node/cluster/s2_catalog.py): S2 requests forwarded to a stream's primary
        port = self.s2_catalog.listen(interface)
        if port is not None:
            addresses["s2_peer"] = at % (advertised, port)
        incarnation = load_or_create_incarnation(node.config.data_dir)
        self.membership = Membership(self.client, self.prefix, node.node_id, incarnation, addresses, reactor=node.reactor)
        try:
            yield self.membership.start()
            self.election = Election(self.client, self.prefix, node.node_id)
            self.membership.on_new_lease(self.election.campaign)
            yield self.election.start(self.membership.lease)
            self.pd = PlacementDriver(self.client, self.prefix, node.node_id, self.membership, node.store,
                                      node.config.replication_factor, reactor=node.reactor)
            yield self.pd.start()
            self.replicator.pd, self.replicator.membership = self.pd, self.membership
            self.pd.listeners.append(self.replicator.record_changed)
            for rec in list(self.pd.streams.values()):
                self.replicator.record_changed(rec)  # the ranges this node sequences: their replicas catch up now
            self.membership.on_change(self.replicator.members_changed)
            self.failover = Failover(self.pd, self.membership, self.election, self.replicator, node.reactor)
            self.failover.start()
            toasty = ToastyCluster(node, self.client, self.prefix, self.membership, node.config.replication_factor,
                                   node.reactor)
            yield toasty.start()
            self.toasty = toasty
            token = node.config.http_token
            yield self.s2_catalog.start(hashlib.sha256(token.encode("utf-8")).hexdigest() if token else None)
            yield kv.start()
            self.kv = kv
        except BaseException:
            if kv.port is not None:
                kv.port.stopListening()
            yield self.stop()
            raise
        # after start, a slow etcd gets shorter retries so requests answer (with an error) promptly
        self.client.deadline = 3.0
        self.started = True
        self.log.info("cluster member {node_id} of {prefix} at {urls}", node_id=node.node_id, prefix=self.prefix,
                      urls=",".join(self.client.urls))

    @defer.inlineCallbacks
    def stop(self):
        if self.toasty is not None:
            self.toasty.stop()
        if self.failover is not None:
            self.failover.stop()
        yield self.s2_catalog.stop()
        if self.kv is not None:
            yield self.kv.stop()
        yield self.replicator.stop()
        if self.pd is not None:
            self.pd.stop()
        if self.election is not None:
            self.election.stop()
        if self.membership is not None:
            yield self.membership.stop()
        yield self.client.close()

    @defer.inlineCallbacks
    def describe(self):
        """Live members (node_id -> record) and the leader's node id, as etcd says now."""
        kvs, _ = yield self.client.get_prefix(self.prefix + "members/")
        members = member_records(kvs)
        leader = yield self.election.current_leader()
        return members, leader

    @staticmethod
    def classify(e):
        """(kind, message) of a cluster error for the protocols to answer with, or None if ``e``
        is not one. Kinds: no_available_rs, stream_not_found, not_here (message: the address to
        ask), unavailable (etcd did not answer), error."""
        if isinstance(e, placement.NoAvailableRS):
            return "no_available_rs", str(e)
        if isinstance(e, placement.StreamGone):
            return "stream_not_found", str(e)
        if isinstance(e, placement.NotHere):
            return "not_here", e.address
        if isinstance(e, etcd.EtcdUnavailable) or (isinstance(e, etcd.EtcdError) and e.code in (14, 4)):
            # etcd slow or unreachable: the request fails, the node keeps serving what it can
            return "unavailable", "placement driver unavailable: %s" % e
        if isinstance(e, (etcd.EtcdError, placement.PlacementError)):
            return "error", "placement driver: %s" % e
        return None

    def status(self):
        """The cluster as this node holds it in memory (no etcd request): node/cluster_view.py's
        snapshot (mode, leader, members, ranges, failovers) for the metrics and the status page,
        plus what `sbpctl status` and `sbpctl cluster` show (prefix, etcd and whether it answers,
        this node's role)."""
        members = []
        if self.membership is not None:
            for nid, rec in sorted(self.membership.members.items()):
                members.append({"node_id": nid, "sbp": rec.get("sbp"), "http": rec.get("http"), "alive": True})
        ranges = []
        if self.pd is not None:
            for rec in list(self.pd.streams.values()):
                for r in rec["ranges"]:
                    p = placement.primary_of(r)
                    progress = self.replicator.progress(rec["stream_id"]) if r["end"] < 0 else {}
                    ranges.append({"stream_id": rec["stream_id"], "index": r["index"], "start": r["start"], "end": r["end"],
                                   "leader": p["id"] if p else None, "replicas": [x["id"] for x in r["servers"]],
                                   "confirm_offset": progress.get("confirm_offset"),
                                   "replica_ends": progress.get("replica_ends", {})})
        return {
            "mode": "cluster",
            "leader": self.election.leader_id if self.election else None,
            "members": members,
            "ranges": ranges,
            "failovers": self.failover.count if self.failover else 0,
            "last_failover": self.failover.last if self.failover else None,
            "prefix": self.prefix,
            "etcd": ",".join(self.client.urls),
            "etcd_reachable": self.client.available,
            "live_members": [m["node_id"] for m in members],
            "is_leader": bool(self.election and self.election.is_leader),
            "streams_known": len(self.pd.streams) if self.pd else 0,
            "replication_factor": self.node.config.replication_factor,
            "toasty": self.toasty.status() if self.toasty is not None else None,
            "kv": self.kv.status() if self.kv is not None else {"placed": False},
        }


__all__ = ["ClusterNode", "StartRefused"]
