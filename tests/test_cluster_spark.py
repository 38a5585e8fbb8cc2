"""The ``sbp`` Spark source on a 3-node cluster (CONTRACT §9 "every interface, every node";
issue 18): reads from the replicas of each range, a batch read through node C of a stream
written through node A with a sealed and an open range, and a streaming query that goes on
across a kill -9 of the stream's primary into an idempotent sink with nothing lost or doubled.

One etcd, three nodes and one SparkSession for the module; the failover runs once (the
``failed_over`` fixture) and two tests check what it left.
"""

import threading
import time

import pytest

from protocols.sbp.client import BlockingSbpClient, SbpError
from storage import record_batch
from tests.etcdproc import etcd_available
from tests.sparksession import start_session
from tests.test_cluster import client, three_nodes, view, wait_for

pyspark = pytest.importorskip("pyspark")

pytestmark = [
    pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed"),
    pytest.mark.slow,
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    with three_nodes(tmp_path_factory.mktemp("spark3")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def spark():
    import node.spark

    session = start_session()
    node.spark.register(session)
    yield session
    session.stop()


def primary_of(node, sid):
    ranges = client(node).list_ranges(sid)
    return next(s["server_id"] for s in ranges[-1]["servers"] if s["is_primary"])


def test_partitions_are_spread_over_the_replicas_of_their_range(trio):
    from node.spark.source import SbpBatchReader

    etcd, nodes = trio
    a, b, c = nodes
    with client(a) as cl:
        sids = [cl.create_stream(replica_nums=3)["stream_id"] for _ in range(3)]
    with BlockingSbpClient(*a.address("sbp"), follow_cluster=True) as w:
        for sid in sids:
            w.append(sid, record_batch.encode([(1, [], b"x%d" % i) for i in range(10)]))
    streams = ",".join(map(str, sids))
    addresses = {n.endpoint("sbp") for n in nodes}

    spread = SbpBatchReader({"endpoint": c.endpoint("sbp"), "streams": streams}).partitions()
    assert len(spread) == 3 and all(p.end - p.start == 10 for p in spread)
    # three equal partitions, three replicas each: one on each node, the other replicas next
    assert {p.servers[0] for p in spread} == addresses
    assert all(set(p.servers) == addresses for p in spread)

    through_c = SbpBatchReader({"endpoint": c.endpoint("sbp"), "streams": streams, "read_from": "endpoint"}).partitions()
    assert [p.servers for p in through_c] == [[c.endpoint("sbp")]] * 3


class Writer:
    """Appends one-record-per-line batches ``w<n>-<i>`` through one node (it forwards nothing:
    the client follows PD_NOT_LEADER to the primary). A batch that fails is not sent again (it
    may or may not have landed: unacknowledged); the next batch takes the next n."""

    def __init__(self, node, sid):
        self.node = node
        self.sid = sid
        self.acked = []  # (offset, [bodies])
        self.failed = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        c = BlockingSbpClient(*self.node.address("sbp"), timeout=5, follow_cluster=True)
        n = 0
        while not self.stop.is_set():
            bodies = [b"w%d-%d" % (n, i) for i in range(1 + n % 4)]
            n += 1
            try:
                off = c.append(self.sid, record_batch.encode([(1000 + n, [], body) for body in bodies]))
            except (SbpError, OSError):
                self.failed += 1
                c.close()
                c = BlockingSbpClient(*self.node.address("sbp"), timeout=5, follow_cluster=True)
                time.sleep(0.05)
                continue
            self.acked.append((off, bodies))
            time.sleep(0.002)
        c.close()

    def records(self):
        return sum(len(b) for _, b in self.acked)


@pytest.fixture(scope="module")
def failed_over(trio, spark):
    """A stream written through A, read by a streaming query through C into an idempotent sink
    (micro-batch id -> its rows, replaced when Spark replays a batch), its primary B killed -9
    mid-way. Returns a dict of what happened."""
    etcd, nodes = trio
    a = nodes[0]
    with client(a) as cl:
        # a stream whose primary is neither A (the writers' node) nor C (Spark's)
        for _ in range(6):
            sid = cl.create_stream(replica_nums=3)["stream_id"]
            if primary_of(a, sid) not in (a.node_id, nodes[2].node_id):
                break
        else:
            pytest.fail("no stream got node 2 as its primary")
    b = next(n for n in nodes if n.node_id == primary_of(a, sid))
    c = next(n for n in nodes if n not in (a, b))

    sink = {}
    lock = threading.Lock()

    def keep(df, batch_id):
        got = [(r["offset"], bytes(r["body"])) for r in df.select("offset", "body").collect()]
        with lock:
            sink[batch_id] = got  # idempotent: a replayed micro-batch replaces itself

    def offsets():
        # a query that died stops the wait at once, with its own error
        if query is not None and query.exception() is not None:
            raise AssertionError("the streaming query failed: %s" % query.exception())
        with lock:
            return sorted(o for rows in sink.values() for o, _ in rows)

    query = None

    w = Writer(a, sid)
    w.thread.start()
    query = (spark.readStream.format("sbp").option("endpoint", c.endpoint("sbp")).option("streams", str(sid))
             .option("timeout", "20").load()
             .writeStream.foreachBatch(keep).trigger(processingTime="200 milliseconds").start())
    try:
        wait_for(lambda: len(offsets()) >= 300, timeout=120, what="the query to read 300 records")
        b.kill9()
        before = w.records()
        wait_for(lambda: w.records() >= before + 300, timeout=60, what="appends through A to resume after the failover")
        w.stop.set()
        w.thread.join(20)
        wait_for(lambda: len(client(c).list_ranges(sid)) == 2, what="the sealed range in C's answer")

        def tail():
            ranges = client(c).list_ranges(sid)
            return ranges[-1]["next_offset"]

        acked_end = max(off + len(bodies) for off, bodies in w.acked)
        wait_for(lambda: tail() >= acked_end, what="C to confirm every acknowledged record")
        end = tail()
        wait_for(lambda: offsets() and offsets()[-1] >= end - 1, timeout=60, what="the query to reach offset %d" % end)
        assert query.exception() is None
    finally:
        query.stop()
        w.stop.set()
    with lock:
        rows = [row for _, got in sorted(sink.items()) for row in got]
    return {"sid": sid, "a": a, "b": b, "c": c, "writer": w, "rows": rows, "end": end, "trio": trio}


def test_a_streaming_query_goes_on_across_a_primary_failover(failed_over):
    w, rows, end = failed_over["writer"], failed_over["rows"], failed_over["end"]
    # every offset of the stream exactly once over the micro-batches: none lost, none doubled
    got = [o for o, _ in rows]
    assert sorted(got) == list(range(end))
    by_offset = dict(rows)
    # every acknowledged record at its acknowledged offset; unacknowledged batches (the ones in
    # flight at the kill) at most once
    for off, bodies in w.acked:
        assert [by_offset[off + i] for i in range(len(bodies))] == bodies
    assert len(set(by_offset.values())) == len(rows)
    assert w.failed >= 1  # the kill was seen by the writer: the stream failed over under it


def test_a_batch_read_through_c_of_sealed_and_open_ranges(failed_over, spark):
    sid, b, c = failed_over["sid"], failed_over["b"], failed_over["c"]
    want = sorted(failed_over["rows"])

    def read(**opts):
        r = spark.read.format("sbp").option("endpoint", c.endpoint("sbp")).option("streams", str(sid))
        for k, v in opts.items():
            r = r.option(k, v)
        df = r.load()
        return df, sorted((x["offset"], bytes(x["body"])) for x in df.select("offset", "body").collect())

    ranges = client(c).list_ranges(sid)
    assert [r["end_offset"] >= 0 for r in ranges] == [True, False]
    # B (range 0's old primary) is down: range 0 is read from A or C, range 1 from its replicas
    df, got = read()
    assert df.rdd.getNumPartitions() == 2
    assert got == want
    assert read(read_from="endpoint")[1] == want

    # B back (on new ports) with its own copy of range 0: reads of range 0 may go there again
    b.start(timeout=60)
    wait_for(lambda: b.node_id in view(c)[0], timeout=30, what="B live again")
    assert read()[1] == want
