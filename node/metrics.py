"""The node's Prometheus metrics (every one is listed in docs/observability.md).

One ``CollectorRegistry`` per node holds:

- the library's process, platform and GC collectors (CPU, RSS, open fds, ...);
- the request latency histograms the protocol servers feed through ``NodeContext.observe_latency``
  (one observation per APPEND / FETCH / KV GET or SET run / Toasty READ / WRITE; reactor thread
  only, see ``ReactorHistogram``), the store's fsync histogram fed by the WAL's ``on_sync`` hook
  (writer thread) and etcd's round trips (the cluster code);
- ``NodeCollector``, which at scrape time turns the counters the protocols already keep in
  ``node.metrics``, the store's ``stats()``, the streams' offsets, the swarm peers' sync state and
  the optional cluster view (``node.cluster``, see node/cluster_view.py) into metric families.

So a request costs at most one histogram observation; everything else is read when scraped.
"""

import heapq
import os
import time
from bisect import bisect_left
from importlib import metadata

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

from node import cluster_view
from protocols.partition import server as kv_server
from protocols.s2 import api as s2_api
from protocols.sbp import server as sbp_server
from protocols.swarm import server as swarm_server
from protocols.toasty import server as toasty_server

DEFAULT_STREAM_LABELS = 100
OTHER_STREAMS = "_other"  # the label value that sums the streams past the --metrics-streams limit

# From 100 us (a KV GET run, an append group-committed with --fsync never) to 10 s (a FETCH parked
# at the tail waits up to its max_wait_ms).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
FSYNC_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0)

# name used by the hooks -> (protocol, operation) labels of sbpnode_request_duration_seconds
OPERATIONS = {
    "sbp.append": ("sbp", "append"),
    "sbp.fetch": ("sbp", "fetch"),
    "kv.get": ("kv", "get"),
    "kv.set": ("kv", "set"),
    "toasty.read": ("toasty", "read"),
    "toasty.write": ("toasty", "write"),
}
ETCD = "etcd"  # the cluster code's hook name for one etcd round trip


def version() -> str:
    try:
        return metadata.version("sbpnode")
    except metadata.PackageNotFoundError:
        return "unknown"


def ignore_latency(operation, seconds):
    """``observe_latency`` of a node without metrics (--metrics off)."""


class NodeMetrics:
    """The registry and the objects the hooks feed; ``exposition()`` is what GET /metrics serves."""

    def __init__(self, node, stream_labels=DEFAULT_STREAM_LABELS):
        self.node = node
        self.started = getattr(node, "started", None) or time.time()
        self.registry = registry = CollectorRegistry()
        ProcessCollector(namespace="", registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        self.request_seconds = RequestLatency()
        registry.register(self.request_seconds)
        self.fsync_seconds = Histogram(
            "sbpnode_store_fsync_duration_seconds",
            "One sync of the store's write-ahead log: an fdatasync, or a group's write that syncs its "
            "bytes itself (RWF_DSYNC, under --fsync always).",
            buckets=FSYNC_BUCKETS, registry=registry,
        )
        self.etcd_seconds = Histogram(
            "sbpnode_etcd_request_duration_seconds",
            "One round trip to etcd by the cluster code (none in single-node mode).",
            buckets=LATENCY_BUCKETS, registry=registry,
        )
        # bound observe methods: a hook costs one dict lookup and the observation
        self._observers = {name: h.observe for name, h in self.request_seconds.histograms.items()}
        self._observers[ETCD] = self.etcd_seconds.observe
        self.collector = NodeCollector(node, self, stream_labels)
        registry.register(self.collector)

    def observe_latency(self, operation: str, seconds: float) -> None:
        self._observers[operation](seconds)

    def observe_fsync(self, seconds: float) -> None:
        self.fsync_seconds.observe(seconds)

    def latency_buckets(self):
        """{operation: (upper bounds, cumulative counts)} of every latency histogram (the last bound
        +Inf), for the status page's history (node/status_history.py)."""
        out = {name: (list(h.bounds) + [float("inf")], h.cumulative())
               for name, h in self.request_seconds.histograms.items()}
        families = list(self.fsync_seconds.collect())
        for family in families:
            for s in family.samples:
                if s.name == "sbpnode_store_fsync_duration_seconds_bucket":
                    bounds, counts = out.setdefault("store.fsync", ([], []))
                    bounds.append(float(s.labels["le"]))
                    counts.append(s.value)
        return out

    def exposition(self):
        """(body, content type) in the Prometheus text format, written by prometheus_client."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ReactorHistogram:
    """Bucket counts of observations made on the reactor thread only, exposed through the
    library's HistogramMetricFamily by ``RequestLatency``. prometheus_client's own Histogram takes
    a lock twice per observation (0.85 us here); this is a bisect and two adds (0.13 us), which
    keeps the request path's cost inside the 3% budget (docs/benchmarks.md "Metrics")."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds=LATENCY_BUCKETS):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, seconds):
        # bisect_left: a value equal to a bound counts in that bound's bucket (le, "<=")
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def cumulative(self):
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


class RequestLatency:
    """``sbpnode_request_duration_seconds{protocol,operation}``: one ReactorHistogram per
    operation of OPERATIONS, collected (on the reactor thread, where scrapes are served)."""

    def __init__(self):
        self.histograms = {name: ReactorHistogram() for name in OPERATIONS}

    def describe(self):
        return []

    def collect(self):
        family = HistogramMetricFamily(
            "sbpnode_request_duration_seconds",
            "Time from a request's arrival to its reply (APPEND: durable per --fsync; FETCH: "
            "including time parked at the tail; KV: one observation per pipelined run).",
            labels=["protocol", "operation"],
        )
        for name, h in self.histograms.items():
            cumulative = h.cumulative()
            buckets = [(_le(b), c) for b, c in zip(h.bounds, cumulative)] + [("+Inf", cumulative[-1])]
            family.add_metric(list(OPERATIONS[name]), buckets, sum_value=h.sum)
        yield family


def _le(bound):
    return repr(float(bound))


def _counter(name, doc, labels=()):
    return CounterMetricFamily(name, doc, labels=list(labels))


def _gauge(name, doc, labels=()):
    return GaugeMetricFamily(name, doc, labels=list(labels))


class NodeCollector:
    """Reads, at scrape time, what the node keeps anyway (the custom-collector pattern of
    prometheus_client: nothing is added to the request paths)."""

    def __init__(self, node, metrics: NodeMetrics, stream_labels: int):
        self.node = node
        self.metrics = metrics
        self.stream_labels = stream_labels

    def describe(self):
        return []  # families vary with the node's state; the registry must not pre-check names

    def collect(self):
        node = self.node
        yield from self._node()
        yield from self._protocols(node.metrics)
        if node.store is not None:
            yield from self._store(node.store)
            yield from self._streams(node.store)
        yield from self._peers(node.metrics.get("peers") or {})
        yield from self._cluster(cluster_view.snapshot(node))

    # -- the node ---------------------------------------------------------------------------------

    def _node(self):
        node = self.node
        info = InfoMetricFamily("sbpnode_node", "This node: id, version and fsync policy.")
        info.add_metric([], {
            "node_id": str(node.node_id), "version": version(),
            "fsync": str(getattr(node.config, "fsync", "")),
        })
        yield info
        g = _gauge("sbpnode_start_time_seconds", "When the node started (Unix time).")
        g.add_metric([], self.metrics.started)
        yield g

    def _protocols(self, m):
        sbp = m.get("sbp") or {}
        kv = m.get("kv") or {}
        s2 = m.get("s2") or {}
        swarm = m.get("swarm_server") or {}
        requests = _counter("sbpnode_requests", "Requests received, by protocol and operation "
                            "(operation \"any\": the protocol counts all its requests together).",
                            ["protocol", "operation"])
        for op, key in (("append", "appends"), ("fetch", "fetches")):
            if key in sbp:
                requests.add_metric(["sbp", op], sbp[key])
        if "requests" in kv:
            requests.add_metric(["kv", "any"], kv["requests"])
        if "requests" in s2:
            requests.add_metric(["s2", "any"], s2["requests"])
        for key, value in sorted(m.items()):
            if key.startswith("toasty_") and isinstance(value, int):
                requests.add_metric(["toasty", key[len("toasty_"):]], value)
        if "batches" in swarm:
            requests.add_metric(["swarm", "batch"], swarm["batches"])
        yield requests

        errors = _counter("sbpnode_protocol_errors", "Requests refused as malformed or failed by a bug, "
                          "by protocol (store errors are answered with a status and not counted here).",
                          ["protocol"])
        if "errors" in sbp:
            errors.add_metric(["sbp"], sbp["errors"])
        yield errors

        yield from self._responses(m)

        records = _counter("sbpnode_records", "Records appended (in) and read (out), by protocol.",
                           ["protocol", "direction"])
        if "append_records" in sbp:
            records.add_metric(["sbp", "in"], sbp["append_records"])
        if "appended_records" in s2:
            records.add_metric(["s2", "in"], s2["appended_records"])
        if "read_records" in s2:
            records.add_metric(["s2", "out"], s2["read_records"])
        yield records

        payload = _counter("sbpnode_payload_bytes", "Record-batch and item payload bytes received (in) "
                           "and sent (out), by protocol.", ["protocol", "direction"])
        if "append_bytes" in sbp:
            payload.add_metric(["sbp", "in"], sbp["append_bytes"])
        if "fetch_bytes" in sbp:
            payload.add_metric(["sbp", "out"], sbp["fetch_bytes"])
        if "appended_bytes" in s2:
            payload.add_metric(["s2", "in"], s2["appended_bytes"])
        if "read_bytes" in s2:
            payload.add_metric(["s2", "out"], s2["read_bytes"])
        if "bytes" in swarm:
            payload.add_metric(["swarm", "out"], swarm["bytes"])
        peers_in = sum(p.get("bytes", 0) for p in (m.get("peers") or {}).values())
        if m.get("peers"):
            payload.add_metric(["swarm", "in"], peers_in)
        yield payload

        if "fetch_sendfile_bytes" in sbp:
            c = _counter("sbpnode_sbp_fetch_sendfile_bytes", "FETCH reply bytes sent with sendfile(2) from the WAL files.")
            c.add_metric([], sbp["fetch_sendfile_bytes"])
            yield c
        if "read_ahead_hits" in sbp:
            c = _counter("sbpnode_sbp_read_ahead_hits", "FETCHes answered from the connection's read-ahead.")
            c.add_metric([], sbp["read_ahead_hits"])
            yield c
        if "fetch_pool_reads" in sbp:
            c = _counter("sbpnode_sbp_fetch_pool_reads", "FETCH reads (read-aheads included) that went to the store's "
                         "read pool because their bytes were not all in the page cache.")
            c.add_metric([], sbp["fetch_pool_reads"])
            yield c

        wire = _counter("sbpnode_wire_bytes", "Bytes read from (in) and written to (out) the connections, "
                        "by protocol (KV and Toasty; the other protocols count payload bytes).",
                        ["protocol", "direction"])
        for protocol, section in (("kv", kv), ("toasty", m.get("toasty") or {})):
            if "bytes_in" in section:
                wire.add_metric([protocol, "in"], section["bytes_in"])
                wire.add_metric([protocol, "out"], section.get("bytes_out", 0))
        yield wire

        conns = _gauge("sbpnode_connections", "Open client connections, by listener.", ["protocol"])
        for name, count in self._connections().items():
            conns.add_metric([name], count)
        yield conns

        guard = m.get("connections") or {}  # node/guard.py
        for key, kind, name, text in (
            ("refused", _counter, "sbpnode_connections_refused", "Connections closed at once past --max-connections."),
            ("closed_idle", _counter, "sbpnode_connections_closed_idle", "Connections closed after their listener's --idle-timeout."),
            ("closed_stalled", _counter, "sbpnode_connections_closed_stalled", "Connections not reading their replies, aborted over --max-unsent-bytes."),
            ("unsent_bytes", _gauge, "sbpnode_unsent_reply_bytes", "Reply bytes held for clients, not yet taken by the kernel."),
        ):
            if key in guard:
                metric = kind(name, text)
                metric.add_metric([], guard[key])
                yield metric

    def _responses(self, m):
        """sbpnode_responses_total from the counts each protocol server keeps by its own compact
        key (each server's ``response_labels`` turns a key into labels)."""
        family = _counter("sbpnode_responses", "Replies sent, by protocol, operation (opcode, command, "
                          "request or message type, route group) and status; result=\"error\" for a refusal "
                          "or failure.", ["protocol", "operation", "status", "result"])
        sources = (
            ("sbp", m.get("sbp_responses"), sbp_server.response_labels),
            ("kv", (m.get("kv") or {}).get("responses"), kv_server.response_labels),
            ("toasty", (m.get("toasty") or {}).get("responses"), toasty_server.response_labels),
            ("s2", m.get("s2_responses"), s2_api.response_labels),
            ("swarm", (m.get("swarm_server") or {}).get("responses"), swarm_server.response_labels),
        )
        for protocol, counts, labels_of in sources:
            series = {}
            for key, count in list((counts or {}).items()):
                operation, status, ok = labels_of(key)
                labels = (protocol, operation, status, "ok" if ok else "error")
                series[labels] = series.get(labels, 0) + count
            for labels, count in sorted(series.items()):
                family.add_metric(list(labels), count)
        yield family

    def _connections(self):
        out = {}
        for name, port in (getattr(self.node, "ports", None) or {}).items():
            factory = getattr(port, "factory", None)
            factory = getattr(factory, "wrappedFactory", factory)  # the TLS wrapper of --http
            conns = getattr(factory, "connections", None)
            if conns is not None:
                out[name] = len(conns)
        sbp = (self.node.metrics.get("sbp") or {}).get("connections")
        if sbp is not None:
            out["sbp"] = sbp
        return out

    # -- the store --------------------------------------------------------------------------------

    def _store(self, store):
        try:
            stats = store.stats()
        except Exception:  # closed or closing: nothing to report
            return
        gauges = (
            ("sbpnode_store_wal_bytes", "Bytes in the write-ahead log's segments.", "wal_bytes"),
            ("sbpnode_store_wal_segments", "Write-ahead log segment files.", "wal_segments"),
            ("sbpnode_store_streams", "Record streams in the store.", "streams"),
            ("sbpnode_store_batches", "Record batches indexed.", "batches"),
            ("sbpnode_store_chunks", "Content-addressed chunks stored.", "chunks"),
            ("sbpnode_store_chunk_packs", "Chunk pack files.", "chunk_packs"),
            ("sbpnode_store_kv_keys", "Keys in the key-value partitions.", "kv_keys"),
            ("sbpnode_store_meta_keys", "Keys in the metadata tables.", "meta_keys"),
            ("sbpnode_store_queued_bytes", "Bytes waiting for the writer thread (the store's in-memory "
             "write queue: the memtable of this design).", "queued_bytes"),
        )
        for name, doc, key in gauges:
            if key in stats:
                g = _gauge(name, doc)
                g.add_metric([], stats[key])
                yield g
        c = _counter("sbpnode_store_wal_written_bytes", "Bytes written to the write-ahead log since start "
                     "(WAL position; grows across segment deletion).")
        c.add_metric([], stats.get("wal_position", 0))
        yield c
        g = _gauge("sbpnode_store_failed", "1 once an I/O error made the store refuse writes.")
        g.add_metric([], 1 if stats.get("failed") else 0)
        yield g
        g = _gauge("sbpnode_store_disk_full", "1 while writes are refused because the disk is full (ENOSPC).")
        g.add_metric([], 1 if stats.get("disk_full") else 0)
        yield g
        wal = getattr(store, "wal", None)
        if wal is not None and hasattr(wal, "flushes"):
            c = _counter("sbpnode_store_group_commits", "Writer groups committed to the write-ahead log "
                         "(one write + at most one fsync for many requests).")
            c.add_metric([], wal.flushes)
            yield c
        path = getattr(store, "path", None)
        if path:
            g = _gauge("sbpnode_store_index_bytes", "Size of the LMDB index/kv/metadata file.")
            g.add_metric([], _file_size(os.path.join(path, "index", "data.mdb")))
            yield g
            g = _gauge("sbpnode_store_chunk_bytes", "Bytes in the chunk pack files.")
            g.add_metric([], _dir_size(os.path.join(path, "chunks")))
            yield g

    def _streams(self, store):
        try:
            offsets = store.log.offsets()
        except Exception:
            return
        # the biggest streams by record count get their own label; the rest are summed in _other
        named = heapq.nlargest(self.stream_labels, offsets.items(), key=lambda kv: kv[1][1] - kv[1][0])
        records = _gauge("sbpnode_stream_records", "Records a stream holds (next offset - trim offset); "
                         "streams past --metrics-streams are summed under stream=\"_other\".", ["stream"])
        end = _gauge("sbpnode_stream_next_offset", "The offset the stream's next record gets "
                     "(single node: also its confirm offset).", ["stream"])
        start = _gauge("sbpnode_stream_trim_offset", "The stream's first readable offset.", ["stream"])
        named_total = 0
        for sid, (trim, nxt) in named:
            label = [str(sid)]
            records.add_metric(label, nxt - trim)
            end.add_metric(label, nxt)
            start.add_metric(label, trim)
            named_total += nxt - trim
        if len(named) < len(offsets):
            records.add_metric([OTHER_STREAMS], sum(n - t for t, n in offsets.values()) - named_total)
        yield records
        yield end
        yield start
        g = _gauge("sbpnode_stream_label_limit", "--metrics-streams: streams given their own label.")
        g.add_metric([], self.stream_labels)
        yield g

    # -- peers and cluster ------------------------------------------------------------------------

    def _peers(self, peers):
        connected = _gauge("sbpnode_peer_connected", "1 while the swarm sync connection to the peer is up.", ["peer"])
        items = _counter("sbpnode_peer_sync_items", "Items synced from the peer.", ["peer"])
        nbytes = _counter("sbpnode_peer_sync_bytes", "Bytes synced from the peer.", ["peer"])
        lag = _gauge("sbpnode_peer_sync_lag_items", "Items the peer has that this node has not synced yet.", ["peer"])
        for address, p in sorted(peers.items()):
            connected.add_metric([address], 1 if p.get("connected") else 0)
            items.add_metric([address], p.get("items", 0))
            nbytes.add_metric([address], p.get("bytes", 0))
            lag.add_metric([address], p.get("lag", 0) or 0)
        yield from (connected, items, nbytes, lag)

    def _cluster(self, view):
        g = _gauge("sbpnode_cluster_members", "Members of the cluster (1: single-node mode).")
        g.add_metric([], len(view["members"]))
        yield g
        leader = view.get("leader")
        g = _gauge("sbpnode_cluster_leader", "The placement-driver leader's node id (-1: none known; "
                   "single-node mode: this node).")
        g.add_metric([], leader if leader is not None else -1)
        yield g
        g = _gauge("sbpnode_cluster_is_leader", "1 if this node is the placement-driver leader.")
        g.add_metric([], 1 if leader is not None and leader == self.node.node_id else 0)
        yield g
        c = _counter("sbpnode_cluster_failovers", "Range-leader changes after a failure, seen by this node.")
        c.add_metric([], view.get("failovers", 0))
        yield c
        confirm = _gauge("sbpnode_range_confirm_offset", "A range's confirm offset (acknowledged to writers).",
                         ["stream", "range"])
        lag = _gauge("sbpnode_replication_lag_records", "Records a replica is behind its range's end.",
                     ["stream", "range", "replica"])
        for r in view["ranges"][: self.stream_labels]:
            labels = [str(r["stream_id"]), str(r["index"])]
            if r.get("confirm_offset") is not None:
                confirm.add_metric(labels, r["confirm_offset"])
            ends = r.get("replica_ends") or {}
            top = max(ends.values()) if ends else None
            for replica, end in sorted(ends.items()):
                lag.add_metric(labels + [str(replica)], top - end)
        yield confirm
        yield lag


def _file_size(path):
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _dir_size(path):
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
    except OSError:
        pass
    return total
