"""CPU per key-value request inside one process: the Primary_Partition server over a real store
(writer thread, the chosen fsync policy), driven through an in-memory transport, so the figure is
the node's own work per SET and GET (parse, store, group commit, merges into LMDB, replies, thread
hand-offs) without the sockets and without the load generator: far less sensitive to a loaded
machine than wall-clock throughput.

    python bench/kv_cpu.py [--keys 300000] [--depth 64] [--chunk 16] [--fsync interval:1000]

SET every key (scrambled 8-byte keys, 100-byte values), then GET every key, keeping ``--depth``
requests in flight, fed in reads of ``--chunk`` requests as replies come back (as
``bench/kv_bench.py``'s generator does); every memtable write is merged into LMDB before the SET
figure is taken. Prints process CPU per request and the reactor / writer threads' shares.
"""

import argparse
import os
import resource
import shutil
import struct
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from twisted.internet import defer, reactor  # noqa: E402
from twisted.internet.testing import StringTransport  # noqa: E402

from protocols.partition import codec, gets_compiled, sets_compiled  # noqa: E402
from protocols.partition.server import KvServerFactory  # noqa: E402
from storage import Store  # noqa: E402

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/stat" % tid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def process_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker_cpu(store):
    """(pid, CPU seconds) of the store's kv merge worker process (storage/kv_merge.py), if any:
    its CPU is the store's, counted with the process's."""
    pid = getattr(store.kv, "merge_worker_pid", lambda: None)()
    if pid is None:
        return None, 0.0
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None, 0.0
    return pid, (int(fields[11]) + int(fields[12])) / _TICK


class Transport(StringTransport):
    """Counts reply bytes instead of keeping them."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0
        self.on_write = None

    def write(self, data):
        self.nbytes += len(data)
        if self.on_write is not None:
            self.on_write()


def drive(proto, tr, requests, reply_len, depth, chunk):
    """Feed ``requests`` keeping ``depth`` in flight, ``chunk`` per read; fires when every reply is
    written."""
    done = defer.Deferred()
    n = len(requests)
    state = {"sent": 0}
    base = tr.nbytes

    def pump():
        answered = (tr.nbytes - base) // reply_len
        if answered >= n:
            if not done.called:
                tr.on_write = None
                done.callback(None)
            return
        while state["sent"] < n and state["sent"] - answered < depth:
            end = min(state["sent"] + chunk, n)
            data = b"".join(requests[state["sent"] : end])
            state["sent"] = end
            # a read arrives on a later reactor pass, as from a socket
            reactor.callLater(0, proto.dataReceived, data)

    tr.on_write = pump
    pump()
    return done


@defer.inlineCallbacks
def run(args):
    tmp = tempfile.mkdtemp(prefix="kv-cpu-")
    store = Store.open(tmp, fsync=args.fsync, reactor=reactor, node_id=1, retention_check_s=0)
    if args.kv_cache_mb is not None:
        store.kv.row_cache_bytes = args.kv_cache_mb << 20  # as the node's --kv-cache-mb
    try:
        factory = KvServerFactory(store.kv, store=store)
        proto = factory.buildProtocol(None)
        tr = Transport()
        proto.makeConnection(tr)
        pack = struct.Struct(">Q").pack
        keys = [pack((i * GOLDEN) & MASK) for i in range(args.keys)]
        value = os.urandom(args.value_size)
        reactor_tid = threading.get_ident() and threading.get_native_id()
        for phase in ("set", "get"):
            if phase == "set":
                reqs = [codec.encode_set(i, k, value) for i, k in enumerate(keys)]
                reply_len = codec.HEADER_LEN
            else:
                reqs = [codec.encode_get(i, k) for i, k in enumerate(keys)]
                reply_len = codec.HEADER_LEN + 6 + len(keys[0]) + args.value_size
            t0, c0, th0, (wpid0, w0) = time.perf_counter(), process_cpu(), thread_cpu(), worker_cpu(store)
            yield drive(proto, tr, reqs, reply_len, args.depth, args.chunk)
            if phase == "set":
                yield store.kv.flush()  # every write merged into LMDB: its cost is the SET's
                while store.kv.memtable_keys():
                    yield store.kv.flush()
            t1, c1, th1, (wpid1, w1) = time.perf_counter(), process_cpu(), thread_cpu(), worker_cpu(store)
            n = len(keys)
            worker = (w1 - (w0 if wpid0 == wpid1 else 0.0)) * 1e6 / n  # (a worker started in the phase: all of it)
            c1 += worker * n / 1e6
            per = {tid: (th1.get(tid, 0) - th0.get(tid, 0)) * 1e6 / n for tid in th1}
            react = per.pop(reactor_tid, 0.0)
            others = sorted(per.values(), reverse=True)
            print("%s: %d requests, %.0f/s wall, process CPU %.2f us/request (reactor %.2f, busiest other thread %.2f, "
                  "merge worker process %.2f, counted in the process's)"
                  % (phase.upper(), n, n / (t1 - t0), (c1 - c0) * 1e6 / n, react, others[0] if others else 0.0, worker),
                  flush=True)
            del reqs
        cache = getattr(store.kv, "row_cache", None)
        if cache is not None:
            print("row cache: %s" % cache.stats())
    finally:
        yield store.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=300_000)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--fsync", default="interval:1000")
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="the row cache's size, as the node's --kv-cache-mb")
    ap.add_argument("--python-gets", action="store_true",
                    help="without the compiled GET passes a node loads (protocols/partition/gets_compiled.py)")
    ap.add_argument("--python-sets", action="store_true",
                    help="without the compiled SET pass a node loads (protocols/partition/sets_compiled.py)")
    args = ap.parse_args(argv)
    if not args.python_gets:
        gets_compiled.start_loading()
        gets_compiled.wait()
    if not args.python_sets:
        sets_compiled.start_loading()
        sets_compiled.wait()
    print("kv_cpu: %d keys, %d-byte values, depth %d, reads of %d, fsync %s, GETs %s, SETs %s, load average %.2f %.2f %.2f"
          % ((args.keys, args.value_size, args.depth, args.chunk, args.fsync,
              "python" if args.python_gets else gets_compiled.state,
              "python" if args.python_sets else sets_compiled.state) + os.getloadavg()))
    failure = []

    def go():
        d = run(args)
        d.addErrback(failure.append)
        d.addBoth(lambda _: reactor.stop())

    reactor.callWhenRunning(go)
    reactor.run()
    if failure:
        failure[0].printTraceback()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
