"""S2 appends in a 3-node cluster through the stream's primary and through a node that forwards to
it (docs/benchmarks.md, "S2 across the cluster"), with the official s2-sdk as the client.

    python bench/s2_cluster_bench.py [--records 100000] [--batch 100] [--size 100] [--unary 300]

Starts one etcd and three nodes (R = 3, --fsync never) in a temporary directory, creates one S2
stream per run, and measures on the primary and on a non-primary: an S2S append session of
--records records (batches of --batch, ack latency percentiles), then --unary unary appends one
after the other (latency percentiles). Stops everything at the end.
"""

import argparse
import asyncio
import os
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100.0))] if values else float("nan")


def stream_id(endpoint, name):
    req = urllib.request.Request(endpoint + "/v1/streams/" + name, headers={"s2-basin": "sbpnode-default"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.headers["sbp-stream-id"])


async def session_run(endpoint, name, args):
    from s2_sdk import S2, AppendInput, Endpoints, Record

    async with S2("bench", endpoints=Endpoints(account=endpoint, basin=endpoint)) as s2:
        stream = s2.basin("sbpnode-default").stream(name)
        batch = AppendInput(records=[Record(body=b"x" * args.size) for _ in range(args.batch)])
        latencies = []

        async def acked(ticket, submitted):
            await ticket
            latencies.append(time.perf_counter() - submitted)

        t0 = time.perf_counter()
        async with stream.append_session() as session:
            waiters = []
            for _ in range(args.records // args.batch):
                ticket = await session.submit(batch)
                waiters.append(asyncio.ensure_future(acked(ticket, time.perf_counter())))
            await asyncio.gather(*waiters)
        seconds = time.perf_counter() - t0
        unary = []
        one = AppendInput(records=[Record(body=b"u" * args.size)])
        for _ in range(args.unary):
            t = time.perf_counter()
            await stream.append(one)
            unary.append(time.perf_counter() - t)
        return seconds, latencies, unary


def report(label, records, size, seconds, latencies, unary):
    ms = lambda v: v * 1000  # noqa: E731
    print("%-13s session %8.0f records/s %6.1f MB/s  ack p50 %6.1f p99 %6.1f ms | unary p50 %5.2f p99 %5.2f ms"
          % (label, records / seconds, records * size / seconds / 1e6, ms(pct(latencies, 50)), ms(pct(latencies, 99)),
             ms(pct(unary, 50)), ms(pct(unary, 99))))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--unary", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2, help="primary/forwarded pairs, alternating")
    args = parser.parse_args()

    from protocols.sbp.client import BlockingSbpClient
    from tests.etcdproc import EtcdCluster
    from tests.test_cluster import start_nodes

    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    with tempfile.TemporaryDirectory() as base:
        etcd = EtcdCluster(base, members=1).start()
        nodes = []
        try:
            nodes = start_nodes(base, etcd.client_urls, [1, 2, 3])
            by_id = {n.node_id: n for n in nodes}
            for r in range(args.rounds):
                for via_primary in (True, False):
                    name = "bench-%d-%d" % (r, via_primary)
                    first = "http://127.0.0.1:%d" % nodes[0].ports["http"]
                    req = urllib.request.Request(first + "/v1/streams", data=b'{"stream":"%s"}' % name.encode(),
                                                 headers={"content-type": "application/json"}, method="POST")
                    urllib.request.urlopen(req, timeout=30).read()
                    sid = stream_id(first, name)
                    with BlockingSbpClient("127.0.0.1", nodes[0].ports["sbp"]) as c:
                        servers = c.list_ranges(sid)[-1]["servers"]
                    pid = next(s["server_id"] for s in servers if s["is_primary"])
                    node = by_id[pid] if via_primary else next(n for n in nodes if n.node_id != pid)
                    endpoint = "http://127.0.0.1:%d" % node.ports["http"]
                    seconds, latencies, unary = asyncio.run(session_run(endpoint, name, args))
                    report("primary" if via_primary else "non-primary", args.records, args.size, seconds, latencies, unary)
        finally:
            for n in nodes:
                n.kill9()
            etcd.stop()
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
