"""The official S2 TypeScript SDK (@s2-dev/streamstore from npm, installed under tests/js by
.ci/run) against a real node: a token the SDK issues with the root token, scoped to one basin
and a stream prefix, drives an append session and a read session; an append outside the scope
gets 403 permission_denied; locations and basin metrics as the SDK parses them (issue 23)."""

import json
import os
import shutil
import subprocess

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
