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
"""

import argparse
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
from storage import Store, record_batch  # noqa: E402

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
    for _ in range(BATCHES // 320):
        yield defer.gatherResults([store.log.append(sid, batch) for _ in range(320)])
    ports = {}
    factories = {}
    for zc in (True, False):
        factory = server.SbpServerFactory(_Node(store, reactor))
        if args.compare == "prefetch":
            factory.prefetch_steps = server.PREFETCH_STEPS if zc else 0
        else:
            factory.zero_copy = zc
        factories[zc] = factory
        ports[zc] = reactor.listenTCP(0, factory, interface="127.0.0.1")
    results = {True: [], False: []}
    pool = {True: [], False: []}
    for _ in range(args.rounds):
        for zc in (True, False):
            if args.evict:
                yield threads.deferToThread(evict, store)
            p0 = factories[zc].metrics.get("fetch_pool_reads", 0)
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            argv = [sys.executable, "-c", CLIENT, str(ports[zc].getHost().port), str(sid), str(args.requests), REPO]
            yield threads.deferToThread(subprocess.run, argv, check=True)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            usr = (r1.ru_utime - r0.ru_utime) / args.requests * 1e6
            sys_ = (r1.ru_stime - r0.ru_stime) / args.requests * 1e6
            results[zc].append((usr + sys_, usr, sys_))
            pool[zc].append(factories[zc].metrics.get("fetch_pool_reads", 0) - p0)
    print("node CPU per 1 MiB FETCH reply (%d rounds of %d; load average %.1f%s):" % (
        args.rounds, args.requests, os.getloadavg()[0], "; pages evicted before each round" if args.evict else ""))
    names = ({True: "zero-copy, prefetch", False: "zero-copy, no prefetch"} if args.compare == "prefetch"
             else {True: "zero-copy (sendfile)", False: "copying (read pool + send)"})
    for zc, v in results.items():
        v.sort()
        mid = v[len(v) // 2]
        print("  %-28s median %4.0f us (user %4.0f, system %4.0f), min %4.0f us; reads from the read pool per round %s" % (
            names[zc], mid[0], mid[1], mid[2], v[0][0], pool[zc]))
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
    ap.add_argument("--compare", choices=("zero-copy", "prefetch"), default="zero-copy")
    ap.add_argument("--evict", action="store_true", help="drop the WAL's pages from the page cache before each round")
    args = ap.parse_args()
    task.react(lambda reactor: run(reactor, args))


if __name__ == "__main__":
    main()
