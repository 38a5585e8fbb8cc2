"""What the node's metrics cost, piece by piece (issue 22; results in docs/benchmarks.md "Metrics").

    python bench/metrics_cost.py [--streams 1000] [--scrapes 50]

1. the request-path hook, in process: one ``observe_latency`` call with its two perf_counter
   reads (what each APPEND, FETCH, KV run and Toasty READ/WRITE pays), against the no-op hook of
   ``--metrics off`` and against prometheus_client's own ``Histogram.observe``;
2. the replies-by-status counting each protocol server does per reply (sbpnode_responses_total)
   and per read / per send (sbpnode_wire_bytes_total), with the servers' own code where it is a
   function and the same statements where it is inline in a hot loop;
3. a scrape and a status poll of a real node holding ``--streams`` streams: GET /metrics and
   GET /ui/status.json latency (p50/p99) and the node's CPU per request.

The end-to-end A/B (append throughput with metrics on and off) is ``bench/sbp_bench.py
--metrics-ab N``; for KV GET, ``bench/kv_bench.py --only kv --metrics on|off``.
"""

import argparse
import http.client
import os
import sys
import tempfile
import shutil
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from node.metrics import LATENCY_BUCKETS, NodeMetrics, ignore_latency  # noqa: E402


def per_call_us(fn, n=300_000):
    best = float("inf")
    for _ in range(5):  # the best of 5: the machine is shared
        t = time.perf_counter()
        fn(n)
        best = min(best, time.perf_counter() - t)
    return best / n * 1e6


def hook_costs():
    from prometheus_client import CollectorRegistry, Histogram

    node = SimpleNamespace(node_id=1, store=None, metrics={}, config=SimpleNamespace(fsync="always"), ports={}, cluster=None)
    m = NodeMetrics(node)
    pc = time.perf_counter

    def on(n, observe=m.observe_latency):
        for _ in range(n):
            t0 = pc()
            observe("sbp.append", pc() - t0)

    def off(n, observe=ignore_latency):
        for _ in range(n):
            t0 = pc()
            observe("sbp.append", pc() - t0)

    lib = Histogram("x_seconds", "x", ["protocol", "operation"], buckets=LATENCY_BUCKETS,
                    registry=CollectorRegistry()).labels("sbp", "append").observe

    def library(n, observe=lib):
        for _ in range(n):
            t0 = pc()
            observe(pc() - t0)

    def empty(n):
        for _ in range(n):
            pass

    base = per_call_us(empty)
    return {"metrics on (ours)": per_call_us(on) - base, "metrics off (no-op hook)": per_call_us(off) - base,
            "prometheus_client Histogram": per_call_us(library) - base}


def status_costs(get_run=60, set_run=33):
    """us per counted unit (APPEND frame, FETCH entry, KV GET or SET in a pipelined run, Toasty
    reply, S2 response, swarm message), loop overhead subtracted."""
    from protocols.partition import server as kv
    from protocols.s2.api import route_group
    from protocols.s2.http import BaseResponder, HttpRequest
    from protocols.sbp import codec as sbp_codec
    from protocols.sbp.append import _APPEND_OK
    from protocols.sbp.server import SbpServerProtocol
    from protocols.swarm.server import SwarmServerProtocol
    from protocols.toasty import codec as toasty_codec
    from protocols.toasty import server as toasty

    def empty(n):
        for _ in range(n):
            pass

    base = per_call_us(empty)
    out = {}

    responses = {}

    def sbp_append(n, responses=responses):  # AppendHandler._appended_one
        for _ in range(n):
            responses[_APPEND_OK] = responses.get(_APPEND_OK, 0) + 1

    conn = SimpleNamespace(factory=SimpleNamespace(responses={}))
    count_reply = SbpServerProtocol.count_reply

    def sbp_fetch_entry(n):  # FetchOp._complete
        for _ in range(n):
            count_reply(conn, sbp_codec.FETCH, 0)

    out["SBP APPEND frame (inline increment)"] = per_call_us(sbp_append) - base
    out["SBP FETCH entry (count_reply)"] = per_call_us(sbp_fetch_entry) - base

    kv_metrics = {"responses": {}, "bytes_out": 0, "bytes_in": 0}
    values = [b"v"] * get_run

    def kv_get_run(n, m=kv_metrics, values=values):  # _get_run + _flush + dataReceived, once per run
        responses = m["responses"]
        for _ in range(n):
            missing = 0  # counted in the reply loop, on the DATA_NOT_FOUND branch only
            responses[kv._GET_OK] = responses.get(kv._GET_OK, 0) + len(values) - missing
            if missing:
                responses[kv._GET_NOT_FOUND] = responses.get(kv._GET_NOT_FOUND, 0) + missing
            m["bytes_out"] = m.get("bytes_out", 0) + 4096
            m["bytes_in"] = m.get("bytes_in", 0) + 2048

    def kv_set_run(n, m=kv_metrics, count=set_run, removes=0):  # _run_done's fast path + _flush + dataReceived
        responses = m["responses"]
        for _ in range(n):
            responses[kv._SET_OK] = responses.get(kv._SET_OK, 0) + count - removes
            if removes:
                responses[kv._REMOVE_OK] = responses.get(kv._REMOVE_OK, 0) + removes
            m["bytes_out"] = m.get("bytes_out", 0) + 4096
            m["bytes_in"] = m.get("bytes_in", 0) + 2048

    out["KV GET in a run of %d (per GET)" % get_run] = (per_call_us(kv_get_run) - base) / get_run
    out["KV SET in a run of %d (per SET)" % set_run] = (per_call_us(kv_set_run) - base) / set_run

    stats = {"responses": {}, "bytes_in": 0, "bytes_out": 0}
    ok_reply = toasty_codec.WriteSuccess(1)
    error_reply = toasty_codec.ReadError("No such file or directory: /x")

    def toasty_reply(n, reply=ok_reply, stats=stats):  # _ToastyServerProtocol._ready + a read + a flush
        for _ in range(n):
            kind = reply.TYPE
            key = kind << 8 | toasty._error_status(reply.message) if kind in toasty._ERROR_REPLIES else kind << 8
            responses = stats["responses"]
            responses[key] = responses.get(key, 0) + 1
            stats["bytes_in"] += 100
            stats["bytes_out"] += 100

    out["Toasty reply, success"] = per_call_us(toasty_reply) - base
    out["Toasty reply, error (its ErrorCode looked up)"] = per_call_us(
        lambda n: toasty_reply(n, error_reply)) - base

    responder = BaseResponder(HttpRequest("GET", "/v1/streams/s/records?seq_num=0", [], "127.0.0.1"))
    responder.statuses = {}
    segments = responder.request.segments

    def s2_response(n):  # S2Api.dispatch's route group + BaseResponder._count
        for _ in range(n):
            responder.route = route_group(segments)
            responder._count(200)

    out["S2 response (route group + count)"] = per_call_us(s2_response, n=100_000) - base
    swarm = SimpleNamespace(factory=SimpleNamespace(stats={"responses": {}}))

    def swarm_message(n):
        for _ in range(n):
            SwarmServerProtocol._count(swarm, "get_range", "ok")

    out["swarm message"] = per_call_us(swarm_message) - base
    return out


def proc_cpu(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values, p):
    v = sorted(values)
    return v[min(len(v) - 1, int(p / 100.0 * len(v)))]


def scrape_costs(streams, scrapes):
    from protocols.sbp.client import BlockingSbpClient
    from storage import record_batch
    from tests.nodeproc import NodeProcess

    base = tempfile.mkdtemp(prefix="metrics-cost-")
    node = NodeProcess(base, name="n", fsync="never", log_level="warn", kv="none", meta="none", chunks="none", swarm="none")
    try:
        node.start()
        c = BlockingSbpClient("127.0.0.1", node.ports["sbp"])
        batch = record_batch.encode([(0, [], b"x" * 100)])
        for _ in range(streams):
            c.append(c.create_stream()["stream_id"], batch)
        c.close()
        out = {}
        for path in ("/metrics", "/ui/status.json"):
            conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=30)
            lat, size = [], 0
            cpu0 = proc_cpu(node.proc.pid)
            for _ in range(scrapes):
                t = time.perf_counter()
                conn.request("GET", path)
                resp = conn.getresponse()
                size = len(resp.read())
                lat.append(time.perf_counter() - t)
            cpu = (proc_cpu(node.proc.pid) - cpu0) / scrapes
            conn.close()
            out[path] = (pct(lat, 50) * 1000, pct(lat, 99) * 1000, cpu * 1000, size)
        return out
    finally:
        node.terminate()
        shutil.rmtree(base, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--scrapes", type=int, default=50)
    args = ap.parse_args()
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    for name, us in hook_costs().items():
        print("hook, %-28s %.3f us a call (with its two perf_counter reads)" % (name, us))
    rounds = [status_costs() for _ in range(3)]  # the least of 3 rounds: the machine is shared
    for name in rounds[0]:
        print("responses by status, %-46s %.3f us" % (name, min(r[name] for r in rounds)))
    for path, (p50, p99, cpu, size) in scrape_costs(args.streams, args.scrapes).items():
        print("GET %-16s with %d streams: p50 %.1f ms  p99 %.1f ms  node CPU %.1f ms a request  %d bytes" % (
            path, args.streams, p50, p99, cpu, size))


if __name__ == "__main__":
    main()
