"""Toasty across a cluster (R = 3) beside a single node: big-file put/get and small-file latency.

    python bench/cluster_toasty_bench.py [--size MiB] [--files N] [--dir DIR]

1. Starts one etcd and three nodes (cluster mode, --replication-factor 3) and one single node,
   all real `twistd sbpnode` processes on loopback with --fsync never and their data in DIR.
2. put: the blocking client writes a --size MiB file of random bytes (64 KiB chunks, as
   bench/toasty_bench.py) through node A; every chunk goes to the three write locations, and each
   WRITE (<= 1024 chunks) is checked by A (a majority of the named holders asked) and committed
   by an etcd transaction. The same file is put to the single node.
3. get: read back through node B (another node than the writer) and through the single node,
   every chunk's SHA-256 checked.
4. small files: --files new 4 KiB files written one at a time (READ, CREATE_CHUNK x R, WRITE),
   and a READ of each; latency percentiles for both, cluster and single node.
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from protocols.toasty.client import BlockingToastyClient  # noqa: E402
from tests.etcdproc import EtcdCluster  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402
from tests.test_cluster import start_nodes  # noqa: E402

MiB = 1024 * 1024
CHUNK = 64 * 1024


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def big_file(writer, reader, data, path):
    with BlockingToastyClient(*writer.address("meta"), timeout=300, parallel=32) as c:
        t = time.perf_counter()
        c.write(path, data, truncate=True, chunk_size=CHUNK)
        put = time.perf_counter() - t
    with BlockingToastyClient(*reader.address("meta"), timeout=300, parallel=32) as c:
        t = time.perf_counter()
        got = c.read(path)
        get = time.perf_counter() - t
    assert got == data, "read back different bytes"
    return put, get


def small_files(node, n, prefix):
    rnd = random.Random(7)
    writes, reads = [], []
    with BlockingToastyClient(*node.address("meta"), timeout=60) as c:
        for i in range(n):
            data = rnd.randbytes(4096)
            t = time.perf_counter()
            c.write("%s-%d" % (prefix, i), data)
            writes.append(time.perf_counter() - t)
            t = time.perf_counter()
            assert c.read("%s-%d" % (prefix, i)) == data
            reads.append(time.perf_counter() - t)
    return writes, reads


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="big file size in MiB (default 256)")
    ap.add_argument("--files", type=int, default=300, help="small files written one at a time (default 300)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under the repo)")
    args = ap.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="toasty-cluster-bench-",
                                        dir=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(base, exist_ok=True)
    rnd = random.Random(42)
    data = b"".join(rnd.randbytes(8 * MiB) for _ in range(args.size // 8)) + rnd.randbytes(args.size % 8 * MiB)
    etcd = EtcdCluster(base, members=1).start()
    nodes = []
    single = NodeProcess(base, name="single", fsync="never", sbp="none", kv="none", swarm="none", http="none")
    try:
        nodes.extend(start_nodes(base, etcd.client_urls, [1, 2, 3]))
        single.start()
        print("load average at start: %.2f %.2f %.2f" % os.getloadavg())
        mb = len(data) / 1e6
        results = {}
        for name, writer, reader in (("single node", single, single), ("cluster R=3", nodes[0], nodes[1])):
            put, get = big_file(writer, reader, data, "/big")
            results[name] = (put, get)
            print("%-12s big file %d MiB (64 KiB chunks): put %7.1f MB/s (%.2f s)  get %7.1f MB/s (%.2f s)"
                  % (name, args.size, mb / put, put, mb / get, get))
        (sp, sg), (cp, cg) = results["single node"], results["cluster R=3"]
        print("cluster / single: put %.2fx  get %.2fx" % (sp / cp, sg / cg))
        for name, node in (("single node", single), ("cluster R=3", nodes[0])):
            writes, reads = small_files(node, args.files, "/small")
            print("%-12s %d x 4 KiB new file alone: write p50 %.2f ms p99 %.2f ms; read p50 %.2f ms p99 %.2f ms"
                  % (name, args.files, pct(writes, 50) * 1e3, pct(writes, 99) * 1e3, pct(reads, 50) * 1e3,
                     pct(reads, 99) * 1e3))
        print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
    finally:
        for n in nodes:
            n.kill9()
        single.kill9()
        etcd.stop()
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
