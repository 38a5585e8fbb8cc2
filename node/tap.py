"""`twistd sbpnode`: the start options of CONTRACT §1 and the service they build."""

from twisted.python import usage

from node import config as nodeconfig


class Options(usage.Options):
    synopsis = "[options]"
    longdesc = (
        "Run one sbpnode: a storage node keeping one store in --data-dir and serving it over SBP, "
        "key-value, Toasty metadata + chunks, swarm peer sync and the S2-compatible HTTP API. "
        "Each listener takes a Twisted server endpoint string (tcp:0:interface=127.0.0.1 picks a "
        "free port) or `none` to turn it off."
    )
    optParameters = [
        ["data-dir", None, "./sbpnode-data", "All durable state of the node lives here."],
        ["node-id", None, None, "This node's numeric id (positive int32). Default: random on first start, then persisted."],
        ["sbp", None, nodeconfig.DEFAULT_ENDPOINTS["sbp"], "SBP listener (range server + placement driver)."],
        ["kv", None, nodeconfig.DEFAULT_ENDPOINTS["kv"], "Primary_Partition key-value listener."],
        ["kv-client", None, nodeconfig.DEFAULT_ENDPOINTS["kv_client"], "The same key-value store in yesSQL's client framing (its cli.py, cli.go, HTTP bridge)."],
        ["meta", None, nodeconfig.DEFAULT_ENDPOINTS["meta"], "Toasty metadata-server listener."],
        ["chunks", None, nodeconfig.DEFAULT_ENDPOINTS["chunks"], "Toasty chunk-server listener."],
        ["swarm", None, nodeconfig.DEFAULT_ENDPOINTS["swarm"], "swarm stream! peer-sync listener."],
        ["http", None, nodeconfig.DEFAULT_ENDPOINTS["http"], "S2-compatible records API (HTTP/1.1 and cleartext HTTP/2)."],
        ["fsync", None, "always", "always (ack after fdatasync), interval:MS, or never."],
        ["http-token", None, None, "Require 'Authorization: Bearer TOKEN' on the HTTP API."],
        ["http-tls-cert", None, None, "PEM certificate: serve the HTTP API over TLS (HTTP/2 via ALPN)."],
        ["http-tls-key", None, None, "PEM private key for --http-tls-cert."],
        ["max-batch-bytes", None, str(nodeconfig.DEFAULT_MAX_BATCH_BYTES), "Largest record batch an APPEND entry may carry (1413 above it)."],
        ["ready-file", None, None, "Write a JSON object of the bound ports here (atomically) once every listener is bound."],
        ["log-level", None, "info", "Lowest log level written: debug, info, warn, error or critical."],
        ["replication-factor", None, None, "Replicas for new streams (replica_nums 0) and Toasty chunks. Default: 1 single node, 3 with --cluster."],
        ["cluster", None, None, "Cluster mode: etcd client URLs, comma-separated (http://127.0.0.1:2379)."],
        ["cluster-prefix", None, nodeconfig.DEFAULT_CLUSTER_PREFIX, "Key prefix for this cluster in etcd."],
        ["advertise", None, None, "Host other nodes and clients use to reach this node's listeners. Default: each listener's interface."],
        ["cluster-tls-cert", None, None, "PEM certificate of this node for mutual TLS between nodes and to etcd."],
        ["cluster-tls-key", None, None, "PEM private key for --cluster-tls-cert."],
        ["cluster-tls-ca", None, None, "PEM CA certificate: node-to-node peers must present a certificate it signed."],
        ["shutdown-timeout", None, "10", "Seconds to let in-flight work finish on SIGTERM/SIGINT."],
        ["max-unsent-bytes", None, str(nodeconfig.DEFAULT_MAX_UNSENT_BYTES), "Reply bytes held for all clients together past which stalled readers are cut off; 0: no cap."],
        ["max-connections", None, "0", "Open client connections (all listeners) past which new ones are closed at once; 0: the fd limit less 256."],
        ["metrics", None, "on", "on: Prometheus metrics at GET /metrics and the status page at GET / on the --http listener; off: neither, and no latency timing."],
        ["metrics-token", None, None, "Require 'Authorization: Bearer TOKEN' (or ?token=TOKEN) on /metrics and the status page (default: open)."],
        ["kv-reads", None, "leader", "Cluster mode: who answers a key-value GET: leader (linearizable) or replica (this node's applied copy when it holds one: acknowledged values, possibly stale; docs/cluster.md)."],
        ["kv-cache-mb", None, "256", "MiB of memory for the key-value row cache (LMDB's values of recently merged or read keys, for the kv listener's GETs); 0: none."],
        ["metrics-streams", None, "100", "Streams given their own `stream` label in the metrics (the biggest by records); the rest are summed as stream=\"_other\"."],
    ]

    def __init__(self):
        super().__init__()
        self["peers"] = []
        self["idle-timeouts"] = []

    def opt_peer(self, endpoint):
        """Another node's swarm listener (client endpoint string, e.g.
        tcp:host=127.0.0.1:port=7704) to sync from; repeatable."""
        from twisted.internet import endpoints, reactor

        try:
            endpoints.clientFromString(reactor, endpoint)
        except Exception as e:
            raise usage.UsageError("--peer: %r is not a client endpoint string (%s)" % (endpoint, e))
        self["peers"].append(endpoint)

    def opt_idle_timeout(self, value):
        """Close a connection after SECONDS without data either way: `--idle-timeout S` for every
        listener or `--idle-timeout LISTENER=S`, repeatable; 0: never. Default 300, swarm 3600."""
        self["idle-timeouts"].append(value)

    def postOptions(self):
        self.config = nodeconfig.from_options(self)


def makeService(options):
    from node.service import NodeService, attach_log_level

    class _TwistdNodeService(NodeService):
        def setServiceParent(self, parent):
            super().setServiceParent(parent)
            if hasattr(parent, "setComponent"):
                attach_log_level(self, parent, getattr(options, "parent", None))

    node_service = _TwistdNodeService(options.config)
    node_service.prepare()
    return node_service
