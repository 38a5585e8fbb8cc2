"""Replicated streams (CONTRACT §9 Appends, Reads; issue 17): real etcd, three real nodes."""

import pytest

from protocols.sbp import codec
from protocols.sbp.client import BlockingSbpClient, SbpError
from storage import record_batch
from tests.etcdproc import EtcdCluster, etcd_available
from tests.test_cluster import batch, client, start_nodes, wait_for

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed")


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    base = tmp_path_factory.mktemp("repl3")
    etcd = EtcdCluster(base, members=1).start()
    nodes = start_nodes(base, etcd.client_urls, [1, 2, 3])
    yield etcd, nodes
    for n in nodes:
        n.kill9()
    etcd.stop()


def roles(nodes, sid):
    (r0,) = client(nodes[0]).list_ranges(sid)
    by_id = {n.node_id: n for n in nodes}
    primary = by_id[next(s["server_id"] for s in r0["servers"] if s["is_primary"])]
    return primary, [n for n in nodes if n is not primary]


def fetch_all(node, sid, upto):
    """Every batch of ``sid`` on ``node`` from 0 (FETCH, plain client: no following), as bytes."""
    out = []
    offset = 0
    with client(node) as c:
        while offset < upto:
            data = c.fetch(sid, offset)
            if not data:
                break
            for b in record_batch.split(data):
                out.append(bytes(b))
                offset = int.from_bytes(b[1:9], "big", signed=True) + int.from_bytes(b[9:13], "big", signed=True)
    return offset, out


def test_appends_on_the_primary_are_fetched_byte_identical_from_every_replica(trio):
    etcd, nodes = trio
    with client(nodes[0]) as c:
        sid = c.create_stream(replica_nums=3)["stream_id"]
    primary, others = roles(nodes, sid)

    # pipelined appends on the primary: consecutive offsets, answered once a majority holds them
    entries = [(sid, batch(1 + i % 5, tag=b"b%d-" % i)) for i in range(200)]
    with client(primary) as c:
        bases = c.append_pipelined(entries, window=16)
    counts = [1 + i % 5 for i in range(200)]
    expected = [sum(counts[:i]) for i in range(200)]
    assert bases == expected
    total = sum(counts)

    # FETCH from all three: the same bytes (base offsets included)
    end, want = fetch_all(primary, sid, total)
    assert end == total and len(want) == 200
    for n in others:
        wait_for(lambda: fetch_all(n, sid, total) == (total, want), what="node %d serves the stream" % n.node_id)

    # a replica's long-poll FETCH wakes on the next acknowledged append
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        with client(others[0]) as rc:
            fut = pool.submit(rc.fetch, sid, total, 1 << 20, 10000)
            with client(primary) as c:
                assert c.append(sid, batch(2, tag=b"late")) == total
            data = fut.result(timeout=15)
    (b,) = list(record_batch.split(data))
    assert int.from_bytes(b[1:9], "big") == total and record_batch.decode(bytes(b))[0].record_count == 2

    # APPEND on a non-primary: PD_NOT_LEADER naming the primary
    for n in others:
        with client(n) as c:
            with pytest.raises(SbpError) as info:
                c.append(sid, batch(1))
        assert info.value.code == codec.PD_NOT_LEADER and info.value.message == primary.endpoint("sbp")

    # DESCRIBE_RANGES shows each replica's progress (on the primary: every replica's durable end)
    def progressed():
        d = client(primary).describe_range(sid, 0)
        p = d.get("progress") or {}
        return d["next_offset"] == total + 2 and p.get("confirm_offset") == total + 2 \
            and sorted(p["replica_ends"].values()) == [total + 2] * 3 and p
    p = wait_for(progressed, what="every replica's progress on the primary")
    assert sorted(p["replica_ends"]) == sorted(str(n.node_id) for n in nodes)
    for n in others:
        wait_for(lambda: client(n).describe_range(sid, 0)["next_offset"] == total + 2, what="confirm learned")


def test_reads_stop_at_the_confirm_offset_and_a_restarted_replica_catches_up(trio):
    etcd, nodes = trio
    with client(nodes[1]) as c:
        sid = c.create_stream(replica_nums=3)["stream_id"]
    primary, (r1, r2) = roles(nodes, sid)
    with client(primary) as c:
        assert c.append(sid, batch(3)) == 0
    wait_for(lambda: fetch_all(r1, sid, 3)[0] == 3 and fetch_all(r2, sid, 3)[0] == 3, what="replicas hold 3")

    # one replica down: a majority (primary + the other) still acknowledges
    r2.kill9()
    with client(primary) as c:
        bases = c.append_pipelined([(sid, batch(2, tag=b"x%d-" % i)) for i in range(50)], window=16)
    assert bases == list(range(3, 103, 2))

    # it comes back and catches up what it missed (the primary resends from its store)
    r2.restart()
    end, want = fetch_all(primary, sid, 103)
    assert end == 103
    wait_for(lambda: fetch_all(r2, sid, 103) == (103, want), timeout=30, what="the restarted replica caught up")

    # and it takes part again: appends go on, every replica converges
    with client(primary) as c:
        assert c.append(sid, batch(1)) == 103
    end, want = fetch_all(primary, sid, 104)
    for n in (r1, r2):
        wait_for(lambda: fetch_all(n, sid, 104) == (104, want), what="node %d converged" % n.node_id)


def test_a_fetch_on_a_node_without_a_replica_names_one(trio):
    etcd, nodes = trio
    with client(nodes[0]) as c:
        sid = c.create_stream(replica_nums=1)["stream_id"]
    primary, others = roles(nodes, sid)
    with client(primary) as c:
        assert c.append(sid, batch(2)) == 0
        assert len(list(record_batch.split(c.fetch(sid, 0)))) == 1
    with client(others[0]) as c:
        with pytest.raises(SbpError) as info:
            c.fetch(sid, 0)
    assert info.value.code == codec.PD_NOT_LEADER and info.value.message == primary.endpoint("sbp")
    with BlockingSbpClient("127.0.0.1", others[0].ports["sbp"], timeout=10, follow_cluster=True) as c:
        assert len(list(record_batch.split(c.fetch(sid, 0)))) == 1
