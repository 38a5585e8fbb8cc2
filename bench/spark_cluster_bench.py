"""Spark batch read of R=3 streams on a 3-node cluster: every FETCH through one node vs each
partition on a replica of its range, spread over the replicas (``read_from``, issue 18).

    python bench/spark_cluster_bench.py                            # defaults below
    python bench/spark_cluster_bench.py --records 1000000 --streams 3 --repeat 5

Starts its own etcd (one member) and three nodes (``--fsync never``, loopback, temp dir), appends
``--records`` records of ``--body-bytes`` to each of ``--streams`` R=3 streams through node 1
(one range each, so one Spark partition per stream), starts a ``local[2]`` SparkSession (not
timed), then reads every row and column of all streams through node 1 (``read_from=endpoint``:
node 1 serves every FETCH) and spread over the replicas (``read_from=replicas``), in ``--repeat``
interleaved rounds after one warm-up each (Spark's ``noop`` sink). Prints best and median rows/s
and the CPU seconds each node spent per run (from /proc), which shows where the reads went.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protocols.sbp.client import BlockingSbpClient  # noqa: E402
from storage import record_batch  # noqa: E402
from tests.etcdproc import EtcdCluster  # noqa: E402
from tests.test_cluster import start_nodes  # noqa: E402


def cpu_seconds(pid):
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load(node, streams, records, body_bytes, batch_records=1000):
    body = os.urandom(body_bytes)
    sids = []
    with BlockingSbpClient(*node.address("sbp"), timeout=60, follow_cluster=True) as c:
        for _ in range(streams):
            sid = c.create_stream(replica_nums=3)["stream_id"]
            entries = []
            for start in range(0, records, batch_records):
                n = min(batch_records, records - start)
                entries.append((sid, record_batch.encode([(start + i, [], body) for i in range(n)])))
            primary = c.for_stream(sid)
            for i in range(0, len(entries), 16):
                primary.append_pipelined(entries[i:i + 16], window=16)
            sids.append(sid)
    return sids


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=500_000, help="records per stream")
    p.add_argument("--streams", type=int, default=3)
    p.add_argument("--body-bytes", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    base = tempfile.mkdtemp(prefix="spark-cluster-bench-")
    etcd = EtcdCluster(base, members=1).start()
    nodes = []
    spark = None
    try:
        nodes = start_nodes(base, etcd.client_urls, [1, 2, 3])
        t0 = time.perf_counter()
        sids = load(nodes[0], args.streams, args.records, args.body_bytes)
        total = args.records * args.streams
        print("loaded %d streams x %d records (R=3) in %.1f s" % (args.streams, args.records, time.perf_counter() - t0))
        # every replica has confirmed everything before the reads start
        for n in nodes:
            with BlockingSbpClient(*n.address("sbp"), timeout=60) as c:
                for sid in sids:
                    while c.list_ranges(sid)[-1]["next_offset"] < args.records:
                        time.sleep(0.05)

        from tests.sparksession import start_session

        import node.spark

        spark = start_session()
        node.spark.register(spark)
        endpoint = nodes[0].endpoint("sbp")
        streams = ",".join(map(str, sids))

        def run(read_from):
            before = [cpu_seconds(n.proc.pid) for n in nodes]
            t = time.perf_counter()
            (spark.read.format("sbp").option("endpoint", endpoint).option("streams", streams)
             .option("read_from", read_from).load().write.format("noop").mode("overwrite").save())
            took = time.perf_counter() - t
            return took, [cpu_seconds(n.proc.pid) - b for n, b in zip(nodes, before)]

        modes = ["endpoint", "replicas"]
        results = {m: [] for m in modes}
        for m in modes:
            run(m)  # warm-up: Python workers, the decoder's cache
        for _ in range(args.repeat):
            for m in modes:
                results[m].append(run(m))
        load_avg = os.getloadavg()
        print("%d records (%d streams x %d, %d B bodies), local[2], load average %.1f %.1f %.1f"
              % (total, args.streams, args.records, args.body_bytes, *load_avg))
        for m in modes:
            times = [t for t, _ in results[m]]
            cpu = [sum(c[i] for _, c in results[m]) / len(results[m]) for i in range(len(nodes))]
            print("read_from=%-9s best %9.0f rows/s  median %9.0f rows/s  node CPU s/run: %s"
                  % (m, total / min(times), total / statistics.median(times),
                     " ".join("n%d=%.2f" % (i + 1, x) for i, x in enumerate(cpu))))
        best = {m: min(t for t, _ in results[m]) for m in modes}
        print("spread / through one node (best): %.2fx" % (best["endpoint"] / best["replicas"]))
    finally:
        if spark is not None:
            spark.stop()
        for n in nodes:
            n.kill9()
        etcd.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
