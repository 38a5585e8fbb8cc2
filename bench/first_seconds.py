"""Append latency in the first seconds after start, side by side with Redis (issue 21).

    python bench/first_seconds.py [--seconds 10] [--rate-mb 20] [--runs 1]

Starts one sbpnode (twistd, ``--fsync always``, SBP listener only) and, as soon as its ready file
appears, sends appends at a steady ``--rate-mb`` MB/s for ``--seconds``: one APPEND of one batch
of 64 x 1 KiB records at a time, paced open-loop (``bench/sbp_bench.py``'s latency load). Then
the same for a Debian redis-server (``appendonly yes``, ``appendfsync always``), started the same
way: the load begins as soon as it accepts a connection, XADD groups of 64 x 1 KiB. Prints the
node's start-up time to ready and p50/p99/p99.9/max of each side, the same load run again on the
node right after (the warm node on this machine at this moment: the reference for "as fast as any
later second"), a disk floor and the load average.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from sbp_bench import Redis, disk_floor, pct, redis_latency_load, run_in_process, sbp_latency_load  # noqa: E402

from protocols.sbp.client import BlockingSbpClient  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402


def summary(name, lat_s, seconds):
    ms = [x * 1000 for x in lat_s]
    line = "%-8s n=%-5d p50 %6.2f ms  p99 %7.2f ms  p99.9 %7.2f ms  max %7.2f ms" % (
        name, len(ms), pct(ms, 50), pct(ms, 99), pct(ms, 99.9), max(ms) if ms else float("nan"))
    # replies come back in order at a steady send rate: a sample's index says when it was sent
    per_s = len(ms) / seconds if seconds else 1
    first = ms[: int(per_s)]
    worst = sorted(range(len(ms)), key=ms.__getitem__)[-5:]
    line += "\n         first second p99 %.2f ms; worst at %s s" % (
        pct(first, 99), ", ".join("%.1f" % (i / per_s) for i in sorted(worst)))
    return line


def run_node(base, args, k):
    opts = {name: "none" for name in ("kv", "meta", "chunks", "swarm", "http")}
    node = NodeProcess(base, name="first-%d" % k, fsync="always", log_level="info", **opts)
    t0 = time.monotonic()
    node.start()
    to_ready = time.monotonic() - t0
    try:
        # the stream is created before the clock starts (a client's first step too)
        c = BlockingSbpClient("127.0.0.1", node.ports["sbp"])
        sid = c.create_stream()["stream_id"]
        state = c.status().get("append_check")
        c.close()
        res = run_in_process(sbp_latency_load, node.ports["sbp"], sid, args.rate_mb * 1e6, args.seconds)
        # the same load again on the same node, now long warm: what "full speed" is on this machine
        later = run_in_process(sbp_latency_load, node.ports["sbp"], sid, args.rate_mb * 1e6, args.seconds)
    finally:
        node.terminate()
    logged = [line for line in node.log_text().splitlines() if "ready in" in line]
    return to_ready, state, res, later, logged[-1].split("] ", 1)[-1] if logged else "?"


def run_redis(base, args):
    t0 = time.monotonic()
    with Redis(base, "always") as redis:
        to_ready = time.monotonic() - t0
        res = run_in_process(redis_latency_load, redis.port, args.rate_mb * 1e6, args.seconds)
    return to_ready, res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rate-mb", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where the node and Redis keep their data (a temp dir)")
    args = ap.parse_args()
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    for k in range(args.runs):
        base = tempfile.mkdtemp(prefix="first-seconds-", dir=args.dir)
        try:
            print("disk floor (64 KiB write + fdatasync) p50 %.2f ms p99 %.2f ms" % disk_floor(base))
            to_ready, state, res, later, logged = run_node(base, args, k)
            print("sbpnode: ready file after %.2f s (spawn included; node says: %s), append_check=%s"
                  % (to_ready, logged, state))
            print(summary("sbpnode", res["latencies"], args.seconds))
            print(summary("(later)", later["latencies"], args.seconds))
            r_ready, rres = run_redis(base, args)
            print("redis: accepting after %.2f s" % r_ready)
            print(summary("redis", rres["latencies"], args.seconds))
        finally:
            shutil.rmtree(base, ignore_errors=True)
        print("load average after run %d: %.2f %.2f %.2f" % ((k + 1,) + os.getloadavg()))


if __name__ == "__main__":
    main()
