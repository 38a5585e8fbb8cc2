"""Key-value benchmark in cluster mode (issue 20): 3 sbpnodes (R=3) vs Redis master + replica.

    python bench/kv_cluster_bench.py [--keys 100000] [--depth 64] [--value-size 100] [--failovers 3]

sbpnode: one etcd member and 3 nodes (``--replication-factor 3``, ``--fsync never`` unless
``--fsync``); every SET is acknowledged once a majority (2 of 3) holds it. Phases, each with
pre-encoded pipelined requests (``--depth`` in flight per connection):

  SET one    every key once through node 1 (one connection)       ops/s, latency percentiles
  GET one    every key once through node 1
  SET spread every key once more, a third through each node (3 connections at once)
  GET spread the same for GET
  FAILOVER   kill -9 the leader of one partition while a client SETs keys of that partition one
             at a time through another node: seconds from the kill to the first SET answered
             OK (the killed node is restarted between rounds), ``--failovers`` rounds, median

Redis: a master and a replica (``replicaof``), no persistence unless ``--redis-fsync``; SETs go
in windows of ``--depth`` followed by ``WAIT 1 0`` (the window is acknowledged once the replica
has it), GETs pipelined to the master. Spread: the same load split over 3 connections to the
master (a replica serves reads only). Prints both sides and the ratios; the machine's load
average is printed at the start.
"""

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.kv_bench import (RespReader, connect, fmt_lat, make_keys, pipelined,  # noqa: E402
                            resp, start_redis)
from protocols.partition import codec  # noqa: E402
from protocols.partition.client import BlockingKvClient, KvError  # noqa: E402
from protocols.sbp.client import BlockingSbpClient, call_status  # noqa: E402
from tests.etcdproc import EtcdCluster  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402


def start_cluster(base, fsync, **options):
    etcd = EtcdCluster(base, members=1).start()
    nodes = [NodeProcess(base, name="n%d" % i, cluster=etcd.client_urls, fsync=fsync, node_id=i,
                         replication_factor=3, meta="none", chunks="none", swarm="none", http="none", **options)
             for i in (1, 2, 3)]
    threads = [threading.Thread(target=n.start, kwargs={"timeout": 120}) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return etcd, nodes


def placement(node):
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=30) as c:
        return c.call(call_status()).get("cluster", {}).get("kv", {}).get("partitions")


def wait_placed(node, timeout=60):
    with BlockingKvClient("127.0.0.1", node.ports["kv"], timeout=60) as c:
        c.set(b"\x00bench-warm", b"1")  # the first key places the partitions
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parts = placement(node)
        if parts and all(p["leader"] is not None for p in parts):
            return parts
        time.sleep(0.1)
    raise RuntimeError("partitions not placed")


def cpu_seconds(nodes):
    """User + system CPU seconds the node processes used so far (/proc; 0 where unreadable)."""
    total = 0
    for n in nodes:
        try:
            with open("/proc/%d/stat" % n.proc.pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def records(nodes):
    """Records in the 8 partition streams (the largest applied offset any node reports)."""
    applied = [0] * 8
    for n in nodes:
        with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=30) as c:
            parts = c.call(call_status()).get("cluster", {}).get("kv", {}).get("partitions") or []
        for p in parts:
            applied[p["partition"]] = max(applied[p["partition"]], p["applied"])
    return sum(applied)


def run_spread(ports, per_port_requests, reply_len, depth):
    """One connection per port, all at once: (ops/s overall, merged latency samples)."""
    out = [None] * len(ports)

    def run(i):
        sock = connect(ports[i])
        out[i] = pipelined(sock, per_port_requests[i], reply_len, depth)
        sock.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ports))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    el = time.perf_counter() - t0
    n = sum(len(r) for r in per_port_requests)
    samples = sorted(s for r in out for s in r[1])
    return n / el, samples


def kv_sets(keys, value):
    return [codec.encode_set(i, k, value) for i, k in enumerate(keys)]


def kv_gets(keys):
    return [codec.encode_get(i, k) for i, k in enumerate(keys)]


def failover_round(nodes, by_id, part_index=0):
    """Kill -9 the leader of partition ``part_index``; seconds until a SET of one of its keys
    through another node is answered OK. Restarts the killed node and waits until it is live."""
    parts = placement(next(n for n in nodes if n.proc is not None and n.proc.poll() is None))
    victim = by_id[parts[part_index]["leader"]]
    other = next(n for n in nodes if n is not victim)
    key_byte = part_index << 5
    with BlockingKvClient("127.0.0.1", other.ports["kv"], timeout=60) as c:
        c.set(bytes([key_byte]) + b"fo-before", b"1")
        t0 = time.monotonic()
        victim.kill9()
        i = 0
        while True:
            try:
                c.set(bytes([key_byte]) + b"fo-%d" % i, b"1")
                break
            except KvError:
                i += 1
        seconds = time.monotonic() - t0
    victim.start(timeout=120)
    return seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--fsync", default="never", help="the nodes' --fsync")
    ap.add_argument("--redis-fsync", choices=["none", "everysec", "always"], default="none")
    ap.add_argument("--failovers", type=int, default=3)
    ap.add_argument("--only", choices=["kv", "redis"], default=None)
    args = ap.parse_args(argv)
    value = os.urandom(args.value_size)
    keys = make_keys(args.keys)
    thirds = [keys[i::3] for i in range(3)]
    get_reply = codec.HEADER_LEN + 6 + 8 + args.value_size
    print("kv_cluster_bench: %d keys, %d-byte values, depth %d, 3 nodes R=3 fsync=%s vs redis master+replica (%s), WAIT 1 0 per window"
          % (args.keys, args.value_size, args.depth, args.fsync, args.redis_fsync))
    print("load average at start: %.2f %.2f %.2f" % os.getloadavg())
    results = {}
    tmp = tempfile.mkdtemp(prefix="kv-cluster-bench-")
    etcd = nodes = None
    procs = []
    try:
        if args.only != "redis":
            etcd, nodes = start_cluster(tmp, args.fsync)
            by_id = {n.node_id: n for n in nodes}
            parts = wait_placed(nodes[0])
            print("placement: " + ", ".join("p%d->%s" % (p["partition"], p["leader"]) for p in parts))
            port = nodes[0].ports["kv"]
            sock = connect(port)
            before = records(nodes)
            cpu0 = cpu_seconds(nodes)
            t0 = time.perf_counter()
            _el, lat, tail = pipelined(sock, kv_sets(keys, value), codec.HEADER_LEN, args.depth)
            el = time.perf_counter() - t0
            cpu = cpu_seconds(nodes) - cpu0
            assert tail == codec.encode_status(len(keys) - 1, codec.OK), tail
            results[("kv", "set one")] = args.keys / el
            print("sbpnode SET one    %9.0f ops/s  %s" % (args.keys / el, fmt_lat(lat)))
            # how well write runs are grouped: replicated records per SET (one record per append)
            print("sbpnode SET one    %.3f records per SET, %.0f us of node CPU per SET (3 nodes; "
                  "load-independent, unlike ops/s on a loaded machine)" % ((records(nodes) - before) / args.keys,
                                                                          cpu / args.keys * 1e6))
            el, lat, tail = pipelined(sock, kv_gets(keys), get_reply, args.depth)
            assert tail == codec.encode_get_reply(len(keys) - 1, keys[-1], value), tail
            results[("kv", "get one")] = args.keys / el
            print("sbpnode GET one    %9.0f ops/s  %s" % (args.keys / el, fmt_lat(lat)))
            sock.close()
            ports = [n.ports["kv"] for n in nodes]
            rate, lat = run_spread(ports, [kv_sets(t, value) for t in thirds], codec.HEADER_LEN, args.depth)
            results[("kv", "set spread")] = rate
            print("sbpnode SET spread %9.0f ops/s  %s" % (rate, fmt_lat(lat)))
            rate, lat = run_spread(ports, [kv_gets(t) for t in thirds], get_reply, args.depth)
            results[("kv", "get spread")] = rate
            print("sbpnode GET spread %9.0f ops/s  %s" % (rate, fmt_lat(lat)))
            times = []
            for r in range(args.failovers):
                s = failover_round(nodes, by_id, part_index=r % 8)
                times.append(s)
                print("sbpnode FAILOVER round %d: %.2f s" % (r + 1, s))
            if times:
                results[("kv", "failover")] = statistics.median(times)
                print("sbpnode FAILOVER median %.2f s over %d rounds" % (statistics.median(times), len(times)))
            for n in nodes:
                n.kill9()
            etcd.stop()
            nodes = etcd = None
        if args.only != "kv":
            master, mport = start_redis(tmp, args.redis_fsync)
            procs.append(master)
            rdir = os.path.join(tmp, "replica")
            os.makedirs(rdir, exist_ok=True)
            replica, rport = start_redis(rdir, args.redis_fsync)
            procs.append(replica)
            s = connect(rport)
            s.sendall(resp(b"REPLICAOF", b"127.0.0.1", b"%d" % mport))
            RespReader(s).read()
            deadline = time.monotonic() + 30
            m = connect(mport)
            mr = RespReader(m)
            while True:
                m.sendall(resp(b"WAIT", b"1", b"100"))
                if mr.read() == 1:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("redis replica did not connect")
            m.close()
            s.close()
            sets = [resp(b"SET", k, value) for k in keys]

            def windows(reqs):
                return [b"".join(reqs[i:i + args.depth]) + resp(b"WAIT", b"1", b"0")
                        for i in range(0, len(reqs), args.depth)]

            def window_reply(n):
                return 5 * n + 4  # +OK\r\n each, then :1\r\n

            sock = connect(mport)
            ws = windows(sets)
            full = [w for w in ws if len(w) == len(ws[0])]
            t0 = time.perf_counter()
            _el, lat, _tail = pipelined(sock, full, window_reply(args.depth), 1, chunk=1)
            for w in ws[len(full):]:
                pipelined(sock, [w], window_reply(args.keys % args.depth), 1, chunk=1)
            el = time.perf_counter() - t0
            results[("redis", "set one")] = args.keys / el
            print("redis   SET one    %9.0f ops/s  per window of %d: %s" % (args.keys / el, args.depth, fmt_lat(lat)))
            gets = [resp(b"GET", k) for k in keys]
            greply = len(b"$%d\r\n" % args.value_size) + args.value_size + 2
            el, lat, _tail = pipelined(sock, gets, greply, args.depth)
            results[("redis", "get one")] = args.keys / el
            print("redis   GET one    %9.0f ops/s  %s" % (args.keys / el, fmt_lat(lat)))
            sock.close()
            per = [[resp(b"SET", k, value) for k in t] for t in thirds]
            n_full = min(len(p) for p in per) // args.depth
            reqs = [windows(p)[:n_full] for p in per]
            rate, lat = run_spread([mport] * 3, reqs, window_reply(args.depth), 1)
            rate = rate * args.depth  # windows/s -> SETs/s
            results[("redis", "set spread")] = rate
            print("redis   SET spread %9.0f ops/s  per window: %s" % (rate, fmt_lat(lat)))
            rate, lat = run_spread([mport] * 3, [[resp(b"GET", k) for k in t] for t in thirds], greply, args.depth)
            results[("redis", "get spread")] = rate
            print("redis   GET spread %9.0f ops/s  %s" % (rate, fmt_lat(lat)))
        if args.only is None:
            for what in ("set one", "get one", "set spread", "get spread"):
                print("ratio %-10s sbpnode/redis = %.2fx" % (what, results[("kv", what)] / results[("redis", what)]))
        print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
    finally:
        if nodes:
            for n in nodes:
                n.kill9()
        if etcd is not None:
            etcd.stop()
        for p in procs:
            p.kill()
            p.wait()


if __name__ == "__main__":
    main()
