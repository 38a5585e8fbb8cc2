"""S2 control plane at scale against a real node: creating a stream costs the same whatever the
number of streams (issue 23: it used to rebuild the name index per create), and every listener
gets a listen backlog fit for bursts of connects."""

import http.client
import json
import subprocess
import time

import pytest

from node.config import DEFAULT_BACKLOG, NodeConfig, with_backlog
from tests.nodeproc import NodeProcess


def test_with_backlog_defaults_and_respects_the_users_value():
    assert with_backlog("tcp:0:interface=127.0.0.1") == "tcp:0:interface=127.0.0.1:backlog=%d" % DEFAULT_BACKLOG
    assert with_backlog("tcp:0:backlog=7:interface=127.0.0.1") == "tcp:0:backlog=7:interface=127.0.0.1"
    assert with_backlog("unix:/tmp/x.sock") == "unix:/tmp/x.sock:backlog=%d" % DEFAULT_BACKLOG
    assert with_backlog(None) is None
    assert NodeConfig(http="tcp:0").endpoint("http") == "tcp:0:backlog=%d" % DEFAULT_BACKLOG


def _listen_backlog(port):
    # ss shows a listening socket's backlog in the Send-Q column.
    out = subprocess.run(["ss", "-ltnH", "sport = :%d" % port], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0] == "LISTEN":
            return int(fields[2])
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_create_cost_is_flat_over_10000_streams(tmp_path):
    node = NodeProcess(tmp_path, fsync="never", http="tcp:0:interface=127.0.0.1",
                       sbp="tcp:0:interface=127.0.0.1:backlog=77")
    node.start()
    try:
        somaxconn = int(open("/proc/sys/net/core/somaxconn").read())
        assert _listen_backlog(node.ports["http"]) == min(DEFAULT_BACKLOG, somaxconn)
        assert _listen_backlog(node.ports["sbp"]) == 77
        conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=30)
        per_thousand = []
        for k in range(10):
            t0 = time.perf_counter()
            for i in range(1000):
                body = json.dumps({"stream": "s-%05d" % (k * 1000 + i)})
                conn.request("POST", "/v1/streams", body, {"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                assert resp.status == 201, resp.status
            per_thousand.append(time.perf_counter() - t0)
        first, last = per_thousand[0], per_thousand[-1]
        # The old index rebuild made the last thousand ~15x slower than the first; a generous
        # ratio leaves room for a loaded machine without letting O(n) creates through.
        assert last <= 3 * first + 0.5, per_thousand
        conn.request("GET", "/v1/streams?prefix=s-0999&limit=1000")
        listed = json.loads(conn.getresponse().read())
        assert [s["name"] for s in listed["streams"]] == ["s-0999%d" % i for i in range(10)]
        conn.request("POST", "/v1/streams", json.dumps({"stream": "s-00000"}), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 409 and json.loads(resp.read())["code"] == "resource_already_exists"
        conn.close()
    finally:
        node.terminate()
