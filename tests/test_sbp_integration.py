"""SBP against real node processes: clients, durability across kill -9, shutdown, sbpctl stream."""

import fcntl
import json
import os
import socket
import subprocess
import struct
import sys
import termios
import threading
import time
import zlib

import pytest
import pytest_twisted
from twisted.internet import defer, reactor

from protocols.sbp import codec
from protocols.sbp.client import BlockingSbpClient, SbpClient, SbpConnectionError, SbpError
from storage import record_batch
from tests.waiting import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def batch(n, tag=b"r", size=20):
    return record_batch.encode([(1000 + i, [(b"k", b"v%d" % i)], tag + b"%d-" % i + b"." * size) for i in range(n)])


def records(data):
    return [r for b in record_batch.split(data) for r in record_batch.decode(b)[1]]


def client_for(node):
    return BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10)


def fetches_handled(node):
    """FETCH requests the node has taken in (a FETCH at the tail is parked once counted)."""
    with client_for(node) as c:
        return c.status()["metrics"]["sbp"]["fetches"]


def test_blocking_client_end_to_end_and_kill9_durability(node_factory):
    node = node_factory(fsync="always")
    c = client_for(node)
    s = c.create_stream()
    sid = s["stream_id"]
    assert sid >> 32 == node.node_id and sid & 0xFFFFFFFF >= 1
    bases = [c.append(sid, batch(10, b"a%d" % k)) for k in range(5)]
    assert bases == [0, 10, 20, 30, 40]
    assert c.append_many([(sid, batch(3)), (sid, batch(2))]) == [50, 53]
    with pytest.raises(SbpError) as e:
        c.append(sid, b"\x22" + b"\x00" * 40)
    assert e.value.code == codec.CORRUPT_BATCH
    with pytest.raises(SbpError) as e:
        c.append(12345, batch(1))
    assert e.value.code == codec.STREAM_NOT_FOUND
    data = c.fetch(sid, 0, 1 << 20)
    rs = records(data)
    assert [r.offset for r in rs] == list(range(55))
    assert rs[0].body.startswith(b"a00-") and rs[0].headers == [(b"k", b"v0")] and rs[0].timestamp_ms == 1000
    assert c.fetch(sid, 55) == b""
    with pytest.raises(SbpError) as e:
        c.fetch(sid, 56)
    assert e.value.code == codec.OFFSET_OUT_OF_RANGE
    assert c.describe_streams([sid])[0]["stream_id"] == sid
    (r0,) = c.list_ranges(sid)
    assert (r0["range_index"], r0["start_offset"], r0["next_offset"], r0["end_offset"]) == (0, 0, 55, -1)
    opened = c.seal(sid, 0)
    assert (opened["range_index"], opened["start_offset"]) == (1, 55)
    assert c.append(sid, batch(5)) == 55
    c.trim(sid, 12)
    # whole batches: the one holding 12 starts at 10
    assert records(c.fetch(sid, 12, 1))[0].offset == 10
    with pytest.raises(SbpError):
        c.fetch(sid, 5)
    # kill -9: everything acked survives; offsets continue after restart
    node.kill9()
    node.start()
    c2 = client_for(node)
    assert [r.offset for r in records(c2.fetch(sid, 12, 1 << 20))] == list(range(10, 60))
    assert c2.append(sid, batch(1)) == 60
    ranges = c2.list_ranges(sid)
    assert [r["range_index"] for r in ranges] == [0, 1] and ranges[0]["end_offset"] == 55
    c.close()
    c2.close()


def test_node_switches_to_the_compiled_append_check(node_factory):
    """The node validates APPENDs with msgpack until its compiled check has loaded (sbpctl status:
    append_check), then with that: good batches go in, malformed ones still get CORRUPT_BATCH."""
    node = node_factory()
    c = client_for(node)
    # the first run on a machine compiles (seconds)
    wait_until(lambda: c.status()["append_check"] != "loading", timeout=120, what="the append check to load")
    try:
        import numba  # noqa: F401
    except ImportError:
        assert c.status()["append_check"] == "msgpack"
    else:
        assert c.status()["append_check"] == "compiled"
    sid = c.create_stream()["stream_id"]
    assert c.append(sid, batch(64, size=1000)) == 0
    bad = bytearray(record_batch.encode([(1, [], b"x"), (2, [], b"y")]))
    bad[30] = 0x01  # record 0's array header becomes an int: the block no longer holds 2 records
    bad[21:25] = zlib.crc32(bytes(bad[29:])).to_bytes(4, "big")
    with pytest.raises(SbpError) as e:
        c.append(sid, bytes(bad))
    assert e.value.code == codec.CORRUPT_BATCH
    assert c.append(sid, batch(1)) == 64
    c.close()


def test_kill9_during_pipelined_appends_keeps_every_ack(node_factory):
    node = node_factory(fsync="always")
    c = client_for(node)
    sid = c.create_stream()["stream_id"]
    acked = []
    stop = threading.Event()

    def writer():
        w = client_for(node)
        try:
            while not stop.is_set():
                acked.append(w.append(sid, batch(4, b"w")))
        except SbpError:
            pass

    t = threading.Thread(target=writer)
    t.start()
    wait_until(lambda: len(acked) >= 20, timeout=30, what="appends acknowledged before the kill")
    node.kill9()
    stop.set()
    t.join(10)
    assert acked, "no append was acknowledged before the kill"
    node.start()
    c = client_for(node)
    nxt = max(r["next_offset"] for r in c.list_ranges(sid))
    assert nxt >= acked[-1] + 4
    offsets = []
    off = 0
    while off < nxt:
        data = c.fetch(sid, off, 1 << 20)
        rs = records(data)
        offsets += [r.offset for r in rs]
        off = rs[-1].offset + 1
    assert offsets == list(range(nxt))
    assert c.append(sid, batch(1)) == nxt
    c.close()


def test_long_poll_and_sigterm_answers_parked_fetch(node_factory):
    node = node_factory(fsync="never")
    c = client_for(node)
    sid = c.create_stream()["stream_id"]
    result = {}

    def waiter():
        w = client_for(node)
        t0 = time.monotonic()
        result["data"] = w.fetch(sid, 0, 1 << 20, max_wait_ms=10000)
        result["t"] = time.monotonic() - t0

    t = threading.Thread(target=waiter)
    t.start()
    wait_until(lambda: fetches_handled(node) >= 1, what="the FETCH to park")
    c.append(sid, batch(2))
    t.join(5)
    assert len(records(result["data"])) == 2 and result["t"] < 3
    # a raw socket parked at the tail: SIGTERM sends GOAWAY and NO_NEW_RECORD, then exits 0
    s = socket.create_connection(("127.0.0.1", node.ports["sbp"]))
    hdr = codec.encode_table("FetchRequest", codec.T.FetchRequest(60000, 1, [codec.T.FetchInfo(sid, 0, 2, 1000)]))
    s.sendall(codec.encode_frame(codec.FETCH, 0, 77, hdr))
    wait_until(lambda: fetches_handled(node) >= 2, what="the raw socket's FETCH to park")
    node.proc.send_signal(15)
    fb = codec.FrameBuffer()
    frames = []
    s.settimeout(10)
    while True:
        data = s.recv(65536)
        if not data:
            break
        fb.feed(data)
        while (f := fb.next()) is not None:
            frames.append(f)
    assert frames[0].opcode == codec.GOAWAY and frames[0].flags == 0
    assert frames[1].stream_id == 77 and frames[1].flags == 0x03
    assert codec.decode_header(frames[1]).fetch_responses[0].status.code == codec.NO_NEW_RECORD
    assert node.proc.wait(20) == 0
    s.close()
    c.close()


def test_blocking_client_pickles_config_only():
    import pickle

    c = BlockingSbpClient("127.0.0.1", 1, timeout=0.5)
    c2 = pickle.loads(pickle.dumps(c))
    assert (c2.host, c2.port, c2.timeout) == ("127.0.0.1", 1, 0.5)
    with pytest.raises(SbpConnectionError):
        c2.create_stream()
    e = pickle.loads(pickle.dumps(SbpError(1404, "x")))
    assert e.code == 1404


@pytest_twisted.ensureDeferred
async def test_twisted_client_follow_and_reconnect(node_factory):
    node = node_factory(fsync="never")
    client = SbpClient(reactor, "127.0.0.1", node.ports["sbp"])
    try:
        sid = (await client.create_stream())["stream_id"]
        got = []
        done = defer.Deferred()

        def on_batches(data, nxt):
            got.extend(r.offset for r in records(data))
            if len(got) >= 6 and not done.called:
                done.callback(None)

        follower = client.follow(sid, 0, on_batches, max_wait_ms=2000)
        bases = await defer.gatherResults([client.append(sid, batch(2)) for _ in range(3)])
        assert sorted(bases) == [0, 2, 4]
        await done
        follower.stop()
        assert got == list(range(6))
        # async iterator form
        it = client.follow(sid, 2, max_wait_ms=500)
        data, nxt = await it.__anext__()
        assert records(data)[0].offset == 2 and nxt == 6
        it.stop()
        await follower.done
        # errors arrive as SbpError through the Deferred
        with pytest.raises(SbpError) as e:
            await client.fetch(sid, 99)
        assert e.value.code == codec.OFFSET_OUT_OF_RANGE
        gone = client.follow(424242, 0, lambda data, nxt: None)
        with pytest.raises(SbpError):
            await gone.done
        many = await client.fetch_many([(sid, 0, 1), (sid, 6, 10)])
        assert len(records(many[0])) == 2 and many[1] == b""
        # the node restarts on another port? no: same port needed for reconnect; kill and restart
        # on the same port
        port = node.ports["sbp"]
        node.kill9()
        node.options["sbp"] = "tcp:%d:interface=127.0.0.1" % port
        with pytest.raises(SbpConnectionError):
            await client.append(sid, batch(1))
        node.start()
        base = await client.append(sid, batch(1))
        assert base == 6
    finally:
        await client.close()


def sbpctl(*args, input=None, timeout=60):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "node.cli", *args], input=input, capture_output=True, timeout=timeout, env=env, cwd=REPO)


def test_sbpctl_stream(node_factory):
    node = node_factory(fsync="never")
    ep = "--endpoint=127.0.0.1:%d" % node.ports["sbp"]
    r = sbpctl("stream", "create", ep)
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    lines = b"".join(b"line %d\n" % i for i in range(1000))
    r = sbpctl("stream", "append", sid, ep, "--batch-records", "100", input=lines)
    assert r.returncode == 0, r.stderr
    assert b"appended 1000 records" in r.stdout and b"rec/s" in r.stderr
    r = sbpctl("stream", "fetch", sid, ep, "--offset", "5", "--limit", "3")
    assert r.stdout.decode().splitlines() == ["line 5", "line 6", "line 7"]
    r = sbpctl("stream", "fetch", sid, ep, "--json", "--offset", "999")
    (obj,) = [json.loads(l) for l in r.stdout.decode().splitlines()]
    assert obj["offset"] == 999 and obj["body"] == "line 999" and obj["stream_id"] == int(sid)
    r = sbpctl("stream", "tail", sid, ep, "-n", "2")
    assert r.stdout.decode().splitlines() == ["line 998", "line 999"]
    r = sbpctl("stream", "list", ep, "--json")
    (obj,) = [json.loads(l) for l in r.stdout.decode().splitlines()]
    assert obj["stream_id"] == int(sid) and obj["next_offset"] == 1000
    r = sbpctl("stream", "seal", sid, ep)
    assert r.returncode == 0 and b"range 1 is open at offset 1000" in r.stdout
    r = sbpctl("stream", "trim", sid, ep, "500")
    assert r.returncode == 0 and b"starts at 500" in r.stdout
    r = sbpctl("stream", "describe", sid, ep)
    assert b"start=500 next=1000" in r.stdout
    # fetch --follow prints records as they arrive
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO
    parked = fetches_handled(node) + 1
    p = subprocess.Popen([sys.executable, "-m", "node.cli", "stream", "fetch", sid, ep, "--offset", "1000", "--follow"],
                         stdout=subprocess.PIPE, env=env, cwd=REPO)
    try:
        wait_until(lambda: fetches_handled(node) >= parked, what="the follower's FETCH to park")
        c = client_for(node)
        c.append(int(sid), record_batch.encode([(1, [], b"followed!")]))
        line = p.stdout.readline()
        assert line == b"followed!\n"
    finally:
        p.kill()
        p.wait()
    # errors are one line, no traceback
    r = sbpctl("stream", "fetch", "424242", ep)
    assert r.returncode == 1 and b"STREAM_NOT_FOUND" in r.stderr and b"Traceback" not in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    r = sbpctl("stream", "list", "--endpoint=127.0.0.1:%d" % free)
    assert r.returncode == 1 and b"Traceback" not in r.stderr and b"cannot connect" in r.stderr


def _unread(sock):
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _rss_mb(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def test_slow_fetch_reader_does_not_make_the_node_buffer(node_factory):
    node = node_factory(fsync="never")
    c = client_for(node)
    sid = c.create_stream()["stream_id"]
    big = batch(64, size=1000)
    for _ in range(20):
        c.append(sid, big)  # ~1.3 MiB
    base_rss = _rss_mb(node.proc.pid)
    n = 600  # ~780 MiB of replies if the node buffered them all
    hdr = codec.encode_table("FetchRequest", codec.T.FetchRequest(0, 1, [codec.T.FetchInfo(sid, 0, 0, 4 << 20)]))
    s = socket.create_connection(("127.0.0.1", node.ports["sbp"]))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    s.sendall(b"".join(codec.encode_frame(codec.FETCH, 0, i + 1, hdr) for i in range(n)))
    # the node has done what it will for a reader that does not read: the bytes waiting in our
    # socket and the node's RSS stop changing from one look to the next
    last = [None]

    def settled():
        now = (_unread(s), _rss_mb(node.proc.pid))
        was, last[0] = last[0], now
        return now[0] > 0 and now == was

    wait_until(settled, timeout=30, interval=0.25, what="the node to stop sending to the stalled reader")
    peak = _rss_mb(node.proc.pid)
    assert peak - base_rss < 250, "node grew by %.0f MiB for a reader that does not read" % (peak - base_rss)
    # the reader catches up: every reply arrives, whole
    fb = codec.FrameBuffer()
    got = 0
    s.settimeout(30)
    while got < n:
        fb.feed(s.recv(1 << 20))
        while (f := fb.next()) is not None:
            assert f.flags == 0x03 and len(f.payload) == 20 * len(big)
            got += 1
    s.close()
    c.close()


def test_blocking_client_survives_a_node_restart_for_reads(node_factory):
    node = node_factory(fsync="always", sbp="tcp:%d:interface=127.0.0.1" % _free_port())
    c = client_for(node)
    sid = c.create_stream()["stream_id"]
    c.append(sid, batch(3))
    assert node.terminate() == 0
    node.start()
    # the node said GOAWAY and closed between requests: the client reconnects before sending
    assert len(records(c.fetch(sid, 0))) == 3
    node.terminate()
    node.start()
    assert c.append(sid, batch(1)) == 3
    # killed between requests (no GOAWAY): the stale connection is noticed too
    node.kill9()
    node.start()
    assert c.append(sid, batch(1)) == 4
    c.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
