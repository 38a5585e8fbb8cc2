"""Units for the Spark data source's Arrow conversion and option parsing (no SparkSession, no node)."""

import datetime

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.spark.arrow import (
    ARROW_SCHEMA,
    SCHEMA_DDL,
    arrow_to_records,
    encode_records,
    fetch_to_arrow,
    parse_streams,
    split_endpoint,
)
from storage import record_batch
from storage.record_batch import InvalidBatch

UTC = datetime.timezone.utc


def rows_of(batch):
    return [(r["stream_id"], r["offset"], r["timestamp"], [(h["name"], h["value"]) for h in r["headers"]], r["body"]) for r in batch.to_pylist()]


def expected_rows(sid, batches):
    """What record_batch.decode says, in the CONTRACT §8 row shape."""
    out = []
    for b in batches:
        _, records = record_batch.decode(b)
        for r in records:
            ts = datetime.datetime.fromtimestamp(r.timestamp_ms / 1000, tz=UTC)
            out.append((sid, r.offset, ts, list(r.headers), r.body))
    return out


def test_arrow_schema_is_what_spark_expects():
    # Spark compares a yielded RecordBatch's schema with to_arrow_schema(DDL) and refuses others.
    # (Parsing the DDL string needs a JVM; the Spark tests read through it. This is its StructType.)
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql import types as T

    header = T.StructType([T.StructField("name", T.BinaryType()), T.StructField("value", T.BinaryType())])
    spark_schema = T.StructType(
        [
            T.StructField("stream_id", T.LongType()),
            T.StructField("offset", T.LongType()),
            T.StructField("timestamp", T.TimestampType()),
            T.StructField("headers", T.ArrayType(header)),
            T.StructField("body", T.BinaryType()),
        ]
    )
    ddl = ", ".join("%s %s" % (f.name, f.dataType.simpleString()) for f in spark_schema.fields)
    assert SCHEMA_DDL == ddl.replace("bigint", "long")
    assert to_arrow_schema(spark_schema, timezone="UTC").equals(ARROW_SCHEMA)


def test_fetch_result_of_several_batches():
    b1 = record_batch.encode([(1000, [], b"a"), (1001, [(b"k", b"v")], b"bb"), (999, [(b"x", b""), (b"y", b"z")], b"")], base_offset=10)
    b2 = record_batch.encode([(5000, [], b"c" * 300)], base_offset=13)
    batch, next_offset = fetch_to_arrow(b1 + b2, 42, 10, 100)
    assert next_offset == 14
    assert batch.schema.equals(ARROW_SCHEMA)
    assert rows_of(batch) == expected_rows(42, [b1, b2])


def test_rows_outside_lo_hi_are_dropped():
    b1 = record_batch.encode([(i, [], b"%d" % i) for i in range(5)], base_offset=0)
    b2 = record_batch.encode([(i, [], b"%d" % i) for i in range(5, 10)], base_offset=5)
    batch, next_offset = fetch_to_arrow(b1 + b2, 1, 3, 7)
    assert next_offset == 10
    assert batch.column("offset").to_pylist() == [3, 4, 5, 6]
    assert batch.column("body").to_pylist() == [b"3", b"4", b"5", b"6"]
    # A batch wholly below lo contributes nothing but still advances next_offset.
    batch, next_offset = fetch_to_arrow(b1, 1, 5, 9)
    assert batch is None and next_offset == 5


def test_corrupt_batches_are_refused():
    good = record_batch.encode([(1, [], b"abc")])
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 0xFF
    with pytest.raises(InvalidBatch):
        fetch_to_arrow(bytes(bad_crc), 1, 0, 10)
    with pytest.raises(InvalidBatch):
        fetch_to_arrow(good[:-1], 1, 0, 10)
    with pytest.raises(InvalidBatch):
        fetch_to_arrow(b"\x00" + good[1:], 1, 0, 10)


records_st = st.lists(
    st.tuples(
        st.integers(0, 2**40),
        st.lists(st.tuples(st.binary(max_size=8), st.binary(max_size=8)), max_size=3),
        st.binary(max_size=64),
    ),
    min_size=1,
    max_size=20,
)


@given(st.lists(records_st, min_size=1, max_size=4), st.integers(0, 2**40), st.data())
def test_round_trip_matches_record_batch_decode(groups, base, data):
    batches = []
    offset = base
    for recs in groups:
        batches.append(record_batch.encode(recs, base_offset=offset))
        offset += len(recs)
    lo = data.draw(st.integers(base, offset))
    hi = data.draw(st.integers(lo, offset))
    batch, next_offset = fetch_to_arrow(b"".join(batches), 7, lo, hi)
    assert next_offset == offset
    want = [r for r in expected_rows(7, batches) if lo <= r[1] < hi]
    assert (rows_of(batch) if batch is not None else []) == want


def test_write_path_round_trip():
    table = pa.table(
        {
            "stream_id": pa.array([1, 1, 1], pa.int64()),
            "offset": pa.array([0, 1, 2], pa.int64()),
            "timestamp": pa.array([1_700_000_000_123_456, None, 0], pa.timestamp("us", tz="UTC")),
            "headers": pa.array([[{"name": b"a", "value": b"b"}], [], None], ARROW_SCHEMA.field("headers").type),
            "body": pa.array([b"x", None, b"zz"], pa.binary()),
        }
    )
    recs = arrow_to_records(table.to_batches()[0], now_ms=77)
    assert recs == [(1_700_000_000_123, [(b"a", b"b")], b"x"), (77, (), b""), (0, (), b"zz")]
    out = list(encode_records(recs, max_batch_bytes=1 << 20))
    assert [n for _, n in out] == [3]
    _, decoded = record_batch.decode(out[0][0])
    assert [(r.timestamp_ms, r.headers, r.body) for r in decoded] == [(1_700_000_000_123, [(b"a", b"b")], b"x"), (77, [], b""), (0, [], b"zz")]


def test_write_accepts_string_bodies_and_splits_batches():
    batch = pa.record_batch({"body": pa.array(["é" * 10] * 50)})
    recs = arrow_to_records(batch, now_ms=5)
    assert recs[0] == (5, (), "é".encode() * 10)
    out = list(encode_records(recs, max_batch_bytes=200))
    assert sum(n for _, n in out) == 50 and len(out) > 1
    for b, n in out:
        assert record_batch.validate(b).record_count == n
    with pytest.raises(ValueError):
        arrow_to_records(pa.record_batch({"value": pa.array([b"x"])}))


def test_options():
    assert split_endpoint("node7.example:7700") == ("node7.example", 7700)
    assert split_endpoint("[::1]:7700") == ("::1", 7700)
    for bad in ("", "host", "host:", ":7700", "host:x"):
        with pytest.raises(ValueError):
            split_endpoint(bad)
    assert parse_streams(" 4294967297, 5,4294967297,0x10 ") == [4294967297, 5, 16]
    for bad in (None, "", " , ", "abc"):
        with pytest.raises(ValueError):
            parse_streams(bad)


def test_planning_and_admission():
    from node.spark.source import _Options, _admit, _bounds, _offset_spec, plan_partitions

    ranges = [
        {"range_index": 1, "start_offset": 80, "next_offset": 160, "end_offset": 160},
        {"range_index": 0, "start_offset": 30, "next_offset": 80, "end_offset": 80},  # trimmed to 30
        {"range_index": 2, "start_offset": 160, "next_offset": 200, "end_offset": -1},
    ]
    assert _bounds(ranges) == (30, 200)
    assert _bounds([]) == (0, 0)
    opts = _Options({"Endpoint": "node:7700"})
    parts = plan_partitions(opts, 9, ranges, 50, 170)
    assert [(p.range_index, p.start, p.end) for p in parts] == [(0, 50, 80), (1, 80, 160), (2, 160, 170)]
    assert plan_partitions(opts, 9, ranges, 100, 100) == []

    spec = _offset_spec('{"9": 120}', "earliest")
    assert (spec(9), spec(10)) == (120, "earliest")
    assert _offset_spec(None, "latest")(9) == "latest"
    assert _offset_spec("7", "earliest")(1) == 7
    with pytest.raises(ValueError):
        _offset_spec("-1", "earliest")

    # Water-filling: equal shares, what a small backlog leaves goes to the others, never over the cap.
    begin = {1: 0, 2: 100, 3: 5}
    end = {1: 1000, 2: 103, 3: 1005}
    got = _admit(begin, end, 100)
    assert got == {1: 49, 2: 103, 3: 53}  # 3 + 49 + 48 = 100
    assert _admit(begin, end, 10_000) == end
    assert _admit(begin, begin, 10) == begin
