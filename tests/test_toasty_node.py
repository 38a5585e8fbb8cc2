"""Toasty against real node processes: clients, sbpctl fs, restarts and kill -9 mid-write."""

import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest
import pytest_twisted
from twisted.internet import reactor

from protocols.toasty import codec
from protocols.toasty.client import BlockingConnection, BlockingToastyClient, NotFoundError, ToastyClient, ToastyError
from tests.nodeproc import REPO


def blob(n, seed=b"x"):
    out = bytearray()
    block = hashlib.sha256(seed).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


def test_put_get_stat_list_blocking(node):
    with BlockingToastyClient(*node.address("meta")) as c:
        c.mkdir("/docs")
        data = blob(5 * 1024 * 1024 + 123)  # 4096-byte chunks: two WRITE pieces
        gen = c.write("/docs/big", data, truncate=True)
        assert c.read("/docs/big") == data
        info = c.stat("/docs/big")
        assert info == {"is_dir": False, "gen": gen, "chunk_size": 4096, "size": len(data)}
        assert c.read("/docs/big", 4000, 10_000) == data[4000:14_000]
        # overwrite with shorter content (TRUNCATE_AFTER), then patch in the middle
        c.write("/docs/big", b"hello world", truncate=True)
        assert c.read("/docs/big") == b"hello world"
        c.write("/docs/big", b"W", offset=6)
        assert c.read("/docs/big") == b"hello World"
        c.write("/docs/big", b"+", offset=11)  # past the end of file, inside the last chunk
        assert c.read("/docs/big") == b"hello World+"
        c.write("/docs/big", b"", offset=11, truncate=True)
        c.write("/docs/big", b"!", offset=9000)  # a hole in between reads as zeros
        assert c.read("/docs/big") == b"hello World" + bytes(9000 - 11) + b"!"
        # a chosen chunk size goes through CREATE first
        c.write("/docs/k64", data[:300_000], chunk_size=65536)
        assert c.stat("/docs/k64")["chunk_size"] == 65536
        assert c.read("/docs/k64") == data[:300_000]
        gen_dir, items = c.list("/docs")
        assert [(i.name, i.is_dir) for i in items] == [(b"big", False), (b"k64", False)]
        assert c.stat("/docs")["is_dir"]
        with pytest.raises(NotFoundError):
            c.read("/nope")
        with pytest.raises(ToastyError):
            c.delete("/docs")  # not empty
        c.delete("/docs/big")
        c.delete("/docs/k64")
        c.delete("/docs")
        assert c.list("/")[1] == []


def test_write_conflict_retries_from_read(node):
    """Two writers racing on one file: every write lands (each retry re-reads the generation)."""
    errors = []

    def writer(k):
        try:
            with BlockingToastyClient(*node.address("meta")) as c:
                for i in range(15):
                    c.write("/shared", bytes([k]) * 10, offset=k * 10)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    with BlockingToastyClient(*node.address("meta")) as c:
        assert c.read("/shared") == b"\x00" * 10 + b"\x01" * 10 + b"\x02" * 10


def test_chunks_listener_off_means_no_write_locations(node_factory):
    n = node_factory(chunks="none")
    conn = BlockingConnection(*n.address("meta"))
    r = conn.call(codec.Read(0, b"/missing", 0, 1))
    assert r.TYPE == codec.READ_ERROR and r.write_locations == []
    conn.call(codec.Create(b"/f", False, 4096))
    r = conn.call(codec.Read(0, b"/f", 0, 1))
    assert r.TYPE == codec.READ_SUCCESS and r.write_locations == []
    conn.close()


def test_garbage_on_real_sockets_closes_and_node_survives(node):
    import socket

    for listener, junk in [("meta", b"\x01\x00\x63\x00\x10\x00\x00\x00" + bytes(8)), ("chunks", b"GET / HTTP/1.1\r\n\r\n")]:
        s = socket.create_connection(node.address(listener), timeout=5)
        s.sendall(junk)
        assert s.recv(100) == b""  # closed, no reply
        s.close()
    with BlockingToastyClient(*node.address("meta")) as c:
        assert c.list("/")[0] == 1


@pytest_twisted.ensureDeferred
async def test_twisted_client_round_trip(node):
    c = await ToastyClient.connect(reactor, *node.address("meta"))
    try:
        data = blob(700_000, b"tw")
        await c.mkdir("/t")
        gen = await c.write("/t/f", data, truncate=True, chunk_size=65536)
        assert await c.read("/t/f") == data
        gen2 = await c.write("/t/f", b"abc", offset=65530)
        assert gen2 > gen
        expect = data[:65530] + b"abc" + data[65533:]
        assert await c.read("/t/f") == expect
        await c.write("/t/g", b"A" * 10)
        await c.write("/t/g", b"B" * 10, offset=10)  # past the end of file, inside its chunk
        assert await c.read("/t/g") == b"A" * 10 + b"B" * 10
        await c.delete("/t/g")
        g, items = await c.list("/t")
        assert [i.name for i in items] == [b"f"]
        await c.delete("/t/f")
        try:
            await c.read("/t/f")
        except NotFoundError:
            pass
        else:
            raise AssertionError("read of a deleted file succeeded")
    finally:
        c.close()


def sbpctl(node, *args, input=None):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(
        [sys.executable, "-m", "node.cli", "fs", "--endpoint", node.endpoint("meta")] + list(args),
        input=input, capture_output=True, env=env, timeout=60,
    )


def test_sbpctl_fs(node, tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(blob(1_500_000, b"cli"))
    assert sbpctl(node, "mkdir", "/c").returncode == 0
    r = sbpctl(node, "put", str(src), "/c/file", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert b"sha256 " + hashlib.sha256(src.read_bytes()).hexdigest().encode() in r.stderr
    out = tmp_path / "out.bin"
    r = sbpctl(node, "get", "/c/file", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == src.read_bytes()
    r = sbpctl(node, "ls", "/c")
    assert r.stdout == b"file\n"
    r = sbpctl(node, "get", "/c")  # a directory prints its listing
    assert r.returncode == 0 and r.stdout == b"file\n"
    r = sbpctl(node, "stat", "/c/file")
    assert b"size         1500000" in r.stdout and b"chunk_size   65536" in r.stdout
    r = sbpctl(node, "put", "-", "/c/small", input=b"tiny")
    assert r.returncode == 0, r.stderr
    assert sbpctl(node, "get", "/c/small").stdout == b"tiny"
    r = sbpctl(node, "rm", "/c")
    assert r.returncode == 1 and b"not empty" in r.stderr
    r = sbpctl(node, "get", "/c/../etc")
    assert r.returncode == 1 and b"Invalid path" in r.stderr
    r = sbpctl(node, "get", "/c/nothing")
    assert r.returncode == 1 and b"No such file" in r.stderr
    assert sbpctl(node, "rm", "/c/file").returncode == 0
    assert sbpctl(node, "ls", "/c").stdout == b"small\n"


def test_generations_persist_across_restart(node_factory):
    n = node_factory(fsync="always")
    with BlockingToastyClient(*n.address("meta")) as c:
        d = c.mkdir("/d")
        g = c.write("/d/f", b"x" * 10000, truncate=True)
        c.write("/d/f", b"", offset=100, truncate=True)  # TRUNCATE_AFTER must survive
        g = c.stat("/d/f")["gen"]
    n.restart()
    with BlockingToastyClient(*n.address("meta")) as c:
        _, items = c.list("/d")
        assert [(i.name, i.gen) for i in items] == [(b"f", g)]
        assert c.list("/d")[0] == d and c.list("/")[0] == 1
        assert c.read("/d/f") == b"x" * 100
        assert c.mkdir("/e") > g  # the counter went on, no reuse


def test_kill9_mid_write_leaves_old_or_new(node_factory):
    """Writers overwrite files with versions (each one WRITE); after kill -9 every file holds
    exactly one version, at least the last acknowledged one."""
    n = node_factory(fsync="always")
    files = ["/k%d" % i for i in range(4)]
    size = 3 * 4096 + 100
    acked = {f: -1 for f in files}
    sent = {f: -1 for f in files}
    stop = threading.Event()

    def writer(f):
        try:
            with BlockingToastyClient(*n.address("meta"), timeout=10) as c:
                v = 0
                while not stop.is_set():
                    sent[f] = v
                    c.write(f, bytes([v % 251]) * (size - v % 7), truncate=True)
                    acked[f] = v
                    v += 1
        except (OSError, ToastyError):
            pass

    threads = [threading.Thread(target=writer, args=(f,)) for f in files]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while min(acked.values()) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    n.kill9()
    stop.set()
    for t in threads:
        t.join(15)
    assert min(acked.values()) >= 5
    n.start()
    with BlockingToastyClient(*n.address("meta")) as c:
        for f in files:
            data = c.read(f)
            versions = [v for v in range(acked[f], sent[f] + 1) if data == bytes([v % 251]) * (size - v % 7)]
            assert versions, "%s: %d bytes match no version in %d..%d" % (f, len(data), acked[f], sent[f])


@pytest.mark.parametrize("chunk_size", [16, 4096])
def test_random_writes_match_a_model(node, chunk_size):
    """Random writes (offsets inside, at and past the end, truncations) read back like a bytearray."""
    import random

    rnd = random.Random(chunk_size)
    model = bytearray()
    with BlockingToastyClient(*node.address("meta")) as c:
        path = "/model%d" % chunk_size
        c.write(path, b"", chunk_size=chunk_size)
        for step in range(60):
            size = len(model)
            offset = rnd.choice([0, rnd.randrange(0, size + 1), size, size + rnd.randrange(0, 3 * chunk_size), rnd.randrange(0, 40 * chunk_size)])
            data = bytes(rnd.getrandbits(8) for _ in range(rnd.choice([0, 1, rnd.randrange(1, 5 * chunk_size)])))
            truncate = rnd.random() < 0.3
            c.write(path, data, offset=offset, truncate=truncate)
            if offset > len(model):
                model += bytes(offset - len(model))
            model[offset : offset + len(data)] = data
            if truncate:
                del model[offset + len(data) :]
            assert c.read(path) == bytes(model), step
        assert c.stat(path)["size"] == len(model)
