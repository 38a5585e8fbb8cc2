"""Cluster mode (CONTRACT §9): real etcd, real nodes on loopback, kill -9."""

import contextlib
import os
import subprocess
import threading
import time
from collections import Counter

import pytest
import pytest_twisted

from protocols.sbp import codec
from protocols.sbp.client import BlockingSbpClient, SbpError, call_describe_cluster, call_status
from storage import record_batch
from tests.etcdproc import EtcdCluster, etcd_available, free_port
from tests.nodeproc import NodeProcess

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed")


def batch(n, tag=b"r"):
    return record_batch.encode([(1000 + i, [], tag + b"%d" % i) for i in range(n)])


def client(node, timeout=10):
    return BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=timeout)


def members(node):
    with client(node) as c:
        return c.call(call_describe_cluster())


def view(node):
    """(sorted live node ids, leader id) as DESCRIBE_PD_CLUSTER on ``node`` says."""
    ms = members(node)
    leaders = [int(m["name"]) for m in ms if m["is_leader"]]
    assert len(leaders) <= 1
    return sorted(int(m["name"]) for m in ms), (leaders[0] if leaders else None)


def watched_members(node):
    """The live node ids ``node``'s own membership watch holds (DESCRIBE_PD_CLUSTER's detail)."""
    with client(node) as c:
        return c.call(call_status()).get("cluster", {}).get("watched_members", [])


def wait_for(cond, timeout=15.0, step=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("%s not met within %ss" % (what, timeout))
        time.sleep(step)


def start_nodes(base, etcd_urls, ids, **options):
    """Start nodes concurrently (start-up is mostly waiting on imports)."""
    nodes = [NodeProcess(base, name="n%d" % i, cluster=etcd_urls, fsync="never", node_id=i, **options) for i in ids]
    errors = []

    def run(n):
        try:
            n.start(timeout=60)
        except Exception as e:  # pragma: no cover (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for n in nodes:
            n.kill9()
        raise errors[0]

    def settled():  # every new node sees all of them live (in etcd and in its own watch), and a leader
        views = [view(n) for n in nodes]
        watched = [watched_members(n) for n in nodes]
        return (all(set(ids) <= set(live) and leader is not None for live, leader in views)
                and all(set(ids) <= set(w) for w in watched))

    try:
        wait_for(settled, timeout=30, what="every started node to see %s live" % (ids,))
    except AssertionError:
        for n in nodes:
            n.kill9()
        raise
    return nodes


@contextlib.contextmanager
def three_nodes(base):
    """One etcd member and nodes 1, 2, 3 under ``base``: (etcd, nodes); killed and stopped after."""
    etcd = EtcdCluster(base, members=1).start()
    try:
        nodes = start_nodes(base, etcd.client_urls, [1, 2, 3])
        try:
            yield etcd, nodes
        finally:
            for n in nodes:
                n.kill9()
    finally:
        etcd.stop()


@pytest.fixture
def cluster3(tmp_path):
    with three_nodes(tmp_path) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared3(tmp_path_factory):
    """3 nodes + 1 etcd for the tests that kill nothing."""
    with three_nodes(tmp_path_factory.mktemp("shared3")) as cluster:
        yield cluster


@pytest_twisted.ensureDeferred
async def test_twisted_client_follows_the_cluster(shared3):
    from twisted.internet import reactor

    from protocols.sbp.client import SbpClient

    etcd, nodes = shared3
    c = SbpClient(reactor, "127.0.0.1", nodes[0].ports["sbp"], follow_cluster=True)
    try:
        sids = [(await c.create_stream(replica_nums=1))["stream_id"] for _ in range(3)]
        for sid in sids:  # one on each node (least loaded first): two are elsewhere
            assert await c.append(sid, batch(2)) == 0
            assert await c.append(sid, batch(1)) == 2
            assert record_batch.decode(await c.fetch(sid, 2))[0].record_count == 1
        plain = SbpClient(reactor, "127.0.0.1", nodes[0].ports["sbp"])
        elsewhere = 0
        for sid in sids:
            try:
                await plain.append(sid, batch(1))
            except SbpError as e:
                assert e.code == codec.PD_NOT_LEADER
                elsewhere += 1
        await plain.close()
        assert elsewhere >= 1
    finally:
        await c.close()


def test_membership_placement_and_routing(shared3):
    etcd, nodes = shared3
    by_id = {n.node_id: n for n in nodes}
    # every node lists the same live members and the same single leader
    views = [view(n) for n in nodes]
    assert all(v == views[0] for v in views), views
    assert views[0][0] == [1, 2, 3] and views[0][1] in (1, 2, 3)

    # streams created on every node: ids carry the creator's node id; R distinct live nodes per
    # range, one primary; spread evenly
    created = []
    for i in range(6):
        creator = nodes[i % 3]
        with client(creator) as c:
            s = c.create_stream(replica_nums=3 if i < 3 else 1, retention_period_ms=0)
        assert s["stream_id"] >> 32 == creator.node_id
        assert s["replica_nums"] == (3 if i < 3 else 1)
        created.append(s["stream_id"])
    assert len(set(created)) == 6
    primaries = Counter()
    for sid in created:
        ranges = [client(n).list_ranges(sid) for n in nodes]  # any node answers from etcd
        assert all(r == ranges[0] for r in ranges)
        (r0,) = ranges[0]
        servers = r0["servers"]
        assert len({s["server_id"] for s in servers}) == len(servers)
        assert sum(s["is_primary"] for s in servers) == 1
        p = next(s for s in servers if s["is_primary"])
        assert p["advertise_addr"] == nodes[[n.node_id for n in nodes].index(p["server_id"])].endpoint("sbp")
        primaries[p["server_id"]] += 1
    # even over every stream of the cluster (other tests of this module made some too)
    everything = {}
    for n in nodes:
        everything.update(client(n).list_all_ranges())
    spread = Counter(s["server_id"] for ranges in everything.values() for r in ranges for s in r["servers"] if s["is_primary"])
    assert max(spread.values()) - min(spread.values()) <= 1 and len(spread) == 3, spread

    # replica_nums 0 takes --replication-factor (3 in a cluster); more than live: 1502
    with client(nodes[0]) as c:
        assert len(c.list_ranges(c.create_stream(replica_nums=0)["stream_id"])[0]["servers"]) == 3
        with pytest.raises(SbpError) as info:
            c.create_stream(replica_nums=4)
        assert info.value.code == codec.NO_AVAILABLE_RS

    # APPEND on the primary; PD_NOT_LEADER with the primary's address elsewhere; FETCH likewise
    sid = created[0]
    r0 = client(nodes[1]).list_ranges(sid)[0]
    primary = by_id[next(s["server_id"] for s in r0["servers"] if s["is_primary"])]
    other = next(n for n in nodes if n is not primary)
    with client(primary) as c:
        assert c.append(sid, batch(3)) == 0
        assert c.append(sid, batch(2)) == 3
    with client(other) as c:
        with pytest.raises(SbpError) as info:
            c.append(sid, batch(1))
        assert info.value.code == codec.PD_NOT_LEADER and info.value.message == primary.endpoint("sbp")
        # a replica serves FETCH (issue 17): the batches the primary acknowledged (while it
        # lacks some of them, a read past its end names the primary)
        def replica_records():
            try:
                return sum(len(record_batch.decode(b)[1]) for b in record_batch.split(c.fetch(sid, 0)))
            except SbpError as e:
                assert e.code == codec.PD_NOT_LEADER and e.message == primary.endpoint("sbp")
                return 0
        wait_for(lambda: replica_records() == 5, what="the replica serves the acknowledged records")
        # DESCRIBE_RANGES from any node; TRIM must go to the primary
        assert c.describe_range(sid, 0)["servers"] == r0["servers"]
        with pytest.raises(SbpError) as info:
            c.trim(sid, 1)
        assert info.value.code == codec.PD_NOT_LEADER
    with client(primary) as c:
        assert sum(len(record_batch.decode(b)[1]) for b in record_batch.split(c.fetch(sid, 0))) == 5
        assert c.describe_range(sid, 0)["next_offset"] == 5
        c.trim(sid, 3)
    assert client(other).describe_streams([sid])[0]["stream_id"] == sid

    # every host made its local replica state (the watch)
    for n in nodes:
        hosted = [s for s in created[:3]]
        wait_for(lambda: all(("created the local replica of stream %d" % s) in n.log_text() for s in hosted),
                 what="local replicas on node %d" % n.node_id)

    # UPDATE on one node is seen on another; DELETE removes it everywhere
    with client(nodes[2]) as c:
        c.update_stream(created[1], retention_period_ms=60000)
    assert client(nodes[0]).describe_streams([created[1]])[0]["retention_period_ms"] == 60000
    with client(nodes[1]) as c:
        c.delete_stream(created[1])
    for n in nodes:
        with pytest.raises(SbpError) as info:
            client(n).describe_streams([created[1]])
        assert info.value.code == codec.STREAM_NOT_FOUND

    # ALLOCATE_ID from several nodes at once: all distinct
    ids = []
    lock = threading.Lock()

    def alloc(n):
        with client(n) as c:
            got = [c.allocate_id() for _ in range(10)]
        with lock:
            ids.extend(got)

    threads = [threading.Thread(target=alloc, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == 30 and len(set(ids)) == 30

    # concurrent CREATE_STREAMS on every node never collide
    sids = []

    def create(n):
        with client(n) as c:
            got = [c.create_stream(replica_nums=1)["stream_id"] for _ in range(10)]
        with lock:
            sids.extend(got)

    threads = [threading.Thread(target=create, args=(n,)) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(sids)) == 30

    # sbpctl status shows cluster mode
    st = client(nodes[0]).call(call_status())
    assert st["cluster"]["prefix"] == "/sbpnode/" and st["cluster"]["live_members"] == [1, 2, 3]

    # the metrics and status page read the same view (node/cluster_view.py)
    import urllib.request

    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % nodes[1].ports["http"], timeout=10) as r:
        text = r.read().decode()
    assert "sbpnode_cluster_members 3.0" in text and "sbpnode_cluster_leader %d.0" % views[0][1] in text
    assert "sbpnode_etcd_request_duration_seconds_count" in text

    # clients follow the cluster: any node's address, PD_NOT_LEADER followed (bounded)
    with BlockingSbpClient("127.0.0.1", other.ports["sbp"], timeout=10, follow_cluster=True) as c:
        assert c.append(sid, batch(1)) == 5
        assert c.fetch(sid, 5)
        assert c.for_stream(sid).port == primary.ports["sbp"]
    out = sbpctl("stream", "append", str(sid), "--endpoint", other.endpoint("sbp"), "--no-progress", input="a\nb\n")
    assert "offsets 6..7" in out
    out = sbpctl("stream", "describe", str(sid), "--endpoint", other.endpoint("sbp"), "--json")
    assert '"next_offset": 8' in out
    out = sbpctl("cluster", "--endpoint", other.endpoint("sbp"))
    assert "mode      cluster" in out and "leader    %d" % views[0][1] in out
    out = sbpctl("status", "--endpoint", other.endpoint("sbp"))
    assert "cluster: 3 live member(s)" in out


def sbpctl(*args, input=None):
    import sys

    result = subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, input=input, timeout=60,
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr
    return result.stdout




def test_duplicate_kill9_reelection_and_restart(cluster3, tmp_path):
    etcd, nodes = cluster3
    live, leader = view(nodes[0])
    # a live node's id on another data dir: refused with one line, non-zero exit, nothing left
    leases_before = sorted(x["ID"] for x in etcd.request(0, "/v3/lease/leases", {}).get("leases", []))
    dup = NodeProcess(tmp_path, name="dup", cluster=etcd.client_urls, node_id=nodes[1].node_id, fsync="never")
    result = subprocess.run(dup.argv(), capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode != 0
    assert "node_id %d is already live" % nodes[1].node_id in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert view(nodes[1])[0] == [1, 2, 3]
    # nothing half-registered: the refused node's lease was revoked
    assert sorted(x["ID"] for x in etcd.request(0, "/v3/lease/leases", {}).get("leases", [])) == leases_before

    # kill -9 the leader: it leaves the member list within TTL + 5 s and another leads within 10 s
    old = next(n for n in nodes if n.node_id == leader)
    survivors = [n for n in nodes if n is not old]
    killed_at = time.monotonic()
    old.kill9()

    def new_leader():
        vs = [view(n) for n in survivors]
        if all(v == vs[0] for v in vs) and vs[0][1] not in (None, leader) and old.node_id not in vs[0][0]:
            return vs[0]
        return None

    live2, leader2 = wait_for(new_leader, timeout=10, what="re-election")
    took = time.monotonic() - killed_at
    print("re-election after kill -9 of the leader: %.2fs" % took)
    assert took < 8.0
    assert sorted(live2) == sorted(n.node_id for n in survivors)

    # restart on its own data dir: rejoins (kill -9 again and restart at once, before the old
    # lease runs out: the old incarnation's key is taken over, not refused)
    old.start(timeout=60)
    wait_for(lambda: view(survivors[0])[0] == [1, 2, 3], what="rejoin")
    old.kill9()
    old.start(timeout=60)
    wait_for(lambda: all(view(n)[0] == [1, 2, 3] for n in nodes), what="rejoin after a quick restart")
    # a clean stop leaves at once (lease revoked)
    assert old.terminate() == 0
    wait_for(lambda: old.node_id not in view(survivors[0])[0], timeout=2, what="clean leave")


def test_bad_etcd_url_and_prefix(tmp_path):
    # nothing listens there: a one-line error and a non-zero exit after the start deadline
    n = NodeProcess(tmp_path, name="lonely", cluster="http://127.0.0.1:%d" % free_port(), fsync="never")
    t = time.monotonic()
    result = subprocess.run(n.argv(), capture_output=True, text=True, timeout=90,
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode != 0
    assert "etcd unreachable" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert time.monotonic() - t < 60
    assert not os.path.exists(n.ready_file)
    # an URL that is not one: refused by option parsing
    result = subprocess.run(NodeProcess(tmp_path, name="bad", cluster="etcd:2379").argv(), capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode != 0 and "--cluster" in result.stderr + result.stdout


def test_incompatible_prefix_is_refused(tmp_path):
    etcd = EtcdCluster(tmp_path, members=1).start()
    try:
        etcd.request(0, "/v3/kv/put", {"key": "L3NicG5vZGUvdmVyc2lvbg==", "value": "OTk="})  # /sbpnode/version = 99
        n = NodeProcess(tmp_path, name="n", cluster=etcd.client_urls, fsync="never")
        result = subprocess.run(n.argv(), capture_output=True, text=True, timeout=60,
                                env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert result.returncode != 0 and "layout version 99" in result.stderr
        # nothing half-registered: no member key, no lease left
        assert "kvs" not in etcd.request(0, "/v3/kv/range", {"key": "L3NicG5vZGUvbWVtYmVycy8=", "range_end": "L3NicG5vZGUvbWVtYmVycy9="})
        leases = etcd.request(0, "/v3/lease/leases", {})
        assert not leases.get("leases")
    finally:
        etcd.stop()


@pytest.mark.slow
def test_three_etcd_members_one_killed(tmp_path):
    etcd = EtcdCluster(tmp_path, members=3).start()
    nodes = []
    try:
        nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3])
        assert view(nodes[0])[0] == [1, 2, 3]
        # the first URL every node tries hangs (SIGSTOP) for longer than the lease TTL: the
        # keep-alives time out on it and go to the others; nobody leaves
        import signal

        etcd.procs[0].send_signal(signal.SIGSTOP)
        try:
            until = time.monotonic() + 4.5
            while time.monotonic() < until:
                assert all(view(n)[0] == [1, 2, 3] for n in nodes)
                time.sleep(0.2)
        finally:
            etcd.procs[0].send_signal(signal.SIGCONT)
        etcd.kill9(0)
        # the cluster keeps working through the other two members
        with client(nodes[1], timeout=20) as c:
            s = c.create_stream(replica_nums=3)
            assert len(c.list_ranges(s["stream_id"])[0]["servers"]) == 3
        # past the lease TTL every node is (still, or again) a member: keep-alives went to the
        # live etcd members
        deadline = time.monotonic() + 4
        wait_for(lambda: time.monotonic() > deadline, what="a lease TTL")

        def converged():
            vs = [view(n) for n in nodes]
            return all(v[0] == [1, 2, 3] for v in vs) and len({v[1] for v in vs}) == 1 and vs[0][1] is not None

        wait_for(converged, timeout=10, what="all members seen with one leader")
        # a node killed now still leaves the list, and its death is seen by all
        nodes[2].kill9()
        wait_for(lambda: all(view(n)[0] == [1, 2] for n in nodes[:2]), timeout=10, what="member leaves")
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


def test_etcd_down_while_running(tmp_path):
    """The node keeps serving what it holds while etcd is away, says so in status, and is a
    member again once etcd is back."""
    etcd = EtcdCluster(tmp_path, members=1).start()
    nodes = []
    try:
        nodes = start_nodes(tmp_path, etcd.client_urls, [7], advertise="localhost")
        (n,) = nodes
        # --advertise: the host others are told
        assert members(n)[0]["advertise_addr"] == "localhost:%d" % n.ports["sbp"]
        with client(n) as c:
            sid = c.create_stream(replica_nums=1)["stream_id"]
            assert c.append(sid, batch(2)) == 0
        etcd.kill9(0)
        with client(n) as c:
            assert c.append(sid, batch(1)) == 2  # served from what the node holds
            assert c.fetch(sid, 0)
        wait_for(lambda: client(n).call(call_status())["cluster"]["etcd_reachable"] is False, timeout=15,
                 what="status saying etcd is unreachable")
        with client(n, timeout=20) as c:
            with pytest.raises(SbpError) as info:
                c.create_stream(replica_nums=1)
            assert "placement driver unavailable" in info.value.message
        etcd.start_member(0)
        wait_for(lambda: view(n) == ([7], 7), timeout=20, what="membership after etcd returns")
        with client(n) as c:
            assert c.create_stream(replica_nums=1)["stream_id"] >> 32 == 7
        assert client(n).call(call_status())["cluster"]["etcd_reachable"] is True
    finally:
        for node in nodes:
            node.kill9()
        etcd.stop()


def test_sbpctl_cluster_on_a_single_node(node):
    out = sbpctl("cluster", "--endpoint", node.endpoint("sbp"))
    assert "mode      single node" in out and "leader    %d" % node.node_id in out
    assert "single node" in sbpctl("status", "--endpoint", node.endpoint("sbp"))


def test_a_single_node_turned_cluster_member_keeps_its_streams_and_ids(tmp_path, etcd):
    n = NodeProcess(tmp_path, name="solo", fsync="never", node_id=9).start()
    try:
        with client(n) as c:
            old = [c.create_stream()["stream_id"] for _ in range(2)]
            assert c.append(old[0], batch(2)) == 0
        assert n.terminate() == 0
        n.options["cluster"] = etcd.client_urls
        n.start(timeout=60)
        with client(n) as c:
            new = c.create_stream(replica_nums=1)["stream_id"]
            assert new >> 32 == 9 and new & 0xFFFFFFFF > max(s & 0xFFFFFFFF for s in old)
            # the streams from before --cluster stay this node's, served here
            assert c.append(old[0], batch(1)) == 2
            assert c.fetch(old[1], 0, max_wait_ms=0) == b""
    finally:
        n.kill9()
