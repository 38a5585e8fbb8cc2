"""The official S2 TypeScript SDK (@s2-dev/streamstore from npm, installed under tests/js by
.ci/run) against a real node: a token the SDK issues with the root token, scoped to one basin
and a stream prefix, drives an append session and a read session; an append outside the scope
gets 403 permission_denied; locations and basin metrics as the SDK parses them (issue 23). And
against a 3-node cluster: forwarded appends, reads through another node, a session across a
failover (issue 18)."""

import json
import os
import queue
import shutil
import subprocess
import threading
import time

import pytest

from tests.nodeproc import NodeProcess

JS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "js")
SDK = os.path.join(JS_DIR, "node_modules", "@s2-dev", "streamstore", "package.json")

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("node") is None or not os.path.exists(SDK),
                       reason="node or @s2-dev/streamstore missing (.ci/run installs them: npm ci --prefix tests/js)"),
]


def test_typescript_sdk_scoped_token_append_and_read_sessions(tmp_path):
    node = NodeProcess(tmp_path, fsync="never", http_token="root-token")
    node.start()
    try:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=10)
        conn.request("POST", "/v1/basins", json.dumps({"basin": "ts-basin-1"}),
                     {"authorization": "Bearer root-token", "content-type": "application/json"})
        assert conn.getresponse().status == 201
        conn.close()
        ep = "http://127.0.0.1:%d" % node.ports["http"]
        env = dict(os.environ, S2_ACCOUNT_ENDPOINT=ep, S2_BASIN_ENDPOINT=ep, S2_ACCESS_TOKEN="root-token",
                   S2_BASIN="ts-basin-1")
        proc = subprocess.run(["node", os.path.join(JS_DIR, "scoped_session.mjs")], env=env, cwd=JS_DIR,
                              capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["token"] == "s2at_"
        assert out["ackEnds"] == list(range(1, 21))
        assert out["bodies"] == ["r%d" % i for i in range(20)]
        assert out["denied"] == {"status": 403, "code": "permission_denied"}
        assert out["locations"] == [["local", True]]
        assert out["appendOps"] >= 20
    finally:
        node.terminate()


def test_typescript_sdk_token_metrics_and_location_rules(tmp_path):
    """tests/js/parity.mjs: the rules the TypeScript SDK's cloud suites hold S2 to (token listing,
    pagination, issue variants, 409/404/422s, scope denials and escalation, auto-prefix; metrics
    range and interval rules; locations; encryption round trip and wrong key), checked through the SDK."""
    node = NodeProcess(tmp_path, fsync="never", http_token="root-token")
    node.start()
    try:
        ep = "http://127.0.0.1:%d" % node.ports["http"]
        env = dict(os.environ, S2_ACCOUNT_ENDPOINT=ep, S2_BASIN_ENDPOINT=ep, S2_ACCESS_TOKEN="root-token")
        proc = subprocess.run(["node", os.path.join(JS_DIR, "parity.mjs")], env=env, cwd=JS_DIR,
                              capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"failures": []}
    finally:
        node.terminate()


def test_typescript_sdk_against_a_cluster_across_a_failover(tmp_path):
    """tests/js/cluster_session.mjs against 3 nodes and etcd (CONTRACT §9 "Every interface, every
    node"): basin and stream created through node 1; appends (unary and a session) through a node
    that is not the stream's primary (forwarded to it) and reads through the other one; then an
    append session through the same node while the primary is killed with SIGKILL: as the Python
    SDK's test (tests/test_s2_cluster.py), with matchSeqNum on every input each one is stored
    exactly once, in order, at the seq_num its ack named, and a session ends (412, or a spent 503)
    only where the outcome was unknown."""
    from tests.etcdproc import EtcdCluster, etcd_available
    from tests.test_cluster import start_nodes
    from tests.test_s2_cluster import ROOT, roles, stream_id

    if not etcd_available():
        pytest.skip("etcd-server is not installed")
    started = time.monotonic()
    etcd = EtcdCluster(tmp_path, members=1).start()
    nodes = []
    proc = None
    try:
        nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3], http_token=ROOT)
        url = lambda n: "http://127.0.0.1:%d" % n.ports["http"]  # noqa: E731
        env = dict(os.environ, S2_ACCOUNT_ENDPOINT=url(nodes[0]), S2_BASIN_ENDPOINT=url(nodes[0]),
                   S2_ACCESS_TOKEN=ROOT, S2_BASIN="ts-cluster", S2_ENDPOINT_A=url(nodes[0]))
        proc = subprocess.Popen(["node", os.path.join(JS_DIR, "cluster_session.mjs")], env=env, cwd=JS_DIR,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out = queue.Queue()
        threading.Thread(target=lambda: [out.put(line) for line in proc.stdout] + [out.put(None)], daemon=True).start()

        def message(timeout=60):
            line = out.get(timeout=timeout)
            assert line is not None, "cluster_session.mjs ended: %s" % proc.stderr.read()[-4000:]
            return json.loads(line)

        assert message() == {"phase": "created"}
        sid = stream_id(nodes[0], "ts-cluster", "events")
        primary, (via, reader) = roles(nodes, sid)
        proc.stdin.write(json.dumps({"append": url(via), "read": url(reader), "failover": True}) + "\n")
        proc.stdin.flush()
        assert message() == {"phase": "kill"}
        primary.kill9()
        result = message(timeout=120)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-4000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        for n in nodes:
            n.kill9()
        etcd.stop()
    assert result["unary"] == [0, 5]
    assert result["sessionAcks"] == list(range(5, 25)) and result["tailBefore"] == 25
    base = 25
    stored = result["stored"]
    assert stored[:base] == [[i, "u%d" % i] for i in range(5)] + [[5 + i, "s%d" % i] for i in range(20)]
    # every failover input exactly once, in order, at seq_num base + i; nothing acknowledged lost
    assert stored[base:] == [[base + i, "f%d" % i] for i in range(200)], stored[base:]
    assert len(result["acked"]) > result["killedAfter"]
    for i, seq in result["acked"]:
        assert seq == i, (i, seq)
    print("typescript failover outcome: sessions %d, errors %s, %.1f s" % (
        result["sessions"], result["errors"], time.monotonic() - started))
