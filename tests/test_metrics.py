"""Prometheus metrics, the status page and its JSON, scraped from real nodes after real traffic
(docs/observability.md)."""

import http.client
import json
import shutil
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.status_history import quantile
from protocols.partition.client import BlockingKvClient
from protocols.sbp.client import BlockingSbpClient
from protocols.toasty.client import BlockingToastyClient
from storage import record_batch
from tests.waiting import wait_until


def get(node, path, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=30)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def post_json(node, path, obj):
    conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=30)
    conn.request("POST", path, body=json.dumps(obj).encode(), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status in (200, 201), body
    return json.loads(body) if body else None


def scrape(node, headers=None):
    """{(sample name, frozenset of labels): value} from GET /metrics, parsed by prometheus_client."""
    status, hdrs, body = get(node, "/metrics", headers)
    assert status == 200, body
    assert hdrs["content-type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def batch(n):
    return record_batch.encode([(1000 + i, [], b"value-%d" % i) for i in range(n)])


def traffic(node):
    """A little of every protocol: SBP append + fetch, KV set + get, Toasty write + read, S2
    append + read."""
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10) as c:
        sid = c.create_stream()["stream_id"]
        for _ in range(5):
            c.append(sid, batch(10))
        assert c.fetch(sid, 0, 1 << 20)
    with BlockingKvClient(*node.address("kv")) as kv:
        for i in range(20):
            kv.set(b"k%d" % i, b"v%d" % i)
        assert kv.get(b"k3") == b"v3"
    with BlockingToastyClient(*node.address("meta")) as t:
        t.write("/f", b"hello" * 1000, truncate=True)
        assert t.read("/f") == b"hello" * 1000
    post_json(node, "/v1/streams", {"stream": "metrics-s2"})
    post_json(node, "/v1/streams/metrics-s2/records", {"records": [{"body": "a"}, {"body": "b"}]})
    status, _, body = get(node, "/v1/streams/metrics-s2/records?seq_num=0&count=10")
    assert status == 200 and len(json.loads(body)["records"]) == 2
    return sid


def test_quantile_interpolates_like_histogram_quantile():
    bounds = [0.001, 0.01, 0.1, float("inf")]
    assert quantile(0.5, bounds, [0, 0, 0, 0]) is None
    assert quantile(0.5, bounds, [10, 10, 10, 10]) == pytest.approx(0.0005)
    assert quantile(0.5, bounds, [0, 10, 10, 10]) == pytest.approx(0.0055)
    assert quantile(0.99, bounds, [0, 0, 0, 5]) == 0.1  # above the last finite bound: that bound


def test_metrics_after_traffic_on_each_protocol(node):
    before = scrape(node)
    sid = traffic(node)
    after = scrape(node)

    def moved(name, **labels):
        assert value(after, name, **labels) > value(before, name, **labels), (name, labels)

    moved("sbpnode_requests_total", protocol="sbp", operation="append")
    moved("sbpnode_requests_total", protocol="sbp", operation="fetch")
    moved("sbpnode_requests_total", protocol="kv", operation="any")
    moved("sbpnode_requests_total", protocol="toasty", operation="write")
    moved("sbpnode_requests_total", protocol="toasty", operation="read")
    moved("sbpnode_requests_total", protocol="s2", operation="any")
    moved("sbpnode_records_total", protocol="sbp", direction="in")
    moved("sbpnode_records_total", protocol="s2", direction="in")
    moved("sbpnode_records_total", protocol="s2", direction="out")
    moved("sbpnode_payload_bytes_total", protocol="sbp", direction="in")
    moved("sbpnode_payload_bytes_total", protocol="sbp", direction="out")
    moved("sbpnode_payload_bytes_total", protocol="s2", direction="in")
    moved("sbpnode_payload_bytes_total", protocol="s2", direction="out")
    for protocol, op in (("sbp", "append"), ("sbp", "fetch"), ("kv", "get"), ("kv", "set"),
                         ("toasty", "read"), ("toasty", "write")):
        moved("sbpnode_request_duration_seconds_count", protocol=protocol, operation=op)
        assert value(after, "sbpnode_request_duration_seconds_sum", protocol=protocol, operation=op) > 0
    assert value(after, "sbpnode_request_duration_seconds_count", protocol="sbp", operation="append") == 5
    assert value(after, "sbpnode_request_duration_seconds_bucket", protocol="sbp", operation="append", le="+Inf") == 5
    # the store (the node runs with --fsync always: every group commit syncs the WAL)
    moved("sbpnode_store_group_commits_total")
    moved("sbpnode_store_fsync_duration_seconds_count")
    moved("sbpnode_store_wal_written_bytes_total")
    assert value(after, "sbpnode_store_wal_bytes") > 0
    assert value(after, "sbpnode_store_index_bytes") > 0
    assert value(after, "sbpnode_store_chunks") >= 1 and value(after, "sbpnode_store_chunk_bytes") > 0
    assert value(after, "sbpnode_store_kv_keys") >= 20
    assert value(after, "sbpnode_store_failed") == 0
    # per stream, the cluster of one, the node and the library's process collectors
    assert value(after, "sbpnode_stream_records", stream=str(sid)) == 50
    assert value(after, "sbpnode_stream_next_offset", stream=str(sid)) == 50
    assert value(after, "sbpnode_cluster_members") == 1
    assert value(after, "sbpnode_cluster_leader") == node.node_id
    assert value(after, "sbpnode_cluster_is_leader") == 1
    assert value(after, "sbpnode_node_info", node_id=str(node.node_id), version="0.1.0", fsync="always") == 1
    assert value(after, "process_resident_memory_bytes") > 0
    assert value(after, "process_open_fds") > 0
    assert any(name == "python_info" for name, _ in after)  # the library's platform collector


def failing_requests(node):
    """One request each protocol refuses or fails: SBP APPEND to a stream that does not exist,
    KV DELETE_CURSOR of an unknown cursor (and a GET of a missing key, an answer, not an error),
    Toasty READ of a missing file, S2 read of a missing stream, swarm GetRange of a missing
    stream."""
    import socket

    from protocols.partition.client import KvError
    from protocols.swarm import codec as swarm_codec

    with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10) as c:
        try:
            c.append(987654321, batch(1))
        except Exception:
            pass  # the client may raise on the entry's status; the reply is what is counted
    with BlockingKvClient(*node.address("kv")) as kv:
        assert kv.get(b"no-such-key") is None
        with pytest.raises(KvError):
            kv.delete_cursor(b"no-such-cursor")
    with BlockingToastyClient(*node.address("meta")) as t:
        with pytest.raises(Exception):
            t.read("/no-such-file")
    assert get(node, "/v1/streams/no-such-stream/records?seq_num=0")[0] == 404
    with socket.create_connection(node.address("swarm"), timeout=10) as s:
        s.sendall(swarm_codec.encode(swarm_codec.GetRange(1, swarm_codec.log_id(987654321), 1, None, 10, False)))
        assert s.recv(65536)  # the StreamState refusal


def test_responses_by_status_and_wire_bytes(node):
    before = scrape(node)
    traffic(node)
    failing_requests(node)

    def series(samples, protocol, operation, status, result):
        return value(samples, "sbpnode_responses_total", protocol=protocol, operation=operation,
                     status=status, result=result)

    expected = (
        ("sbp", "append", "NONE", "ok"), ("sbp", "fetch", "NONE", "ok"),
        ("sbp", "create_streams", "NONE", "ok"), ("sbp", "append", "STREAM_NOT_FOUND", "error"),
        ("kv", "set", "OK", "ok"), ("kv", "get", "OK", "ok"), ("kv", "get", "DATA_NOT_FOUND", "ok"),
        ("kv", "delete_cursor", "ERR_CURSOR_NOT_FOUND", "error"),
        ("toasty", "write", "ok", "ok"), ("toasty", "read", "ok", "ok"), ("toasty", "read", "NOT_FOUND", "error"),
        ("s2", "streams", "201", "ok"), ("s2", "records", "200", "ok"), ("s2", "records", "404", "error"),
        ("swarm", "get_range", "no_such_stream", "error"),
    )

    def all_moved():
        after = scrape(node)
        return after if all(series(after, *labels) > series(before, *labels) for labels in expected) else None

    try:
        after = wait_until(all_moved, what="every protocol's responses by status")
    except AssertionError:
        after = scrape(node)
        missing = [labels for labels in expected if series(after, *labels) <= series(before, *labels)]
        seen = sorted(dict(k[1]).items() for k in after if k[0] == "sbpnode_responses_total")
        raise AssertionError("did not move: %r; series: %r" % (missing, seen))
    assert series(after, "sbp", "append", "NONE", "ok") - series(before, "sbp", "append", "NONE", "ok") == 5
    assert series(after, "kv", "set", "OK", "ok") - series(before, "kv", "set", "OK", "ok") == 20
    # KV and Toasty count the bytes on the wire, both ways
    for protocol in ("kv", "toasty"):
        for direction in ("in", "out"):
            assert value(after, "sbpnode_wire_bytes_total", protocol=protocol, direction=direction) > \
                value(before, "sbpnode_wire_bytes_total", protocol=protocol, direction=direction), (protocol, direction)
    assert value(after, "sbpnode_wire_bytes_total", protocol="toasty", direction="in") > 5000  # the 5000-byte write


def test_toasty_connections_are_counted(node):
    with BlockingToastyClient(*node.address("meta")) as t:
        t.write("/c", b"x", truncate=True)
        assert value(scrape(node), "sbpnode_connections", protocol="meta") == 1
    wait_until(lambda: value(scrape(node), "sbpnode_connections", protocol="meta") == 0, what="the meta connection gone")


def test_stream_labels_are_bounded(node_factory):
    n = node_factory(metrics_streams=2, fsync="never", kv="none", meta="none", chunks="none", swarm="none")
    with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=10) as c:
        sids = [c.create_stream()["stream_id"] for _ in range(4)]
        for k, sid in enumerate(sids):
            c.append(sid, batch(k + 1))
    samples = scrape(n)
    labelled = {dict(labels)["stream"]: v for (name, labels), v in samples.items() if name == "sbpnode_stream_records"}
    # the two biggest streams by records get a label; the other two are summed in _other
    assert labelled == {str(sids[3]): 4, str(sids[2]): 3, "_other": 3}
    assert value(samples, "sbpnode_stream_label_limit") == 2


def test_status_page_and_json(node):
    status, headers, body = get(node, "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    html = body.decode()
    for needle in ('id="members"', 'id="chart-throughput"', 'id="chart-latency"', 'id="busiest"',
                   "/ui/vendor/uPlot.iife.min.js", "/ui/app.js"):
        assert needle in html
    assert get(node, "/ui/")[2] == body
    for path, ctype in (("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css"),
                        ("/ui/vendor/uPlot.iife.min.js", "text/javascript"), ("/ui/vendor/uPlot.min.css", "text/css")):
        status, headers, data = get(node, path)
        assert status == 200 and headers["content-type"].startswith(ctype) and data, path
    assert get(node, "/ui/nope.js")[0] == 404  # not ours: the S2 API's 404

    sid = traffic(node)

    def sampled():
        doc = json.loads(get(node, "/ui/status.json")[2])
        series = doc["series"]
        # a point covering the traffic: an interval with appends and an append latency
        if any(series["append_records_s"]) and any(v is not None for v in series["latency_ms"].get("sbp.append", {}).get("p99", [])):
            return doc
        return None

    doc = wait_until(sampled, what="a status sample covering the traffic")
    n = doc["node"]
    assert n["node_id"] == node.node_id and n["version"] == "0.1.0" and n["fsync"] == "always"
    assert n["uptime_s"] >= 0 and n["listeners"]["sbp"] == "127.0.0.1:%d" % node.ports["sbp"]
    assert doc["cluster"]["mode"] == "single node" and doc["cluster"]["leader"] == node.node_id
    assert [m["node_id"] for m in doc["cluster"]["members"]] == [node.node_id]
    assert doc["cluster"]["per_node"][str(node.node_id)]["leads"] >= 2  # the SBP and the S2 stream
    assert doc["store"]["streams"] >= 2 and doc["streams"]["count"] >= 2
    series = doc["series"]
    assert len(series["t"]) == len(series["appends_s"]) == len(series["latency_ms"]["sbp.append"]["p50"])
    assert set(series["latency_ms"]) >= {"sbp.append", "sbp.fetch", "kv.get", "kv.set", "toasty.read", "toasty.write"}
    assert doc["totals"]["sbp_appends"] == 5 and doc["totals"]["sbp_append_records"] == 50
    assert doc["peers"] == []

    def busiest():
        d = json.loads(get(node, "/ui/status.json")[2])
        return d if d["streams"]["busiest"] else None

    d = wait_until(busiest, timeout=60, what="the busiest streams")
    assert d["streams"]["busiest"][0]["stream_id"] == str(sid) and d["streams"]["busiest"][0]["next_offset"] == 50


def test_metrics_token(node_factory):
    n = node_factory(metrics_token="s3cret", fsync="never", kv="none", meta="none", chunks="none", swarm="none")
    for path in ("/metrics", "/", "/ui/status.json", "/ui/app.js"):
        status, headers, body = get(n, path)
        assert status == 401 and json.loads(body)["code"] == "authn", path
        assert headers["www-authenticate"].startswith("Bearer")
        assert get(n, path, {"authorization": "Bearer wrong"})[0] == 401
        assert get(n, path, {"authorization": "Bearer s3cret"})[0] == 200, path
        assert get(n, path + "?token=s3cret")[0] == 200, path
    assert scrape(n, {"authorization": "Bearer s3cret"})
    # the S2 API does not need the metrics token (no --http-token here)
    assert get(n, "/health")[0] == 200


def test_metrics_off(node_factory):
    n = node_factory(metrics="off", fsync="never", kv="none", meta="none", chunks="none", swarm="none")
    status, _, body = get(n, "/metrics")
    assert status == 404 and json.loads(body)["code"] == "bad_path"  # the S2 API's answer
    with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=10) as c:
        sid = c.create_stream()["stream_id"]
        assert c.append(sid, batch(3)) == 0


def test_bad_option_values(node_factory):
    with pytest.raises(RuntimeError, match="--metrics"):
        node_factory(metrics="maybe")
    with pytest.raises(RuntimeError, match="--metrics-streams"):
        node_factory(metrics_streams=-1)


def free_port():
    from tests.etcdproc import free_port as below_ephemeral

    return below_ephemeral()


def prometheus_query(port, promql):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    from urllib.parse import urlencode

    conn.request("GET", "/api/v1/query?" + urlencode({"query": promql}))
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    conn.close()
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("prometheus"), reason="Debian's prometheus is not installed (.ci/run installs it)")
def test_a_real_prometheus_scrapes_the_node(node_factory, tmp_path):
    n = node_factory(fsync="never", kv="none", meta="none", chunks="none", swarm="none")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: sbpnode\n    metrics_path: /metrics\n"
        "    static_configs:\n      - targets: ['127.0.0.1:%d']\n" % n.ports["http"]
    )
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(
        ["prometheus", "--config.file=%s" % config, "--storage.tsdb.path=%s" % (tmp_path / "tsdb"),
         "--web.listen-address=127.0.0.1:%d" % port, "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path))
    try:
        def ready():
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                return get_port(port, "/-/ready")[0] == 200
            except OSError:
                return False

        wait_until(ready, timeout=60, what="prometheus ready")
        # the load starts once Prometheus has scraped the node: increase() needs a sample before it
        wait_until(lambda: prometheus_query(port, 'up{job="sbpnode"} == 1'), timeout=30, what="a first scrape")
        stop = time.monotonic() + 4
        with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=10) as c:
            sid = c.create_stream()["stream_id"]
            appended = 0
            while time.monotonic() < stop or appended < 20:  # a small load over a few scrapes
                c.append(sid, batch(10))
                appended += 1
                time.sleep(0.02)

        def appends_seen():
            r = prometheus_query(port, 'sbpnode_requests_total{protocol="sbp",operation="append"}')
            return r if r and float(r[0]["value"][1]) == appended else None

        r = wait_until(appends_seen, timeout=30, what="prometheus to scrape the appends")
        assert r[0]["metric"]["job"] == "sbpnode"

        def durations_seen():  # the histogram may be observed a reactor turn after the counter
            r = prometheus_query(port, 'sbpnode_request_duration_seconds_count{operation="append"}')
            return r if r and float(r[0]["value"][1]) == appended else None

        wait_until(durations_seen, timeout=30, what="prometheus to scrape every append's duration")

        def p99_seen():
            r = prometheus_query(port, 'histogram_quantile(0.99, sum by (le) '
                                 '(increase(sbpnode_request_duration_seconds_bucket{operation="append"}[1m])))')
            return r if r and r[0]["value"][1] not in ("NaN", "0") else None

        p99 = wait_until(p99_seen, timeout=30, what="an append p99 from prometheus")
        assert 0 < float(p99[0]["value"][1]) < 10  # seconds: a sane latency
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def get_port(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


def sbpctl(*args):
    import sys

    from tests.nodeproc import REPO

    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_sbpctl_top_once_for_a_node_and_its_cluster(node_factory):
    n = node_factory(metrics_token="t0k", fsync="never", kv="none", meta="none", chunks="none", swarm="none")
    with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=10) as c:
        sid = c.create_stream()["stream_id"]
        c.append(sid, batch(7))
    endpoint = "127.0.0.1:%d" % n.ports["http"]
    r = sbpctl("top", "--endpoint", endpoint, "--once")
    assert r.returncode == 1 and "--token" in r.stderr  # the node wants its metrics token

    def screen_with_the_stream():
        r = sbpctl("top", "--endpoint", endpoint, "--token", "t0k", "--once")
        assert r.returncode == 0, r.stderr
        return r.stdout if str(sid) in r.stdout else None

    out = wait_until(screen_with_the_stream, timeout=60, what="sbpctl top to show the busy stream")
    assert out.startswith("sbpnode %d " % n.node_id)
    assert "cluster: single node, 1 member(s), leader %d" % n.node_id in out
    assert "sbp.append" in out and "throughput" in out
    r = sbpctl("top", "--endpoint", endpoint, "--token", "t0k", "--once", "--cluster")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()
    assert rows[0].startswith("cluster: single node") and rows[2].split()[0] == str(n.node_id)
    r = sbpctl("top", "--endpoint", "127.0.0.1:1", "--once")
    assert r.returncode == 1 and "not reachable" in r.stderr


def test_reactor_histogram_exposes_what_the_library_histogram_would():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from node.metrics import LATENCY_BUCKETS, RequestLatency

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    latency = RequestLatency()
    ours.register(latency)
    reference = Histogram("sbpnode_request_duration_seconds", "x", ["protocol", "operation"],
                          buckets=LATENCY_BUCKETS, registry=theirs).labels("sbp", "append")
    for v in (0.00005, 0.0001, 0.0003, 0.001, 0.0099, 0.01, 3.0, 11.0, 0.0):  # bounds included
        latency.histograms["sbp.append"].observe(v)
        reference.observe(v)

    def samples(registry):
        out = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for s in family.samples:
                if s.labels.get("operation") == "append" and not s.name.endswith("_created"):
                    out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    assert samples(ours) == samples(theirs)


class StubCluster:
    """The interface node/cluster_view.py documents for cluster mode (not built yet)."""

    def status(self):
        return {
            "leader": 2,
            "members": [{"node_id": 1, "sbp": "a:1", "http": "a:2", "alive": True},
                        {"node_id": 2, "sbp": "b:1", "http": "b:2", "alive": True},
                        {"node_id": 3, "sbp": "c:1", "http": None, "alive": False}],
            "ranges": [{"stream_id": 7, "index": 0, "start": 0, "end": -1, "leader": 2, "replicas": [1, 2, 3],
                        "confirm_offset": 90, "replica_ends": {1: 100, 2: 100, 3: 60}}],
            "failovers": 4,
        }


def test_cluster_metrics_from_a_cluster_view():
    from types import SimpleNamespace

    from node import cluster_view
    from node.metrics import NodeMetrics

    node = SimpleNamespace(node_id=1, store=None, metrics={}, config=SimpleNamespace(fsync="always"),
                           ports={}, cluster=StubCluster())
    m = NodeMetrics(node)
    m.observe_latency("etcd", 0.002)
    body, ctype = m.exposition()
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    assert value(samples, "sbpnode_cluster_members") == 3
    assert value(samples, "sbpnode_cluster_leader") == 2
    assert value(samples, "sbpnode_cluster_is_leader") == 0
    assert value(samples, "sbpnode_cluster_failovers_total") == 4
    assert value(samples, "sbpnode_range_confirm_offset", stream="7", range="0") == 90
    assert value(samples, "sbpnode_replication_lag_records", stream="7", range="0", replica="3") == 40
    assert value(samples, "sbpnode_replication_lag_records", stream="7", range="0", replica="1") == 0
    assert value(samples, "sbpnode_etcd_request_duration_seconds_count") == 1
    view = cluster_view.snapshot(node)
    assert view["mode"] == "cluster"
    assert cluster_view.ranges_per_node(view) == {1: {"leads": 0, "replicas": 1}, 2: {"leads": 1, "replicas": 1},
                                                  3: {"leads": 0, "replicas": 1}}


def test_peer_sync_metrics_and_status(node_factory):
    a = node_factory(name="a", fsync="never", kv="none", meta="none", chunks="none")
    with BlockingSbpClient("127.0.0.1", a.ports["sbp"], timeout=10) as c:
        sid = c.create_stream()["stream_id"]
        for _ in range(3):
            c.append(sid, batch(4))
    b = node_factory(name="b", fsync="never", kv="none", meta="none", chunks="none", peer=a.peer_endpoint())
    peer = a.endpoint("swarm")

    def synced():
        s = scrape(b)
        if value(s, "sbpnode_peer_connected", peer=peer) == 1 and value(s, "sbpnode_peer_sync_items_total", peer=peer) >= 3:
            return s
        return None

    s = wait_until(synced, what="B's metrics to show A's batches synced")
    assert value(s, "sbpnode_peer_sync_bytes_total", peer=peer) > 0
    assert value(s, "sbpnode_payload_bytes_total", protocol="swarm", direction="in") > 0
    assert ("sbpnode_peer_sync_lag_items", frozenset({("peer", peer)})) in s
    sa = scrape(a)
    assert value(sa, "sbpnode_requests_total", protocol="swarm", operation="batch") >= 1
    assert value(sa, "sbpnode_connections", protocol="swarm") == 1
    peers = json.loads(get(b, "/ui/status.json")[2])["peers"]
    assert [p["peer"] for p in peers] == [peer] and peers[0]["connected"] and peers[0]["items"] >= 3


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("chromium"), reason="Debian's chromium is not installed (.ci/run installs it)")
def test_a_real_browser_draws_the_status_page(node_factory, tmp_path):
    n = node_factory(fsync="never", kv="none", meta="none", chunks="none", swarm="none")
    with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=10) as c:
        sid = c.create_stream()["stream_id"]

        def charted():  # appends until the node's history has an interval with them in it
            c.append(sid, batch(10))
            doc = json.loads(get(n, "/ui/status.json")[2])
            return doc if any(doc["series"]["append_records_s"]) and doc["streams"]["busiest"] else None

        wait_until(charted, timeout=60, what="a status sample with appends")
    url = "http://127.0.0.1:%d/" % n.ports["http"]
    # headless, no sandbox (CI runs as root); --virtual-time-budget lets the page's polls and
    # timers run before the DOM is dumped
    chromium = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--user-data-dir=%s" % (tmp_path / "chromium"), "--virtual-time-budget=5000"]
    r = subprocess.run(chromium + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    assert 'id="state" class="state ok">live<' in dom
    assert "%d (leader)" % n.node_id in dom  # the members table
    assert ">%d<" % sid in dom  # the busiest streams, the full 64-bit id
    throughput = dom.split('id="chart-throughput"', 1)[1].split("</section>", 1)[0]
    assert int(throughput.split('data-points="', 1)[1].split('"', 1)[0]) >= 1
    assert "<canvas" in throughput and "append records/s" in throughput  # uPlot drew it
    latency = dom.split('id="chart-latency"', 1)[1].split("</section>", 1)[0]
    assert "<canvas" in latency and "sbp.append p99" in latency
    shot = tmp_path / "status-page.png"
    r = subprocess.run(chromium + ["--window-size=1280,1600", "--screenshot=%s" % shot, url],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]


def test_metrics_and_status_json_over_h2c(node):
    from tests.test_s2_http import H2

    cl = H2(node.ports["http"])
    sids = {path: cl.request("GET", path) for path in ("/metrics", "/ui/status.json", "/")}
    cl.pump(lambda: all(cl.responses[s]["ended"] for s in sids.values()))
    r = {path: cl.responses[s] for path, s in sids.items()}
    assert all(x["status"] == "200" for x in r.values()), r
    families = {f.name for f in text_string_to_metric_families(r["/metrics"]["data"].decode())}
    assert "sbpnode_requests" in families and "sbpnode_request_duration_seconds" in families
    assert json.loads(r["/ui/status.json"]["data"])["node"]["node_id"] == node.node_id
    assert b'id="chart-throughput"' in r["/"]["data"]


def test_response_labels_stay_bounded():
    from protocols.partition import codec as kv_codec
    from protocols.partition import server as kv_server
    from protocols.s2.api import route_group
    from protocols.sbp import codec as sbp_codec
    from protocols.sbp import server as sbp_server
    from protocols.toasty import codec as toasty_codec
    from protocols.toasty import server as toasty_server

    assert sbp_server.response_labels(sbp_codec.FETCH << 16 | sbp_codec.NO_NEW_RECORD) == ("fetch", "NO_NEW_RECORD", True)
    assert sbp_server.response_labels(0 << 16 | sbp_codec.INVALID_REQUEST) == ("unknown", "INVALID_REQUEST", False)
    assert kv_server.response_labels(kv_codec.GET << 8 | kv_codec.DATA_NOT_FOUND) == ("get", "DATA_NOT_FOUND", True)
    assert kv_server.response_labels(0 << 8 | kv_server.ERR_STATUS + kv_codec.E_MSG_TOO_SHORT) == ("unknown", "ERR_MSG_TOO_SHORT", False)
    assert toasty_server.response_labels(toasty_codec.WRITE_ERROR << 8 | toasty_server._error_status(
        "Generation counter mismatch or invalid value: 3")) == ("write", "BAD_GENERATION", False)
    assert toasty_server.response_labels(toasty_codec.LIST_ERROR << 8 | toasty_server._error_status("?")) == ("list", "other", False)
    # S2: a fixed route group whatever the path
    assert route_group(["v1", "streams", "a%2Fb", "records"]) == "records"
    assert route_group(["v1", "streams", "x"]) == "streams"
    assert route_group(["v1", "no-such-kind", "x"]) == "other"
    assert route_group(["wp-admin", "x.php"]) == "other"
    assert route_group([]) == route_group(["metrics"]) == route_group(["ui", "app.js"]) == "node_pages"
