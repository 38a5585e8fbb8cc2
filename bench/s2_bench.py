"""S2 HTTP API benchmark with the official s2-sdk as the client (docs/benchmarks.md, "S2 HTTP API").

    python bench/s2_bench.py [--records 1000000] [--batch 1000] [--size 100] [--fsync always]
                             [--endpoint http://127.0.0.1:PORT]

    python bench/s2_bench.py --compare [--records 200000] ...

Without --endpoint it starts a node (tests/nodeproc.py) in a temporary directory and stops it at
the end. Measures: an S2S append session of N records (batches of --batch, --size-byte bodies; ack
latency percentiles), an S2S read session of them, then unary protobuf and JSON appends and reads.
With --compare: the S2S append and read sessions only, on a plain stream, on encrypted streams
(aegis-256, aes-256-gcm) and through a scoped access token, one after the other on one node.
"""

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100.0))]


async def run(endpoint, args):
    from s2_sdk import S2, AppendInput, Endpoints, ReadLimit, Record, SeqNum

    ep = Endpoints(account=endpoint, basin=endpoint)
    mb = args.records * args.size / 1e6
    async with S2(args.token or "bench", endpoints=ep) as s2:
        basin = s2.basin("sbpnode-default")
        name = "bench-%d" % int(time.time() * 1000)
        await basin.create_stream(name)
        stream = basin.stream(name)

        body = b"x" * args.size
        batch = AppendInput(records=[Record(body=body) for _ in range(args.batch)])
        nbatches = args.records // args.batch
        latencies = []
        t0 = time.perf_counter()
        async def acked(ticket, submitted):
            await ticket
            latencies.append(time.perf_counter() - submitted)

        async with stream.append_session(max_unacked_bytes=args.unacked * 1024 * 1024) as session:
            waiters = []
            for i in range(nbatches):
                ticket = await session.submit(batch)
                # ack latency: from the moment the session accepted the batch to its ack
                waiters.append(asyncio.ensure_future(acked(ticket, time.perf_counter())))
            await asyncio.gather(*waiters)
        dt = time.perf_counter() - t0
        n = nbatches * args.batch
        print("append session: %d records in %.2fs: %.0f records/s, %.1f MB/s; ack latency ms p50 %.1f p99 %.1f max %.1f"
              % (n, dt, n / dt, mb / dt, pct(latencies, 50) * 1e3, pct(latencies, 99) * 1e3, max(latencies) * 1e3))

        # Ack latency without queueing: one batch in flight at a time.
        lat1 = []
        async with stream.append_session() as session:
            for _ in range(args.unary):
                s = time.perf_counter()
                await (await session.submit(batch))
                lat1.append(time.perf_counter() - s)
        print("append session, 1 batch in flight: %d batches: ack latency ms p50 %.1f p99 %.1f max %.1f"
              % (len(lat1), pct(lat1, 50) * 1e3, pct(lat1, 99) * 1e3, max(lat1) * 1e3))

        t0 = time.perf_counter()
        got = 0
        async for rb in stream.read_session(start=SeqNum(0), limit=ReadLimit(count=n)):
            got += len(rb.records)
        dt = time.perf_counter() - t0
        assert got == n, (got, n)
        print("read session:   %d records in %.2fs: %.0f records/s, %.1f MB/s" % (got, dt, got / dt, mb / dt))

        # Unary protobuf appends and reads (the SDK's append()/read()).
        k = max(1, min(args.unary, nbatches))
        t0 = time.perf_counter()
        lat = []
        for _ in range(k):
            s = time.perf_counter()
            await stream.append(batch)
            lat.append(time.perf_counter() - s)
        dt = time.perf_counter() - t0
        print("unary append (protobuf, SDK): %d x %d records: %.0f records/s, latency ms p50 %.1f p99 %.1f"
              % (k, args.batch, k * args.batch / dt, pct(lat, 50) * 1e3, pct(lat, 99) * 1e3))
        t0 = time.perf_counter()
        got = 0
        pos = 0
        for _ in range(k):
            rb = await stream.read(start=SeqNum(pos), limit=ReadLimit(count=1000))
            got += len(rb.records)
            pos = rb.records[-1].seq_num + 1
        dt = time.perf_counter() - t0
        print("unary read (protobuf, SDK): %d records: %.0f records/s" % (got, got / dt))

    # Unary JSON over HTTP/1.1 (urllib, keep-alive off: worst case for plain REST clients).
    base = endpoint.rstrip("/") + "/v1/streams/" + name + "/records"
    headers = {"content-type": "application/json"}
    if args.token:
        headers["authorization"] = "Bearer " + args.token
    payload = json.dumps({"records": [{"body": "x" * args.size} for _ in range(args.batch)]}).encode()
    t0 = time.perf_counter()
    for _ in range(k):
        req = urllib.request.Request(base, data=payload, headers=headers, method="POST")
        urllib.request.urlopen(req).read()
    dt = time.perf_counter() - t0
    print("unary append (JSON, HTTP/1.1): %d x %d records: %.0f records/s" % (k, args.batch, k * args.batch / dt))
    t0 = time.perf_counter()
    got = 0
    for i in range(k):
        req = urllib.request.Request(base + "?seq_num=%d&count=1000" % (i * 1000), headers=headers)
        got += len(json.loads(urllib.request.urlopen(req).read())["records"])
    dt = time.perf_counter() - t0
    print("unary read (JSON, HTTP/1.1): %d records: %.0f records/s" % (got, got / dt))


async def sessions(stream, args):
    """(append records/s, MB/s, ack p50 ms, ack p99 ms, read records/s) of one S2S session pair."""
    from s2_sdk import AppendInput, ReadLimit, Record, SeqNum

    batch = AppendInput(records=[Record(body=b"x" * args.size) for _ in range(args.batch)])
    nbatches = args.records // args.batch
    n = nbatches * args.batch
    latencies = []

    async def acked(ticket, submitted):
        await ticket
        latencies.append(time.perf_counter() - submitted)

    t0 = time.perf_counter()
    async with stream.append_session(max_unacked_bytes=args.unacked * 1024 * 1024) as session:
        waiters = [asyncio.ensure_future(acked(await session.submit(batch), time.perf_counter()))
                   for _ in range(nbatches)]
        await asyncio.gather(*waiters)
    append_dt = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = 0
    async for rb in stream.read_session(start=SeqNum(0), limit=ReadLimit(count=n)):
        got += len(rb.records)
    read_dt = time.perf_counter() - t0
    assert got == n, (got, n)
    return (n / append_dt, n * args.size / 1e6 / append_dt, pct(latencies, 50) * 1e3, pct(latencies, 99) * 1e3,
            n / read_dt)


async def compare(endpoint, args):
    import os as _os

    from s2_sdk import (S2, AccessTokenScope, BasinConfig, Encryption, Endpoints, ExactMatch,
                        OperationGroupPermissions, Permission, PrefixMatch)

    ep = Endpoints(account=endpoint, basin=endpoint)
    stamp = int(time.time())
    key = _os.urandom(32)
    rows = []
    async with S2(args.token or "bench", endpoints=ep) as root:
        plain = "bench-plain-%d" % stamp
        await root.create_basin(plain)
        await root.basin(plain).create_stream("s")
        rows.append(("plain", await sessions(root.basin(plain).stream("s"), args)))
        for cipher in (Encryption.AEGIS_256, Encryption.AES_256_GCM):
            name = "bench-%s-%d" % (cipher.value.replace("-", ""), stamp)
            await root.create_basin(name, config=BasinConfig(stream_cipher=cipher))
            await root.basin(name).create_stream("s")
            rows.append((cipher.value, await sessions(root.basin(name).stream("s", encryption_key=key), args)))
        token = await root.issue_access_token("bench-%d" % stamp, scope=AccessTokenScope(
            basins=ExactMatch(plain), streams=PrefixMatch("scoped/"),
            op_groups=OperationGroupPermissions(basin=Permission.READ_WRITE, stream=Permission.READ_WRITE)))
    async with S2(token, endpoints=ep) as scoped:
        await scoped.basin(plain).create_stream("scoped/s")
        rows.append(("scoped token", await sessions(scoped.basin(plain).stream("scoped/s"), args)))
    print("| stream | append session records/s | MB/s | ack p50 ms | ack p99 ms | read session records/s |")
    print("|---|---|---|---|---|---|")
    for label, (rate, mbs, p50, p99, rrate) in rows:
        print("| %s | %.0f | %.1f | %.1f | %.1f | %.0f |" % (label, rate, mbs, p50, p99, rrate))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--unacked", type=int, default=5, help="append session max unacked MiB")
    ap.add_argument("--unary", type=int, default=100, help="unary calls of --batch records each")
    ap.add_argument("--fsync", default="always")
    ap.add_argument("--endpoint", help="use a running node (http://host:port) instead of starting one")
    ap.add_argument("--token")
    ap.add_argument("--compare", action="store_true",
                    help="sessions only: plain, aegis-256, aes-256-gcm and a scoped token")
    args = ap.parse_args()
    job = compare if args.compare else run
    if args.endpoint:
        asyncio.run(job(args.endpoint, args))
        return
    from tests.nodeproc import NodeProcess

    with tempfile.TemporaryDirectory() as tmp:
        node = NodeProcess(tmp, fsync=args.fsync)
        node.start()
        try:
            print("node: fsync=%s, http port %d" % (args.fsync, node.ports["http"]))
            asyncio.run(job("http://127.0.0.1:%d" % node.ports["http"], args))
        finally:
            node.terminate()


if __name__ == "__main__":
    main()
