"""Toasty benchmark: a big file through the protocols vs `cp` on the same disk, and small files.

    python bench/toasty_bench.py [--size MiB] [--files N] [--fsync never|always|interval:MS] [--dir DIR]
                                 [--chunk-size KiB] [--parallel N] [--rounds N] [--ceiling]

1. Makes a file of --size MiB (random bytes, so nothing deduplicates) in DIR.
2. `cp` of it to DIR (timed; `cp` does not fsync, see --fsync), the reference.
3. put: the blocking client writes it to a node on loopback (64 KiB chunks, or --chunk-size: READ,
   CREATE, CREATE_CHUNK x N pipelined, WRITE per 1024 chunks), reading the source file as it goes.
4. get: the blocking client reads it back into a file in DIR, checking every chunk's SHA-256.
   With --rounds N, put and get run N times each (alternating) and every round is printed.
   With --ceiling, bench/toasty_ceiling.py measures this machine's bound first, in the same run,
   and each put and get is printed as a fraction of it: of its MB/s (wall time: a loaded machine
   lowers this) and of its CPU cost (the ceiling's CPU-seconds per GB over the node's + the
   client's: what the load takes away least).
5. small files: --files creates+writes of 4 KiB files (each a CREATE_CHUNK and a WRITE with
   CREATE_IF_MISSING and expect_gen 2^64-1; the two pipelines interleaved, each WRITE sent when its
   chunk is acknowledged), plus the latency of one new file written alone with the blocking
   client (READ, CREATE_CHUNK, WRITE round trips).
The node is a real `twistd sbpnode` process with its data dir in DIR.
"""

import argparse
import hashlib
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # toasty_ceiling

from protocols.toasty import codec  # noqa: E402
from protocols.toasty.client import BlockingConnection, BlockingToastyClient  # noqa: E402
from storage import sha256 as multi_sha256  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402

MiB = 1024 * 1024


def make_source(path, size):
    rnd = random.Random(42)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 * MiB)
            f.write(rnd.randbytes(n))
            left -= n
    with open(path, "rb") as f:  # in the page cache for both contenders
        while f.read(8 * MiB):
            pass


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def proc_cpu(pid):
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CpuMeter:
    """CPU seconds the node and this (client) process spend between ``start`` and ``stop``."""

    def __init__(self, pid):
        self.pid = pid

    def start(self):
        self.node0, self.client0 = proc_cpu(self.pid), self_cpu()

    def stop(self):
        return proc_cpu(self.pid) - self.node0, self_cpu() - self.client0


def cpu_timed(meter, fn):
    meter.start()
    elapsed, result = timed(fn)
    node, client = meter.stop()
    return elapsed, result, node, client


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p / 100))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512, help="big file size in MiB (default 512)")
    ap.add_argument("--files", type=int, default=10_000, help="number of 4 KiB files (default 10000)")
    ap.add_argument("--fsync", default="never", help="node fsync policy (default never: cp does not fsync either)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under the repo)")
    ap.add_argument("--rounds", type=int, default=1, help="put + get rounds of the big file (default 1)")
    ap.add_argument("--ceiling", action="store_true", help="measure bench/toasty_ceiling.py first and print fractions of it")
    ap.add_argument("--parallel", type=int, default=32, help="chunk requests in flight (default 32)")
    ap.add_argument("--chunk-size", type=int, default=64, help="the big file's chunk size in KiB (default 64)")
    args = ap.parse_args(argv)

    base = args.dir or tempfile.mkdtemp(prefix="toasty-bench-", dir=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(base, exist_ok=True)
    size = args.size * MiB
    src, cp_dst, got = (os.path.join(base, n) for n in ("src.bin", "cp.bin", "get.bin"))
    node = NodeProcess(base, name="bench", fsync=args.fsync, sbp="none", kv="none", swarm="none", http="none")
    bound = None
    if args.ceiling:
        import toasty_ceiling

        bound = toasty_ceiling.main(["--size", str(args.size), "--dir", os.path.join(base, "ceiling")])
        shutil.rmtree(os.path.join(base, "ceiling"), ignore_errors=True)
    try:
        make_source(src, size)
        t_cp = min(timed(lambda: subprocess.run(["cp", src, cp_dst], check=True))[0] for _ in range(3))
        os.remove(cp_dst)
        # For context next to --fsync always: the same copy made durable (`sync FILE` fsyncs it).
        t_cps, _ = timed(lambda: (subprocess.run(["cp", src, cp_dst], check=True), subprocess.run(["sync", cp_dst], check=True)))
        os.remove(cp_dst)
        node.start()
        meter = CpuMeter(node.proc.pid)
        mb = size / 1e6
        cp_rate = mb / t_cp
        print("big file: %d MiB, chunk size %d KiB, node --fsync %s, %d in flight; load average %.2f %.2f %.2f"
              % ((args.size, args.chunk_size, args.fsync, args.parallel) + os.getloadavg()))
        print("  cp   %8.1f MB/s  (%.2f s); cp + sync of the copy %.1f MB/s" % (cp_rate, t_cp, mb / t_cps))
        with BlockingToastyClient(*node.address("meta"), timeout=120, parallel=args.parallel) as c:
            # the client loads its multi-buffer SHA-256 on a thread (the node did before its ready
            # file): wait for it, so the first round does not run on hashlib meanwhile
            multi_sha256.wait_loaded(300)
            print("  chunk hashing in the client: %s%s" % (multi_sha256.state, " (%s)" % multi_sha256.why if multi_sha256.why else ""))
            for _ in range(args.rounds):
                with open(src, "rb") as f:
                    t_put, _, put_node, put_client = cpu_timed(meter, lambda: c.write_stream("/big", f, size, truncate=True, chunk_size=args.chunk_size * 1024))

                def get():
                    with open(got, "wb") as out:
                        return c.read_into("/big", out.write)

                t_get, n, get_node, get_client = cpu_timed(meter, get)
                assert n == size
                same = _sha(src) == _sha(got)
                os.remove(got)
                for name, t, node_cpu, client_cpu, target in (("put", t_put, put_node, put_client, 0.5), ("get", t_get, get_node, get_client, 1.0)):
                    rate = mb / t
                    line = "  %s  %8.1f MB/s  (%.2f s)  ratio to cp %.2f (target >= %.1f)  CPU s node %.2f + client %.2f = %.2f per GB" % (
                        name, rate, t, rate / cp_rate, target, node_cpu, client_cpu, (node_cpu + client_cpu) / (mb / 1e3))
                    if bound is not None:
                        line += "\n       of the ceiling: %.2f of its %.0f MB/s, %.2f of its CPU cost (%.2f CPU-s per GB)" % (
                            rate / bound[name], bound[name], bound[name + "_cost"] / ((node_cpu + client_cpu) / (mb / 1e3)), bound[name + "_cost"])
                    if name == "get":
                        line += "  content %s" % ("identical" if same else "DIFFERENT")
                    print(line)

        rate, lat, small_node, small_client = small_files(node, args.files, meter)
        print("small files: %d x 4 KiB creates+writes: %.0f files/s (target 10000)" % (args.files, rate))
        print("  CPU seconds: node %.2f + client %.2f (%.0f + %.0f us per file)" % (small_node, small_client, small_node / args.files * 1e6, small_client / args.files * 1e6))
        print("  one new file alone, client.write (READ, CREATE_CHUNK, WRITE round trips): p50 %.2f ms  p99 %.2f ms" % (pct(lat, 50) * 1e3, pct(lat, 99) * 1e3))
    finally:
        node.kill9()
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
        else:
            for name in ("src.bin", "cp.bin", "get.bin"):
                if os.path.exists(os.path.join(base, name)):
                    os.remove(os.path.join(base, name))


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 * MiB), b""):
            h.update(block)
    return h.digest()


def small_files(node, count, meter):
    meta = BlockingConnection(*node.address("meta"))
    chunks = BlockingConnection(*node.address("chunks"))
    meta.call(codec.Create(b"/small", True))
    loc = [node.address("chunks")]
    payloads = [os.urandom(4096) for _ in range(count)]
    # Interleaved pipelines: a file's WRITE goes out as soon as its CREATE_CHUNK is answered (the
    # chunk is then durable in the store), while later chunks are still being uploaded.
    meter.start()
    t0 = time.perf_counter()
    ok, window = 0, 128
    failed = []

    def check(reply):
        if reply.TYPE != codec.WRITE_SUCCESS and not failed:
            failed.append(reply)
        return reply.TYPE == codec.WRITE_SUCCESS

    def write_for(i, reply):
        assert reply.TYPE == codec.CREATE_CHUNK_SUCCESS, reply
        meta.send(codec.Write(codec.MISSING_GENERATION, codec.CREATE_IF_MISSING, b"/small/f%06d" % i, 0, 4096, [codec.WriteChunk(reply.hash, loc)]))

    sent_writes = 0
    for i, p in enumerate(payloads):
        chunks.send(codec.CreateChunk(4096, 0, p))
        if len(chunks.pending) >= window:
            write_for(sent_writes, chunks.recv())
            sent_writes += 1
            if len(meta.pending) >= window:
                ok += check(meta.recv())
    while chunks.pending:
        write_for(sent_writes, chunks.recv())
        sent_writes += 1
    while meta.pending:
        ok += check(meta.recv())
    elapsed = time.perf_counter() - t0
    node_cpu, client_cpu = meter.stop()
    assert ok == count, "%d of %d writes failed, the first with %r" % (count - ok, count, failed[0])
    meta.close()
    chunks.close()
    lat = []
    with BlockingToastyClient(*node.address("meta")) as c:
        for i in range(300):
            t = time.perf_counter()
            c.write(b"/small/alone%d" % i, payloads[i % count])
            lat.append(time.perf_counter() - t)
    return count / elapsed, lat, node_cpu, client_cpu


if __name__ == "__main__":
    main()
