"""The node's start options (CONTRACT §1), validated into one immutable NodeConfig."""

import os
from dataclasses import dataclass, field
from typing import List, Optional

from twisted.python import usage

LISTENERS = ("sbp", "kv", "kv_client", "meta", "chunks", "swarm", "http")

DEFAULT_ENDPOINTS = {
    "sbp": "tcp:7700:interface=127.0.0.1",
    "kv": "tcp:7701:interface=127.0.0.1",
    "kv_client": "tcp:7705:interface=127.0.0.1",  # CONTRACT §4.1
    "meta": "tcp:7702:interface=127.0.0.1",
    "chunks": "tcp:7703:interface=127.0.0.1",
    "swarm": "tcp:7704:interface=127.0.0.1",
    "http": "tcp:7780:interface=127.0.0.1",
}

DEFAULT_CLUSTER_PREFIX = "/sbpnode/"
# Listen backlog for bursts of connects (Twisted's default is 50); a `backlog=` in the user's
# endpoint string wins. The kernel caps it at net.core.somaxconn.
DEFAULT_BACKLOG = 1024
_BACKLOG_TYPES = ("tcp", "tcp6", "ssl", "unix")

DEFAULT_MAX_BATCH_BYTES = 16 * 1024 * 1024 - 64 * 1024
# Seconds without data either way before a connection is closed (node/guard.py); 0: never. Swarm
# peers hold subscriptions that may see no data for long in a quiet cluster (they reconnect).
DEFAULT_MAX_UNSENT_BYTES = 256 * 1024 * 1024
DEFAULT_IDLE_TIMEOUTS = {"sbp": 300, "kv": 300, "kv_client": 300, "meta": 300, "chunks": 300, "swarm": 3600, "http": 300}
LOG_LEVELS = ("debug", "info", "warn", "error", "critical")


@dataclass(frozen=True)
class NodeConfig:
    data_dir: str = "./sbpnode-data"
    node_id: Optional[int] = None  # None: random on first start, then persisted
    sbp: Optional[str] = DEFAULT_ENDPOINTS["sbp"]
    kv: Optional[str] = DEFAULT_ENDPOINTS["kv"]
    kv_client: Optional[str] = DEFAULT_ENDPOINTS["kv_client"]
    meta: Optional[str] = DEFAULT_ENDPOINTS["meta"]
    chunks: Optional[str] = DEFAULT_ENDPOINTS["chunks"]
    swarm: Optional[str] = DEFAULT_ENDPOINTS["swarm"]
    http: Optional[str] = DEFAULT_ENDPOINTS["http"]
    peers: List[str] = field(default_factory=list)
    fsync: object = None  # storage.FsyncPolicy
    http_token: Optional[str] = None
    http_tls_cert: Optional[str] = None
    http_tls_key: Optional[str] = None
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    ready_file: Optional[str] = None
    log_level: str = "info"
    replication_factor: int = 1
    shutdown_timeout: float = 10.0
    max_connections: int = 0  # 0: derived from RLIMIT_NOFILE at start (node/guard.py)
    max_unsent_bytes: int = DEFAULT_MAX_UNSENT_BYTES
    idle_timeouts: dict = field(default_factory=lambda: dict(DEFAULT_IDLE_TIMEOUTS))
    # CONTRACT §9 (cluster mode); cluster None: a cluster of one, as before
    cluster: Optional[str] = None
    cluster_prefix: str = DEFAULT_CLUSTER_PREFIX
    advertise: Optional[str] = None
    cluster_tls_cert: Optional[str] = None
    cluster_tls_key: Optional[str] = None
    cluster_tls_ca: Optional[str] = None
    metrics: bool = True  # --metrics on|off: the Prometheus registry, latency hooks and status page
    metrics_token: Optional[str] = None  # --metrics-token: bearer token for /metrics and the status page
    metrics_streams: int = 100  # --metrics-streams: streams that get their own label
    kv_reads: str = "leader"  # --kv-reads leader|replica: who answers a cluster GET (docs/cluster.md)
    kv_cache_mb: int = 256  # --kv-cache-mb: the key-value row cache's memory (storage/kv_cache.py); 0: none

    def endpoint(self, name: str) -> Optional[str]:
        return with_backlog(getattr(self, name))


def option_name(listener: str) -> str:
    """The command-line option of a listener (``kv_client`` -> ``kv-client``)."""
    return listener.replace("_", "-")


def with_backlog(description: Optional[str]) -> Optional[str]:
    """The endpoint string with ``backlog=DEFAULT_BACKLOG`` unless it names a backlog already."""
    if description is None or description.split(":", 1)[0].lower() not in _BACKLOG_TYPES:
        return description
    if any(part.strip().lower().startswith("backlog=") for part in description.split(":")[1:]):
        return description
    return description + ":backlog=%d" % DEFAULT_BACKLOG


def parse_endpoint(name: str, value: str) -> Optional[str]:
    """CONTRACT §1: `none` turns a listener off; anything else must parse as a server endpoint."""
    if value.strip().lower() == "none":
        return None
    from twisted.internet import endpoints, reactor

    try:
        endpoints.serverFromString(reactor, value)
    except Exception as e:
        raise usage.UsageError("--%s: %r is not a server endpoint string (%s)" % (name, value, e))
    return value


def parse_fsync(value: str):
    from storage import FsyncPolicy

    try:
        return FsyncPolicy.parse(value)
    except ValueError:
        raise usage.UsageError(
            "--fsync: %r is not a policy; allowed: always, interval:MS (MS a positive integer), never"
            % value
        )


def parse_positive_int(option: str, value, upper: int = None) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise usage.UsageError("--%s: %r is not an integer" % (option, value))
    if n < 1 or (upper is not None and n > upper):
        bound = "1..%d" % upper if upper is not None else ">= 1"
        raise usage.UsageError("--%s: %d is out of range (%s)" % (option, n, bound))
    return n


def parse_idle_timeouts(values) -> dict:
    """``--idle-timeout S`` (every listener) or ``--idle-timeout LISTENER=S``, repeatable, later
    ones winning; S in seconds, 0 for never."""
    out = dict(DEFAULT_IDLE_TIMEOUTS)
    for value in values:
        name, _, seconds = value.rpartition("=")
        if name and name not in LISTENERS:
            raise usage.UsageError("--idle-timeout: %r: %r is not a listener (%s)" % (value, name, ", ".join(LISTENERS)))
        try:
            s = float(seconds)
        except ValueError:
            s = -1.0
        if not s >= 0 or s == float("inf"):
            raise usage.UsageError("--idle-timeout: %r: expected SECONDS or LISTENER=SECONDS (0: never)" % value)
        for n in [name] if name else LISTENERS:
            out[n] = s
    return out
def parse_cluster_urls(value: str) -> str:
    from urllib.parse import urlsplit

    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise usage.UsageError("--cluster: no etcd URL given")
    for u in urls:
        parts = urlsplit(u)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise usage.UsageError("--cluster: %r is not an etcd client URL like http://127.0.0.1:2379" % u)
    return ",".join(urls)


def parse_cluster_prefix(value: str) -> str:
    if not value or not value.startswith("/"):
        raise usage.UsageError("--cluster-prefix: %r must start with /" % value)
    return value if value.endswith("/") else value + "/"


def cluster_tls(opts):
    paths = [opts["cluster-tls-cert"], opts["cluster-tls-key"], opts["cluster-tls-ca"]]
    if not any(paths):
        return None, None, None
    if not all(paths):
        raise usage.UsageError("--cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together")
    for name, path in zip(("cert", "key", "ca"), paths):
        if not os.path.isfile(path):
            raise usage.UsageError("--cluster-tls-%s: no file %s" % (name, path))
    from node.cluster.tls import CertificateRefused, check_node_certificate

    try:
        # CONTRACT §9: a node without a CA-signed certificate takes no part: it does not start
        check_node_certificate(*paths)
    except CertificateRefused as e:
        raise usage.UsageError("--cluster-tls-cert: %s" % e)
    return tuple(os.path.abspath(p) for p in paths)
def parse_kv_reads(value) -> str:
    if value not in ("leader", "replica"):
        raise usage.UsageError("--kv-reads: %r is not leader or replica" % (value,))
    return value


def parse_on_off(option: str, value) -> bool:
    v = str(value).strip().lower()
    if v not in ("on", "off"):
        raise usage.UsageError("--%s: %r is not on or off" % (option, value))
    return v == "on"


def parse_non_negative_int(option: str, value) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise usage.UsageError("--%s: %r is not an integer" % (option, value))
    if n < 0:
        raise usage.UsageError("--%s: %d is out of range (>= 0)" % (option, n))
    return n


def from_options(opts) -> NodeConfig:
    """Build a NodeConfig from validated twistd Options (node/tap.py)."""
    node_id = opts["node-id"]
    if node_id is not None:
        node_id = parse_positive_int("node-id", node_id, 2**31 - 1)
    level = opts["log-level"].lower()
    if level not in LOG_LEVELS:
        raise usage.UsageError("--log-level: %r is not one of %s" % (level, ", ".join(LOG_LEVELS)))
    cert, key = opts["http-tls-cert"], opts["http-tls-key"]
    if bool(cert) != bool(key):
        raise usage.UsageError("--http-tls-cert and --http-tls-key go together")
    cluster = parse_cluster_urls(opts["cluster"]) if opts["cluster"] else None
    tls_cert, tls_key, tls_ca = cluster_tls(opts)
    if tls_cert and not cluster:
        raise usage.UsageError("--cluster-tls-* need --cluster")
    rf = opts["replication-factor"]
    # CONTRACT §9: 1 for a single node, 3 in a cluster
    rf = parse_positive_int("replication-factor", rf, 16) if rf is not None else (3 if cluster else 1)
    return NodeConfig(
        cluster=cluster,
        cluster_prefix=parse_cluster_prefix(opts["cluster-prefix"]),
        advertise=opts["advertise"] or None,
        cluster_tls_cert=tls_cert,
        cluster_tls_key=tls_key,
        cluster_tls_ca=tls_ca,
        data_dir=os.path.abspath(opts["data-dir"]),
        node_id=node_id,
        peers=list(opts["peers"]),
        fsync=parse_fsync(opts["fsync"]),
        http_token=opts["http-token"],
        http_tls_cert=cert,
        http_tls_key=key,
        max_batch_bytes=parse_positive_int("max-batch-bytes", opts["max-batch-bytes"], 16 * 1024 * 1024 - 64),
        ready_file=os.path.abspath(opts["ready-file"]) if opts["ready-file"] else None,
        log_level=level,
        replication_factor=rf,
        shutdown_timeout=float(opts["shutdown-timeout"]),
        max_connections=0 if opts["max-connections"] in (None, "0") else parse_positive_int("max-connections", opts["max-connections"]),
        idle_timeouts=parse_idle_timeouts(opts["idle-timeouts"]),
        max_unsent_bytes=0 if opts["max-unsent-bytes"] == "0" else parse_positive_int("max-unsent-bytes", opts["max-unsent-bytes"]),
        metrics=parse_on_off("metrics", opts["metrics"]),
        metrics_token=opts["metrics-token"],
        metrics_streams=parse_non_negative_int("metrics-streams", opts["metrics-streams"]),
        kv_reads=parse_kv_reads(opts["kv-reads"]),
        kv_cache_mb=parse_non_negative_int("kv-cache-mb", opts["kv-cache-mb"]),
        **{name: parse_endpoint(option_name(name), opts[option_name(name)]) for name in LISTENERS},
    )
