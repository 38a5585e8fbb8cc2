"""Replicated appends (issue 17; results in docs/benchmarks.md "Replication"), side by side with Redis
replication on the same machine.

    PYTHONPATH=$PWD python3 bench/replication_bench.py [--batches 1500] [--failovers 10]

Starts, on loopback ports in a temp dir:

- ours: one etcd and three sbpnodes (``--cluster``, ``--fsync always``), one R = 3 stream (ack_count
  2: an acknowledgement means two durable copies);
- Redis: a master and two replicas (Debian redis-server, ``appendonly yes``, ``appendfsync always``
  on all three, ``replicaof`` the master);
- ours as a single node with ``--fsync always`` (no replication: the ceiling).

All three run at once; ``--rounds`` rounds run each side in turn and the medians are compared (the
machine's load moves by the minute).

Each load is one process with pre-encoded requests over a raw socket: 1 KiB records, 64 per
APPEND (for Redis 64 pipelined XADDs), ``--window`` (16) APPENDs in flight. Redis gets, per
pipeline window of 16 x 64 XADDs, a ``WAIT N 0`` (N = 2 by default: both replicas; ``--wait 1``
asks for one, two copies as ours): the window's batches are acknowledged by the WAIT's answer, the
next window is sent after it. Printed: records/s, MiB/s, per-batch latency p50/p99 (send to
acknowledgement), the servers' CPU time per record (user + system of the three nodes, of the three
redis-servers, of the single node: less sensitive to the machine's load than wall-clock rates), the
ratios; then the append latency of ours at a steady ``--rate-mb`` MB/s
(64 KiB batches paced open-loop), then failover: ``--failovers`` kill -9s of the primary under a
steady writer, each the time to the first acknowledged append on the new range (median over the
kills that hit the primary: it is asked of every live node right before each kill).
"""

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

import sbp_bench  # noqa: E402
from sbp_bench import BATCH_RECORDS, RECORD_SIZE, pct, redis_cmd, run_in_process  # noqa: E402

from protocols.sbp import codec  # noqa: E402
from protocols.sbp.client import BlockingSbpClient, SbpError  # noqa: E402
from storage import record_batch  # noqa: E402
from tests.etcdproc import EtcdCluster  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402


# -- servers --------------------------------------------------------------------------------------


class RedisReplicated:
    """A master and ``replicas`` replicas, appendfsync always on each."""

    def __init__(self, base, replicas=2):
        self.base = base
        self.ports = [sbp_bench.free_port() for _ in range(replicas + 1)]
        self.procs = []

    def _start(self, i, extra):
        d = os.path.join(self.base, "redis-%d" % i)
        os.makedirs(d, exist_ok=True)
        p = subprocess.Popen(
            ["redis-server", "--port", str(self.ports[i]), "--bind", "127.0.0.1", "--dir", d, "--appendonly", "yes",
             "--appendfsync", "always", "--save", "", "--daemonize", "no", "--protected-mode", "no",
             "--loglevel", "warning"] + extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.ports[i]), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self):
        self._start(0, [])
        for i in range(1, len(self.ports)):
            self._start(i, ["--replicaof", "127.0.0.1", str(self.ports[0])])
        # wait until the master sees every replica online
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            s = sbp_bench._connect(self.ports[0])
            s.sendall(redis_cmd(b"INFO", b"replication"))
            time.sleep(0.1)
            info = s.recv(1 << 16)
            s.close()
            if info.count(b"state=online") == len(self.ports) - 1:
                return self
            time.sleep(0.2)
        raise RuntimeError("redis replicas did not come online")

    def __exit__(self, *exc):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def start_cluster(base, fsync="always"):
    os.makedirs(base, exist_ok=True)
    etcd = EtcdCluster(base, members=1).start()
    opts = {name: "none" for name in ("kv", "meta", "chunks", "swarm", "http")}
    nodes = [NodeProcess(base, name="r%d" % i, cluster=etcd.client_urls, fsync=fsync, node_id=i, log_level="warn", **opts)
             for i in (1, 2, 3)]
    threads = [threading.Thread(target=n.start, kwargs={"timeout": 60}) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return etcd, nodes


def wait_loaded(port):
    c = BlockingSbpClient("127.0.0.1", port)
    deadline = time.monotonic() + 60
    while c.status().get("append_check") == "loading" and time.monotonic() < deadline:
        time.sleep(0.1)
    c.close()


def open_range(nodes, sid):
    """The stream's open range as the cluster says it now: LIST_RANGES asked of every live node,
    the newest answer kept (a node that just restarted may still show an older range)."""
    best = None
    for n in nodes:
        if n.proc is None or n.proc.poll() is not None:
            continue
        try:
            with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=3) as c:
                r = c.list_ranges(sid)[-1]
        except Exception:
            continue
        if best is None or r["range_index"] > best["range_index"]:
            best = r
    return best


def primary_of(nodes, sid, rng=None):
    """The node sequencing the stream's open range now (None while no live node names one)."""
    r = rng or open_range(nodes, sid)
    if r is None:
        return None
    pid = next((s["server_id"] for s in r["servers"] if s["is_primary"]), None)
    return next((x for x in nodes if x.node_id == pid and x.proc is not None and x.proc.poll() is None), None)


# -- load generators (own process) ------------------------------------------------------------------


def _ok_response_check():
    """A cheap exact test of an APPEND response header for "one entry, status OK": the server
    answers such an APPEND with ``codec.encode_append_response_one`` (a template whose only
    variable bytes are its five scalars), so a header equal to the template outside those bytes
    is a success; any other header is decoded in full. (The load generator shares the 2 cores
    with the servers: a full FlatBuffers decode per response cost it ~50 us per APPEND.)"""
    zero = codec.encode_append_response_one(0, 0, 0, 0, 0)
    ones = codec.encode_append_response_one(-1, -1, -1, -1, -1)
    segments, start = [], 0
    for i in range(len(zero) + 1):
        varies = i < len(zero) and zero[i] != ones[i]
        if varies or i == len(zero):
            if i > start:
                segments.append((start, i, zero[start:i]))
            start = i + 1
    size = len(zero)

    def ok(f):
        if f.flags != 0x03:
            return False
        h = f.header
        if len(h) == size and all(h[a:b] == seg for a, b, seg in segments):
            return True
        return codec.decode_header(f).append_responses[0].status.code == codec.OK

    return ok


def sbp_window_load(port, sid, batches, window, q):
    """Pipelined APPENDs, ``window`` in flight; per-batch latency (acknowledgements come in offset
    order, so in send order)."""
    frames = sbp_bench.sbp_append_frames(sid)
    ok = _ok_response_check()
    s = sbp_bench._connect(port)
    fb = codec.FrameBuffer()
    sent = acked = errors = 0
    sent_at = []
    lat = []
    t0 = time.perf_counter()
    while acked < batches:
        if sent < batches and sent - acked < window:
            n = min(window - (sent - acked), batches - sent)
            now = time.perf_counter()
            s.sendall(b"".join(frames[(sent + j) % len(frames)] for j in range(n)))
            sent_at.extend([now] * n)
            sent += n
        fb.feed(s.recv(1 << 20))
        while (f := fb.next()) is not None:
            lat.append(time.perf_counter() - sent_at[acked])
            acked += 1
            if not ok(f):
                errors += 1
    el = time.perf_counter() - t0
    s.close()
    q.put({"seconds": el, "records": batches * BATCH_RECORDS, "errors": errors, "latencies": lat})


def redis_wait_load(port, batches, window, replicas, q):
    """Per window: ``window`` groups of 64 pipelined XADDs, then ``WAIT replicas 0``; the window's
    groups are acknowledged by the WAIT's answer."""
    groups = [b"".join(redis_cmd(b"XADD", b"s", b"*", b"f", sbp_bench.record_value(k * BATCH_RECORDS + i))
                       for i in range(BATCH_RECORDS)) for k in range(16)]
    wait = redis_cmd(b"WAIT", b"%d" % replicas, b"0")
    s = sbp_bench._connect(port)
    sent = 0
    lat = []
    errors = 0
    short = 0
    t0 = time.perf_counter()
    while sent < batches:
        n = min(window, batches - sent)
        t = time.perf_counter()
        s.sendall(b"".join(groups[(sent + j) % len(groups)] for j in range(n)) + wait)
        need = n * 2 * BATCH_RECORDS + 1  # "$15\r\n<id>\r\n" per XADD, ":N\r\n" for the WAIT
        newlines = 0
        tail = b""
        while newlines < need:
            data = s.recv(1 << 20)
            if data.startswith(b"-") or b"\n-" in data:
                errors += 1
            newlines += data.count(b"\n")
            tail = (tail + data)[-16:]
        # WAIT answers how many replicas hold the writes: at least the number asked for (more when
        # every replica is as quick: ":2" to WAIT 1 with two replicas), fewer only on a timeout
        answered = tail[tail.rfind(b":", 0, len(tail) - 2) + 1:-2] if tail.endswith(b"\r\n") else b""
        if not answered.isdigit() or int(answered) < replicas:
            short += 1
        lat.extend([time.perf_counter() - t] * n)
        sent += n
    el = time.perf_counter() - t0
    s.close()
    q.put({"seconds": el, "records": batches * BATCH_RECORDS, "errors": errors + short, "latencies": lat})


# -- measurements -----------------------------------------------------------------------------------


def cpu_seconds(pids):
    """User + system CPU seconds used so far by the processes ``pids`` (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def measured(run, pids, n):
    """``run(n)`` with the server processes' CPU seconds over it (``r["cpu"]``): CPU time per record
    moves much less with the machine's load than wall-clock throughput does."""
    before = cpu_seconds(pids)
    r = run(n)
    r["cpu"] = cpu_seconds(pids) - before
    return r


def show(name, r):
    rate = r["records"] / r["seconds"]
    lat = [x * 1000 for x in r["latencies"]]
    print("%-44s %9.0f rec/s %7.1f MiB/s  p50 %6.2f ms  p99 %6.2f ms  errors %d  server CPU %.2f us/rec"
          % (name, rate, rate * RECORD_SIZE / 1048576, pct(lat, 50), pct(lat, 99), r["errors"],
             r["cpu"] / r["records"] * 1e6), flush=True)
    return rate, r["cpu"] / r["records"] * 1e6


def settle(redis_ports):
    """Before each side's run: wait until the kernel's write-back of the run before is done and
    no Redis (master or replica) has an AOF rewrite running or scheduled, as ``sbp_bench`` does
    between its phases. Each Redis's AOF grows by ~96 MB a run, so its default auto-rewrite (a
    forked child writing the whole data set) ran on into the next side's run, in the 13:57 closing
    run of 2026-11-27 the single node's (its rate 245k, 429k, 234k rec/s in three rounds, p99 up to
    30 ms): whichever side comes next should not pay for the one before. Prints the wait if any."""
    waited = sbp_bench.settle_writeback()
    waited += sum(sbp_bench.settle_redis_rewrite(port) for port in redis_ports)
    if waited >= 0.05:
        print("    (waited %.2f s for write-back and Redis's AOF rewrites)" % waited, flush=True)


def side_by_side(base, args):
    """All three set-ups up at once; ``--rounds`` rounds, each one run per side in turn (the
    machine's load changes by the minute: alternating keeps the comparison fair); then the paced
    latency run on ours."""
    etcd, nodes = start_cluster(os.path.join(base, "ours"))
    os.makedirs(os.path.join(base, "single"), exist_ok=True)
    try:
        with BlockingSbpClient("127.0.0.1", nodes[0].ports["sbp"]) as c:
            sid = c.create_stream(replica_nums=3)["stream_id"]
        p = primary_of(nodes, sid)
        for n in nodes:
            wait_loaded(n.ports["sbp"])
        with RedisReplicated(os.path.join(base, "redis"), replicas=2) as redis, \
                sbp_bench.Node(os.path.join(base, "single"), "always") as single:
            with BlockingSbpClient("127.0.0.1", single.port) as c:
                single_sid = c.create_stream()["stream_id"]
            # server CPU: the three nodes (etcd is idle in steady state), the three redis-servers, the node
            pids = {"ours": [n.proc.pid for n in nodes], "redis": [x.pid for x in redis.procs], "single": [single.proc.proc.pid]}
            sides = [
                ("sbpnode R=3 ack 2, --fsync always",
                 lambda n: measured(lambda k: run_in_process(sbp_window_load, p.ports["sbp"], sid, k, args.window), pids["ours"], n)),
                ("redis master+2 replicas, always, WAIT %d 0" % args.wait,
                 lambda n: measured(lambda k: run_in_process(redis_wait_load, redis.ports[0], k, args.window, args.wait),
                                    pids["redis"], n)),
                ("sbpnode single node, --fsync always",
                 lambda n: measured(lambda k: run_in_process(sbp_window_load, single.port, single_sid, k, args.window),
                                    pids["single"], n)),
            ]
            for _, run in sides:
                run(200)  # warm-up
            rates = {name: [] for name, _ in sides}
            cpus = {name: [] for name, _ in sides}
            for i in range(args.rounds):
                print("round %d (load average %.1f)" % (i + 1, os.getloadavg()[0]), flush=True)
                for name, run in sides:
                    settle(redis.ports)
                    rate, cpu = show("  " + name, run(args.batches))
                    rates[name].append(rate)
                    cpus[name].append(cpu)
        lat = run_in_process(sbp_bench.sbp_latency_load, p.ports["sbp"], sid, args.rate_mb * 1e6, args.latency_seconds)
        return [statistics.median(rates[name]) for name, _ in sides], [statistics.median(cpus[name]) for name, _ in sides], lat
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


def failovers(base, count):
    """``count`` kill -9s of the stream's primary under a steady writer (one append at a time on
    whichever node LIST_RANGES names, retrying on any error); each the seconds from the kill to
    the first acknowledged append after it. The primary is asked of the cluster right before each
    kill (every live node's LIST_RANGES, the newest range), and a kill counts only if the stream
    then moved to a new range (the killed node was its primary); the others are reported and left
    out of the median. The killed node is restarted and the stream is back at three copies
    (re-replication) before the next kill."""
    etcd, nodes = start_cluster(os.path.join(base, "failover"), fsync="never")
    out = []
    try:
        with BlockingSbpClient("127.0.0.1", nodes[0].ports["sbp"]) as c:
            sid = c.create_stream(replica_nums=3)["stream_id"]
        acked = []
        stop = threading.Event()

        def writer():
            c = None
            while not stop.is_set():
                try:
                    if c is None:
                        p = primary_of(nodes, sid)
                        if p is None:
                            time.sleep(0.02)
                            continue
                        c = BlockingSbpClient("127.0.0.1", p.ports["sbp"], timeout=5)
                    c.append(sid, record_batch.encode([(1, [], b"x" * 100)]))
                    acked.append(time.monotonic())
                except (SbpError, OSError, Exception):
                    if c is not None:
                        try:
                            c.close()
                        except Exception:
                            pass
                    c = None
                    time.sleep(0.01)

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        kills = 0
        while len(out) < count and kills < 2 * count:
            # steady state: three copies, appends flowing, every live node naming the same range
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                r = open_range(nodes, sid)
                if r is not None and len(r["servers"]) == 3 and acked and time.monotonic() - acked[-1] < 0.2:
                    break
                time.sleep(0.1)
            r = open_range(nodes, sid)  # right before the kill
            p = primary_of(nodes, sid, r)
            if p is None:
                continue
            killed = time.monotonic()
            p.kill9()
            dead = time.monotonic()  # (an answer read between the signal and the exit is not one of the new range's)
            kills += 1
            while not any(x > dead for x in acked[-5:]):
                time.sleep(0.01)
            took = next(x for x in acked if x > dead) - killed
            after = open_range(nodes, sid)
            if after is not None and after["range_index"] > r["range_index"]:
                out.append(took)
                print("  failover %d: kill -9 of node %d (primary of range %d) to the first acknowledged append on range %d: "
                      "%.2f s" % (len(out), p.node_id, r["range_index"], after["range_index"], took), flush=True)
            else:
                print("  kill -9 of node %d: the stream stayed on range %d (it was not the primary by then): %.2f s, "
                      "not counted" % (p.node_id, r["range_index"], took), flush=True)
            p.start(timeout=60)
        stop.set()
        t.join(10)
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=1500, help="APPENDs of 64 x 1 KiB per run")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="runs per side, alternating; medians compared")
    ap.add_argument("--wait", type=int, default=2, help="Redis: WAIT N 0 per window (2: both replicas)")
    ap.add_argument("--rate-mb", type=float, default=20.0)
    ap.add_argument("--latency-seconds", type=float, default=10.0)
    ap.add_argument("--failovers", type=int, default=10)
    ap.add_argument("--no-speed", action="store_true", help="only the failovers")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="sbp-repl-bench-")
    try:
        print("load average: %.2f %.2f %.2f, %d CPUs" % (os.getloadavg() + (os.cpu_count(),)), flush=True)
        print("1 KiB records, 64 per APPEND, %d in flight, %d APPENDs per run" % (args.window, args.batches))
        if args.no_speed:
            times = failovers(base, args.failovers)
            print("failover over %d kill -9s of the primary: median %.2f s, min %.2f s, max %.2f s (target median < 5 s)"
                  % (len(times), statistics.median(times), min(times), max(times)))
            return
        (r_ours, r_redis, r_single), (c_ours, c_redis, c_single), lat = side_by_side(base, args)
        print("medians over %d rounds: replicated %.0f rec/s, redis+WAIT %.0f rec/s, single node %.0f rec/s"
              % (args.rounds, r_ours, r_redis, r_single))
        print("server CPU per record (medians): replicated %.2f us (3 nodes), redis+WAIT %.2f us (3 servers), single node "
              "%.2f us; replicated / single %.2fx" % (c_ours, c_redis, c_single, c_ours / c_single))
        print("ratio replicated / redis+WAIT: %.2fx (target >= 2x)" % (r_ours / r_redis))
        print("ratio replicated / single node: %.2fx (target >= 0.5x)" % (r_ours / r_single))
        ms = [x * 1000 for x in lat["latencies"]]
        print("sbpnode R=3 at %.0f MB/s paced (64 KiB batches): p50 %.2f ms p99 %.2f ms p99.9 %.2f ms, %d of %d answered "
              "(target p99 < 10 ms)" % (args.rate_mb, pct(ms, 50), pct(ms, 99), pct(ms, 99.9), len(ms), lat["sent"]), flush=True)
        if args.failovers:
            times = failovers(base, args.failovers)
            if times:
                print("failover over %d kill -9s of the primary: median %.2f s, min %.2f s, max %.2f s (target median < 5 s)"
                      % (len(times), statistics.median(times), min(times), max(times)))
        print("load average: %.2f %.2f %.2f" % os.getloadavg())
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
