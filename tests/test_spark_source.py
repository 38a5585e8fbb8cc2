"""The ``sbp`` Spark data source against a real node process, on ``local[2]``.

One SparkSession for the whole file (starting one costs ~5 s); one node for the file. Everything
in one module so ``pytest -n 2 --dist loadfile`` starts Spark once.
"""

import datetime
import json

import pytest

from storage import record_batch
from tests.nodeproc import NodeProcess
from tests.sparksession import start_session

pyspark = pytest.importorskip("pyspark")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

UTC = datetime.timezone.utc


@pytest.fixture(scope="module")
def sbp_node(tmp_path_factory):
    node = NodeProcess(tmp_path_factory.mktemp("spark-node"), fsync="never").start()
    yield node
    node.kill9()


@pytest.fixture(scope="module")
def client(sbp_node):
    from protocols.sbp.client import BlockingSbpClient

    c = BlockingSbpClient(*sbp_node.address("sbp"))
    yield c
    c.close()


@pytest.fixture(scope="session")
def spark_session():
    spark = start_session()
    yield spark
    spark.stop()


@pytest.fixture(scope="module")
def spark(spark_session):
    # Before register(): is the format already there through pyspark_sbp (Spark's automatic
    # registration)? load() is lazy about options but fails at once on an unknown format.
    try:
        spark_session.read.format("sbp").load()
        auto = "loaded"
    except Exception as e:
        auto = str(e)
    import node.spark

    node.spark.register(spark_session)
    spark_session.auto_registration_result = auto
    return spark_session


def append(client, sid, records):
    """Append ``(timestamp_ms, headers, body)`` records as one batch; return the batch as stored."""
    batch = record_batch.encode(records)
    base = client.append(sid, batch)
    return record_batch.with_base_offset(batch, base)


def expected(sid, batches, lo=0, hi=1 << 62):
    out = []
    for b in batches:
        for r in record_batch.decode(b)[1]:
            if lo <= r.offset < hi:
                ts = datetime.datetime.fromtimestamp(r.timestamp_ms / 1000, tz=UTC).replace(tzinfo=None)
                out.append((sid, r.offset, ts, [(n, v) for n, v in r.headers], r.body))
    return out


def rows(df):
    out = []
    for r in df.orderBy("stream_id", "offset").collect():
        headers = [(bytes(h["name"]), bytes(h["value"])) for h in r["headers"]]
        out.append((r["stream_id"], r["offset"], r["timestamp"], headers, bytes(r["body"])))
    return out


def reader(spark, node, streams, **opts):
    r = spark.read.format("sbp").option("endpoint", node.endpoint("sbp")).option("streams", streams)
    for k, v in opts.items():
        r = r.option(k, str(v))
    return r.load()


def test_automatic_registration(spark):
    assert spark.auto_registration_result == "loaded"


def test_batch_read_equals_appended_across_ranges_and_offsets(spark, sbp_node, client):
    a = client.create_stream()["stream_id"]
    b = client.create_stream()["stream_id"]
    batches = []
    ts = 1_700_000_000_000
    for i in range(3):  # three ranges: sealed, sealed, open
        for j in range(2):
            recs = [(ts + 7 * k - j, [(b"h%d" % k, b"v\x00%d" % i)] * (k % 3), b"body-%d-%d-%d" % (i, j, k)) for k in range(40)]
            batches.append(append(client, a, recs))
        if i < 2:
            client.seal(a, i)
    b_batches = [append(client, b, [(ts, [], b"")]), append(client, b, [(ts + 1, [(b"", b"")], b"\xff" * 3000)] * 5)]
    assert len(client.list_ranges(a)) == 3

    df = reader(spark, sbp_node, "%d,%d" % (a, b))
    assert df.rdd.getNumPartitions() == 4  # CONTRACT §8: one per (stream, range)
    assert rows(df) == expected(a, batches) + expected(b, b_batches)
    assert [f.simpleString() for f in [df.schema]] == [
        "struct<stream_id:bigint,offset:bigint,timestamp:timestamp,headers:array<struct<name:binary,value:binary>>,body:binary>"
    ]

    # start/end offsets: inside a batch, across a range boundary (ranges hold 80 records each).
    sub = reader(spark, sbp_node, str(a), start_offset=75, end_offset=163)
    assert sub.rdd.getNumPartitions() == 3
    assert rows(sub) == expected(a, batches, 75, 163)
    assert reader(spark, sbp_node, str(a), start_offset=100, end_offset=100).count() == 0
    assert len(reader(spark, sbp_node, str(a)).limit(3).collect()) == 3  # a task stopped early
    per_stream = reader(spark, sbp_node, "%d,%d" % (a, b), start_offset=json.dumps({str(a): 239}), end_offset="latest")
    assert [(r[0], r[1]) for r in rows(per_stream)] == [(a, 239)] + [(b, o) for o in range(6)]


def test_streaming_available_now_picks_up_new_records(spark, sbp_node, client, tmp_path):
    """readStream from one stream, writeStream (format sbp) into another, two availableNow runs."""
    sid = client.create_stream()["stream_id"]
    copy = client.create_stream()["stream_id"]
    first = [append(client, sid, [(1000 + i, [], b"a%d" % i) for i in range(10)]) for _ in range(5)]
    ck = str(tmp_path / "ck")

    def run():
        q = (
            spark.readStream.format("sbp")
            .option("endpoint", sbp_node.endpoint("sbp"))
            .option("streams", str(sid))
            .option("max_records_per_trigger", "20")
            .load()
            .writeStream.format("sbp")
            .option("endpoint", sbp_node.endpoint("sbp"))
            .option("stream", str(copy))
            .option("checkpointLocation", ck)
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination(120)
        return [p["numInputRows"] for p in q.recentProgress]

    assert run() == [20, 20, 10]  # admission control: ReadMaxRows(20) per micro-batch
    client.seal(sid, 0)
    later = [append(client, sid, [(2000, [(b"k", b"v")], b"late%d" % i)]) for i in range(3)]
    assert sum(run()) == 3  # only what was appended between the triggers
    # Micro-batches run in order and each read one range here, so the copy keeps the order.
    source = expected(sid, first + later)
    got = rows(reader(spark, sbp_node, str(copy)))
    assert [r[1] for r in got] == list(range(len(source)))
    assert [r[2:] for r in got] == [r[2:] for r in source]


def test_write_then_read_back(spark, sbp_node, client, tmp_path):
    sid = client.create_stream()["stream_id"]
    when = datetime.datetime(2025, 1, 2, 3, 4, 5, 678000)
    data = [(b"w%d" % i, [(b"n", b"%d" % i)] if i % 2 else [], when) for i in range(200)]
    df = spark.createDataFrame(data, "body binary, headers array<struct<name:binary,value:binary>>, timestamp timestamp").repartition(2)
    report = str(tmp_path / "report.json")
    (df.write.format("sbp").mode("append").option("endpoint", sbp_node.endpoint("sbp"))
       .option("stream", str(sid)).option("report_path", report).save())
    with open(report) as f:
        summary = json.load(f)["streams"][str(sid)]
    assert summary["records"] == 200 and summary["first_offset"] == 0 and summary["last_offset"] == 199

    back = rows(reader(spark, sbp_node, str(sid)))
    assert [r[1] for r in back] == list(range(200))
    assert sorted((r[4], r[3], r[2]) for r in back) == sorted((b, h, when) for b, h, _ in data)

    # A read stream written back routes by its stream_id column when no stream option is given.
    copy = reader(spark, sbp_node, str(sid), end_offset=50).selectExpr("stream_id", "headers", "body")
    copy.write.format("sbp").mode("append").option("endpoint", sbp_node.endpoint("sbp")).save()
    assert reader(spark, sbp_node, str(sid)).count() == 250


def test_any_node_of_a_cluster(spark, tmp_path):
    """CONTRACT §9: given a node that does not hold the stream, the source reads and writes it
    through the node that does (PD_NOT_LEADER followed)."""
    from protocols.sbp.client import BlockingSbpClient
    from tests.etcdproc import EtcdCluster, etcd_available

    if not etcd_available():
        pytest.skip("etcd-server is not installed")
    etcd = EtcdCluster(tmp_path, members=1).start()
    nodes = []
    try:
        nodes = [NodeProcess(tmp_path, name="c%d" % i, cluster=etcd.client_urls, node_id=i, fsync="never").start()
                 for i in (1, 2)]
        with BlockingSbpClient(*nodes[0].address("sbp")) as c:
            sids = [c.create_stream(replica_nums=1)["stream_id"] for _ in range(2)]
            primaries = [c.list_ranges(s)[0]["servers"][0]["server_id"] for s in sids]
        sid = sids[primaries.index(2)]  # the stream node 2 holds; Spark is given node 1
        when = datetime.datetime(2025, 1, 2, 3, 4, 5)
        data = [(b"c%d" % i, [], when) for i in range(30)]
        df = spark.createDataFrame(data, "body binary, headers array<struct<name:binary,value:binary>>, timestamp timestamp")
        df.write.format("sbp").mode("append").option("endpoint", nodes[0].endpoint("sbp")).option("stream", str(sid)).save()
        back = rows(reader(spark, nodes[0], str(sid)))
        assert [r[1] for r in back] == list(range(30)) and sorted(r[4] for r in back) == sorted(b for b, _, _ in data)
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()
