"""Cluster-mode benchmark (CONTRACT §9): start-up, placement-driver throughput, leader failover.

    python bench/cluster_bench.py                       # defaults below
    python bench/cluster_bench.py --ops 2000 --clients 8 --kills 10

Starts its own etcd (one member, loopback, temp dir) and three nodes (``--fsync never``). Measures:

1. start-to-ready: from spawning ``twistd sbpnode --cluster ...`` to its ready file (median of
   ``--starts`` starts), beside the same node without ``--cluster``;
2. placement-driver ops/s and latency percentiles for CREATE_STREAMS and DESCRIBE_RANGES, with
   ``--clients`` blocking clients (threads, one request in flight each) all against one node, then
   spread over the three;
3. APPEND on a stream's primary, cluster mode beside a single node (what routing costs the data
   path): ``--appends`` frames of 16 records x 100 B, 16 in flight, ``--fsync never``;
4. leader failover: kill -9 of the placement-driver leader until both survivors name the same new
   leader (DESCRIBE_PD_CLUSTER polled every 20 ms), ``--kills`` times (the killed node restarts
   between kills); median and worst.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protocols.sbp.client import BlockingSbpClient, call_describe_cluster  # noqa: E402
from tests.etcdproc import EtcdCluster  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402


def pct(values, p):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100.0 * (len(s) - 1))))]


def start_timed(node):
    t = time.monotonic()
    node.start(timeout=120)
    return time.monotonic() - t


def bench_start(base, etcd, starts):
    cluster, single = [], []
    for i in range(starts):
        n = NodeProcess(base, name="s%d" % i, cluster=etcd.client_urls, fsync="never")
        cluster.append(start_timed(n))
        n.terminate()
        m = NodeProcess(base, name="p%d" % i, fsync="never")
        single.append(start_timed(m))
        m.terminate()
    print("start-to-ready (spawn to ready file), %d starts: cluster median %.2fs (max %.2fs); single node median %.2fs (max %.2fs)"
          % (starts, statistics.median(cluster), max(cluster), statistics.median(single), max(single)))


def run_ops(targets, clients, ops, fn):
    """``clients`` threads, each with its own connection to targets[i % len]; ``ops`` calls in
    all. Returns (ops/s, latencies in s)."""
    per = ops // clients
    lat = []
    lock = threading.Lock()
    errors = []

    def worker(i):
        node = targets[i % len(targets)]
        mine = []
        try:
            with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=30) as c:
                for k in range(per):
                    t = time.perf_counter()
                    fn(c, i, k)
                    mine.append(time.perf_counter() - t)
        except Exception as e:  # reported below
            errors.append(e)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return len(lat) / elapsed, lat


def report(name, rate, lat):
    print("  %-40s %8.0f ops/s   p50 %6.2f ms  p99 %6.2f ms  max %6.2f ms" % (
        name, rate, pct(lat, 50) * 1e3, pct(lat, 99) * 1e3, max(lat) * 1e3))


def bench_pd(nodes, clients, ops):
    print("placement driver, %d clients, %d ops per run:" % (clients, ops))
    made = []
    lock = threading.Lock()

    def create(c, i, k):
        s = c.create_stream(replica_nums=3)
        with lock:
            made.append(s["stream_id"])

    for label, targets in (("one node", nodes[:1]), ("spread over three", nodes)):
        rate, lat = run_ops(targets, clients, ops, create)
        report("CREATE_STREAMS (R=3), " + label, rate, lat)
    sids = list(made)

    def describe(c, i, k):
        c.describe_range(sids[(i * 7919 + k) % len(sids)], 0)

    for label, targets in (("one node", nodes[:1]), ("spread over three", nodes)):
        rate, lat = run_ops(targets, clients, ops, describe)
        report("DESCRIBE_RANGES, " + label, rate, lat)


def bench_append(cluster_node, single_node, appends):
    from storage import record_batch

    batch = record_batch.encode([(1000 + i, [], b"x" * 100) for i in range(16)])
    print("APPEND on the primary, %d frames of 16 x 100 B records, 16 in flight:" % appends)
    # R=3: replicated (issue 17), acknowledged once two of the three nodes hold each batch
    for label, node, r in (("cluster R=1", cluster_node, 1), ("cluster R=3", cluster_node, 3), ("single node", single_node, 1)):
        with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=30, follow_cluster=True) as c:
            sid = c.create_stream(replica_nums=r)["stream_id"]
            target = c.for_stream(sid)
            target.append_pipelined([(sid, batch)] * 200, window=16)  # warm-up
            t = time.perf_counter()
            target.append_pipelined([(sid, batch)] * appends, window=16)
            elapsed = time.perf_counter() - t
        print("  %-14s %8.0f appends/s  %8.0f records/s" % (label, appends / elapsed, appends * 16 / elapsed))


def view(node):
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=5) as c:
        ms = c.call(call_describe_cluster())
    leaders = [int(m["name"]) for m in ms if m["is_leader"]]
    return sorted(int(m["name"]) for m in ms), (leaders[0] if leaders else None)


def bench_failover(nodes, kills):
    times = []
    for k in range(kills):
        _, leader = view(nodes[0])
        while leader is None:
            time.sleep(0.02)
            _, leader = view(nodes[0])
        old = next(n for n in nodes if n.node_id == leader)
        survivors = [n for n in nodes if n is not old]
        t = time.monotonic()
        old.kill9()
        while True:
            try:
                vs = [view(n) for n in survivors]
            except Exception:
                vs = []
            if vs and all(v == vs[0] for v in vs) and vs[0][1] not in (None, leader):
                break
            if time.monotonic() - t > 30:
                raise RuntimeError("no new leader 30 s after kill %d" % k)
            time.sleep(0.02)
        times.append(time.monotonic() - t)
        old.start(timeout=120)
        while view(old)[0] != sorted(n.node_id for n in nodes):
            time.sleep(0.05)
    print("leader failover (kill -9 of the leader to both survivors naming one new leader), %d kills: "
          "median %.2fs, worst %.2fs, best %.2fs" % (kills, statistics.median(times), max(times), min(times)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--starts", type=int, default=3)
    p.add_argument("--appends", type=int, default=5000)
    a = p.parse_args()
    base = tempfile.mkdtemp(prefix="cluster-bench-")
    etcd = EtcdCluster(base, members=1).start()
    nodes = []
    try:
        print("load average: %.2f %.2f %.2f" % os.getloadavg())
        bench_start(base, etcd, a.starts)
        nodes = [NodeProcess(base, name="n%d" % i, cluster=etcd.client_urls, node_id=i, fsync="never").start(timeout=120)
                 for i in (1, 2, 3)]
        bench_pd(nodes, a.clients, a.ops)
        single = NodeProcess(base, name="single", fsync="never").start(timeout=120)
        try:
            # the primary of a new R=1 stream is the least loaded node: ask that node
            bench_append(nodes[0], single, a.appends)
        finally:
            single.kill9()
        bench_failover(nodes, a.kills)
        print("load average: %.2f %.2f %.2f" % os.getloadavg())
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
