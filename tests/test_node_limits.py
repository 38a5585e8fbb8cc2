"""What clients may cost a real node (issue 21; node/guard.py): idle timeouts, half frames,
--max-connections, clients that never read their replies, and connection floods."""

import json
import os
import socket
import struct
import sys
import time

import pytest

from protocols.partition import codec as kvc
from protocols.partition.client import BlockingKvClient
from protocols.sbp import codec as sbpc
from protocols.sbp.client import BlockingSbpClient


def rss_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wait_for(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for " + what)
        time.sleep(0.05)


def connections(node):
    c = BlockingSbpClient("127.0.0.1", node.ports["sbp"])
    try:
        return c.status()["metrics"]["connections"]
    finally:
        c.close()


def closed_by_peer(sock, timeout=10.0):
    """True once the node has closed ``sock`` (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def sbp_fetch_frame(rid, sid, offset=0, max_bytes=1 << 20, wait_ms=0):
    header = sbpc.encode_table(
        "FetchRequest", sbpc.T.FetchRequest(wait_ms, 1, [sbpc.T.FetchInfo(sid, 0, offset, max_bytes)])
    )
    return sbpc.encode_frame(sbpc.FETCH, 0, rid, header)


def test_idle_timeout_closes_silent_and_half_sent_connections(node_factory):
    node = node_factory(fsync="never", idle_timeout=["1", "kv=0"])
    silent = socket.create_connection(node.address("sbp"))
    half = socket.create_connection(node.address("meta"))
    half.sendall(b"\x00\x00\x10")  # the start of a length prefix, then nothing
    http = socket.create_connection(node.address("http"))
    http.sendall(b"GET /v1/basins HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    kv = socket.create_connection(node.address("kv"))  # kv=0: never idle
    t0 = time.monotonic()
    for s in (silent, half, http):
        assert closed_by_peer(s), "not closed"
    assert time.monotonic() - t0 < 8
    # kv has no timeout: still open and answering
    kv.sendall(kvc.encode_get(7, b"k"))
    kv.settimeout(5)
    assert kv.recv(65536)
    assert connections(node)["closed_idle"] == 3
    for s in (silent, half, http, kv):
        s.close()


def test_max_connections_refuses_cleanly_and_recovers(node_factory):
    node = node_factory(fsync="never", max_connections=4)
    held = [socket.create_connection(node.address("kv")) for _ in range(3)]
    status = BlockingSbpClient("127.0.0.1", node.ports["sbp"])  # the fourth
    wait_for(lambda: status.status()["metrics"]["connections"]["open"] == 4, what="4 open")
    refused = socket.create_connection(node.address("kv"))
    refused.settimeout(5)
    assert refused.recv(10) == b""  # a FIN at once: no hang in the backlog, no reset
    refused.close()
    assert status.status()["metrics"]["connections"]["refused"] == 1
    held.pop().close()
    wait_for(lambda: status.status()["metrics"]["connections"]["open"] == 3, what="a free slot")
    c = BlockingKvClient("127.0.0.1", node.ports["kv"])
    c.set(b"k", b"v")
    assert c.get(b"k") == b"v"
    c.close()
    status.close()
    log = node.log_text()
    assert log.count("refusing connections on kv") == 1, log[-2000:]
    for s in held:
        s.close()


def test_half_frames_then_gone_free_everything(node_factory):
    """200 clients each send a third of a 12 MiB APPEND frame (4 MiB) and disconnect: the node
    holds none of it afterwards."""
    node = node_factory(fsync="never")
    pid = node.proc.pid
    payload = b"\x00" * (4 << 20)
    prefix = struct.pack(">I", 12 << 20)
    wait_for(lambda: connections(node)["open"] == 1, what="no connections but ours")
    before = rss_bytes(pid)
    for k in range(200):
        s = socket.create_connection(node.address("sbp" if k % 2 else "kv"))
        try:
            s.sendall(prefix + payload[: 1 << 20] if k % 2 == 0 else prefix + payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the node may refuse the frame's length and close before all of it is sent
        s.close()
    wait_for(lambda: connections(node)["open"] == 1, what="all gone")
    grown = rss_bytes(pid) - before
    assert grown < 64 << 20, "RSS grew %d MiB" % (grown >> 20)


@pytest.mark.slow
def test_clients_that_never_read_cost_bounded_memory(node_factory):
    """100 clients each pipeline large GET_FFs (4 MiB replies) and 100 each park a long-poll FETCH
    behind 16 pipelined 1 MiB FETCHes, none of them reading: RSS stays under the
    --max-unsent-bytes cap plus a margin, stalled readers are cut, others are still served."""
    cap = 96 << 20
    node = node_factory(fsync="never", max_unsent_bytes=cap, log_level="warn")
    pid = node.proc.pid
    kv = BlockingKvClient("127.0.0.1", node.ports["kv"])
    value = b"v" * (64 << 10)
    for i in range(64):
        kv.set(b"key%04d" % i, value)  # 4 MiB in all
    sbp = BlockingSbpClient("127.0.0.1", node.ports["sbp"])
    sid = sbp.create_stream()["stream_id"]
    from storage import record_batch

    batch = record_batch.encode([(1, [], b"r" * 1024) for _ in range(64)])
    for _ in range(64):
        sbp.append(sid, batch)
    base = rss_bytes(pid)
    readers = []
    # a cursor, then GET_FFs that each start over at the first key (4 MiB replies)
    get_ff = kvc.encode_create_cursor(1, b"c", b"") + b"".join(
        kvc.encode_scan(kvc.GET_FF, i, 1024, b"c", b"key0000") for i in range(2, 10))
    fetches = b"".join(sbp_fetch_frame(r, sid) for r in range(1, 17)) + sbp_fetch_frame(17, sid, 1 << 40, wait_ms=60000)
    peak = 0
    for k in range(100):
        for port, data in ((node.ports["kv"], get_ff), (node.ports["sbp"], fetches)):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that does not read
            s.connect(("127.0.0.1", port))
            s.sendall(data)
            readers.append(s)
        peak = max(peak, rss_bytes(pid))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        peak = max(peak, rss_bytes(pid))
        time.sleep(0.05)
    # others are still served, quickly
    t = time.monotonic()
    assert kv.get(b"key0001") == value
    assert time.monotonic() - t < 2
    conns = connections(node)
    grown = peak - base
    print("RSS base %d MiB, peak +%d MiB; %s" % (base >> 20, grown >> 20, json.dumps(conns)))
    assert grown < cap + (64 << 20), "RSS grew %d MiB" % (grown >> 20)
    assert conns["closed_stalled"] > 0
    for s in readers:
        s.close()
    kv.close()
    sbp.close()


def _flood(ports, n, q):
    """Open and close ``n`` connections, round-robin over ``ports``, as fast as they go (niced: the
    load generator is not what is measured)."""
    os.nice(10)
    t0 = time.monotonic()
    failed = 0
    for k in range(n):  # n stays well inside the ephemeral port range (closed ones sit in TIME_WAIT)
        try:
            s = socket.create_connection(("127.0.0.1", ports[k % len(ports)]), timeout=5)
            if k % 3 == 0:
                s.sendall(b"\x00\x00\x00")  # a few bytes of a frame, then gone
            s.close()
        except OSError:
            failed += 1
    q.put((time.monotonic() - t0, failed))


@pytest.mark.slow
def test_connection_flood_and_1000_open_leave_others_served(node_factory):
    """1,000 connections held open and 5,000 opened and closed in a loop: a kv client keeps getting
    its answers with p99 under 20 ms (on a machine loaded by others, see below)."""
    import multiprocessing

    node = node_factory(fsync="never", log_level="warn")
    ports = [node.ports[name] for name in ("sbp", "kv", "meta", "chunks", "swarm", "http")]
    held = [socket.create_connection(("127.0.0.1", ports[k % len(ports)])) for k in range(1000)]
    kv = BlockingKvClient("127.0.0.1", node.ports["kv"])
    kv.set(b"k", b"v" * 100)
    wait_for(lambda: connections(node)["open"] >= 1002, what="1000 held open")

    def get_latency(seconds):
        lat, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            assert kv.get(b"k") == b"v" * 100
            lat.append(time.perf_counter() - t)
            time.sleep(0.002)
        return sorted(lat)

    before = get_latency(3.0)
    base_p99 = before[int(0.99 * len(before))] * 1000
    q = multiprocessing.get_context("fork").Queue()
    # 3 x 5,000: one round lasts ~0.2 s, ~50 GETs, whose "p99" would be their maximum; three give
    # a percentile of a few hundred samples
    flood = multiprocessing.get_context("fork").Process(target=_flood, args=(ports, 15000, q))
    lat = []
    flood.start()
    try:
        while flood.is_alive() or not lat:
            t = time.perf_counter()
            assert kv.get(b"k") == b"v" * 100
            lat.append(time.perf_counter() - t)
            time.sleep(0.0005)
        seconds, failed = q.get(timeout=60)
    finally:
        flood.join(60)
    lat.sort()
    p99 = lat[int(0.99 * len(lat))] * 1000
    print("flood: 15000 connects in %.1f s (%d failed); %d GETs meanwhile, p50 %.2f ms p99 %.2f ms max %.2f ms;"
          " before the flood p99 %.2f ms; load average %.1f"
          % (seconds, failed, len(lat), lat[len(lat) // 2] * 1000, p99, lat[-1] * 1000, base_p99, os.getloadavg()[0]))
    assert failed == 0
    # The target is 20 ms. The test machine is shared (2 cores, load 4-14 while other work runs),
    # and there everything, the kv client included, waits for the CPU for tens of ms at times:
    # then only a stall of the node's own making (a full GC, an accept loop over a whole backlog)
    # is caught, by a bound of 250 ms.
    loaded = os.getloadavg()[0] > (os.cpu_count() or 1)
    assert p99 < (250.0 if loaded else max(20.0, 5 * base_p99)), (p99, base_p99)
    assert node.proc.poll() is None
    for s in held:
        s.close()
    kv.close()


def test_fd_exhaustion_is_a_log_line_not_a_crash(node_factory, tmp_path):
    """A node whose fd limit is 200 (hard) and told to take 1,000 connections runs out of fds:
    Twisted's EMFILE recovery closes the extra clients, the node logs it and keeps serving."""
    from tests.nodeproc import NodeProcess

    class LimitedNode(NodeProcess):
        def argv(self):
            # the node raises its soft limit to the hard one at start: lower both, then exec it
            limit = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200)); "
                     "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
            return [sys.executable, "-c", limit] + super().argv()[1:]

    node = LimitedNode(tmp_path, name="limited", fsync="never", max_connections=1000)
    node.start()
    try:
        held = []
        for k in range(300):
            s = socket.create_connection(node.address("kv"))
            held.append(s)
        # the node has closed what it could not hold
        wait_for(lambda: "EMFILE" in node.log_text(), what="the EMFILE log line")
        for s in held:
            s.close()
        assert node.proc.poll() is None
        c = BlockingKvClient("127.0.0.1", node.ports["kv"])
        c.set(b"a", b"b")
        assert c.get(b"a") == b"b"
        c.close()
    finally:
        node.kill9()


def test_the_guard_keeps_no_closed_connection_alive():
    """The guard hooks each protocol's connectionLost with a closure holding the protocol; left in
    place after the loss it is a reference cycle that only a full garbage collection frees (the
    flood's long stall, docs/operations.md "Floods")."""
    import gc
    import weakref

    from twisted.internet import task
    from twisted.internet.protocol import Protocol

    from node.guard import ConnectionGuard

    lost = []

    class P(Protocol):
        def connectionLost(self, reason=None):
            lost.append(reason)

    guard = ConnectionGuard(task.Clock(), 10, {"kv": 300})
    p = P()
    guard.admit("kv", p)
    assert guard.metrics["open"] == 1
    p.connectionLost("gone")
    assert lost == ["gone"] and guard.metrics["open"] == 0 and "connectionLost" not in vars(p)
    alive = weakref.ref(p)
    gc.disable()
    try:
        del p
        assert alive() is None  # freed by reference counting alone
    finally:
        gc.enable()
