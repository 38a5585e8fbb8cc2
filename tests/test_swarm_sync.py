"""Swarm peer sync between real node processes on loopback (--peer), checked over the swarm
listeners themselves with the blocking client."""

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from bench.swarm_bench import preload_subprocess
from tests.etcdproc import free_port
from protocols.sbp.client import BlockingSbpClient
from protocols.swarm import codec
from protocols.swarm.client import BlockingSwarmClient
from protocols.swarm.codec import ChunkDelivery, GetRange, OfferedHashes, StreamDescriptor, StreamInfoReq, StreamInfoRes, WantedHashes
from tests.nodeproc import REPO
from tests.waiting import wait_until

OFF = dict(sbp="none", kv="none", meta="none", chunks="none", http="none", fsync="never")


def info(node):
    with BlockingSwarmClient("127.0.0.1", node.ports["swarm"]) as c:
        return c.stream_info()


def content(node):
    """{ID: [hashes in index order]} (CHUNKS as a sorted list: arrival order differs per node)."""
    out = {}
    with BlockingSwarmClient("127.0.0.1", node.ports["swarm"]) as c:
        for stream, cursor in c.stream_info().items():
            hashes = c.hashes(stream, cursor)
            out[stream] = sorted(hashes) if stream == codec.CHUNKS_ID else hashes
    return out


def live_peers(node):
    """node.metrics["peers"] as the node has it now (SBP status), not the 1/s snapshot file."""
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10) as c:
        return c.status()["metrics"].get("peers", {})


def peers_snapshot(node):
    try:
        with open(os.path.join(node.data_dir, "swarm-peers.json")) as f:
            return json.load(f)["peers"]
    except (FileNotFoundError, ValueError):
        return {}


def test_two_nodes_sync_chunks_and_logs(tmp_path, node_factory):
    pre = preload_subprocess(str(tmp_path / "a-data"), 11, chunks=300, chunk_size=1000, streams=2, batches=20, records=3, body=50)
    a = node_factory(name="a", node_id=11, **OFF)
    want = info(a)
    assert want[codec.CHUNKS_ID] == 300 and len(want) == 3
    assert {k.key for k in want if k.name == "LOG"} == set(pre["streams"])
    b = node_factory(name="b", node_id=12, peer=a.peer_endpoint(), **OFF)
    wait_until(lambda: info(b) == want, what="B to hold A's chunks and streams")
    assert content(b) == content(a)  # same hashes: identical chunk bytes and stored batches
    # observability: the peer list shows A, caught up
    snap = wait_until(lambda: (lambda p: p if p and list(p.values())[0].get("lag") == 0 and list(p.values())[0]["streams"] else None)(peers_snapshot(b)), what="peer stats")
    stats = snap[a.endpoint("swarm")]
    assert stats["connected"] and stats["items"] == 300 + 40
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "node.cli", "peer", "list", "--data-dir", b.data_dir], capture_output=True, env=env, timeout=60)
    assert out.returncode == 0 and a.endpoint("swarm") in out.stdout.decode()
    out = subprocess.run([sys.executable, "-m", "node.cli", "peer", "status", "--data-dir", b.data_dir], capture_output=True, env=env, timeout=60)
    assert out.returncode == 0 and "CHUNKS|" in out.stdout.decode() and "LOG|" in out.stdout.decode()


def test_three_nodes_both_ways_converge(tmp_path, node_factory):
    ports = {n: free_port() for n in "abc"}
    ids = {"a": 21, "b": 22, "c": 23}
    for n in "abc":
        preload_subprocess(str(tmp_path / (n + "-data")), ids[n], chunks=150, chunk_size=512, streams=1, batches=10, records=2, body=30, seed=n)
    nodes = {}
    for n in "abc":
        peers = ["tcp:host=127.0.0.1:port=%d" % ports[m] for m in "abc" if m != n]
        opts = dict(OFF, swarm="tcp:%d:interface=127.0.0.1" % ports[n])
        nodes[n] = node_factory(name=n, node_id=ids[n], peer=peers, **opts)

    def converged():
        infos = [info(nodes[n]) for n in "abc"]
        return all(i == infos[0] for i in infos) and infos[0][codec.CHUNKS_ID] == 450 and len(infos[0]) == 4

    wait_until(converged, what="three nodes to converge")
    contents = [content(nodes[n]) for n in "abc"]
    assert contents[0] == contents[1] == contents[2]
    # each stream kept its id everywhere and its owner did not get a copy back as a new stream
    sids = sorted(int(k.key) for k in contents[0] if k.name == "LOG")
    assert sorted(s >> 32 for s in sids) == [21, 22, 23]
    # idle and caught up: nothing more crosses the wire (only hashes ever did for known items).
    # Every link must come up and report no lag; data can converge through the other links before
    # a node's last connect retry (backoff up to 5 s) has even happened, so wait for it.

    def links_up(n):
        peers = peers_snapshot(nodes[n]).values()
        return len(peers) == 2 and all(p["connected"] and p.get("lag") == 0 for p in peers)

    for n in "abc":
        wait_until(lambda: links_up(n), timeout=30.0, what="node %s's peer links up and caught up" % n)


def test_restart_mid_batch_resumes(tmp_path, node_factory):
    preload_subprocess(str(tmp_path / "a-data"), 31, chunks=4000, chunk_size=4096, streams=1, batches=300, records=8, body=1000)
    a = node_factory(name="a", node_id=31, **OFF)
    want = info(a)
    b = node_factory(name="b", node_id=32, peer=a.peer_endpoint(), **OFF)
    wait_until(lambda: info(b).get(codec.CHUNKS_ID), timeout=30, what="B to start syncing")
    b.kill9()  # mid-sync: intervals and chunks may disagree; the restart must fix it
    b.start()
    wait_until(lambda: info(b) == want, what="B to finish after a kill -9")
    assert content(b) == content(a)
    # a clean restart once synced resumes from the persisted intervals: nothing is refetched
    b.restart()
    # reconnected, and its streams compared with A's: a refetch would show here as lag or items
    snap = wait_until(lambda: (lambda p: p if p and all(v["connected"] and v["streams"] and "lag" in v for v in p.values()) else None)(peers_snapshot(b)), what="B reconnected and compared")
    stats = snap[a.endpoint("swarm")]
    assert stats["items"] == 0 and stats["lag"] == 0
    assert info(b) == want


class EvilPeer:
    """A stream! server that offers one chunk and then delivers what ``deliver`` returns."""

    def __init__(self, deliver):
        self.deliver = deliver
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.closed_by_peer = 0
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        self.sock.settimeout(0.2)
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn):
        reader = codec.FrameReader()
        data = b"good chunk"
        addr = hashlib.sha256(data).digest()
        conn.settimeout(10)
        try:
            while True:
                got = conn.recv(65536)
                if not got:
                    self.closed_by_peer += 1
                    return
                for body in reader.feed(got):
                    msg = codec.decode_body(body)
                    if isinstance(msg, StreamInfoReq):
                        conn.sendall(codec.encode(StreamInfoRes([StreamDescriptor(codec.CHUNKS_ID, 1, False)])))
                    elif isinstance(msg, GetRange):
                        conn.sendall(codec.encode(OfferedHashes(msg.ruid, 1, addr)))
                    elif isinstance(msg, WantedHashes):
                        conn.sendall(codec.encode(ChunkDelivery(msg.ruid, 1, [self.deliver(addr, data)])))
        except OSError:
            self.closed_by_peer += 1
        finally:
            conn.close()

    def close(self):
        self.stop = True
        self.sock.close()


@pytest.mark.parametrize("kind", ["bad-hash", "unsolicited"])
def test_bad_peer_dropped_and_nothing_stored(tmp_path, node_factory, kind):
    if kind == "bad-hash":
        evil = EvilPeer(lambda addr, data: (addr, data + b"!"))
    else:
        other = b"never offered"
        evil = EvilPeer(lambda addr, data: (hashlib.sha256(other).digest(), other))
    try:
        b = node_factory(name="b", node_id=42, peer="tcp:host=127.0.0.1:port=%d" % evil.port, **OFF)
        wait_until(lambda: evil.closed_by_peer >= 2 and evil.connections >= 2, timeout=30, what="B to drop and reconnect")
        assert info(b)[codec.CHUNKS_ID] == 0
        snap = peers_snapshot(b)
        assert any(v.get("last_error") for v in snap.values()) or "dropping peer" in b.log_text()
    finally:
        evil.close()


def test_live_sbp_stream_replicated_and_readable_on_follower(tmp_path, node_factory):
    from protocols.sbp.client import BlockingSbpClient, SbpError
    from storage import record_batch

    off = dict(OFF)
    del off["sbp"]
    a = node_factory(name="a", node_id=51, **off)
    b = node_factory(name="b", node_id=52, peer=a.peer_endpoint(), **off)
    with BlockingSbpClient(*a.address("sbp")) as ca, BlockingSbpClient(*b.address("sbp")) as cb:
        sid = ca.create_stream()["stream_id"]
        assert sid >> 32 == 51
        for i in range(5):
            ca.append(sid, record_batch.encode([(1000 + i, [(b"k", b"v")], b"record %d" % i)] * 2))

        def fetch_all(c):
            try:
                return c.fetch(sid, 0, 1 << 20)
            except SbpError:
                return None

        want = fetch_all(ca)
        assert want and len(list(record_batch.split(want))) == 5
        wait_until(lambda: fetch_all(cb) == want, timeout=30, what="B to serve A's stream by FETCH")
        # live: a later append on the owner reaches the follower through the parked GetRange
        ca.append(sid, record_batch.encode([(2000, [], b"late")]))
        want = fetch_all(ca)
        wait_until(lambda: fetch_all(cb) == want, timeout=30, what="the live append on B")
        # the copy is read-only; it names the owner's swarm listener it came from (CONTRACT §2)
        with pytest.raises(SbpError) as e:
            cb.append(sid, record_batch.encode([(3000, [], b"nope")]))
        assert a.endpoint("swarm") in str(e.value)
    # sbpctl peer list through the node's SBP status (node.metrics["peers"])
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "node.cli", "peer", "list", "--endpoint", b.endpoint("sbp"), "--json"], capture_output=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert a.endpoint("swarm") in json.loads(out.stdout)["peers"]


def test_peer_restart_reconnects_with_backoff(tmp_path, node_factory):
    port = free_port()
    preload_subprocess(str(tmp_path / "a-data"), 61, chunks=50, chunk_size=256)
    opts = dict(OFF, swarm="tcp:%d:interface=127.0.0.1" % port)
    a = node_factory(name="a", node_id=61, **opts)
    # B serves SBP so the test can read its live peer stats (status) while it retries
    b = node_factory(name="b", node_id=62, peer="tcp:host=127.0.0.1:port=%d" % port, **dict(OFF, sbp="tcp:0:interface=127.0.0.1"))
    wait_until(lambda: info(b)[codec.CHUNKS_ID] == 50, what="first sync")
    assert a.terminate() == 0
    # more data lands on A while it is down (written offline into its store)
    preload_subprocess(a.data_dir, 61, chunks=30, chunk_size=256)
    key = "127.0.0.1:%d" % port
    # B is retrying with backoff meanwhile
    wait_until(lambda: (live_peers(b).get(key, {}).get("last_error") or "").startswith("connect:"), what="B to retry")
    a.start()
    wait_until(lambda: info(b)[codec.CHUNKS_ID] == 80, what="B to reconnect and catch up")
    assert content(b) == content(a)
    # the snapshot file is refreshed once a second
    wait_until(lambda: peers_snapshot(b).get(key, {}).get("items") == 80, what="stats to show 80 items")
    assert peers_snapshot(b)[key]["connects"] >= 2


def test_chain_relays_replicas(tmp_path, node_factory):
    """A -> B -> C: C learns A's stream from B's replica, under the same id."""
    preload_subprocess(str(tmp_path / "a-data"), 71, chunks=40, chunk_size=300, streams=1, batches=6, records=2, body=20)
    a = node_factory(name="a", node_id=71, **OFF)
    b = node_factory(name="b", node_id=72, peer=a.peer_endpoint(), **OFF)
    c = node_factory(name="c", node_id=73, peer=b.peer_endpoint(), **OFF)
    want = info(a)
    wait_until(lambda: info(c) == want, what="C to get A's data through B")
    assert content(c) == content(a)
