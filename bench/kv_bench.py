"""Key-value benchmark: sbpnode's Primary_Partition protocol side by side with Redis, in one run.

    python bench/kv_bench.py [--keys 1000000] [--depth 64] [--value-size 100] [--fsync never]

Starts a node (only the kv listener, on a free loopback port) and Debian's redis-server (on a free
loopback port, no persistence unless --durable), then for each side with one pre-encoded,
pipelined load generator on one connection (``--depth`` requests in flight):

  SET   every key once (100-byte values)       ops/s and latency percentiles
  GET   every key once                          ops/s and latency percentiles
  SCAN  a full scan: GET_FF pages of 1024 vs Redis SCAN COUNT 1024 + MGET; keys/s
  MEM   the server's resident size (VmRSS, and its anonymous and file-backed parts) with every key
        loaded (measured after GET)
  SETGET  ``SET k; GET k`` pairs pipelined on one connection (``--pairs`` new keys; issue 19's
        stall): pairs/s and latency percentiles per pair, both servers up, in ``--setget-rounds``
        rounds that alternate the two sides (node first in the even rounds, Redis in the odd)

and prints both sides and the ratios (sbpnode / Redis). The SETGET phase alternates because this
machine's fsync and wake-up times drift over minutes (0.11 to 0.27 ms per fdatasync within an
hour; Redis's own SETGET rate 51k to 109k pairs/s in rounds seconds apart): run one side's phase
after the other's and the ratio measures the drift as much as the servers. Each side's figure is
its pairs over its summed time in the rounds; the rounds' own ratios are printed too, and each
server's CPU during the other's rounds (``--setget-rounds 1``: one round each, back to back).
Between phases it waits for the server's background work to end (``settle``: the node's memtable
merge of the SETs, which starts once no write landed for 1-2 s, and Redis's AOF work; the same
wait on both sides, printed), so one phase's background work is not measured as part of the
next; the CPU of the wait after SET counts as SET's.
``--no-settle`` starts each phase at once, as the runs before 2026-11-27 21:40 UTC did.
``--durable`` runs the node with ``--fsync always`` and Redis with ``appendonly yes, appendfsync
always``; ``--redis-fsync everysec`` with ``--fsync interval:1000`` is the "interval vs everysec"
comparison. ``--metrics off`` starts the node without its metrics (with ``--only kv``: the A/B of
their cost).

Keys are 8 bytes, a bijective scramble of the index, so they spread over all 8 partitions.
"""

import argparse
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protocols.partition import codec  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # odd, so i -> i * GOLDEN mod 2**64 is a bijection


def make_keys(n):
    pack = struct.Struct(">Q").pack
    return [pack((i * GOLDEN) & MASK) for i in range(n)]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def child_pids(pid):
    """The live child processes of ``pid`` (the node's kv merge worker, storage/kv_merge.py)."""
    out = []
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/children" % (pid, tid)) as f:
                    out += [int(c) for c in f.read().split()]
            except OSError:
                continue
    except OSError:
        pass
    return out


def family_cpu(pid):
    """{pid: CPU seconds so far} of ``pid`` and of its live descendants: the node's CPU includes
    its merge worker's (a worker that exits within a phase takes its CPU with it: after a failure
    only, which the node logs)."""
    out = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            out[p] = cpu_seconds(p)
        except OSError:
            continue
        todo += child_pids(p)
    return out


def own_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine_cpu():
    """(busy, total) jiffies of the whole machine so far (/proc/stat's cpu line): over a phase,
    busy / total is how much of the 2 cores anything (the node, the generator, the others) used."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def thread_switches(pid):
    """{thread: (voluntary, involuntary) context switches so far} of ``pid``'s threads (each
    voluntary one is a sleep: a wait for work, for the GIL, for a lock)."""
    out = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, tid)) as f:
                text = f.read()
        except OSError:
            continue
        v = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
        i = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", text, re.M).group(1))
        out["reactor" if int(tid) == pid else "thread " + tid] = (v, i)
    return out


def thread_cpu(pid):
    """{thread: CPU seconds so far} of process ``pid``'s threads ("reactor" for the main thread,
    the others by thread id: Python's thread names are not the OS's)."""
    out = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out["reactor" if int(tid) == pid else "thread " + tid] = (int(fields[11]) + int(fields[12])) / _TICK
    for child, seconds in family_cpu(pid).items():
        if child != pid:
            out["merge worker %d" % child] = seconds
    return out


class Profiler:
    """``--py-spy DIR``: py-spy records the node over one phase (raw collapsed stacks, one file per
    phase, ``DIR/<phase>.txt``, summarised by ``bench/pyspy_top.py``), and the phase's CPU per
    operation is printed per thread (reactor ``python3``/``twistd``, ``storage-writer``, ...)."""

    extra = []  # ``--py-spy-gil``: ["--gil"] (only samples holding the GIL: the Python work)

    def __init__(self, outdir, pid, phase):
        self.pid = pid
        self.phase = phase
        self.proc = None
        # what the measured spans added up to (``pause``/``resume``: the SETGET rounds are this
        # node's spans, with Redis's rounds between them)
        self.threads = {}
        self.switches = {}
        self.machine = [0, 0]
        self.running = False
        self.resume()
        if outdir:
            os.makedirs(outdir, exist_ok=True)
            self.proc = subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--threads", "--subprocesses", *self.extra,
                 "--output", os.path.join(outdir, phase + ".txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches before the load starts

    def resume(self):
        """Measure from now (until ``pause`` or ``stop``)."""
        self.threads0 = thread_cpu(self.pid)
        self.switches0 = thread_switches(self.pid)
        self.machine0 = machine_cpu()
        self.running = True

    def pause(self):
        """Add what was measured since ``resume`` to the phase's sums."""
        if not self.running:
            return
        self.running = False
        for k, v in thread_cpu(self.pid).items():
            self.threads[k] = self.threads.get(k, 0.0) + v - self.threads0.get(k, 0.0)
        for k, (v, i) in thread_switches(self.pid).items():
            v0, i0 = self.switches0.get(k, (0, 0))
            a, b = self.switches.get(k, (0, 0))
            self.switches[k] = (a + v - v0, b + i - i0)
        for j, (a, b) in enumerate(zip(self.machine0, machine_cpu())):
            self.machine[j] += b - a

    def stop(self, n):
        self.pause()
        busy, total = self.machine
        if self.proc is not None:
            self.proc.send_signal(2)
            self.proc.wait(60)
        per = sorted((v * 1e6 / n, k) for k, v in self.threads.items())
        print("  %s per thread: %s" % (self.phase, ", ".join("%s %.2f us/op" % (k, v) for v, k in reversed(per) if v >= 0.01)))
        sw = sorted(((a[0], a[1], k) for k, a in self.switches.items()), reverse=True)
        print("  %s machine busy %.0f%% of its %d cores; context switches per 1000 ops (voluntary/involuntary): %s"
              % (self.phase, 100.0 * busy / max(1, total), os.cpu_count(),
                 ", ".join("%s %.0f/%.0f" % (k, v * 1e3 / n, i * 1e3 / n) for v, i, k in sw[:4])))


class CpuMeter:
    """CPU seconds spent by the server process and by this load generator over one phase: on a
    shared machine these say more than wall-clock time (another process's load shows up as less
    throughput, not as more CPU per operation)."""

    def __init__(self, pid):
        self.pid = pid
        self.server0 = family_cpu(pid)  # the node's child processes (its merge worker) count as the node
        self.client0 = own_cpu()

    def seconds(self):
        """(server, generator) CPU seconds since this meter was made."""
        now = family_cpu(self.pid)
        return sum(v - self.server0.get(p, 0.0) for p, v in now.items()), own_cpu() - self.client0

    def us_per(self, n):
        server, client = self.seconds()
        return (server * 1e6 / n, client * 1e6 / n)


def settle(pid, what, idle_share=0.1, span=2.5, step=0.1, timeout=30.0):
    """Wait until ``pid`` and its children have used less than ``idle_share`` of one core over the
    last ``span`` seconds (the node's background memtable merge, Redis's AOF rewrite), at most
    ``timeout`` s, so that one phase's background work does not land in the next phase's figures
    (as db_bench's ``--wait_for_compaction``). ``span`` is past the node's FLUSH_IDLE_S (1 s): a
    memtable is merged once no write landed for that long. Prints and returns how long it waited."""
    t0 = time.perf_counter()
    samples = [(t0, sum(family_cpu(pid).values()))]
    while time.perf_counter() - t0 < timeout:
        time.sleep(step)
        now = time.perf_counter()
        samples.append((now, sum(family_cpu(pid).values())))
        old = [x for x in samples if now - x[0] >= span - 1e-3]
        if old:
            t_old, c_old = old[-1]
            if (samples[-1][1] - c_old) / (now - t_old) < idle_share:
                break
    waited = time.perf_counter() - t0
    print("  (%s: waited %.2f s for the server to go idle)" % (what, waited))
    return waited


def fmt_cpu(cpu):
    return "server CPU %.2f us/op, generator CPU %.2f us/op" % cpu


def percentile(samples, q):
    """samples: sorted list of (latency, weight)."""
    total = sum(w for _, w in samples)
    acc = 0
    for lat, w in samples:
        acc += w
        if acc >= q * total:
            return lat
    return samples[-1][0] if samples else 0.0


def pipelined(sock, requests, reply_len, depth, chunk=16):
    """Send pre-encoded ``requests`` keeping ``depth`` in flight; every reply is ``reply_len``
    bytes. Returns (seconds, latency samples). Requests go out in groups of ``chunk``; each
    group's latency (send -> its last reply) is one sample weighted by its size."""
    n = len(requests)
    target = n * reply_len
    got = 0
    sent = 0
    inflight = []  # (end index, t_sent)
    head = 0
    samples = []
    recv = sock.recv
    perf = time.perf_counter
    t0 = perf()
    while sent < min(depth, n):
        end = min(sent + chunk, depth, n)
        sock.sendall(b"".join(requests[sent:end]))
        inflight.append((end, perf()))
        sent = end
    last_tail = b""
    while got < target:
        data = recv(1 << 20)
        if not data:
            raise RuntimeError("server closed the connection")
        got += len(data)
        last_tail = (last_tail + data)[-reply_len:]
        done = got // reply_len
        now = perf()
        while head < len(inflight) and inflight[head][0] <= done:
            end, ts = inflight[head]
            prev = inflight[head - 1][0] if head else 0
            samples.append((now - ts, end - prev))
            head += 1
        while sent < n and sent - done < depth:
            end = min(sent + chunk, done + depth, n)
            sock.sendall(b"".join(requests[sent:end]))
            inflight.append((end, perf()))
            sent = end
    elapsed = perf() - t0
    if got != target:
        raise RuntimeError("reply bytes %d != expected %d (an error reply?)" % (got, target))
    samples.sort()
    return elapsed, samples, last_tail


# -- sbpnode side ---------------------------------------------------------------------------------


def kv_requests_set(keys, value):
    enc = codec.encode_set
    return [enc(i, k, value) for i, k in enumerate(keys)]


def kv_requests_get(keys):
    enc = codec.encode_get
    return [enc(i, k) for i, k in enumerate(keys)]


def kv_full_scan(port, page):
    sock = connect(port)
    buf = bytearray()

    def call(cmd, req):
        nonlocal buf
        sock.sendall(req)
        while True:
            if len(buf) >= 8:
                (total,) = struct.unpack_from(">Q", buf)
                if len(buf) >= total:
                    reply = codec.decode_reply(buf, cmd)
                    del buf[:total]
                    return reply
            buf += sock.recv(1 << 20)

    t0 = time.perf_counter()
    r = call(codec.CREATE_CURSOR, codec.encode_create_cursor(1, b"bench"))
    assert r.cmd == codec.OK
    req = codec.encode_scan(codec.GET_FF, 2, page, b"bench")
    n = 0
    pages = 0
    jumps = 0
    last = None
    while True:
        r = call(codec.GET_FF, req)
        assert r.cmd == codec.OK, r
        items = r.items
        if items:
            if last is not None:
                assert items[0][0] > last
            last = items[-1][0]
            n += len(items)
            pages += 1
            jumps += r.jumped
        if not items or not r.next_key:
            break
    elapsed = time.perf_counter() - t0
    sock.close()
    return n, elapsed, pages, jumps


# -- Redis side -----------------------------------------------------------------------------------


def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class RespReader:
    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0

    def _fill(self):
        data = self.sock.recv(1 << 20)
        if not data:
            raise RuntimeError("redis closed the connection")
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += data

    def _line(self):
        while True:
            i = self.buf.find(b"\r\n", self.pos)
            if i >= 0:
                line = bytes(self.buf[self.pos : i])
                self.pos = i + 2
                return line
            self._fill()

    def read(self):
        line = self._line()
        t = line[:1]
        if t == b"+":
            return line[1:]
        if t == b"-":
            raise RuntimeError(line.decode())
        if t == b":":
            return int(line[1:])
        if t == b"$":
            n = int(line[1:])
            if n < 0:
                return None
            while len(self.buf) - self.pos < n + 2:
                self._fill()
            v = bytes(self.buf[self.pos : self.pos + n])
            self.pos += n + 2
            return v
        if t == b"*":
            return [self.read() for _ in range(int(line[1:]))]
        raise RuntimeError("bad RESP line %r" % line)

    def read_bulk_array(self):
        """A RESP array of bulk strings (None for nil) in one tight loop: the same work per element
        as the sbpnode side's scan decoder (``codec._scan_elements``), so the scan comparison
        measures the servers, not the two clients' parsers."""
        line = self._line()
        if line[:1] != b"*":
            if line[:1] == b"-":
                raise RuntimeError(line.decode())
            raise RuntimeError("expected a RESP array, got %r" % line)
        out = []
        append = out.append
        buf = self.buf
        pos = self.pos
        for _ in range(int(line[1:])):
            while True:
                i = buf.find(b"\r\n", pos)
                if i >= 0:
                    n = int(buf[pos + 1 : i])
                    if n < 0:
                        append(None)
                        pos = i + 2
                        break
                    if len(buf) >= i + 4 + n:
                        append(bytes(buf[i + 2 : i + 2 + n]))
                        pos = i + 4 + n
                        break
                self.pos = pos
                self._fill()
                buf = self.buf
                pos = self.pos
        self.pos = pos
        return out


def redis_full_scan(port, page):
    sock = connect(port)
    rd = RespReader(sock)
    t0 = time.perf_counter()
    cursor = b"0"
    n = 0
    pages = 0
    count = str(page).encode()
    while True:
        sock.sendall(resp(b"SCAN", cursor, b"COUNT", count))
        if rd._line() != b"*2":
            raise RuntimeError("unexpected SCAN reply")
        cursor = rd.read()
        keys = rd.read_bulk_array()
        if keys:
            sock.sendall(resp(b"MGET", *keys))
            values = rd.read_bulk_array()
            items = list(zip(keys, values))
            n += len(items)
            pages += 1
        if cursor == b"0":
            break
    elapsed = time.perf_counter() - t0
    sock.close()
    return n, elapsed, pages


def start_redis(workdir, appendfsync):
    port = free_port()
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", "", "--daemonize", "no", "--protected-mode", "no"]
    if appendfsync != "none":
        args += ["--appendonly", "yes", "--appendfsync", appendfsync]
    else:
        args += ["--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            s = connect(port)
            s.sendall(resp(b"PING"))
            if RespReader(s).read() == b"PONG":
                s.close()
                return proc, port
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)


def rss(pid):
    """(VmRSS, RssAnon, RssFile) of ``pid`` in MiB."""
    fields = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                fields[name] = int(rest.split()[0]) / 1024.0
    return fields.get("VmRSS", 0.0), fields.get("RssAnon", 0.0), fields.get("RssFile", 0.0)


def fmt_rss(m):
    return "RSS %.0f MiB (anonymous %.0f, file-backed %.0f)" % m


def pair_keys(n):
    return [b"p" + k for k in make_keys(n)]


def fmt_lat(samples):
    """Percentiles, then the weighted mean and the share of the summed latency spent in groups
    that took over 1 ms (stalls: at a fixed depth the rate is depth / mean latency)."""
    total = sum(w for _, w in samples) or 1
    lat_sum = sum(lat * w for lat, w in samples) or 1e-12
    slow = sum(lat * w for lat, w in samples if lat > 0.001)
    return "p50 %.2f ms  p99 %.2f ms  p99.9 %.2f ms  mean %.3f ms (%.0f%% of it in groups over 1 ms)" % (
        tuple(percentile(samples, q) * 1000 for q in (0.5, 0.99, 0.999)) + (lat_sum / total * 1000, 100.0 * slow / lat_sum))


class SetGetSide:
    """One side of the SETGET phase: its connection, its requests, what its rounds added up to."""

    def __init__(self, name, port, pid, requests, reply_len, last_reply):
        self.name = name
        self.sock = connect(port)
        self.pid = pid
        self.requests = requests
        self.reply_len = reply_len
        self.last_reply = last_reply  # (index of a pair) -> the bytes its replies end with
        self.elapsed = 0.0
        self.samples = []
        self.server_cpu = self.client_cpu = 0.0  # CPU seconds over its rounds
        self.rates = []
        self.idle_cpu = 0.0  # its server's CPU seconds during the other side's rounds

    def run(self, lo, hi, depth):
        cpu = CpuMeter(self.pid)
        el, lat, tail = pipelined(self.sock, self.requests[lo:hi], self.reply_len, depth, chunk=8)
        server, client = cpu.seconds()
        assert tail.endswith(self.last_reply(hi - 1)), (self.name, tail)
        self.elapsed += el
        self.samples.extend(lat)
        self.server_cpu += server
        self.client_cpu += client
        self.rates.append((hi - lo) / el)


def setget(args, results, pkeys, value, node, redis, profiling):
    """The SETGET phase: ``--pairs`` pairs per side, in ``--setget-rounds`` slices that alternate the
    sides (``node``, ``redis``: (port, pid) of each side that runs, or None). Each side's rate is
    its pairs over its summed time; its latency samples and CPU are those of its rounds only."""
    depth = max(1, args.depth // 2)
    sides = []
    if node:
        enc_set, enc_get = codec.encode_set, codec.encode_get
        pairs = [enc_set(2 * i, k, value) + enc_get(2 * i + 1, k) for i, k in enumerate(pkeys)]
        reply_len = codec.HEADER_LEN * 2 + 6 + 9 + args.value_size  # a SET's and a GET's reply; pair keys are 9 bytes
        sides.append(SetGetSide("sbpnode", node[0], node[1], pairs, reply_len,
                                lambda i: codec.encode_get_reply(2 * i + 1, pkeys[i], value)))
    if redis:
        pairs = [resp(b"SET", k, value) + resp(b"GET", k) for k in pkeys]
        sides.append(SetGetSide("redis", redis[0], redis[1], pairs, 5 + len(b"$%d\r\n" % args.value_size) + args.value_size + 2,
                                lambda i: value + b"\r\n"))
    rounds = max(1, min(args.setget_rounds, args.pairs))
    bounds = [args.pairs * r // rounds for r in range(rounds + 1)]
    prof = Profiler(args.py_spy, node[1], "setget") if profiling and node else None
    for r in range(rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            if prof is not None:
                (prof.resume if side.name == "sbpnode" else prof.pause)()
            others = [(o, CpuMeter(o.pid)) for o in sides if o is not side]
            side.run(bounds[r], bounds[r + 1], depth)
            for o, meter in others:
                o.idle_cpu += meter.seconds()[0]
        if prof is not None:
            prof.pause()
    if prof is not None:
        prof.stop(args.pairs)
    for side in sides:
        side.sock.close()
        side.samples.sort()
        rate = args.pairs / side.elapsed
        cpu = (side.server_cpu * 1e6 / args.pairs, side.client_cpu * 1e6 / args.pairs)
        results[("kv" if side.name == "sbpnode" else "redis", "setget")] = (rate, cpu)
        print("%-7s SETGET %8.0f pairs/s  %s  %s" % (side.name, rate, fmt_lat(side.samples), fmt_cpu(cpu).replace("/op", "/pair")))
    if len(sides) == 2:
        print("  SETGET rounds (%d pairs each side, alternating), sbpnode/redis: %s" % (
            args.pairs // rounds, " ".join("%.2fx" % (a / b) for a, b in zip(sides[0].rates, sides[1].rates))))
        print("  each server's CPU during the other's rounds (its background work): sbpnode %.1f ms, redis %.1f ms" % (
            sides[0].idle_cpu * 1e3, sides[1].idle_cpu * 1e3))
    for side in sides:
        side.requests = None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--value-size", type=int, default=100)
    ap.add_argument("--page", type=int, default=1024)
    ap.add_argument("--durable", action="store_true", help="node --fsync always vs redis appendfsync always")
    ap.add_argument("--fsync", default=None, help="node fsync policy (default: never, or always with --durable)")
    ap.add_argument("--redis-fsync", choices=["none", "everysec", "always"], default=None,
                    help="redis persistence (default: always with --durable, else none)")
    ap.add_argument("--pairs", type=int, default=100_000, help="SET k; GET k pairs of the SETGET phase (0: skip)")
    ap.add_argument("--setget-rounds", type=int, default=6,
                    help="the SETGET phase in this many rounds per side, the sides alternating")
    ap.add_argument("--kv-cache-mb", type=int, default=None,
                    help="the node's --kv-cache-mb (its row cache; default: the node's default)")
    ap.add_argument("--only", choices=["kv", "redis"], default=None, help="run one side only")
    ap.add_argument("--metrics", choices=["on", "off"], default="on", help="the node's --metrics (A/B of their cost, docs/benchmarks.md)")
    ap.add_argument("--py-spy-gil", action="store_true", help="with --py-spy: only samples holding the GIL")
    ap.add_argument("--threads", action="store_true", help="also print the node's CPU per op by thread")
    ap.add_argument("--no-settle", dest="settle", action="store_false",
                    help="start each phase at once instead of waiting for the server's background work of the "
                         "phase before (the node's memtable merge, Redis's AOF rewrite) to end")
    ap.add_argument("--py-spy", default=None, metavar="DIR",
                    help="record each node phase with py-spy into DIR/<phase>.txt (implies --threads)")
    args = ap.parse_args(argv)
    profiling = args.threads or args.py_spy
    if args.py_spy_gil:
        Profiler.extra = ["--gil"]
    fsync = args.fsync or ("always" if args.durable else "never")
    redis_fsync = args.redis_fsync or ("always" if args.durable else "none")

    value = os.urandom(args.value_size)
    keys = make_keys(args.keys)
    print("kv_bench: %d keys, %d-byte values, depth %d, page %d, node fsync=%s, redis %s"
          % (args.keys, args.value_size, args.depth, args.page, fsync,
             "appendfsync " + redis_fsync if redis_fsync != "none" else "no persistence"))
    try:
        print("load average at start: %.2f %.2f %.2f" % os.getloadavg())
    except OSError:
        pass
    pkeys = pair_keys(args.pairs)
    results = {}
    tmp = tempfile.mkdtemp(prefix="kv-bench-")
    node = redis = None
    try:
        if args.only != "redis":
            cache = {} if args.kv_cache_mb is None else {"kv_cache_mb": args.kv_cache_mb}
            node = NodeProcess(tmp, name="bench", fsync=fsync, metrics=args.metrics, sbp="none", meta="none", chunks="none",
                               swarm="none", http="none", **cache).start()
            port = node.ports["kv"]
            pid = node.proc.pid
            sets = kv_requests_set(keys, value)
            sock = connect(port)
            prof = Profiler(args.py_spy, pid, "set") if profiling else None
            cpu = CpuMeter(pid)
            el, lat, tail = pipelined(sock, sets, codec.HEADER_LEN, args.depth)
            if args.settle:
                settle(pid, "after SET; its merge's CPU counts as SET's")
            cpu = cpu.us_per(args.keys)
            if prof:
                prof.stop(args.keys)
            assert tail == codec.encode_status(len(keys) - 1, codec.OK), tail
            del sets
            results[("kv", "set")] = (args.keys / el, cpu)
            print("sbpnode SET  %10.0f ops/s  %s  %s" % (args.keys / el, fmt_lat(lat), fmt_cpu(cpu)))
            gets = kv_requests_get(keys)
            reply_len = codec.HEADER_LEN + 6 + 8 + args.value_size
            prof = Profiler(args.py_spy, pid, "get") if profiling else None
            cpu = CpuMeter(pid)
            el, lat, tail = pipelined(sock, gets, reply_len, args.depth)
            cpu = cpu.us_per(args.keys)
            if args.settle:
                settle(pid, "after GET")
            if prof:
                prof.stop(args.keys)
            assert tail == codec.encode_get_reply(len(keys) - 1, keys[-1], value), tail
            del gets
            sock.close()
            results[("kv", "get")] = (args.keys / el, cpu)
            print("sbpnode GET  %10.0f ops/s  %s  %s" % (args.keys / el, fmt_lat(lat), fmt_cpu(cpu)))
            results[("kv", "mem")] = rss(pid)
            workers = [rss(c) for c in family_cpu(pid) if c != pid]
            # The merge worker's anonymous memory counts as the node's; its file-backed pages are
            # LMDB's map and the libraries, the same page-cache pages the node maps (not counted twice).
            node_only = results[("kv", "mem")]
            results[("kv", "mem")] = (node_only[0] + sum(w[1] for w in workers), node_only[1] + sum(w[1] for w in workers),
                                      node_only[2])
            lmdb_file = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(node.data_dir) for f in fs
                            if f == "data.mdb") / 1048576.0
            print("sbpnode MEM  %d keys of %d B: %s; LMDB file %.0f MiB%s" % (
                args.keys, args.value_size, fmt_rss(results[("kv", "mem")]), lmdb_file,
                "".join("; merge worker's anonymous %.0f MiB counted (its RSS %.0f, file-backed %.0f: LMDB's map "
                        "and libraries, shared with the node)" % (w[1], w[0], w[2]) for w in workers)))
            cpu = CpuMeter(pid)
            n, el, pages, jumps = kv_full_scan(port, args.page)
            cpu = cpu.us_per(n)
            assert n == args.keys, (n, args.keys)
            results[("kv", "scan")] = (n / el, cpu)
            print("sbpnode SCAN %10.0f keys/s (%d keys, %d GET_FF pages, %d with the jump bit, %.2f s)  %s"
                  % (n / el, n, pages, jumps, el, fmt_cpu(cpu).replace("/op", "/key")))
            if args.pairs and args.settle:
                settle(pid, "after SCAN")
        if args.only != "kv":
            redis, rport = start_redis(tmp, redis_fsync)
            pid = redis.pid
            sets = [resp(b"SET", k, value) for k in keys]
            sock = connect(rport)
            cpu = CpuMeter(pid)
            el, lat, tail = pipelined(sock, sets, 5, args.depth)
            if args.settle:
                settle(pid, "after SET; its AOF work's CPU counts as SET's")
            cpu = cpu.us_per(args.keys)
            assert tail == b"+OK\r\n"
            del sets
            results[("redis", "set")] = (args.keys / el, cpu)
            print("redis   SET  %10.0f ops/s  %s  %s" % (args.keys / el, fmt_lat(lat), fmt_cpu(cpu)))
            gets = [resp(b"GET", k) for k in keys]
            cpu = CpuMeter(pid)
            el, lat, tail = pipelined(sock, gets, len(b"$%d\r\n" % args.value_size) + args.value_size + 2, args.depth)
            cpu = cpu.us_per(args.keys)
            if args.settle:
                settle(pid, "after GET")
            assert tail.endswith(value + b"\r\n")
            del gets
            sock.close()
            results[("redis", "get")] = (args.keys / el, cpu)
            print("redis   GET  %10.0f ops/s  %s  %s" % (args.keys / el, fmt_lat(lat), fmt_cpu(cpu)))
            results[("redis", "mem")] = rss(pid)
            print("redis   MEM  %d keys of %d B: %s" % (args.keys, args.value_size, fmt_rss(results[("redis", "mem")])))
            cpu = CpuMeter(pid)
            n, el, pages = redis_full_scan(rport, args.page)
            cpu = cpu.us_per(n)
            assert n == args.keys, (n, args.keys)
            results[("redis", "scan")] = (n / el, cpu)
            print("redis   SCAN %10.0f keys/s (%d keys, %d SCAN+MGET pages, %.2f s)  %s"
                  % (n / el, n, pages, el, fmt_cpu(cpu).replace("/op", "/key")))
            if args.pairs and args.settle:
                settle(pid, "after SCAN")
        if args.pairs:
            setget(args, results, pkeys, value, node and (node.ports["kv"], node.proc.pid), redis and (rport, redis.pid),
                   profiling)
    finally:
        if node is not None:
            node.kill9()
        if redis is not None:
            redis.kill()
            redis.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.only is None:
        ratio = {op: results[("kv", op)][0] / results[("redis", op)][0] for op in ("set", "get", "scan")}
        print()
        print("ratio sbpnode/redis:  SET %.2fx (target >= 0.5: %s)  GET %.2fx (target >= 0.5: %s)  SCAN %.2fx (target >= 1: %s)" % (
            ratio["set"], "met" if ratio["set"] >= 0.5 else "missed",
            ratio["get"], "met" if ratio["get"] >= 0.5 else "missed",
            ratio["scan"], "met" if ratio["scan"] >= 1 else "missed"))
        print("server CPU per op, sbpnode/redis:  SET %.2fx  GET %.2fx  SCAN %.2fx" % tuple(
            results[("kv", op)][1][0] / max(1e-9, results[("redis", op)][1][0]) for op in ("set", "get", "scan")))
        if args.pairs:
            r = results[("kv", "setget")][0] / results[("redis", "setget")][0]
            print("SET-then-GET pipeline sbpnode/redis: %.2fx (target >= 0.5: %s)" % (r, "met" if r >= 0.5 else "missed"))
        print("resident size with %d keys, sbpnode/redis: %.2fx (%.0f MiB vs %.0f MiB)" % (
            args.keys, results[("kv", "mem")][0] / max(1e-9, results[("redis", "mem")][0]),
            results[("kv", "mem")][0], results[("redis", "mem")][0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
