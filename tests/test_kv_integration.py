"""The kv protocol against real node processes: scans across partitions, limits, kill -9, sbpctl."""

import json
import os
import random
import socket
import struct
import subprocess
import sys
import time

import pytest

from protocols.partition import codec as c
from protocols.partition.client import BlockingKvClient, KvError
from tests.nodeproc import REPO

OFF = dict(sbp="none", meta="none", chunks="none", swarm="none", http="none")


def spread_keys(n, seed=1):
    """Distinct keys over all 8 partitions, of varied lengths (including 1-byte keys)."""
    rnd = random.Random(seed)
    keys = {bytes([b]) for b in range(0, 256, 7)}
    while len(keys) < n:
        keys.add(bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 12))))
    return sorted(keys)


def fill(kv, keys):
    results = kv.pipeline([(c.SET, lambda cid, k=k: c.encode_set(cid, k, b"v:" + k)) for k in keys])
    assert results == [None] * len(keys)


def test_full_scans_across_partitions(node_factory):
    node = node_factory(fsync="never", **OFF)
    keys = spread_keys(3000)
    assert {c.partition_of(k) for k in keys} == set(range(8))
    with BlockingKvClient(*node.address("kv")) as kv:
        fill(kv, keys)
        for page_size in (7, 1024):
            pages = list(kv.iter_scan(c.GET_FF, page=page_size))
            got = [k for p in pages for k, _ in p.items]
            assert got == keys  # each key exactly once, in order
            assert all(v == b"v:" + k for p in pages for k, v in p.items)
            for p in pages:
                assert p.jumped == (len({c.partition_of(k) for k, _ in p.items}) > 1)
        pages = list(kv.iter_scan(c.GET_FB, page=100))
        assert [k for p in reversed(pages) for k, _ in p.items] == keys
        assert all(p.keys == sorted(p.keys) for p in pages)
        pages = list(kv.iter_scan(c.GET_KEYS, page=999))
        assert [k for p in pages for k in p.keys] == keys
        prefix = keys[len(keys) // 2][:1]
        pages = list(kv.iter_scan(c.GET_KEYS_PREFIX, page=5, prefix=prefix))
        assert [k for p in pages for k in p.keys] == [k for k in keys if k.startswith(prefix)]

        # a page that fills exactly at a partition's end: the next page starts in the next one
        part0 = [k for k in keys if c.partition_of(k) == 0]
        kv.create_cursor(b"x")
        p = kv.scan(c.GET_KEYS, b"x", len(part0))
        assert p.keys == part0 and not p.jumped and c.partition_of(p.next_key) == 1
        p = kv.scan(c.GET_KEYS, b"x", 1)
        assert c.partition_of(p.keys[0]) == 1 and not p.jumped

        # removes: gone from scans and GETs; REMOVE of a missing key is DATA_NOT_FOUND
        gone = keys[::3]
        assert kv.pipeline([(c.REMOVE, lambda cid, k=k: c.encode_remove(cid, k)) for k in gone]) == [True] * len(gone)
        assert kv.remove(gone[0]) is False
        assert kv.get(gone[1]) is None
        left = [k for k in keys if k not in set(gone)]
        assert [k for p in kv.iter_scan(c.GET_FF, page=1024) for k, _ in p.items] == left

        # errors keep the connection in sync
        with pytest.raises(KvError) as ei:
            kv.scan(c.GET_FF, b"x", 1025)
        assert ei.value.code == c.E_TOO_MANY_ELEMENTS
        with pytest.raises(KvError) as ei:
            kv.scan(c.GET_FF, b"nope", 1)
        assert ei.value.code == c.E_CURSOR_NOT_FOUND
        assert kv.get(left[0]) == b"v:" + left[0]


def test_big_values_and_length_limits(node_factory):
    node = node_factory(fsync="never", **OFF)
    big = os.urandom(16 * 1024 * 1024)
    with BlockingKvClient(*node.address("kv")) as kv:
        kv.set(b"big", big)
        assert kv.get(b"big") == big
        kv.set(b"max", b"m")
        with pytest.raises(KvError) as ei:
            kv.set(b"big", big + b"x")
        assert ei.value.code == c.E_UNKNOWN
        kv.set(b"\xff" * 65535, b"longest key")
        assert kv.get(b"\xff" * 65535) == b"longest key"
        pages = list(kv.iter_scan(c.GET_FF, page=1024))
        assert [k for p in pages for k, _ in p.items] == [b"big", b"max", b"\xff" * 65535]
    # a claimed 1 TB message: ERR 3 echoing client_id, then the server closes
    s = socket.create_connection(node.address("kv"), timeout=10)
    s.sendall(struct.pack(">QQ", 10**12, 77))
    data = b""
    while True:
        chunk = s.recv(100)
        if not chunk:
            break
        data += chunk
    assert data == c.encode_error(77, c.E_MSG_TOO_SHORT)
    s.close()
    # garbage on a connection does not hurt the node
    s = socket.create_connection(node.address("kv"), timeout=10)
    s.sendall(os.urandom(5000))
    s.close()
    with BlockingKvClient(*node.address("kv")) as kv:
        assert kv.get(b"max") == b"m"


@pytest.mark.parametrize("fsync", ["always", "never", "interval:60000"])
def test_acked_writes_survive_kill9(node_factory, fsync):
    """Every acked write is there after kill -9. Under interval/never kv writes skip the WAL: the
    LMDB commit (to the page cache) before the ack is what a process crash must not lose."""
    node = node_factory(fsync=fsync, **OFF)
    keys = spread_keys(2000, seed=3)
    with BlockingKvClient(*node.address("kv")) as kv:
        fill(kv, keys)
        results = kv.pipeline([(c.REMOVE, lambda cid, k=k: c.encode_remove(cid, k)) for k in keys[:100]]
                              + [(c.SET, lambda cid: c.encode_set(cid, keys[150], b"overwritten"))])
        assert results == [True] * 100 + [None]
        kv.set(keys[160], b"set alone")
    node.kill9()
    node.start()
    with BlockingKvClient(*node.address("kv")) as kv:
        got = dict(item for p in kv.iter_scan(c.GET_FF) for item in p.items)
        expected = {k: b"v:" + k for k in keys[100:]}
        expected[keys[150]] = b"overwritten"
        expected[keys[160]] = b"set alone"
        assert got == expected
        assert kv.get(keys[0]) is None


def sbpctl(*args, stdin=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "node.cli", "kv", *args], input=stdin, capture_output=True, env=env, timeout=60)


def test_sbpctl_kv(node_factory):
    node = node_factory(fsync="never", **OFF)
    ep = ["--endpoint", node.endpoint("kv")]
    assert sbpctl("set", "alpha", "one", *ep).returncode == 0
    assert sbpctl("set", "beta", *ep, stdin=b"two\x00bytes").returncode == 0
    assert sbpctl("set", "--hex", "ff00", "c0ffee", *ep).returncode == 0
    r = sbpctl("get", "alpha", *ep)
    assert (r.returncode, r.stdout) == (0, b"one\n")
    r = sbpctl("get", "--base64", "YmV0YQ==", *ep)
    assert r.stdout.strip() == b"dHdvAGJ5dGVz"
    r = sbpctl("scan", "--hex", "--json", *ep)
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines == [{"key": "616c706861", "value": "6f6e65"}, {"key": "62657461", "value": "74776f006279746573"}, {"key": "ff00", "value": "c0ffee"}]
    r = sbpctl("scan", "--reverse", "--limit", "2", *ep)
    assert r.stdout.splitlines()[0] == b"\\xff\x00\t\\xc0\\xff\\xee"  # NUL is valid UTF-8
    assert len(r.stdout.splitlines()) == 2
    r = sbpctl("keys", "--prefix", "b", *ep)
    assert r.stdout == b"beta\n"
    r = sbpctl("rm", "alpha", *ep)
    assert r.returncode == 0
    r = sbpctl("rm", "alpha", *ep)
    assert r.returncode == 1 and b"not found" in r.stderr and b"Traceback" not in r.stderr
    r = sbpctl("get", "alpha", *ep)
    assert r.returncode == 1 and r.stderr.startswith(b"sbpctl: error:") and b"Traceback" not in r.stderr
    r = sbpctl("get", "--hex", "zz", *ep)
    assert r.returncode == 1 and b"not valid hex" in r.stderr
    node.kill9()
    r = sbpctl("get", "x", *ep)
    assert r.returncode == 1 and b"not reachable" in r.stderr and b"Traceback" not in r.stderr


def test_long_keys_scan_in_order(node_factory):
    node = node_factory(fsync="never", **OFF)
    base = b"p" * 440
    keys = sorted(base + bytes([i]) + b"x" * 10 for i in range(0, 256, 5))
    with BlockingKvClient(*node.address("kv")) as kv:
        fill(kv, keys)
        pages = list(kv.iter_scan(c.GET_FF, page=7))
        assert [k for p in pages for k, _ in p.items] == keys
        pages = list(kv.iter_scan(c.GET_FB, page=5))
        assert [k for p in reversed(pages) for k, _ in p.items] == keys
        pages = list(kv.iter_scan(c.GET_KEYS_PREFIX, page=3, prefix=base + b"\x05"))
        assert [k for p in pages for k in p.keys] == [base + b"\x05" + b"x" * 10]


def test_sigterm_with_open_connections_then_restart(node_factory):
    node = node_factory(fsync="interval:50", **OFF)
    kv = BlockingKvClient(*node.address("kv"))
    keys = spread_keys(200, seed=3)
    fill(kv, keys)
    kv.create_cursor(b"open")
    # unacknowledged writes in flight when SIGTERM arrives are finished before the store closes
    kv.sock.sendall(b"".join(c.encode_set(10_000 + i, b"late%03d" % i, b"x") for i in range(300)))
    assert node.terminate() == 0
    kv.close()
    node.start()
    with BlockingKvClient(*node.address("kv")) as kv2:
        got = {k for p in kv2.iter_scan(c.GET_KEYS) for k in p.keys}
        assert set(keys) <= got
        with pytest.raises(KvError):
            kv2.scan(c.GET_FF, b"open", 1)  # cursors do not outlive their connection


def test_pipelined_reads_see_the_connections_own_writes(node_factory):
    node = node_factory(fsync="always", **OFF)
    with BlockingKvClient(*node.address("kv")) as kv:
        for round_ in range(20):
            k = b"rw%d" % round_
            results = kv.pipeline([
                (c.SET, lambda cid: c.encode_set(cid, k, b"one")),
                (c.GET, lambda cid: c.encode_get(cid, k)),
                (c.SET, lambda cid: c.encode_set(cid, k, b"two")),
                (c.GET, lambda cid: c.encode_get(cid, k)),
                (c.GET_KEYS, lambda cid: c.encode_scan(c.GET_KEYS, cid, 5, b"nope")),
                (c.REMOVE, lambda cid: c.encode_remove(cid, k)),
                (c.GET, lambda cid: c.encode_get(cid, k)),
                (c.REMOVE, lambda cid: c.encode_remove(cid, k)),
            ])
            assert results[:4] == [None, b"one", None, b"two"]
            assert isinstance(results[4], KvError) and results[4].code == c.E_CURSOR_NOT_FOUND
            assert results[5:] == [True, None, False]


def test_pipelined_set_get_pairs_commit_in_groups_under_fsync_always(node_factory):
    """Issue 19's stall: ``SET k, GET k`` pairs pipelined on one connection under --fsync always
    must share group commits (each GET reads the connection's pending write, its reply waits
    behind the SET's). Counted from the store's group-commit counter, not timed: on the old code
    every GET waited for the SET before it, so every SET was a group commit of its own."""
    from tests.test_metrics import scrape, value

    node = node_factory(fsync="always", sbp="none", meta="none", chunks="none", swarm="none")
    pairs = 2000
    with BlockingKvClient(*node.address("kv")) as kv:
        kv.set(b"warm", b"up")
        before = value(scrape(node), "sbpnode_store_group_commits_total")
        requests = []
        for i in range(pairs):
            key = b"k%05d" % i
            requests.append((c.SET, lambda cid, k=key: c.encode_set(cid, k, b"v" * 40 + k)))
            requests.append((c.GET, lambda cid, k=key: c.encode_get(cid, k)))
        results = kv.pipeline(requests)
        assert results[0::2] == [None] * pairs
        assert results[1::2] == [b"v" * 40 + b"k%05d" % i for i in range(pairs)]
        groups = value(scrape(node), "sbpnode_store_group_commits_total") - before
    assert 1 <= groups <= pairs // 20, groups


def _writer(address, keys, seed, log, stop):
    """Pipelined batches of SETs and REMOVEs of ``keys`` (each key once per batch) until the
    connection breaks; ``log``: [(batch ops, replies received)] in order."""
    rnd = random.Random(seed)
    try:
        s = socket.create_connection(address, timeout=30)
    except OSError:
        return
    n = 0
    try:
        while not stop.is_set():
            ops = []
            for k in rnd.sample(keys, 40):
                n += 1
                ops.append((k, None if rnd.random() < 0.3 else b"%d-%d-" % (seed, n) + b"x" * rnd.randrange(200)))
            entry = [ops, []]
            log.append(entry)
            s.sendall(b"".join(c.encode_remove(i, k) if v is None else c.encode_set(i, k, v) for i, (k, v) in enumerate(ops)))
            buf = b""
            while len(entry[1]) < len(ops):
                data = s.recv(65536)
                if not data:
                    return
                buf += data
                while len(buf) >= c.HEADER_LEN and len(entry[1]) < len(ops):
                    (total,) = struct.unpack_from(">Q", buf)
                    if len(buf) < total:
                        break
                    entry[1].append(struct.unpack_from(">H", buf, 24)[0])
                    buf = buf[total:]
    except OSError:
        return
    finally:
        s.close()


@pytest.mark.slow
def test_kill9_mid_load_keeps_every_acked_set_and_remove(node_factory):
    """kill -9 of a node while four connections pipeline SETs and REMOVEs under --fsync always
    (the memtable merged into LMDB every second while the load runs): after the restart every
    key holds its last acknowledged write, or the write to it still unanswered at the kill, and
    every acknowledged REMOVE was answered as the key's history says. (Kills during merges of
    many small memtables: tests/test_storage_kv_crash.py.)"""
    import threading

    node = node_factory(fsync="always", **OFF)
    rnd = random.Random(2019)
    model = {}  # key -> value acknowledged last (None: removed / never written)
    for round_ in range(3):
        logs = [[] for _ in range(4)]
        stop = threading.Event()
        # each connection owns its keys, so acks on one connection order every write of a key
        key_sets = [[b"%c%d-%04d" % (rnd.choice(b"a\x20\x90\xf0"), t, i) for i in range(400)] for t in range(4)]
        threads = [threading.Thread(target=_writer, args=(node.address("kv"), key_sets[t], round_ * 10 + t, logs[t], stop))
                   for t in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(len(log) for log in logs) < 20 + round_ * 10 and time.monotonic() < deadline:
            time.sleep(0.01)  # wait for load, then kill at a random moment of it
        time.sleep(rnd.uniform(0.0, 0.5))
        node.kill9()
        stop.set()
        for t in threads:
            t.join(30)
        unsure = {}
        for log in logs:
            for ops, answers in log:
                for i, (k, v) in enumerate(ops):
                    if i < len(answers):
                        if v is None:
                            assert answers[i] == (c.OK if model.get(k) is not None else c.DATA_NOT_FOUND), k
                        else:
                            assert answers[i] == c.OK
                        model[k] = v
                    else:
                        unsure[k] = v
        assert sum(len(a) for log in logs for _, a in log) > 0
        node.start()
        with BlockingKvClient(*node.address("kv")) as kv:
            ks = sorted(set(model) | set(unsure))
            got = kv.pipeline([(c.GET, lambda cid, k=k: c.encode_get(cid, k)) for k in ks])
            for k, v in zip(ks, got):
                assert v == model.get(k) or (k in unsure and v == unsure[k]), (k, v, model.get(k))
                model[k] = v  # an unanswered write either landed or not: the store now says which
            assert [k for p in kv.iter_scan(c.GET_KEYS, page=1024) for k in p.keys] == sorted(k for k in ks if model[k] is not None)
