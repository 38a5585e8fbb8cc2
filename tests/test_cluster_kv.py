"""Key-value partitions across the cluster (issue 20; CONTRACT §2, §4, §9): real etcd, 3 real
nodes on loopback, kill -9."""

import random
import signal
import socket
import threading
import time

import pytest

from protocols.partition import client_framing, codec
from protocols.partition.client import BlockingKvClient, KvError
from protocols.partition.codec import GET_FB, GET_FF, GET_KEYS, GET_KEYS_PREFIX
from protocols.sbp.client import call_status
from tests.etcdproc import EtcdCluster, etcd_available
from tests.test_cluster import client, sbpctl, start_nodes, three_nodes, view, wait_for

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed")


def kv(node, timeout=30):
    return BlockingKvClient("127.0.0.1", node.ports["kv"], timeout=timeout)


def set_pipelined(c, batch, acked, errors):
    """SET every (key, value) of ``batch`` in one pipeline: the acknowledged ones into ``acked``,
    the others' errors into ``errors``."""
    results = c.pipeline([(codec.SET, lambda cid, k=k, v=v: codec.encode_set(cid, k, v)) for k, v in batch])
    for (k, v), r in zip(batch, results):
        if r is None:
            acked[k] = v
        else:
            errors.append(r)


def spread_keys(n, tag=b""):
    """``n`` keys over all 8 partitions (first bytes 0..255)."""
    return [bytes([i % 256]) + tag + b"k%05d" % i for i in range(n)]


def full_scan(c, cmd, page=7, prefix=b""):
    out = []
    for p in c.iter_scan(cmd, page=page, prefix=prefix):
        out.extend(p.items)
    return out


@pytest.fixture(scope="module")
def kv3(tmp_path_factory):
    with three_nodes(tmp_path_factory.mktemp("kv3")) as cluster:
        yield cluster


def test_set_on_one_node_get_on_the_others(kv3):
    _etcd, (a, b, c) = kv3
    keys = spread_keys(64, b"x")
    with kv(a) as ca:
        results = ca.pipeline([(codec.SET, lambda cid, k=k: codec.encode_set(cid, k, b"v-" + k)) for k in keys])
        assert results == [None] * len(keys)
    for node in (b, c, a):
        with kv(node) as cn:
            got = cn.pipeline([(codec.GET, lambda cid, k=k: codec.encode_get(cid, k)) for k in keys])
            assert got == [b"v-" + k for k in keys]
    with kv(c) as cc:
        assert cc.remove(keys[3]) is True
        assert cc.remove(keys[3]) is False  # CONTRACT §4: DATA_NOT_FOUND
        assert cc.get(keys[3]) is None
    with kv(b) as cb:
        assert cb.get(keys[3]) is None
        # a pipelined SET then GET on one connection sees its own write (issue 19), remote or not
        r = cb.pipeline([(codec.SET, lambda cid: codec.encode_set(cid, b"\xf0own", b"1")),
                         (codec.GET, lambda cid: codec.encode_get(cid, b"\xf0own")),
                         (codec.SET, lambda cid: codec.encode_set(cid, b"", b"1"))])
        assert r[:2] == [None, b"1"]
        assert isinstance(r[2], KvError) and r[2].code == 0  # CONTRACT §4: an empty key -> ERR 0
        # one run: each REMOVE sees the operations before it (CONTRACT §4: DATA_NOT_FOUND when missing)
        r = cb.pipeline([(codec.SET, lambda cid: codec.encode_set(cid, b"\xa0run", b"1")),
                         (codec.REMOVE, lambda cid: codec.encode_remove(cid, b"\xa0run")),
                         (codec.REMOVE, lambda cid: codec.encode_remove(cid, b"\xa0run"))])
        assert r == [None, True, False]


def test_partitions_are_placed_with_leaders_on_several_nodes(kv3):
    _etcd, nodes = kv3
    with kv(nodes[0]) as c:
        c.set(b"\x00placed", b"1")
    def placed():
        with client(nodes[0]) as s:
            status = s.call(call_status())
        return status.get("cluster", {}).get("kv", {}).get("partitions")

    parts = wait_for(placed, what="the partition placement in the status")
    assert len(parts) == 8
    assert all(len(p["replicas"]) == 3 for p in parts)
    assert len({p["leader"] for p in parts}) == 3  # spread: every node leads some
    out = sbpctl("cluster", "--endpoint", nodes[1].endpoint("sbp"))
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit() and len(line.split()) == 4]
    assert [int(r[0]) for r in rows] == list(range(8))
    assert [int(r[2]) for r in rows] == [p["leader"] for p in parts]


def test_full_scans_through_each_node_equal_one_model(kv3):
    _etcd, nodes = kv3
    rng = random.Random(20)
    model = {}
    with kv(nodes[1]) as c:
        for i in range(300):
            k = bytes([rng.randrange(256)]) + b"scan%04d" % i
            v = b"%d" % rng.randrange(10 ** 6)
            model[k] = v
        c.pipeline([(codec.SET, lambda cid, k=k, v=v: codec.encode_set(cid, k, v)) for k, v in model.items()])
        # plus whatever the other tests wrote: the model is what a full scan of node 1 says first
        everything = dict(full_scan(c, GET_FF, page=1024))
    for k, v in model.items():
        assert everything[k] == v
    ordered = sorted(everything.items())
    for node in nodes:
        with kv(node) as c:
            assert full_scan(c, GET_FF, page=13) == ordered
            fb = []
            for p in c.iter_scan(GET_FB, page=11):
                fb = p.items + fb
            assert fb == ordered
            assert [k for k, _ in full_scan(c, GET_KEYS, page=17)] == [k for k, _ in ordered]
            prefix = b"\x80scan"
            want = [k for k, _ in ordered if k.startswith(prefix)]
            got = []
            for p in c.iter_scan(GET_KEYS_PREFIX, page=3, prefix=prefix):
                got.extend(k for k, _ in p.items if k.startswith(prefix))
            assert got == want


def test_scan_page_across_partitions_sets_the_jump_bit(kv3):
    _etcd, nodes = kv3
    with kv(nodes[2]) as c:
        c.set(b"\x3f\xff\xffjump-a", b"a")  # partition 1
        c.set(b"\x40\x00jump-b", b"b")  # partition 2
        c.create_cursor(b"j", b"\x3f\xff\xffjump-a")
        page = c.scan(GET_FF, b"j", 2)
        assert [k for k, _ in page.items] == [b"\x3f\xff\xffjump-a", b"\x40\x00jump-b"]
        assert page.jumped
        c.create_cursor(b"j", b"\x3f\xff\xffjump-a")
        page = c.scan(GET_FF, b"j", 1)
        assert not page.jumped and page.next_key == b"\x40\x00jump-b"
        with pytest.raises(KvError) as e:
            c.scan(GET_FF, b"nope", 1)
        assert e.value.code == 2


def test_kv_client_framing_reaches_every_key(kv3):
    _etcd, (a, b, _c) = kv3
    with kv(a) as ca:
        ca.set(b"\xe0client", b"framed")
    s = socket.create_connection(("127.0.0.1", b.ports["kv_client"]), timeout=30)
    try:
        s.sendall(client_framing.encode_get(b"\xe0client"))
        data = b""
        while len(data) < 8 or len(data) < int.from_bytes(data[:8], "big"):
            data += s.recv(65536)
        assert client_framing.decode_reply(data, codec.GET) == (codec.OK, None, [(b"\xe0client", b"framed")])
    finally:
        s.close()


def placement_of(node):
    with client(node) as s:
        return s.call(call_status()).get("cluster", {}).get("kv", {}).get("partitions")


def test_a_peer_connection_is_stalled_only_while_requests_get_no_reply():
    from twisted.internet.task import Clock
    from twisted.internet.testing import StringTransport

    from node.cluster.kv_partitions import PeerProtocol

    clock = Clock()
    peer = PeerProtocol(clock)
    peer.makeConnection(StringTransport())
    clock.advance(100)
    assert not peer.stalled(clock.seconds(), 10)  # idle: nothing waits
    d = peer.get(b"k")
    clock.advance(9)
    assert not peer.stalled(clock.seconds(), 10)
    clock.advance(2)
    assert peer.stalled(clock.seconds(), 10)
    peer.dataReceived(codec.encode_status(1, codec.DATA_NOT_FOUND))
    assert d.called and not peer.stalled(clock.seconds(), 10)


def test_requests_forwarded_to_a_hung_leader_end_in_bounded_time(kv3):
    """SIGSTOP a partition's leader: what another node forwarded to it is retried on the new
    leader (reads) or answered ERR 0 (writes: outcome unknown), never left hanging."""
    _etcd, nodes = kv3
    with kv(nodes[0]) as c:
        c.set(b"\x00hung", b"1")
    parts = wait_for(lambda: placement_of(nodes[0]), what="placement")
    by_id = {n.node_id: n for n in nodes}
    # a partition led by another node than the one the client talks to
    p, victim = next((q["partition"], by_id[q["leader"]]) for q in parts if q["leader"] != nodes[0].node_id)
    front = next(n for n in nodes if n is not victim)
    keys = [bytes([p << 5]) + b"hung%03d" % i for i in range(20)]
    with kv(front, timeout=90) as c:
        c.pipeline([(codec.SET, lambda cid, k=k: codec.encode_set(cid, k, b"before")) for k in keys])
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            requests = []
            for i, k in enumerate(keys):
                requests.append((codec.GET, lambda cid, k=k: codec.encode_get(cid, k)))
                if i % 4 == 0:
                    requests.append((codec.SET, lambda cid, k=k: codec.encode_set(cid, k, b"during")))
            results = c.pipeline(requests)
            elapsed = time.monotonic() - t0
            # bounded: the lease TTL (3 s) plus a failover, far below ROUTE_WAIT_S (20 s)
            assert elapsed < 20, elapsed
            for (cmd, _), r in zip(requests, results):
                if cmd == codec.GET:
                    assert r in (b"before", b"during"), r  # retried on the new leader
                else:
                    assert r is None or (isinstance(r, KvError) and r.code in (0, 1)), r
            # the new leader takes writes
            c.set(keys[0], b"after")
            assert c.get(keys[0]) == b"after"
        finally:
            victim.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: victim.node_id in view(nodes[0])[0], timeout=30, what="the resumed node to be a member again")
    with kv(victim) as c:
        assert c.get(keys[0]) == b"after"


@pytest.mark.slow
def test_kill9_of_a_partition_leader_loses_no_acknowledged_set(tmp_path):
    with three_nodes(tmp_path) as (_etcd, nodes):
        by_id = {n.node_id: n for n in nodes}
        with kv(nodes[0]) as c:
            c.set(b"\x00warm", b"1")
        def placement():
            with client(nodes[0]) as s:
                return s.call(call_status()).get("cluster", {}).get("kv", {}).get("partitions")

        parts = wait_for(placement, what="placement")
        victim = by_id[parts[0]["leader"]]
        writers = [n for n in nodes if n is not victim]
        acked = {}
        stop = threading.Event()
        errors = []

        def load(node, w):
            i = 0
            with kv(node, timeout=60) as c:
                while not stop.is_set():
                    batch = [(bytes([(i * 37 + j * 11) % 256]) + b"w%d-%06d-%d" % (w, i, j), b"v%d" % i) for j in range(8)]
                    set_pipelined(c, batch, acked, errors)
                    i += 1

        threads = [threading.Thread(target=load, args=(n, w)) for w, n in enumerate(writers)]
        for t in threads:
            t.start()
        wait_for(lambda: len(acked) > 400, timeout=60, what="acknowledged writes before the kill")
        t_kill = time.monotonic()
        victim.kill9()
        before = len(acked)
        wait_for(lambda: len(acked) > before + 400, timeout=60, what="writes after the failover")
        recovered = time.monotonic() - t_kill
        stop.set()
        for t in threads:
            t.join(60)
        survivors = writers
        for node in survivors:
            with kv(node) as c:
                keys = sorted(acked)
                for i in range(0, len(keys), 500):
                    chunk = keys[i:i + 500]
                    got = c.pipeline([(codec.GET, lambda cid, k=k: codec.encode_get(cid, k)) for k in chunk])
                    assert got == [acked[k] for k in chunk]
        assert recovered < 60


def test_plan_move_spreads_replicas_then_leaders():
    from node.cluster.kv_partitions import plan_move

    three = {p: ([1, 2, 3][p % 3], [1, 2, 3]) for p in range(8)}
    assert plan_move(three, [1, 2, 3]) is None  # 3/3/2 leaders, every node holds every partition
    assert plan_move({p: (1, [1, 2, 3]) for p in range(8)}, [1, 2, 3]) == ("leader", 0, 2)
    # a 4th node: replicas move to it first, from partitions the source does not lead
    move = plan_move(three, [1, 2, 3, 4])
    assert move[0] == "replica" and move[3] == 4 and three[move[1]][0] != move[2]
    # applying the moves converges: 6 replicas and 2 leaders per node
    ranges = dict(three)
    for _ in range(40):
        move = plan_move(ranges, [1, 2, 3, 4])
        if move is None:
            break
        leader, servers = ranges[move[1]]
        if move[0] == "replica":
            servers = [n for n in servers if n != move[2]] + [move[3]]
            leader = leader if leader != move[2] else servers[0]
        else:
            leader = move[2]
        ranges[move[1]] = (leader, servers)
    held = {n: sum(n in s for _l, s in ranges.values()) for n in (1, 2, 3, 4)}
    led = {n: sum(leader == n for leader, _s in ranges.values()) for n in (1, 2, 3, 4)}
    assert set(held.values()) == {6} and set(led.values()) == {2}
    assert plan_move(ranges, [1, 2, 3, 4], skip=set(range(8))) is None


@pytest.mark.slow
def test_a_joining_node_takes_partitions_and_a_dead_ones_are_taken_over(tmp_path):
    """3 nodes, then a 4th joins: partitions' replicas and leaders spread over the 4 (6 replicas,
    2 leaders each) without losing a write; kill -9 one: the other 3 lead every partition and
    hold every write."""
    with three_nodes(tmp_path) as (etcd, nodes):
        model = {}
        with kv(nodes[0]) as c:
            for i in range(400):
                model[bytes([i % 256]) + b"join%04d" % i] = b"v%d" % i
            c.pipeline([(codec.SET, lambda cid, k=k, v=v: codec.encode_set(cid, k, v)) for k, v in model.items()])
        fourth = start_nodes(tmp_path, etcd.client_urls, [4])[0]
        nodes.append(fourth)  # killed by three_nodes' cleanup too
        acked, stop, errors = {}, threading.Event(), []

        def load():
            i = 0
            with kv(nodes[1], timeout=60) as c:
                while not stop.is_set():
                    batch = [(bytes([(i * 7 + j * 31) % 256]) + b"during%06d" % (i * 8 + j), b"d%d" % i) for j in range(8)]
                    for (k, v), r in zip(batch, c.pipeline([(codec.SET, lambda cid, k=k, v=v: codec.encode_set(cid, k, v))
                                                            for k, v in batch])):
                        if r is None:
                            acked[k] = v
                        else:
                            errors.append(r)
                    i += 1

        writer = threading.Thread(target=load)
        writer.start()
        try:
            def spread(live):
                parts = placement_of(nodes[1])
                if not parts or any(p["leader"] not in live or set(p["replicas"]) - set(live) for p in parts):
                    return None
                held = {n: sum(n in p["replicas"] for p in parts) for n in live}
                led = {n: sum(p["leader"] == n for p in parts) for n in live}
                ok = max(held.values()) - min(held.values()) <= 1 and max(led.values()) - min(led.values()) <= 1
                return (held, led) if ok and all(len(p["replicas"]) == 3 for p in parts) else None

            held, led = wait_for(lambda: spread([1, 2, 3, 4]), timeout=90, what="partitions spread over 4 nodes")
            assert set(held.values()) == {6} and set(led.values()) == {2}
        finally:
            stop.set()
            writer.join(60)
        # a write in flight on a leader whose range a move seals is kept (acknowledged) or, cut by
        # the seal, sent again to the new leader: the writer sees no error
        assert errors == [], errors[:3]
        assert len(acked) > 0
        model.update(acked)

        def read_all(node):
            keys = sorted(model)
            with kv(node, timeout=60) as c:
                for i in range(0, len(keys), 500):
                    chunk = keys[i:i + 500]
                    got = c.pipeline([(codec.GET, lambda cid, k=k: codec.encode_get(cid, k)) for k in chunk])
                    assert got == [model[k] for k in chunk]

        read_all(fourth)
        # kill -9 a node that leads something: the other 3 take its partitions over
        victim = nodes[0]
        victim.kill9()
        wait_for(lambda: spread([2, 3, 4]), timeout=90, what="partitions taken over by the 3 survivors")
        for node in nodes[1:]:
            read_all(node)


def kv_status(node):
    with client(node) as s:
        return s.call(call_status()).get("cluster", {}).get("kv", {})


def local_partition(node, p):
    """Partition ``p`` as node ``node``'s own store holds it (led there or not): a snapshot cursor
    on its kv peer port (offset 0: any copy that applied anything), every page."""
    import struct

    from node.cluster.kv_partitions import SNAPSHOT_CURSOR

    name = SNAPSHOT_CURSOR + struct.pack(">BQ", p, 0)
    out = []
    with BlockingKvClient("127.0.0.1", kv_status(node)["peer_port"], timeout=60) as c:
        c.create_cursor(name)
        position = bytes([p << 5])
        while True:
            page = c.scan(GET_FF, name, 1000, position)
            out.extend(page.items)
            if not page.next_key:
                return out
            position = page.next_key


def spread_over_four(node):
    """The placement as ``node`` sees it once every partition has 3 replicas and each of nodes 1-4
    holds 6 of the 24; else None."""
    parts = placement_of(node)
    if not parts or any(len(p["replicas"]) != 3 for p in parts):
        return None
    held = {n: sum(n in p["replicas"] for p in parts) for n in (1, 2, 3, 4)}
    return parts if set(held.values()) == {6} else None


def copies_applied(node, partitions):
    """``node``'s partition status by partition once its copies of ``partitions`` have applied past
    their trim points with no snapshot running; else False."""
    st = {p["partition"]: p for p in kv_status(node)["partitions"]}
    return all(st[q]["applied"] >= st[q]["trim_offset"] > 0 and not st[q]["snapshotting"] for q in partitions) and st


def overwrite_load(node, keys, stop, acked, errors, value_size=16):
    """Pipelines of SETs over ``keys`` again and again (a bounded state, an unbounded stream)."""
    i = 0
    with kv(node, timeout=60) as c:
        while not stop.is_set():
            batch = [(keys[(i * 64 + j) % len(keys)], (b"%d-" % i).ljust(value_size, b"v")) for j in range(64)]
            set_pipelined(c, batch, acked, errors)
            i += 1


@pytest.mark.slow
def test_streams_are_trimmed_and_a_joining_node_takes_a_snapshot(tmp_path):
    """A long overwrite load: every partition's stream is trimmed while it runs and, once it
    stops, down to its end (bounded: a stream keeps only what a replica has not applied). A 4th
    node then joins: its copies start at the trim point, so it takes snapshots, and its own store
    holds every partition it got exactly as the model says."""
    with three_nodes(tmp_path) as (etcd, nodes):
        keys = spread_keys(1024, b"trim")
        acked, stop, errors = {}, threading.Event(), []
        writer = threading.Thread(target=overwrite_load, args=(nodes[0], keys, stop, acked, errors))
        writer.start()
        try:
            def trimmed_under_load():
                parts = kv_status(nodes[1]).get("partitions") or []
                return len(parts) == 8 and all(p["trim_offset"] > 0 for p in parts) and parts
            wait_for(trimmed_under_load, timeout=90, what="every stream trimmed under the write load")
            time.sleep(3)
        finally:
            stop.set()
            writer.join(60)
        assert errors == [], errors[:3]
        model = dict(acked)

        def trimmed_to_the_end():
            parts = kv_status(nodes[1]).get("partitions") or []
            return (len(parts) == 8 and all(p["trim_offset"] == p["applied"] > 0 for p in parts)) and parts
        parts = wait_for(trimmed_to_the_end, timeout=60, what="every stream trimmed to its end after the load")
        records = sum(p["applied"] for p in parts)
        assert records > 64  # many records written, none kept

        fourth = start_nodes(tmp_path, etcd.client_urls, [4])[0]
        nodes.append(fourth)

        parts = wait_for(lambda: spread_over_four(nodes[1]), timeout=120, what="partitions spread over 4 nodes")
        mine = [p["partition"] for p in parts if 4 in p["replicas"]]

        st = wait_for(lambda: copies_applied(fourth, mine), timeout=60, what="the 4th node's copies applied")
        assert sum(st[q]["snapshots"] for q in mine) >= 1
        for q in mine:
            want = sorted((k, v) for k, v in model.items() if k[0] >> 5 == q)
            assert local_partition(fourth, q) == want, q
        with kv(fourth, timeout=60) as c:
            assert full_scan(c, GET_FF, page=500) == sorted(model.items())


@pytest.mark.slow
def test_kill9_during_a_snapshot_transfer(tmp_path):
    """A joining node killed -9 while it copies a snapshot starts the copy over after its restart
    and ends with the full state; no acknowledged write is lost."""
    with three_nodes(tmp_path) as (etcd, nodes):
        model = {}
        value = b"s" * 2048
        with kv(nodes[0], timeout=60) as c:
            for start in range(0, 12000, 500):
                batch = {bytes([i % 256]) + b"snap%06d" % i: value + b"%d" % i for i in range(start, start + 500)}
                c.pipeline([(codec.SET, lambda cid, k=k, v=v: codec.encode_set(cid, k, v)) for k, v in batch.items()])
                model.update(batch)
            c.set(b"\x00last", b"1")  # a record after the bulk, so the trim point passes it
            model[b"\x00last"] = b"1"

        def trimmed():
            parts = kv_status(nodes[1]).get("partitions") or []
            return len(parts) == 8 and all(p["trim_offset"] == p["applied"] > 0 for p in parts) and parts
        wait_for(trimmed, timeout=60, what="every stream trimmed to its end")

        fourth = start_nodes(tmp_path, etcd.client_urls, [4])[0]
        nodes.append(fourth)
        deadline = time.monotonic() + 120
        while True:
            st = kv_status(fourth).get("partitions") or []
            busy = [p["partition"] for p in st if p["snapshotting"]]
            if busy:
                break
            assert time.monotonic() < deadline, "the 4th node never took a snapshot"
            time.sleep(0.01)
        fourth.kill9()
        fourth.start(timeout=60)

        parts = wait_for(lambda: spread_over_four(nodes[1]), timeout=180, what="partitions spread over 4 nodes")
        mine = [p["partition"] for p in parts if 4 in p["replicas"]]

        st = wait_for(lambda: copies_applied(fourth, mine), timeout=90, what="the 4th node's copies applied")
        # the copy cut by the kill was taken again from the start after the restart
        assert all(st[q]["snapshots"] >= 1 for q in busy if q in mine)
        for q in mine:
            want = sorted((k, v) for k, v in model.items() if k[0] >> 5 == q)
            assert local_partition(fourth, q) == want, q
        with kv(fourth, timeout=60) as c:
            for k in sorted(model)[::97]:
                assert c.get(k) == model[k]


@pytest.mark.slow
def test_gets_after_trims_and_a_snapshot_install_answer_the_newest_value(tmp_path):
    """Reads on every node, the new one included, right after each change: values overwritten
    after being read, streams trimmed to their end, a 4th node's copies installed from snapshots,
    then overwritten again: every GET through every node answers the last acknowledged value
    (a stale value kept by any read cache, the row cache of storage/kv_cache.py included, would
    show here; in cluster mode GETs go through the cluster's routed path, which reads the store's
    memtables and LMDB)."""
    with three_nodes(tmp_path) as (etcd, nodes):
        keys = spread_keys(600, b"cache")

        def set_all(node, tag):
            with kv(node, timeout=60) as c:
                assert c.pipeline([(codec.SET, lambda cid, k=k: codec.encode_set(cid, k, tag + k)) for k in keys]) \
                    == [None] * len(keys)

        def gets_everywhere(tag):
            for node in nodes:
                for _ in range(2):  # (a second read: what a first one may have cached)
                    with kv(node, timeout=60) as c:
                        got = c.pipeline([(codec.GET, lambda cid, k=k: codec.encode_get(cid, k)) for k in keys])
                    assert got == [tag + k for k in keys], (node.node_id, tag)

        set_all(nodes[0], b"one-")
        gets_everywhere(b"one-")
        set_all(nodes[1], b"two-")
        gets_everywhere(b"two-")
        with kv(nodes[0], timeout=60) as c:
            c.set(b"\x00last", b"1")  # a record after the bulk, so the trim point passes it

        def trimmed():
            parts = kv_status(nodes[1]).get("partitions") or []
            return len(parts) == 8 and all(p["trim_offset"] == p["applied"] > 0 for p in parts) and parts
        wait_for(trimmed, timeout=60, what="every stream trimmed to its end")
        gets_everywhere(b"two-")

        fourth = start_nodes(tmp_path, etcd.client_urls, [4])[0]
        nodes.append(fourth)
        parts = wait_for(lambda: spread_over_four(nodes[1]), timeout=180, what="partitions spread over 4 nodes")
        mine = [p["partition"] for p in parts if 4 in p["replicas"]]
        st = wait_for(lambda: copies_applied(fourth, mine), timeout=90, what="the 4th node's copies applied")
        assert sum(st[q]["snapshots"] for q in mine) >= 1
        gets_everywhere(b"two-")
        set_all(fourth, b"three-")
        gets_everywhere(b"three-")


def published_nodes(etcd):
    """The node ids with a ``P kv/applied/<node>`` key in etcd (the default prefix)."""
    import base64

    prefix = b"/sbpnode/kv/applied/"
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    r = etcd.request(0, "/v3/kv/range", {"key": base64.b64encode(prefix).decode(),
                                         "range_end": base64.b64encode(end).decode()})
    return sorted(int(base64.b64decode(kv["key"])[len(prefix):]) for kv in r.get("kvs", []))


@pytest.mark.slow
def test_a_dropped_copy_is_cleared_and_a_departed_node_forgotten(tmp_path):
    """Streams trimmed to their end; a 4th node joins, so nodes 1-3 each lose 2 copies to it: each
    clears those partitions' keys from its own store (and keeps the 6 it holds exactly). Then the
    4th is killed -9: re-replication gives its copies back to nodes 1-3, which start them from a
    snapshot (not from what they cleared) and end equal to the model; once no partition names the
    dead node, its published applied offsets are removed from etcd."""
    with three_nodes(tmp_path) as (etcd, nodes):
        model = {}
        with kv(nodes[0], timeout=60) as c:
            for start in range(0, 2000, 500):
                batch = {bytes([i % 256]) + b"drop%05d" % i: b"v%d" % i for i in range(start, start + 500)}
                c.pipeline([(codec.SET, lambda cid, k=k, v=v: codec.encode_set(cid, k, v)) for k, v in batch.items()])
                model.update(batch)
            c.set(b"\x00last", b"1")
            model[b"\x00last"] = b"1"

        def trimmed():
            parts = kv_status(nodes[1]).get("partitions") or []
            return len(parts) == 8 and all(p["trim_offset"] == p["applied"] > 0 for p in parts) and parts
        wait_for(trimmed, timeout=60, what="every stream trimmed to its end")

        def of(q):
            return sorted((k, v) for k, v in model.items() if k[0] >> 5 == q)

        fourth = start_nodes(tmp_path, etcd.client_urls, [4])[0]
        nodes.append(fourth)
        parts = wait_for(lambda: spread_over_four(nodes[1]), timeout=120, what="partitions spread over 4 nodes")
        wait_for(lambda: published_nodes(etcd) == [1, 2, 3, 4], timeout=30, what="4 nodes publishing")
        for node in nodes[:3]:
            gone = [p["partition"] for p in parts if node.node_id not in p["replicas"]]
            assert len(gone) == 2, (node.node_id, parts)

            def cleared(node=node, gone=gone):
                st = {p["partition"]: p for p in kv_status(node)["partitions"]}
                return all(st[q]["cleared"] and st[q]["applied"] == 0 for q in gone)
            wait_for(cleared, timeout=60, what="node %d's dropped copies cleared" % node.node_id)
            for q in range(8):
                assert local_partition(node, q) == ([] if q in gone else of(q)), (node.node_id, q)

        fourth.kill9()
        nodes.pop()  # (dead: three_nodes' cleanup kills the others)

        def back_on_three():
            got = placement_of(nodes[0])
            return got and all(sorted(p["replicas"]) == [1, 2, 3] for p in got) and got
        wait_for(back_on_three, timeout=120, what="every partition back on nodes 1-3")
        for node in nodes:
            st = wait_for(lambda node=node: copies_applied(node, range(8)), timeout=90,
                          what="node %d's copies applied" % node.node_id)
            regained = [p["partition"] for p in parts if node.node_id not in p["replicas"]]
            assert all(st[q]["snapshots"] >= 1 and not st[q]["dropped"] for q in regained), st
            for q in range(8):
                assert local_partition(node, q) == of(q), (node.node_id, q)
        wait_for(lambda: published_nodes(etcd) == [1, 2, 3], timeout=30, what="node 4's published offsets removed")
        assert sum(kv_status(n).get("forgotten_nodes", 0) for n in nodes) >= 1
        with kv(nodes[2], timeout=60) as c:
            assert full_scan(c, GET_FF, page=500) == sorted(model.items())


def test_replica_reads_answer_acknowledged_values_from_the_local_copy(tmp_path):
    """``--kv-reads replica``: a GET is answered from the node's own applied copy (every node holds
    all 8 partitions with 3 nodes and R=3), so it forwards nothing; a value read is always one
    that was acknowledged (old or new), and the newest one shows once the copy applied it."""
    etcd = EtcdCluster(tmp_path, members=1).start()
    try:
        nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3], kv_reads="replica")
        try:
            keys = spread_keys(200, b"stale")
            with kv(nodes[0]) as c:
                c.pipeline([(codec.SET, lambda cid, k=k: codec.encode_set(cid, k, b"old")) for k in keys])
            reader = nodes[1]

            def read_all():
                with kv(reader) as c:
                    return c.pipeline([(codec.GET, lambda cid, k=k: codec.encode_get(cid, k)) for k in keys])
            wait_for(lambda: read_all() == [b"old"] * len(keys), timeout=30, what="replica reads of the first values")
            with kv(nodes[2]) as c:
                c.pipeline([(codec.SET, lambda cid, k=k: codec.encode_set(cid, k, b"new")) for k in keys])
            seen = read_all()
            assert set(seen) <= {b"old", b"new"}, set(seen)
            wait_for(lambda: read_all() == [b"new"] * len(keys), timeout=30, what="replica reads of the new values")
            st = kv_status(reader)
            # a GET of a partition the reader leads is a leader's read, not counted as a replica
            # read; every other GET of the three read_all()s (at least) was answered from its copy
            led = {q["partition"] for q in st["partitions"] if q["leader"] == reader.node_id}
            replica_keys = sum(1 for k in keys if codec.partition_of(k) not in led)
            assert replica_keys > 0, led
            assert st["reads"] == "replica" and st["replica_gets"] >= 3 * replica_keys, (st.get("replica_gets"), replica_keys)
            with kv(reader) as c:  # scans stay with the leaders
                assert dict(full_scan(c, GET_FF, page=100))[keys[7]] == b"new"
        finally:
            for n in nodes:
                n.kill9()
    finally:
        etcd.stop()
