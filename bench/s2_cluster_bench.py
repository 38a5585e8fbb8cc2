"""S2 appends in a 3-node cluster through the stream's primary and through a node that forwards to
it (docs/benchmarks.md, "S2 across the cluster"), with the official s2-sdk as the client.

    python bench/s2_cluster_bench.py [--records 100000] [--batch 100] [--size 100] [--unary 300]
                                     [--tls | --compare-tls]

Starts one etcd and three nodes (R = 3, --fsync never) in a temporary directory, creates one S2
stream per run, and measures on the primary and on a non-primary: an S2S append session of
--records records (batches of --batch, ack latency percentiles), then --unary unary appends one
after the other (latency percentiles), and the CPU the three node processes spent on each
(user + system, from /proc, less what they spend idle, measured for 3 s after start:
microseconds per record of the session, milliseconds per unary append). With
--tls the cluster runs with the cluster TLS options (a test CA, tests/tlscerts.py; etcd with
client certificates): the replica channel and S2 forwarding are mutual TLS. --compare-tls starts
a plain cluster and a TLS cluster side by side and alternates the runs between them (A/B under
the same load). Stops everything at the end.
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.request

IDLE_S = 3.0
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100.0))] if values else float("nan")


def stream_id(endpoint, name):
    req = urllib.request.Request(endpoint + "/v1/streams/" + name, headers={"s2-basin": "sbpnode-default"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.headers["sbp-stream-id"])


def cpu_seconds(pids):
    """User + system CPU seconds the processes ``pids`` have used so far (/proc/<pid>/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


async def session_run(endpoint, name, args, cpu=lambda: 0.0):
    from s2_sdk import S2, AppendInput, Endpoints, Record

    async with S2("bench", endpoints=Endpoints(account=endpoint, basin=endpoint)) as s2:
        stream = s2.basin("sbpnode-default").stream(name)
        batch = AppendInput(records=[Record(body=b"x" * args.size) for _ in range(args.batch)])
        latencies = []

        async def acked(ticket, submitted):
            await ticket
            latencies.append(time.perf_counter() - submitted)

        c0 = cpu()
        t0 = time.perf_counter()
        async with stream.append_session() as session:
            waiters = []
            for _ in range(args.records // args.batch):
                ticket = await session.submit(batch)
                waiters.append(asyncio.ensure_future(acked(ticket, time.perf_counter())))
            await asyncio.gather(*waiters)
        seconds = time.perf_counter() - t0
        c1 = cpu()
        unary = []
        one = AppendInput(records=[Record(body=b"u" * args.size)])
        for _ in range(args.unary):
            t = time.perf_counter()
            await stream.append(one)
            unary.append(time.perf_counter() - t)
        c2 = cpu()
        return seconds, latencies, unary, (c1 - c0, c2 - c1)


def report(label, args, seconds, latencies, unary, cpu):
    ms = lambda v: v * 1000  # noqa: E731
    records = args.records // args.batch * args.batch
    print("%-17s session %8.0f records/s %6.1f MB/s  ack p50 %6.1f p99 %6.1f ms  nodes' CPU %5.1f us/record | "
          "unary p50 %5.2f p99 %5.2f ms  nodes' CPU %5.2f ms/append"
          % (label, records / seconds, records * args.size / seconds / 1e6, ms(pct(latencies, 50)),
             ms(pct(latencies, 99)), cpu[0] / records * 1e6, ms(pct(unary, 50)), ms(pct(unary, 99)),
             cpu[1] / max(1, args.unary) * 1e3), flush=True)


class Cluster:
    """One etcd and nodes 1-3 under ``base`` (mutual TLS between them, and to etcd, with ``tls``)."""

    def __init__(self, base, tls):
        from tests.etcdproc import EtcdCluster
        from tests.test_cluster import start_nodes

        self.label = "tls" if tls else "plain"
        options = {}
        etcd_tls = None
        if tls:
            from tests.tlscerts import CA

            ca = CA(base)
            etcd_cert, etcd_key = ca.issue("etcd")
            etcd_tls = (etcd_cert, etcd_key, ca.path)
            cert, key = ca.issue("node")
            options = {"cluster_tls_cert": cert, "cluster_tls_key": key, "cluster_tls_ca": ca.path}
        self.etcd = EtcdCluster(base, members=1, tls=etcd_tls).start()
        self.nodes = []
        try:
            self.nodes = start_nodes(base, self.etcd.client_urls, [1, 2, 3], **options)
        except BaseException:
            self.etcd.stop()
            raise
        self.by_id = {n.node_id: n for n in self.nodes}
        # what the three nodes spend idle (leases, watches, timers): taken off each figure below
        c0, t0 = self.cpu_total(), time.perf_counter()
        time.sleep(IDLE_S)
        self.idle = (self.cpu_total() - c0) / (time.perf_counter() - t0)
        print("%s cluster idle: %.1f ms CPU/s" % (self.label, self.idle * 1e3), flush=True)

    def cpu_total(self):
        return cpu_seconds([n.proc.pid for n in self.nodes])

    def cpu(self):
        """The nodes' CPU seconds less their idle rate (so differences are the work of the run)."""
        return self.cpu_total() - self.idle * time.perf_counter()

    def run(self, name, via_primary, args):
        from protocols.sbp.client import BlockingSbpClient

        nodes = self.nodes
        first = "http://127.0.0.1:%d" % nodes[0].ports["http"]
        req = urllib.request.Request(first + "/v1/streams", data=b'{"stream":"%s"}' % name.encode(),
                                     headers={"content-type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=30).read()
        sid = stream_id(first, name)
        with BlockingSbpClient("127.0.0.1", nodes[0].ports["sbp"]) as c:
            servers = c.list_ranges(sid)[-1]["servers"]
        pid = next(s["server_id"] for s in servers if s["is_primary"])
        node = self.by_id[pid] if via_primary else next(n for n in nodes if n.node_id != pid)
        endpoint = "http://127.0.0.1:%d" % node.ports["http"]
        result = asyncio.run(session_run(endpoint, name, args, self.cpu))
        report("%s %s" % (self.label, "primary" if via_primary else "forwarded"), args, *result)

    def stop(self):
        for n in self.nodes:
            n.kill9()
        self.etcd.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--unary", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2, help="primary/forwarded pairs, alternating")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--tls", action="store_true", help="the cluster with the cluster TLS options")
    modes.add_argument("--compare-tls", action="store_true", help="a plain and a TLS cluster, runs alternating")
    args = parser.parse_args()

    print("load average before: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    with tempfile.TemporaryDirectory() as base:
        clusters = []
        try:
            for tls in ((False, True) if args.compare_tls else (args.tls,)):
                sub = os.path.join(base, "tls" if tls else "plain")
                os.mkdir(sub)
                clusters.append(Cluster(sub, tls))
            for r in range(args.rounds):
                for via_primary in (True, False):
                    for cluster in clusters:
                        cluster.run("bench-%d-%d" % (r, via_primary), via_primary, args)
        finally:
            for cluster in clusters:
                cluster.stop()
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
