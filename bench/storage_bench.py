"""Storage benchmark (not a test): group-commit appends vs a plain write+fdatasync loop, sequential
read, reopen time, chunk puts, and KV puts/gets. Prints throughput and latency percentiles.

    python bench/storage_bench.py [--dir DIR] [--seconds 5] [--read-gib 1] [--kv 1000000]

The data dir defaults to a temp dir next to the repository (the same disk the node uses).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import defer, reactor, task  # noqa: E402

from storage import Store  # noqa: E402
from storage import record_batch as rb  # noqa: E402

KIB = 1024
MIB = 1024 * KIB


def pct(values, p):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(len(values) * p / 100.0))]


def make_batch(size):
    """A valid record batch of about ``size`` bytes (one record)."""
    probe = rb.encode([(1000, [], b"")])
    return rb.encode([(1000, [], os.urandom(size - len(probe) - 4))])


def plain_loop(path, seconds, size=64 * KIB):
    """The peer: a plain Python loop of 64 KiB os.write + os.fdatasync on the same disk."""
    buf = os.urandom(size)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    n, lat = 0, []
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            os.write(fd, buf)
            os.fdatasync(fd)
            lat.append(time.perf_counter() - t)
            n += 1
    finally:
        os.close(fd)
        os.unlink(path)
    elapsed = time.perf_counter() - start
    return n * size / elapsed, lat


@defer.inlineCallbacks
def group_commit(path, seconds, writers=8, size=64 * KIB):
    store = Store.open(path, fsync="always", reactor=reactor, node_id=1, retention_check_s=0)
    sids = []
    for _ in range(writers):
        sids.append((yield store.log.create_stream()).stream_id)
    batch = make_batch(size)
    lat = []
    count = [0]
    start = time.perf_counter()
    stop_at = start + seconds

    @defer.inlineCallbacks
    def writer(sid):
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            yield store.log.append(sid, batch)
            lat.append(time.perf_counter() - t)
            count[0] += 1

    yield defer.gatherResults([writer(s) for s in sids])
    elapsed = time.perf_counter() - start
    yield store.close()
    return count[0] * len(batch) / elapsed, lat


@defer.inlineCallbacks
def sequential_read(path, gib, batch_size=64 * KIB):
    store = Store.open(path, fsync="never", reactor=reactor, node_id=1, retention_check_s=0)
    sid = (yield store.log.create_stream()).stream_id
    batch = make_batch(batch_size)
    total = int(gib * 1024 * MIB)
    n = total // len(batch)
    t = time.perf_counter()
    window = []
    for i in range(n):
        window.append(store.log.append(sid, batch))
        if len(window) >= 256:
            yield defer.gatherResults(window)
            window = []
    yield defer.gatherResults(window)
    yield store.sync()
    write_s = time.perf_counter() - t
    end = store.log.stream(sid).next_offset
    yield store.close()

    t = time.perf_counter()
    store = Store.open(path, fsync="never", reactor=reactor, node_id=1, retention_check_s=0)
    reopen_s = time.perf_counter() - t

    yield store.close()
    # worst case: the index is lost and the whole WAL is replayed (normally only the tail is)
    shutil.rmtree(os.path.join(path, "index"))
    t = time.perf_counter()
    store = Store.open(path, fsync="never", reactor=reactor, node_id=1, retention_check_s=0)
    rebuild_s = time.perf_counter() - t

    best = 0.0
    for _ in range(2):  # the second pass is from page cache for sure
        offset, got = 0, 0
        t = time.perf_counter()
        while offset < end:
            batches = yield store.log.read(sid, offset, 8 * MIB)
            for b in batches:
                got += len(b)
            offset = rb.read_header(batches[-1]).next_offset
        best = max(best, got / (time.perf_counter() - t))
    yield store.close()
    return n * len(batch) / write_s, reopen_s, rebuild_s, best, got


@defer.inlineCallbacks
def chunk_puts(path, count=20000, size=4 * KIB):
    store = Store.open(path, fsync="always", reactor=reactor, node_id=1, retention_check_s=0)
    datas = [os.urandom(size) for _ in range(count)]
    t = time.perf_counter()
    window = []
    for d in datas:
        window.append(store.chunks.put(d))
        if len(window) >= 256:
            yield defer.gatherResults(window)
            window = []
    yield defer.gatherResults(window)
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    addrs = [store.chunks.by_seq(1, count, count)]
    ds = []
    for _, a in addrs[0][:5000]:
        ds.append(store.chunks.get(a))
    yield defer.gatherResults(ds)
    get_s = time.perf_counter() - t
    npacks = len(os.listdir(os.path.join(path, "chunks")))
    yield store.close()
    return count / put_s, 5000 / get_s, npacks


@defer.inlineCallbacks
def kv(path, count, fsync, window=2000):
    store = Store.open(path, fsync=fsync, reactor=reactor, node_id=1, retention_check_s=0)
    value = os.urandom(100)
    keys = [b"user:%012d" % ((i * 2654435761) % (1 << 40)) for i in range(count)]
    t = time.perf_counter()
    pending = []
    for k in keys:
        pending.append(store.kv.put(k, value))
        if len(pending) >= window:
            yield defer.gatherResults(pending)
            pending = []
            yield task.deferLater(reactor, 0, lambda: None)
    yield defer.gatherResults(pending)
    put_s = time.perf_counter() - t
    get = store.kv.get
    t = time.perf_counter()
    for k in keys:
        get(k)
    get_s = time.perf_counter() - t
    yield store.close()
    return count / put_s, count / get_s


@defer.inlineCallbacks
def main(args):
    base = args.dir or tempfile.mkdtemp(prefix="storage-bench-")
    os.makedirs(base, exist_ok=True)
    try:
        print("data dir: %s (same disk for every case)" % base)
        plain_bps, plain_lat = plain_loop(os.path.join(base, "plain.dat"), args.seconds)
        gc_bps, gc_lat = yield group_commit(os.path.join(base, "gc"), args.seconds)
        print("append 64 KiB, fsync always:")
        print("  plain write+fdatasync loop : %8.1f MB/s  p50 %.2f ms  p99 %.2f ms"
              % (plain_bps / 1e6, pct(plain_lat, 50) * 1e3, pct(plain_lat, 99) * 1e3))
        print("  store, 8 writers           : %8.1f MB/s  p50 %.2f ms  p99 %.2f ms  (%d appends)"
              % (gc_bps / 1e6, pct(gc_lat, 50) * 1e3, pct(gc_lat, 99) * 1e3, len(gc_lat)))
        print("  ratio store/plain          : %8.2f  (target >= 0.6)" % (gc_bps / plain_bps))
        shutil.rmtree(os.path.join(base, "gc"), ignore_errors=True)

        if args.read_gib > 0:
            w_bps, reopen_s, rebuild_s, r_bps, got = yield sequential_read(os.path.join(base, "read"), args.read_gib)
            print("sequential read of %.2f GiB (64 KiB batches, 8 MiB reads):" % (got / 1024 ** 3))
            print("  write (fsync never)        : %8.1f MB/s" % (w_bps / 1e6))
            print("  reopen                     : %8.3f s  (target < 2 s)" % reopen_s)
            print("  reopen, index rebuilt from the whole WAL: %.3f s" % rebuild_s)
            print("  read from page cache       : %8.2f GB/s  (target >= 1)" % (r_bps / 1e9))
            shutil.rmtree(os.path.join(base, "read"), ignore_errors=True)

        if args.chunks > 0:
            put_ops, get_ops, npacks = yield chunk_puts(os.path.join(base, "chunks"), args.chunks)
            print("chunks (4 KiB, fsync always, 256 in flight): put %.0f/s  get %.0f/s  in %d pack files"
                  % (put_ops, get_ops, npacks))
            shutil.rmtree(os.path.join(base, "chunks"), ignore_errors=True)

        if args.kv > 0:
            for fsync in args.kv_fsync.split(","):
                put_ops, get_ops = yield kv(os.path.join(base, "kv-" + fsync), args.kv, fsync)
                print("kv %d puts + %d gets, 100-byte values, fsync %s, 2000 puts in flight:" % (args.kv, args.kv, fsync))
                print("  put %10.0f ops/s   get %10.0f ops/s" % (put_ops, get_ops))
                shutil.rmtree(os.path.join(base, "kv-" + fsync), ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


def run():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--read-gib", type=float, default=1.0)
    p.add_argument("--chunks", type=int, default=20000)
    p.add_argument("--kv", type=int, default=1000000)
    p.add_argument("--kv-fsync", default="always,never")
    args = p.parse_args()
    failed = []

    def go():
        d = main(args)
        d.addErrback(lambda f: (f.printTraceback(), failed.append(f)))
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(go)
    reactor.run()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    run()
