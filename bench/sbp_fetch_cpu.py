"""The node's CPU per FETCH reply, zero-copy path vs copying path, in one process (issue 4).

    python bench/sbp_fetch_cpu.py [--rounds 5] [--requests 400] [--compare prefetch] [--evict]

Wall-clock read rates swing 2x on the shared 2-core machine; CPU per reply does much less. This
opens one store (1 KiB records, 64 per batch, ~200 MiB), serves it with two SBP factories in this
process, one with ``zero_copy`` (replies sent from the WAL files with sendfile) and one without
(the read pool reads and checks the batches, Twisted sends the bytes), and in alternating rounds
lets a client process read ``--requests`` sequential 1 MiB FETCHes from each. It prints this
process's CPU (user + system, from getrusage) per reply: the reactor, the read pool and the
kernel's send path, not the client.

``--compare prefetch`` serves both from the zero-copy path instead, one with the sequential
reader's prefetch (``SbpServerFactory.prefetch_steps``) and one without it (issue 24).
``--evict`` drops the WAL's pages from the page cache before every round (written back first,
then ``posix_fadvise(DONTNEED)``), as memory reclaim does to data written a while ago.

``--window N`` (issue 24) reads with ``bench/sbp_bench.py``'s pipelined reader instead (N FETCHes
of 1 MiB in flight, every reply checked as in that bench: frame CRC over every byte, every batch
header, contiguous offsets), the whole stream once per round (``--mib`` of it), and also prints
the reader's own CPU per reply, and the node's CPU over the reader's (the machine's speed cancels).
``--compare none`` serves one factory only (an A/B of two checkouts runs this once in each).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from twisted.internet import defer, task, threads  # noqa: E402

from protocols.sbp import server  # noqa: E402
from storage import Store, block_check, record_batch  # noqa: E402

BATCHES = 16 * 200

CLIENT = r'''
import socket, sys
sys.path.insert(0, sys.argv[4])
from protocols.sbp import codec
from protocols.sbp.codec import T
port, sid, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(17 << 20)
view = memoryview(buf)
offset = 0
for i in range(n):
    header = codec.encode_table("FetchRequest", T.FetchRequest(0, 1, [T.FetchInfo(sid, 0, offset, 1 << 20)]))
    s.sendall(codec.encode_frame(codec.FETCH, 0, i + 1, header))
    got = 0
    while got < 4 or got < 4 + int.from_bytes(buf[:4], "big"):
        k = s.recv_into(view[got:])
        if not k:
            raise ConnectionError("closed")
        got += k
    offset = (offset + 1024) % (64 * BATCHES - 1024)
'''.replace("BATCHES", str(BATCHES))

PIPE_CLIENT = r'''
import json, sys
sys.path.insert(0, sys.argv[4])
sys.path.insert(0, sys.argv[4] + "/bench")
import sbp_bench

class Q:
    def put(self, r):
        print(json.dumps({"client_cpu": r["client_cpu"], "seconds": r["seconds"], "records": r["records"],
                          "requests": r["requests"], "reordered": r["reordered"]}))

sbp_bench.sbp_pipe_read_load(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5]), Q())
'''


class _Node:
    def __init__(self, store, reactor):
        self.store = store
        self.reactor = reactor
        self.config = type("Config", (), {"max_batch_bytes": 16 << 20})()
        self.node_id = 1
        self.metrics = {}

    def advertised(self, name):
        return ""


@defer.inlineCallbacks
def run(reactor, args):
    store = Store.open(tempfile.mkdtemp(prefix="sbp-fetch-cpu-"), fsync="never", reactor=reactor, retention_check_s=0)
    sid = (yield store.log.create_stream()).stream_id
    batch = record_batch.encode([(1, [], b"x" * 1024) for _ in range(64)])
    batches = args.mib * 16 if args.window else BATCHES
    for _ in range(batches // 320):
        yield defer.gatherResults([store.log.append(sid, batch) for _ in range(320)])
    ports = {}
    factories = {}
    sides = (True,) if args.compare == "none" else (True, False)
    for zc in sides:
        factory = server.SbpServerFactory(_Node(store, reactor))
        if args.compare == "prefetch":
            factory.prefetch_steps = server.PREFETCH_STEPS if zc else 0
        else:
            factory.zero_copy = zc
        factories[zc] = factory
        ports[zc] = reactor.listenTCP(0, factory, interface="127.0.0.1")
    # the factories load the compiled APPEND check on a thread (seconds of CPU): not in a round
    yield block_check.start_loading(reactor)
    results = {zc: [] for zc in sides}
    pool = {zc: [] for zc in sides}
    clients = {zc: [] for zc in sides}
    for _ in range(args.rounds):
        for zc in sides:
            if args.evict:
                yield threads.deferToThread(evict, store)
            p0 = factories[zc].metrics.get("fetch_pool_reads", 0)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            port = str(ports[zc].getHost().port)
            if args.window:
                argv = [sys.executable, "-c", PIPE_CLIENT, port, str(sid), str(batches * 64), REPO, str(args.window)]
                out = yield threads.deferToThread(subprocess.run, argv, check=True, capture_output=True)
                res = json.loads(out.stdout)
                n = res["requests"]
            else:
                argv = [sys.executable, "-c", CLIENT, port, str(sid), str(args.requests), REPO]
                yield threads.deferToThread(subprocess.run, argv, check=True)
                n = args.requests
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            usr = (r1.ru_utime - r0.ru_utime) / n * 1e6
            sys_ = (r1.ru_stime - r0.ru_stime) / n * 1e6
            results[zc].append((usr + sys_, usr, sys_))
            if args.window:
                clients[zc].append((res["client_cpu"] / n * 1e6, n / res["seconds"], res["reordered"]))
            pool[zc].append(factories[zc].metrics.get("fetch_pool_reads", 0) - p0)
    print("node CPU per 1 MiB FETCH reply (%d rounds of %d; load average %.1f%s):" % (
        args.rounds, args.requests, os.getloadavg()[0], "; pages evicted before each round" if args.evict else ""))
    names = ({True: "zero-copy, prefetch", False: "zero-copy, no prefetch"} if args.compare == "prefetch"
             else {True: "zero-copy (sendfile)", False: "copying (read pool + send)"})
    for zc, v in results.items():
        if args.window:
            print("  %-28s per round: node %s us, reader %s us, node/reader %s, replies/s %s, overtaken %s" % (
                names[zc], [round(x[0]) for x in v], [round(c[0]) for c in clients[zc]],
                ["%.3f" % (x[0] / c[0]) for x, c in zip(v, clients[zc])],
                [round(c[1]) for c in clients[zc]], [c[2] for c in clients[zc]]))
            ratios = sorted(x[0] / c[0] for x, c in zip(v, clients[zc]))
            cl = sorted(c[0] for c in clients[zc])
        v = sorted(v)
        mid = v[len(v) // 2]
        print("  %-28s median %4.0f us (user %4.0f, system %4.0f), min %4.0f us; reads from the read pool per round %s" % (
            names[zc], mid[0], mid[1], mid[2], v[0][0], pool[zc]))
        if args.window:
            print("  %-28s reader median %4.0f us per reply; node/reader median %.3f" % ("", cl[len(cl) // 2], ratios[len(ratios) // 2]))
    for p in ports.values():
        yield p.stopListening()
    yield store.close()


def evict(store):
    """Write back and drop the WAL segments' pages from the page cache."""
    wal = store.wal
    for fd in list(wal.fds.values()):
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--compare", choices=("zero-copy", "prefetch", "none"), default="zero-copy")
    ap.add_argument("--window", type=int, default=0, help="pipelined reader with this many FETCHes in flight (0: one at a time)")
    ap.add_argument("--mib", type=int, default=200, help="with --window: the stream's size (read whole once per round)")
    ap.add_argument("--evict", action="store_true", help="drop the WAL's pages from the page cache before each round")
    args = ap.parse_args()
    task.react(lambda reactor: run(reactor, args))


if __name__ == "__main__":
    main()
