"""Replicated streams (CONTRACT §9 Appends, Reads; issue 17): real etcd, three real nodes."""

import pytest

from protocols.sbp import codec
from protocols.sbp.client import BlockingSbpClient, SbpError
from storage import record_batch
from tests.etcdproc import EtcdCluster, etcd_available
from tests.test_cluster import batch, client, start_nodes, three_nodes, wait_for

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed")


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    with three_nodes(tmp_path_factory.mktemp("repl3")) as cluster:
        yield cluster


def roles(nodes, sid):
    (r0,) = client(nodes[0]).list_ranges(sid)
    by_id = {n.node_id: n for n in nodes}
    primary = by_id[next(s["server_id"] for s in r0["servers"] if s["is_primary"])]
    return primary, [n for n in nodes if n is not primary]


def fetch_all(node, sid, upto, start=0):
    """Every batch of ``sid`` on ``node`` from ``start`` (FETCH, plain client: no following), as
    bytes; a copy still catching up answers a read past its end with PD_NOT_LEADER naming the
    primary: what it served up to there."""
    out = []
    offset = start
    with client(node) as c:
        while offset < upto:
            try:
                data = c.fetch(sid, offset)
            except SbpError as e:
                if e.code != codec.PD_NOT_LEADER:
                    raise
                break
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

    # FETCH from all three: the same bytes (base offsets included). An acknowledged batch may be
    # durable on the two other replicas before the primary's own disk: wait for it there too
    wait_for(lambda: fetch_all(primary, sid, total)[0] == total, what="the primary serves the stream")
    end, want = fetch_all(primary, sid, total)
    assert len(want) == 200
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

    # it comes back and catches up what it missed (the primary resends from its store); until
    # then a read past its own end is not answered short: it names the primary (a following
    # client reads there)
    r2.restart()
    with client(r2) as c:
        try:
            data = c.fetch(sid, 3)
            assert int.from_bytes(data[1:9], "big") == 3  # (caught up already)
        except SbpError as e:
            assert e.code == codec.PD_NOT_LEADER and e.message == primary.endpoint("sbp")
    with BlockingSbpClient("127.0.0.1", r2.ports["sbp"], timeout=10, follow_cluster=True) as c:
        data = c.fetch(sid, 3)
        assert int.from_bytes(data[1:9], "big") == 3
    wait_for(lambda: fetch_all(primary, sid, 103)[0] == 103, what="the primary serves 103")
    end, want = fetch_all(primary, sid, 103)
    wait_for(lambda: fetch_all(r2, sid, 103) == (103, want), timeout=30, what="the restarted replica caught up")

    # and it takes part again: appends go on, every replica converges
    with client(primary) as c:
        assert c.append(sid, batch(1)) == 103
    wait_for(lambda: fetch_all(primary, sid, 104)[0] == 104, what="the primary serves 104")
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


class Writer:
    """Appends batches with distinct bodies to ``sid`` on whichever node is the open range's
    primary (LIST_RANGES on a live node), retrying on any error; records what was acknowledged."""

    def __init__(self, nodes, sid):
        import threading

        self.nodes = nodes
        self.sid = sid
        self.acked = []  # (offset, batch as sent, monotonic time of the ack)
        self.stale = []  # status codes of refused appends
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.n = 0

    def primary(self):
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            try:
                ranges = client(n, timeout=3).list_ranges(self.sid)
            except Exception:
                continue
            r = ranges[-1]
            pid = next(s["server_id"] for s in r["servers"] if s["is_primary"])
            return next(x for x in self.nodes if x.node_id == pid)
        return None

    def run(self):
        import time

        c = None
        while not self.stop.is_set():
            b = batch(1 + self.n % 3, tag=b"w%d-" % self.n)
            try:
                if c is None:
                    p = self.primary()
                    if p is None:
                        time.sleep(0.05)
                        continue
                    c = BlockingSbpClient("127.0.0.1", p.ports["sbp"], timeout=5)
                off = c.append(self.sid, b)
            except Exception as e:
                if isinstance(e, SbpError):
                    self.stale.append(e.code)
                try:
                    c and c.close()
                except Exception:
                    pass
                c = None
                time.sleep(0.02)
                continue
            self.acked.append((off, b, time.monotonic()))
            self.n += 1
        if c is not None:
            c.close()


def stored(b, offset):
    return b[:1] + offset.to_bytes(8, "big", signed=True) + b[9:]


@pytest.mark.slow
def test_kill9_of_the_primary_under_load_loses_no_acknowledged_batch(tmp_path):
    import time

    etcd = EtcdCluster(tmp_path, members=1).start()
    nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3])
    try:
        with client(nodes[0]) as c:
            sid = c.create_stream(replica_nums=3)["stream_id"]
        primary, survivors = roles(nodes, sid)
        w = Writer(nodes, sid)
        w.thread.start()
        wait_for(lambda: len(w.acked) >= 200, timeout=60, what="200 acknowledged appends")
        killed_at = time.monotonic()
        primary.kill9()
        before = len(w.acked)
        wait_for(lambda: len(w.acked) >= before + 100, timeout=40, what="appends resumed after the failover")
        w.stop.set()
        w.thread.join(20)
        first_after = next(t for off, b, t in w.acked[before:] if t > killed_at)
        failover_s = first_after - killed_at
        print("failover: kill -9 of the primary to the first acknowledged append: %.2f s" % failover_s)
        # the range was sealed and the next one opened on the survivors
        ranges = client(survivors[0]).list_ranges(sid)
        assert len(ranges) == 2 and ranges[0]["end_offset"] == ranges[1]["start_offset"] and ranges[1]["end_offset"] == -1
        assert {s["server_id"] for s in ranges[-1]["servers"]} == {n.node_id for n in survivors}
        # every acknowledged batch is readable at its acknowledged offset on every live replica;
        # offsets contiguous and ordered
        end = max(off + record_batch.decode(b)[0].record_count for off, b, _ in w.acked)
        for n in survivors:
            wait_for(lambda: fetch_all(n, sid, end)[0] >= end, timeout=20, what="node %d serves up to %d" % (n.node_id, end))
            upto, got = fetch_all(n, sid, end)
            at = {int.from_bytes(x[1:9], "big"): x for x in got}
            for off, b, _ in w.acked:
                assert at.get(off) == stored(b, off), "acknowledged batch at %d missing or different on node %d" % (off, n.node_id)
        acked_offsets = [off for off, _, _ in w.acked]
        assert acked_offsets == sorted(acked_offsets) and len(set(acked_offsets)) == len(acked_offsets)
        assert fetch_all(survivors[0], sid, end) == fetch_all(survivors[1], sid, end)
        assert failover_s < 20
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


@pytest.mark.slow
def test_a_paused_old_primary_acknowledges_nothing_after_the_seal(tmp_path):
    import signal
    from concurrent.futures import ThreadPoolExecutor

    etcd = EtcdCluster(tmp_path, members=1).start()
    nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3])
    try:
        with client(nodes[0]) as c:
            sid = c.create_stream(replica_nums=3)["stream_id"]
        old, survivors = roles(nodes, sid)
        with client(old) as c:
            assert c.append(sid, batch(2)) == 0
        stale = client(old, timeout=60)
        old.proc.send_signal(signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                # sent while it is paused: it reads it only after the seal
                fut = pool.submit(stale.append, sid, batch(1, tag=b"stale"))
                wait_for(lambda: len(client(survivors[0]).list_ranges(sid)) == 2, timeout=30, what="the seal")
                ranges = client(survivors[0]).list_ranges(sid)
                pid = next(s["server_id"] for s in ranges[-1]["servers"] if s["is_primary"])
                new = next(n for n in survivors if n.node_id == pid)
                with client(new) as c:
                    assert c.append(sid, batch(3, tag=b"new")) == 2
                old.proc.send_signal(signal.SIGCONT)
                with pytest.raises(SbpError) as info:
                    fut.result(timeout=30)
                assert info.value.code in (codec.RANGE_ALREADY_SEALED, codec.PD_NOT_LEADER)
        finally:
            old.proc.send_signal(signal.SIGCONT)
            stale.close()
        # the survivors hold exactly the acknowledged batches, the stale one nowhere
        for n in survivors:
            wait_for(lambda: fetch_all(n, sid, 5)[0] == 5, what="node %d serves 5" % n.node_id)
            upto, got = fetch_all(n, sid, 10)
            assert upto == 5 and b"stale" not in b"".join(got)
        # the old primary, back, takes no appends and sends readers to the new range
        with client(old) as c:
            with pytest.raises(SbpError) as info:
                c.append(sid, batch(1))
            assert info.value.code == codec.PD_NOT_LEADER
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


def test_seal_ranges_in_a_cluster_seals_the_open_range_and_opens_the_next(trio):
    etcd, nodes = trio
    with client(nodes[2]) as c:
        sid = c.create_stream(replica_nums=3)["stream_id"]
    primary, others = roles(nodes, sid)
    with client(primary) as c:
        assert c.append(sid, batch(3)) == 0
    # from a node that is not the primary: the failover way (replicas fenced, largest end)
    with client(others[0]) as c:
        new = c.seal(sid, 0)
        assert (new["range_index"], new["start_offset"], new["end_offset"]) == (1, 3, -1)
        for index, code in ((0, codec.RANGE_ALREADY_SEALED), (9, codec.RANGE_NOT_FOUND)):
            with pytest.raises(SbpError) as info:
                c.seal(sid, index)
            assert info.value.code == code
        with pytest.raises(SbpError) as info:
            c.create_range(sid)  # the last range is open: a seal opened it
        assert info.value.code == codec.INVALID_REQUEST and "range 1" in info.value.message
        r0, r1 = c.list_ranges(sid)
    assert r0["end_offset"] == 3 and r1["start_offset"] == 3
    assert sorted(s["server_id"] for s in r1["servers"]) == sorted(n.node_id for n in nodes)
    # the same primary sequences the new range (it held the largest end)
    assert next(s["server_id"] for s in r1["servers"] if s["is_primary"]) == primary.node_id
    with client(primary) as c:
        wait_for(lambda: _appended(c, sid) == 3, what="appends on the new range")
    for n in nodes:
        wait_for(lambda: fetch_all(n, sid, 5)[0] == 5, what="node %d serves 5" % n.node_id)


def _local_trim(node, sid):
    """The trim point of ``node``'s own copy: a FETCH below it names it (OFFSET_OUT_OF_RANGE,
    "offset 0 outside [trim, next]"); 0 while offset 0 is still stored."""
    import re

    with client(node) as c:
        try:
            c.fetch(sid, 0, 1, 0)
            return 0
        except SbpError as e:
            m = re.search(r"outside \[(\d+), ", e.message or "")
            if e.code != codec.OFFSET_OUT_OF_RANGE or not m:
                raise
            return int(m.group(1))


def test_retention_is_decided_by_the_primary_and_reaches_every_replica_as_its_trim(trio):
    """A replicated stream's retention runs on its primary's clock and goes to every replica as
    a trim through the stream record, so all copies keep the same batches (issue 17)."""
    import time

    etcd, nodes = trio
    with client(nodes[1]) as c:
        sid = c.create_stream(replica_nums=3, retention_period_ms=4000)["stream_id"]
    primary, others = roles(nodes, sid)
    with client(primary) as c:
        assert c.append_pipelined([(sid, batch(2, tag=b"old%d-" % i)) for i in range(10)], window=8)[-1] == 18
    time.sleep(4.5)  # the first ten batches outlive the retention period; the next one does not yet
    with client(primary) as c:
        assert c.append(sid, batch(3, tag=b"new")) == 20

    def trimmed_everywhere():
        start = client(nodes[2]).list_ranges(sid)[0]["start_offset"]  # the stream record
        points = [_local_trim(n, sid) for n in nodes]
        return start == 20 and points == [20] * 3
    wait_for(trimmed_everywhere, timeout=12, what="the record and every copy trimmed at 20")
    for n in nodes:
        assert fetch_all(n, sid, 23, 20)[1] == fetch_all(primary, sid, 23, 20)[1] != []


def test_a_trim_reaches_every_replica_and_one_that_was_down(trio):
    """CONTRACT §3 trim on a replicated stream: every copy ends at the primary's trim point,
    including a replica that was down when it happened (it follows the record on restart)."""
    etcd, nodes = trio
    with client(nodes[0]) as c:
        sid = c.create_stream(replica_nums=3)["stream_id"]
    primary, (r1, r2) = roles(nodes, sid)
    with client(primary) as c:
        c.append_pipelined([(sid, batch(2, tag=b"t%d-" % i)) for i in range(20)], window=8)
    wait_for(lambda: fetch_all(r2, sid, 40)[0] == 40, what="the replica holds 40")
    r2.kill9()
    with client(primary) as c:
        c.append_pipelined([(sid, batch(2, tag=b"u%d-" % i)) for i in range(5)], window=8)
        c.trim(sid, 31)  # inside the batch at 30: the trim point is 31, that batch is kept whole
    wait_for(lambda: [_local_trim(n, sid) for n in (primary, r1)] == [31, 31], what="live copies trimmed")
    r2.restart()
    wait_for(lambda: _safe(lambda: _local_trim(r2, sid)) == 31, timeout=30, what="the restarted copy trimmed")
    end, want = fetch_all(primary, sid, 50, 31)
    assert end == 50 and int.from_bytes(want[0][1:9], "big") == 30
    wait_for(lambda: _safe(lambda: fetch_all(r2, sid, 50, 31)) == (50, want), timeout=30,
             what="the restarted copy holds the rest")
    assert client(r1).list_ranges(sid)[0]["start_offset"] == 31


def _appended(c, sid):
    try:
        return c.append(sid, batch(2, tag=b"after-seal"))
    except SbpError:
        return None  # the record of the new range has not reached the primary yet


def _safe(fn):
    """``fn()``, or None if the node does not answer (down, or starting)."""
    try:
        return fn()
    except Exception:
        return None


def _open(node, sid):
    return _safe(lambda: client(node, timeout=3).list_ranges(sid))


@pytest.mark.slow
def test_below_ack_count_appends_get_1502_and_the_old_primarys_tail_is_cut_before_it_copies_again(tmp_path):
    import threading

    etcd = EtcdCluster(tmp_path, members=1).start()
    nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3])
    try:
        with client(nodes[0]) as c:
            sid = c.create_stream(replica_nums=3)["stream_id"]
        old, (a, b) = roles(nodes, sid)
        with client(old) as c:
            assert c.append_pipelined([(sid, batch(2, tag=b"ok%d-" % i)) for i in range(5)], window=5) == [0, 2, 4, 6, 8]
        # both copies die: the primary writes the next batch, cannot send it, and, once their
        # leases expire, answers 1502 (CONTRACT §9: fewer than ack_count live replicas)
        a.kill9()
        b.kill9()
        answers = []

        def tail(c):
            try:
                answers.append(c.append(sid, batch(3, tag=b"tail")))
            except SbpError as e:
                answers.append(e.code)

        with client(old, timeout=30) as c:
            t = threading.Thread(target=tail, args=(c,))
            t.start()
            t.join(30)
        assert answers == [codec.NO_AVAILABLE_RS]
        progress = client(old).describe_range(sid, 0)["progress"]
        assert progress["replica_ends"][str(old.node_id)] == 13 and progress["confirm_offset"] == 10  # the unacknowledged tail
        with client(old) as c:
            with pytest.raises(SbpError) as info:
                c.append(sid, batch(1))
            assert info.value.code == codec.NO_AVAILABLE_RS
        # the primary dies too; the copies come back and the leader seals range 0 at 10
        old.kill9()
        a.restart()
        b.restart()
        wait_for(lambda: (_open(a, sid) or [None]) and len(_open(a, sid)) >= 2, timeout=40, what="the failover")
        r0 = _open(a, sid)[0]
        assert r0["end_offset"] == 10
        r1 = _open(a, sid)[-1]
        new = next(n for n in (a, b) if n.node_id == next(s["server_id"] for s in r1["servers"] if s["is_primary"]))
        with client(new) as c:
            wait_for(lambda: _safe(lambda: c.append(sid, batch(1, tag=b"new"))) is not None, what="appends on range 1")
        # the old primary returns: its tail past the seal is cut and it is taken back as a copy
        # (re-replication: the range had 2 of R = 3)
        old.restart()

        def three_again():
            rs = _open(a, sid) or []
            return rs and rs[-1]["end_offset"] == -1 and old.node_id in [s["server_id"] for s in rs[-1]["servers"]] and rs
        rs = wait_for(three_again, timeout=45, what="the old primary taken back as a copy")
        assert len(rs[-1]["servers"]) == 3
        primary = next(n for n in (a, b) if n.node_id == next(s["server_id"] for s in rs[-1]["servers"] if s["is_primary"]))
        with client(primary) as c:
            end = wait_for(lambda: _safe(lambda: c.append(sid, batch(2, tag=b"three"))), what="appends with three copies") + 2
        wait_for(lambda: fetch_all(primary, sid, end)[0] == end, what="the primary serves the stream")
        want = fetch_all(primary, sid, end)
        assert b"tail" not in b"".join(want[1])
        for n in nodes:
            # a copy answers PD_NOT_LEADER until the new record reaches it through its watch
            wait_for(lambda: _safe(lambda: fetch_all(n, sid, end)) == want, timeout=20,
                     what="node %d holds the stream" % n.node_id)
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


@pytest.mark.slow
def test_a_replica_lost_for_good_is_replaced_within_45_s(tmp_path):
    import time

    etcd = EtcdCluster(tmp_path, members=1).start()
    nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3, 4])
    try:
        with client(nodes[0]) as c:
            sid = c.create_stream(replica_nums=3)["stream_id"]
        (r0,) = client(nodes[0]).list_ranges(sid)
        ids = [s["server_id"] for s in r0["servers"]]
        by_id = {n.node_id: n for n in nodes}
        primary = by_id[next(s["server_id"] for s in r0["servers"] if s["is_primary"])]
        lost = by_id[next(i for i in ids if i != primary.node_id)]
        spare = next(n for n in nodes if n.node_id not in ids)
        with client(primary) as c:
            c.append_pipelined([(sid, batch(2, tag=b"a%d-" % i)) for i in range(20)], window=8)
            c.trim(sid, 21)  # inside the batch at 20: the new copy starts with that batch
        lost.kill9()
        t0 = time.monotonic()
        with client(primary) as c:  # the other two acknowledge meanwhile
            c.append_pipelined([(sid, batch(2, tag=b"b%d-" % i)) for i in range(20)], window=8)

        def replaced():
            rs = _open(primary, sid) or []
            return rs and spare.node_id in [s["server_id"] for s in rs[-1]["servers"]] and rs
        rs = wait_for(replaced, timeout=45, what="a copy on the spare node")
        took = time.monotonic() - t0
        print("re-replication: kill -9 of a replica to the new range on the spare: %.1f s" % took)
        assert {s["server_id"] for s in rs[-1]["servers"]} == set(ids) - {lost.node_id} | {spare.node_id}
        assert next(s["server_id"] for s in rs[-1]["servers"] if s["is_primary"]) == primary.node_id
        # the spare gets the stream before any client appends to the new range: the primary
        # takes the range up when its record comes (campaign seed 25: a spare was left at the old
        # seal, its reads short of acknowledged batches, while the new range took no appends)
        wait_for(lambda: (_safe(lambda: fetch_all(spare, sid, 80, 21)) or (0,))[0] == 80, timeout=20,
                 what="the spare catches up without an append")
        with client(primary) as c:
            base = wait_for(lambda: _safe(lambda: c.append(sid, batch(1, tag=b"c"))), what="appends go on")
        end = base + 1
        wait_for(lambda: fetch_all(primary, sid, end, 21)[0] == end, what="the primary serves the stream")
        want = fetch_all(primary, sid, end, 21)
        assert int.from_bytes(want[1][0][1:9], "big") == 20
        wait_for(lambda: _safe(lambda: fetch_all(spare, sid, end, 21)) == want, timeout=20,
                 what="the spare holds the stream from its trim point")
        assert took < 45
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()
