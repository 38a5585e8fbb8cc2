"""Fuzzing every listener of a live node over the wire (issue 21).

    python bench/fuzz_wire.py [--listeners sbp,kv,meta,chunks,swarm,http] [--cases 2000] [--seed N]

Starts one node (twistd, ``--fsync never``) and, per listener, runs a hypothesis campaign: each
case opens a connection, sends random bytes or valid requests of that protocol mutated (bytes
flipped, cut, inserted, a length field replaced), split at random points, reads whatever comes
back for a moment and closes (or leaves the connection open, to be closed by the node). Checks:

- the node never exits (no crash);
- a witness connection per listener, opened at the start and kept, answers a valid request
  within ``WITNESS_DEADLINE`` after every ``--check-every`` cases (no hang of other connections);
- the node's RSS at the end, with every fuzz connection closed, is within ``--max-rss-growth-mb``
  of where it was after the first check (no growth without bound);
- the node's log holds no traceback (a bug caught by a protocol's last-resort handler still is
  one).

Prints the case count per listener, the node's RSS and any failure with its case. The test suite
runs a short campaign (tests/test_fuzz_wire.py); longer ones are run by hand and recorded in
docs/benchmarks.md.
"""

import argparse
import os
import random
import socket
import struct
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from protocols.partition import codec as kvc  # noqa: E402
from protocols.partition.client import BlockingKvClient  # noqa: E402
from protocols.sbp import client as sbpclient  # noqa: E402
from protocols.sbp import codec as sbpc  # noqa: E402
from protocols.swarm import codec as swc  # noqa: E402
from protocols.toasty import codec as tc  # noqa: E402
from storage import record_batch  # noqa: E402

LISTENERS = ("sbp", "kv", "meta", "chunks", "swarm", "http")
WITNESS_DEADLINE = 5.0


# -- valid requests per listener ----------------------------------------------------------------


def _sbp_frame(call, sid=1):
    return sbpc.encode_frame(call.opcode, 0, sid, call.header, b"".join(call.payload))


def sbp_requests(stream_id):
    batch = record_batch.encode([(1700000000000 + i, [(b"k", b"v")], b"x" * 40) for i in range(3)])
    calls = [
        sbpclient.call_ping(b"hello"),
        sbpclient.call_create_stream(),
        sbpclient.call_describe_streams([stream_id, 12345]),
        sbpclient.call_append(stream_id, batch),
        sbpclient.call_fetch(stream_id, 0, 1 << 16),
        sbpclient.call_fetch(stream_id, 1 << 30, 1 << 16, max_wait_ms=50),
        sbpclient.call_list_ranges(stream_id),
        sbpclient.call_trim(stream_id, 0),
        sbpclient.call_seal(stream_id, 0),
        sbpclient.call_describe_range(stream_id, 0),
        sbpclient.call_allocate_id("x"),
        sbpclient.call_status(),
    ]
    return [_sbp_frame(c, k + 1) for k, c in enumerate(calls)]


def kv_requests():
    return [
        kvc.encode_get(1, b"key"),
        kvc.encode_set(2, b"key", b"value" * 10),
        kvc.encode_remove(3, b"key"),
        kvc.encode_create_cursor(4, b"c", b""),
        kvc.encode_scan(kvc.GET_FF, 5, 10, b"c"),
        kvc.encode_scan(kvc.GET_FB, 6, 10, b"c"),
        kvc.encode_scan(kvc.GET_KEYS_PREFIX, 7, 10, b"c", b"", b"k"),
        kvc.encode_delete_cursor(8, b"c"),
    ]


def meta_requests():
    h = b"\x11" * 32
    return [tc.encode(m) for m in (
        tc.Create(b"/fz", True),
        tc.Create(b"/fz/f", False, 4096),
        tc.List_(0, b"/"),
        tc.Read(0, b"/fz/f", 0, 100),
        tc.Write(0, 0, b"/fz/f", 0, 10, [tc.WriteChunk(h, [("127.0.0.1", 1)])]),
        tc.Delete(0, b"/fz/f"),
    )]


def chunk_requests():
    h = b"\x22" * 32
    return [tc.encode(m) for m in (
        tc.CreateChunk(4096, 0, b"d" * 100),
        tc.UploadChunk(h, 0, b"e" * 100),
        tc.DownloadChunk(h, True),
        tc.DownloadChunk(h, False, 10, 20),
    )]


def swarm_requests():
    return [swc.encode(m) for m in (
        swc.StreamInfoReq([swc.CHUNKS_ID, swc.ALL_LOGS_ID]),
        swc.GetRange(1, swc.CHUNKS_ID, 0, 10, 5, False),
        swc.GetRange(2, swc.log_id(1 << 32), 0, None, 5, True),
        swc.WantedHashes(1, b"\xff"),
        swc.BatchDone(1, 3),
    )]


def http_requests():
    body = b'{"records":[{"body":"hi"}]}'
    return [
        b"GET /v1/basins HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v1/streams HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/streams HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n{\"stream\":\"fz\"}",
        b"POST /v1/streams/fz/records HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
        b"GET /v1/streams/fz/records?seq_num=0&count=5 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v1/streams/fz/records/tail HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00",
    ]


# -- witnesses: one kept connection per listener that must keep answering -------------------------


class Witness:
    """A connection opened at the start and kept; ``check()`` sends one valid request and waits for
    a reply (any bytes) within WITNESS_DEADLINE."""

    def __init__(self, name, port, request):
        self.name, self.port, self.request = name, port, request
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WITNESS_DEADLINE)

    def check(self):
        self.sock.sendall(self.request)
        t = time.monotonic()
        data = self.sock.recv(1 << 20)
        if not data:
            raise AssertionError("%s witness connection closed by the node" % self.name)
        # drain whatever else is in flight for this reply
        self.sock.settimeout(0.05)
        try:
            while self.sock.recv(1 << 20):
                pass
        except (socket.timeout, BlockingIOError):
            pass
        self.sock.settimeout(WITNESS_DEADLINE)
        return time.monotonic() - t

    def close(self):
        self.sock.close()


def witness_request(name, valid):
    return {
        "sbp": valid["sbp"][0],  # PING
        "kv": kvc.encode_get(99, b"witness"),
        "meta": tc.encode(tc.List_(0, b"/")),
        "chunks": tc.encode(tc.DownloadChunk(b"\x33" * 32, True)),
        "swarm": swc.encode(swc.StreamInfoReq([swc.CHUNKS_ID])),
        "http": b"GET /v1/basins HTTP/1.1\r\nHost: x\r\n\r\n",
    }[name]


# -- cases ----------------------------------------------------------------------------------------


def mutations():
    return st.lists(
        st.one_of(
            st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(0, 255)),
            st.tuples(st.just("cut"), st.integers(0, 1 << 16), st.integers(1, 64)),
            st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=16)),
            st.tuples(st.just("length"), st.integers(0, 1 << 16), st.sampled_from(
                [b"\x00" * 4, b"\xff" * 4, b"\x00\x00\x00\x01", b"\x7f\xff\xff\xff", b"\x01\x00\x00\x00",
                 struct.pack(">Q", 2**63), struct.pack("<Q", 40), struct.pack(">I", 16 << 20)])),
        ),
        max_size=4,
    )


def mutate(data, ops):
    data = bytearray(data)
    for op in ops:
        if not data:
            break
        i = op[1] % len(data)
        if op[0] == "flip":
            data[i] = op[2]
        elif op[0] == "cut":
            del data[i : i + op[2]]
        elif op[0] == "insert":
            data[i:i] = op[2]
        else:
            data[i : i + len(op[2])] = op[2]
    return bytes(data)


def case_strategy(valid):
    one = st.one_of(
        st.binary(max_size=512),
        st.tuples(st.sampled_from(valid), mutations()).map(lambda t: mutate(*t)),
        st.sampled_from(valid),
    )
    return st.tuples(
        st.lists(one, min_size=1, max_size=4).map(b"".join),
        st.lists(st.integers(1, 4096), max_size=3),  # split points
        st.booleans(),  # leave the connection open for the node to time out
    )


def run_case(port, data, splits, leave_open, kept):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        pos = 0
        for cut in sorted(splits):
            if cut < len(data) and cut > pos:
                s.sendall(data[pos:cut])
                pos = cut
        s.sendall(data[pos:])
        s.settimeout(0.02)
        try:
            while s.recv(1 << 20):
                pass
        except (socket.timeout, BlockingIOError):
            pass
    except OSError:
        pass  # the node closed or reset it: allowed
    if leave_open and len(kept) < 200:
        kept.append(s)
    else:
        s.close()


def rss_mb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def campaign(node, names, cases, check_every=50, seed=None, max_rss_growth_mb=128, log=print):
    """Fuzz ``names`` listeners of a running NodeProcess; returns {listener: cases run}; raises
    AssertionError on a failed check."""
    pid = node.proc.pid
    sbp = sbpclient.BlockingSbpClient("127.0.0.1", node.ports["sbp"])
    stream_id = sbp.create_stream()["stream_id"]
    sbp.close()
    if "kv" in names:
        with BlockingKvClient("127.0.0.1", node.ports["kv"]) as kv:
            kv.set(b"witness", b"w")
    valid = {"sbp": sbp_requests(stream_id), "kv": kv_requests(), "meta": meta_requests(),
             "chunks": chunk_requests(), "swarm": swarm_requests(), "http": http_requests()}
    witnesses = {n: Witness(n, node.ports[n], witness_request(n, valid)) for n in names}
    for w in witnesses.values():
        w.check()
    rss_start = rss_mb(pid)
    counts = {}
    worst = {}
    kept = []
    for name in names:
        port = node.ports[name]
        done = [0]

        @settings(max_examples=cases, deadline=None, database=None, derandomize=seed is None,
                  suppress_health_check=list(HealthCheck))
        @given(case_strategy(valid[name]))
        def fuzz(case):
            data, splits, leave_open = case
            run_case(port, data, splits, leave_open, kept)
            done[0] += 1
            if node.proc.poll() is not None:
                raise AssertionError("node exited (%s) on a %s case: %r" % (node.proc.returncode, name, data[:200]))
            if done[0] % check_every == 0:
                for w in witnesses.values():
                    worst[w.name] = max(worst.get(w.name, 0.0), w.check())
                while len(kept) > 100:
                    kept.pop(0).close()

        if seed is not None:
            fuzz = __import__("hypothesis").seed(seed)(fuzz)
        t0 = time.monotonic()
        fuzz()
        counts[name] = done[0]
        log("%-6s %5d cases in %5.1f s; RSS %.0f MiB" % (name, done[0], time.monotonic() - t0, rss_mb(pid)))
    for s in kept:
        s.close()
    for w in witnesses.values():
        worst[w.name] = max(worst.get(w.name, 0.0), w.check())
        w.close()
    # give the node a moment to drop what the closed connections held
    time.sleep(0.5)
    rss_end = rss_mb(pid)
    log("witness worst reply times: %s" % ", ".join("%s %.0f ms" % (k, v * 1000) for k, v in sorted(worst.items())))
    log("RSS %.0f MiB after the first check, %.0f MiB at the end" % (rss_start, rss_end))
    if node.proc.poll() is not None:
        raise AssertionError("node exited")
    if rss_end - rss_start > max_rss_growth_mb:
        raise AssertionError("RSS grew %.0f MiB" % (rss_end - rss_start))
    text = node.log_text()
    if "Traceback" in text:
        i = text.index("Traceback")
        raise AssertionError("a traceback in the node's log:\n" + text[max(0, i - 1500) : i + 3000])
    return counts, rss_start, rss_end, worst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listeners", default=",".join(LISTENERS))
    ap.add_argument("--cases", type=int, default=2000, help="hypothesis examples per listener")
    ap.add_argument("--check-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: a random one, printed)")
    ap.add_argument("--max-rss-growth-mb", type=float, default=128)
    args = ap.parse_args()
    from tests.nodeproc import NodeProcess

    names = [n for n in args.listeners.split(",") if n]
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print("seed %d; load average %.2f %.2f %.2f" % ((seed,) + os.getloadavg()))
    with tempfile.TemporaryDirectory(prefix="fuzz-wire-") as base:
        node = NodeProcess(base, fsync="never", log_level="warn", idle_timeout="5")
        node.start()
        try:
            t0 = time.monotonic()
            counts, _, _, _ = campaign(node, names, args.cases, args.check_every, seed,
                                       args.max_rss_growth_mb)
            print("%d cases in %.0f s: %s" % (sum(counts.values()), time.monotonic() - t0, counts))
        finally:
            node.terminate()
    print("load average %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
