"""The physical ceiling for Toasty put/get on this machine, next to `cp` (docs/benchmarks.md).

    python bench/toasty_ceiling.py [--size MiB] [--dir DIR]

Measures, each as MB/s of wall time and MB per CPU-second (the CPU figure is what a loaded
machine cannot take away):
- SHA-256 of 64 KiB chunks on one thread and on two (hashlib releases the GIL for big buffers);
  beside it (not part of the ceiling, which stays hashlib's) the multi-buffer SHA-256 the node and
  the client use where it pays (storage/sha256.py), 16 chunks per call, on one thread and on two;
- the store's CRC-32 (storage.crc.crc32: the pack entries' check) and a plain memory copy;
- Python-to-Python loopback TCP: a sender process (sendall of 1 MiB slices) and a receiver
  process (recv_into a preallocated buffer);
- the store's own chunk put (put_many, batches of 16) and get (get_cached and the pool's get), in
  process, 64 KiB chunks;
- writing fresh pages of a file (what the get's output file costs) and `cp` of a --size file.
Then adds up the work a put and a get cannot avoid (put: the client's SHA-256 check, the node's
SHA-256, its CRC, its pack write, one loopback transfer; get: the node's page-cache read and CRC,
one loopback transfer, the client's SHA-256 and its file write) into CPU-seconds per GB, and the
best MB/s that leaves on the machine's cores.
"""

import argparse
import hashlib
import multiprocessing
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage.crc import crc32  # noqa: E402

MiB = 1024 * 1024
CHUNK = 64 * 1024
CRC_LABEL = "CRC-32 (storage.crc, zlib-ng), 64 KiB chunks"


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(label, fn, nbytes, results):
    c0, t0 = cpu(), time.perf_counter()
    fn()
    wall, used = time.perf_counter() - t0, cpu() - c0
    results[label] = (nbytes / wall / 1e6, nbytes / max(used, 1e-9) / 1e6)
    print("  %-52s %7.0f MB/s wall  %7.0f MB per CPU-second" % (label, *results[label]))


def _receiver(port_q, total, out_q):
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    port_q.put(ls.getsockname()[1])
    s, _ = ls.accept()
    buf = bytearray(1 * MiB)
    view = memoryview(buf)
    got = 0
    c0 = cpu()
    while got < total:
        n = s.recv_into(view)
        if not n:
            break
        got += n
    out_q.put(cpu() - c0)
    s.close()


def loopback(data, rounds, results):
    total = len(data) * rounds
    port_q, out_q = multiprocessing.Queue(), multiprocessing.Queue()
    p = multiprocessing.Process(target=_receiver, args=(port_q, total, out_q))
    p.start()
    c = socket.create_connection(("127.0.0.1", port_q.get()))
    view = memoryview(data)
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(rounds):
        for i in range(0, len(data), MiB):
            c.sendall(view[i : i + MiB])
    c.close()
    recv_cpu = out_q.get()
    p.join()
    wall, send_cpu = time.perf_counter() - t0, cpu() - c0
    label = "loopback TCP, sender + receiver process"
    results[label] = (total / wall / 1e6, total / (send_cpu + recv_cpu) / 1e6)
    print("  %-52s %7.0f MB/s wall  %7.0f MB per CPU-second (send %.2f + recv %.2f CPU-s)"
          % (label, results[label][0], results[label][1], send_cpu, recv_cpu))


def store_bench(base, chunks, results):
    from twisted.internet import defer, reactor

    from storage import Store

    nbytes = len(chunks) * CHUNK

    @defer.inlineCallbacks
    def run():
        try:
            s = Store.open(os.path.join(base, "store"), fsync="never", reactor=reactor, node_id=1)
            addrs = []
            c0, t0 = cpu(), time.perf_counter()
            for i in range(0, len(chunks), 64):
                batch = yield defer.gatherResults([s.chunks.put_many(chunks[j : j + 16]) for j in range(i, min(i + 64, len(chunks)), 16)])
                addrs += [a for part in batch for a in part]
            wall, used = time.perf_counter() - t0, cpu() - c0
            results["store put_many (16 x 64 KiB per batch)"] = (nbytes / wall / 1e6, nbytes / used / 1e6)
            c0, t0 = cpu(), time.perf_counter()
            for a in addrs:
                s.chunks.get_cached(a)
            wall, used = time.perf_counter() - t0, cpu() - c0
            results["store get_cached (page cache, CRC checked)"] = (nbytes / wall / 1e6, nbytes / used / 1e6)
            c0, t0 = cpu(), time.perf_counter()
            for i in range(0, len(addrs), 64):
                yield defer.gatherResults([s.chunks.get(a) for a in addrs[i : i + 64]])
            wall, used = time.perf_counter() - t0, cpu() - c0
            results["store get (read pool, 64 in flight)"] = (nbytes / wall / 1e6, nbytes / used / 1e6)
            yield s.close()
        finally:
            reactor.stop()

    reactor.callWhenRunning(run)
    reactor.run()
    for label in ("store put_many (16 x 64 KiB per batch)", "store get_cached (page cache, CRC checked)", "store get (read pool, 64 in flight)"):
        print("  %-52s %7.0f MB/s wall  %7.0f MB per CPU-second" % (label, *results[label]))


MB_LABEL = "multi-buffer sha256 (storage.sha256), 16 x 64 KiB, 1 thread"
MB_LABEL2 = "multi-buffer sha256, 16 x 64 KiB, 2 threads"


def multi_buffer(chunks, rounds, nbytes, results):
    """Beside the ceiling (which stays hashlib's, the issue's yardstick): the rate of the
    multi-buffer SHA-256 the node and the client use where it pays (storage/sha256.py)."""
    from storage import sha256 as multi_sha256

    multi_sha256.start_loading()
    multi_sha256.wait_loaded(300)
    if not multi_sha256.enabled():
        print("  %-52s not used here: %s" % ("multi-buffer sha256 (storage.sha256)", multi_sha256.why))
        return

    def msha(parts):
        for _ in range(rounds):
            for i in range(0, len(parts), 16):
                multi_sha256.digests(parts[i : i + 16])

    measure(MB_LABEL, lambda: msha(chunks), nbytes, results)

    def msha2():
        half = len(chunks) // 2
        ts = [threading.Thread(target=msha, args=(part,)) for part in (chunks[:half], chunks[half:])]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    measure(MB_LABEL2, msha2, nbytes, results)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="MiB per measurement (default 256)")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: under the repo)")
    args = ap.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="toasty-ceiling-", dir=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(base, exist_ok=True)
    size = args.size * MiB
    data = os.urandom(min(size, 64 * MiB))
    rounds = max(1, size // len(data))
    view = memoryview(data)
    chunks = [view[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    nbytes = len(data) * rounds
    results = {}
    print("ceiling measurements, %d MiB each, %d cores, load average %.2f %.2f %.2f" % ((nbytes // MiB, os.cpu_count()) + os.getloadavg()))
    try:
        def sha(parts):
            for _ in range(rounds):
                for c in parts:
                    hashlib.sha256(c).digest()

        measure("sha256, 64 KiB chunks, 1 thread", lambda: sha(chunks), nbytes, results)

        def sha2():
            ts = [threading.Thread(target=sha, args=(chunks[i::2],)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        measure("sha256, 64 KiB chunks, 2 threads", sha2, nbytes, results)
        multi_buffer(chunks, rounds, nbytes, results)
        measure(CRC_LABEL, lambda: [crc32(c) for _ in range(rounds) for c in chunks], nbytes, results)
        scratch = bytearray(CHUNK)

        def copy():
            for _ in range(rounds):
                for c in chunks:
                    scratch[:] = c

        measure("memory copy, 64 KiB chunks", copy, nbytes, results)
        loopback(data, rounds, results)

        path = os.path.join(base, "pages.bin")

        def fresh_pages():
            with open(path, "wb", buffering=0) as f:
                for _ in range(rounds):
                    for c in chunks:
                        f.write(c)

        measure("write() of fresh file pages, 64 KiB", fresh_pages, nbytes, results)
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # a clean source, as the benchmark's
        cp_runs = []
        for _ in range(3):
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(["cp", path, path + ".cp"], check=True)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            used = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
            cp_runs.append((nbytes / wall / 1e6, nbytes / max(used, 1e-9) / 1e6))
            os.remove(path + ".cp")
        cp_rate, cp_per_cpu = max(r[0] for r in cp_runs), max(r[1] for r in cp_runs)
        results["cp"] = (cp_rate, cp_per_cpu)
        print("  %-52s %7.0f MB/s wall  %7.0f MB per CPU-second (best of 3)" % ("cp of the same file (copy_file_range, no fsync)", cp_rate, cp_per_cpu))
        os.remove(path)
        store_bench(base, chunks, results)
    finally:
        shutil.rmtree(base, ignore_errors=True) if not args.dir else None

    def cost(label):  # CPU-seconds per GB
        return 1e3 / results[label][1]

    sha_c, crc_c = cost("sha256, 64 KiB chunks, 1 thread"), cost(CRC_LABEL)
    tcp_c, page_c = cost("loopback TCP, sender + receiver process"), cost("write() of fresh file pages, 64 KiB")
    read_c = cost("store get_cached (page cache, CRC checked)")
    put = 2 * sha_c + crc_c + page_c + tcp_c
    get = read_c + tcp_c + sha_c + page_c
    cores = os.cpu_count()
    cp_per_cpu = results["cp"][1]
    cp_c = 1e3 / cp_per_cpu  # cp is one thread: on a quiet machine it runs at 1 / cp_c GB/s
    print("unavoidable work per GB (CPU-seconds), the best rate it leaves on %d idle cores, and that rate" % cores)
    print("against cp on an idle core (cp: %.2f CPU-s per GB, so %.0f MB/s unloaded):" % (cp_c, 1e3 / cp_c))
    print("  put: 2 x SHA-256 %.2f + CRC %.2f + pack write %.2f + loopback %.2f = %.2f -> <= %.0f MB/s = %.2f x cp"
          % (2 * sha_c, crc_c, page_c, tcp_c, put, cores * 1e3 / put, cores * cp_c / put))
    print("  get: page-cache read + CRC %.2f + loopback %.2f + SHA-256 %.2f + file write %.2f = %.2f -> <= %.0f MB/s = %.2f x cp"
          % (read_c, tcp_c, sha_c, page_c, get, cores * 1e3 / get, cores * cp_c / get))
    print("  SHA-256 alone on all %d cores: put (2 per byte) <= %.2f x cp, get (1 per byte) <= %.2f x cp"
          % (cores, cores * cp_c / (2 * sha_c), cores * cp_c / sha_c))
    if MB_LABEL in results:
        # not the ceiling (that stays hashlib's): the same sums with the multi-buffer SHA-256
        mb_c = cost(MB_LABEL)
        mb_put = 2 * mb_c + crc_c + page_c + tcp_c
        mb_get = read_c + tcp_c + mb_c + page_c
        print("  beside it, with the multi-buffer SHA-256 (%.2f CPU-s per GB instead of %.2f): put %.2f -> <= %.0f MB/s,"
              " get %.2f -> <= %.0f MB/s" % (mb_c, sha_c, mb_put, cores * 1e3 / mb_put, mb_get, cores * 1e3 / mb_get))
    # for bench/toasty_bench.py --ceiling: the bounds, and the CPU-seconds per GB they assume
    return {"put": cores * 1e3 / put, "get": cores * 1e3 / get, "put_cost": put, "get_cost": get,
            "cp": results["cp"][0], "cp_idle": 1e3 / cp_c}

if __name__ == "__main__":
    main()
