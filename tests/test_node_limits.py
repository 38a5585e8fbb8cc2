"""What clients may cost a real node (issue 21; node/guard.py): idle timeouts, half frames,
--max-connections, clients that never read their replies, and connection floods."""

import json
import socket
import struct
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
        s.sendall(prefix + payload[: 1 << 20] if k % 2 == 0 else prefix + payload)
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
