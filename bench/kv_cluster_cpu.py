"""CPU per SET and per GET through one node of a 3-node cluster (issue 20's A/B helper).

    python bench/kv_cluster_cpu.py [--keys 20000] [--warm 2000] [--depth 64] [--py-spy DIR]

Starts one etcd member and 3 nodes (R=3, ``--fsync never``, as ``bench/kv_cluster_bench.py``),
SETs ``--warm`` keys, then ``--keys`` keys through node 1 at ``--depth`` (requests in groups of
16, as the bench's generator sends them), then GETs them all. For each phase it prints the node
processes' CPU per operation (user + system of the 3 nodes from /proc, summed), the load
generator's own CPU per operation (its process CPU: the machine's speed cancels in the ratio),
the ratio of the two, records per SET and ops/s. ``--py-spy DIR``: py-spy records every node
during the SET phase and the GET phase (``DIR/set-N.txt``, ``DIR/get-N.txt``; summarise with
``bench/pyspy_top.py``); with ``--strace``, ``strace -c -f`` instead (``DIR/set-N.strace``: system
calls per thread kind, to divide by the ops).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.kv_bench import connect, make_keys, pipelined  # noqa: E402
from bench.kv_cluster_bench import cpu_seconds, kv_gets, kv_sets, records, start_cluster, wait_placed  # noqa: E402
from protocols.partition import codec  # noqa: E402


def own_cpu():
    t = os.times()
    return t.user + t.system


def spy(nodes, path, what, strace=False):
    if strace and path:
        os.makedirs(path, exist_ok=True)
        return [subprocess.Popen(["strace", "-c", "-f", "-p", str(n.proc.pid), "-o", os.path.join(path, "%s-%d.strace" % (what, n.node_id))],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in nodes]
    if not path:
        return []
    os.makedirs(path, exist_ok=True)
    return [subprocess.Popen(["py-spy", "record", "-r", "100", "-f", "raw", "-t", "--nonblocking", "-p", str(n.proc.pid),
                              "-o", os.path.join(path, "%s-%d.txt" % (what, n.node_id))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in nodes]


def unspy(procs):
    for p in procs:
        p.send_signal(2)
    for p in procs:
        p.wait(30)


def phase(name, nodes, sock, requests, reply_len, depth, spy_dir, tail, strace=False):
    spies = spy(nodes, spy_dir, name, strace)
    if spies:
        time.sleep(1.0)
    before = records(nodes) if name == "set" else 0
    load = os.getloadavg()[0]
    cpu0, own0 = cpu_seconds(nodes), own_cpu()
    el, _lat, last = pipelined(sock, requests, reply_len, depth)
    cpu, own = cpu_seconds(nodes) - cpu0, own_cpu() - own0
    unspy(spies)
    assert last == tail, (last, tail)
    n = len(requests)
    extra = ""
    if name == "set":
        extra = ", %.3f records per SET" % ((records(nodes) - before) / n)
    print("%s: %d ops, %.0f ops/s, node CPU %.0f us/op, generator CPU %.1f us/op, ratio %.1f%s (load %.1f)"
          % (name.upper(), n, n / el, cpu / n * 1e6, own / n * 1e6, cpu / max(own, 1e-9), extra, load), flush=True)
    return cpu / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--warm", type=int, default=2_000)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--get-rounds", type=int, default=1, help="GET every key this many times (a longer GET phase)")
    ap.add_argument("--py-spy", default=None, metavar="DIR")
    ap.add_argument("--kv-reads", choices=["leader", "replica"], default="leader", help="the nodes' --kv-reads")
    ap.add_argument("--strace", action="store_true", help="strace -c -f every node instead of py-spy (into --py-spy DIR)")
    args = ap.parse_args(argv)
    value = os.urandom(args.value_size)
    keys = make_keys(args.keys + args.warm)
    warm, keys = keys[:args.warm], keys[args.warm:]
    print("kv_cluster_cpu: %d keys (+%d warm-up), %d-byte values, depth %d, --kv-reads %s; load %.2f %.2f %.2f"
          % (args.keys, args.warm, args.value_size, args.depth, args.kv_reads, *os.getloadavg()), flush=True)
    tmp = tempfile.mkdtemp(prefix="kv-cluster-cpu-")
    etcd, nodes = start_cluster(tmp, "never", **({"kv_reads": "replica"} if args.kv_reads == "replica" else {}))
    try:
        wait_placed(nodes[0])
        sock = connect(nodes[0].ports["kv"])
        pipelined(sock, kv_sets(warm, value), codec.HEADER_LEN, args.depth)
        pipelined(sock, kv_gets(warm), codec.HEADER_LEN + 6 + 8 + args.value_size, args.depth)
        time.sleep(0.5)
        phase("set", nodes, sock, kv_sets(keys, value), codec.HEADER_LEN, args.depth, args.py_spy,
              codec.encode_status(len(keys) - 1, codec.OK), args.strace)
        phase("get", nodes, sock, kv_gets(keys * args.get_rounds), codec.HEADER_LEN + 6 + 8 + args.value_size, args.depth, args.py_spy,
              codec.encode_get_reply(len(keys) * args.get_rounds - 1, keys[-1], value), args.strace)
        sock.close()
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


if __name__ == "__main__":
    main()
