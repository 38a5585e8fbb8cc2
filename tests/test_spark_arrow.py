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


# --- the compiled decoder (node/spark/decode.py) against the msgpack one ------------------------
#
# Records blocks are spelled out byte by byte here, so every msgpack encoding CONTRACT §3 allows
# occurs (msgpack.packb always picks the shortest): each int width, str or bin of each length
# width, array16/array32 headers.

INT_FORMATS = {  # format -> (first byte, struct code, min, max); None: a fixint
    "fix": None,
    "u8": (0xCC, ">B", 0, 2**8 - 1), "u16": (0xCD, ">H", 0, 2**16 - 1),
    "u32": (0xCE, ">I", 0, 2**32 - 1), "u64": (0xCF, ">Q", 0, 2**64 - 1),
    "i8": (0xD0, ">b", -(2**7), 2**7 - 1), "i16": (0xD1, ">h", -(2**15), 2**15 - 1),
    "i32": (0xD2, ">i", -(2**31), 2**31 - 1), "i64": (0xD3, ">q", -(2**63), 2**63 - 1),
}
BYTES_FORMATS = {  # format -> (first byte, struct code of the length); fixstr has none
    "fixstr": (0xA0, None), "str8": (0xD9, ">B"), "str16": (0xDA, ">H"), "str32": (0xDB, ">I"),
    "bin8": (0xC4, ">B"), "bin16": (0xC5, ">H"), "bin32": (0xC6, ">I"),
}
ARRAY_FORMATS = {"fix": (0x90, None), "a16": (0xDC, ">H"), "a32": (0xDD, ">I")}


def mp_int(v, fmt="fix"):
    import struct

    if fmt == "fix":
        assert -32 <= v <= 127
        return struct.pack(">b" if v < 0 else ">B", v)
    first, code, _, _ = INT_FORMATS[fmt]
    return bytes([first]) + struct.pack(code, v)


def mp_bytes(b, fmt="bin8"):
    import struct

    first, code = BYTES_FORMATS[fmt]
    if code is None:
        assert len(b) < 32
        return bytes([first | len(b)]) + b
    return bytes([first]) + struct.pack(code, len(b)) + b


def mp_array(n, fmt="fix"):
    import struct

    first, code = ARRAY_FORMATS[fmt]
    if code is None:
        assert n < 16
        return bytes([first | n])
    return bytes([first]) + struct.pack(code, n)


def framed(block, count, base_offset=0, base_ts=0):
    return record_batch.encode_block(block, count, base_ts, base_offset)


def both_ways(buf, sid, lo, hi):
    """(kernel status, what fetch_to_arrow gives, what the msgpack decoder gives); results are
    (rows as Python values, next_offset) or the exception's type."""
    import numpy as np

    from node.spark.arrow import fetch_to_arrow_msgpack
    from node.spark.decode import load_kernel

    kernel = load_kernel()
    assert kernel is not None, "numba is a pinned dependency: the compiled decoder must load"
    status = kernel(np.frombuffer(buf, np.uint8), lo, hi)[0]

    def outcome(f):
        try:
            batch, next_offset = f(buf, sid, lo, hi)
        except Exception as e:
            return type(e)
        if batch is None:
            return None, next_offset
        assert batch.schema.equals(ARROW_SCHEMA)
        batch.validate(full=True)
        # timestamps as int64 microseconds: a random int64 is no Python datetime
        return batch.set_column(2, "timestamp", batch.column(2).view(pa.int64())).to_pylist(), next_offset

    return status, outcome(fetch_to_arrow), outcome(fetch_to_arrow_msgpack)


def test_decoder_byte_vector_every_encoding():
    # Record 0: fixint delta and ts, no headers, a fixstr body.
    # Record 1: uint8 delta, int16 ts -300, array16 headers of one str8/bin16 pair, a bin32 body.
    # Record 2: int64 delta, uint64 ts, array32 headers of two pairs (str16/bin8, fixstr/str32),
    # an empty str8 body. The block array itself is array16.
    block = (
        mp_array(3, "a16")
        + mp_array(4) + mp_int(0) + mp_int(5) + mp_array(0) + mp_bytes(b"hi", "fixstr")
        + mp_array(4) + mp_int(1, "u8") + mp_int(-300, "i16") + mp_array(1, "a16")
        + mp_array(2) + mp_bytes(b"k", "str8") + mp_bytes(b"v" * 3, "bin16") + mp_bytes(b"\x00\xff", "bin32")
        + mp_array(4) + mp_int(2, "i64") + mp_int(2**40, "u64") + mp_array(2, "a32")
        + mp_array(2) + mp_bytes(b"", "str16") + mp_bytes(b"x", "bin8")
        + mp_array(2) + mp_bytes(b"n", "fixstr") + mp_bytes(b"w" * 40, "str32") + mp_bytes(b"", "str8")
    )
    assert block.hex().startswith("dc0003940005" "90a26869" "94cc01d1fed4dc0001" "92d9016bc5000376767")
    buf = framed(block, 3, base_offset=100, base_ts=1_700_000_000_000)
    status, fast, slow = both_ways(buf, 9, 0, 1000)
    assert status == 0 and fast == slow
    rows, next_offset = fast
    assert next_offset == 103
    ts = lambda ms: ms * 1000  # noqa: E731
    assert rows == [
        {"stream_id": 9, "offset": 100, "timestamp": ts(1_700_000_000_005), "headers": [], "body": b"hi"},
        {"stream_id": 9, "offset": 101, "timestamp": ts(1_700_000_000_000 - 300),
         "headers": [{"name": b"k", "value": b"vvv"}], "body": b"\x00\xff"},
        {"stream_id": 9, "offset": 102, "timestamp": ts(1_700_000_000_000 + 2**40),
         "headers": [{"name": b"", "value": b"x"}, {"name": b"n", "value": b"w" * 40}], "body": b""},
    ]
    # Clipping to [101, 102) keeps the middle row only (the batch is still walked whole).
    status, fast, slow = both_ways(buf, 9, 101, 102)
    assert status == 0 and fast == slow and [r["offset"] for r in fast[0]] == [101]


def test_decoder_int_widths_and_extremes():
    # Every int format for offset_delta and timestamp_delta, at its extremes where they fit int64.
    recs = []
    i = 0
    for fmt, spec in INT_FORMATS.items():
        lo_v, hi_v = (-32, 127) if spec is None else spec[2:]
        for ts_delta in (lo_v, hi_v, 0):
            if not -(2**63) <= ts_delta < 2**63 or (fmt == "fix" and not 0 <= i <= 127):
                continue
            dfmt = fmt if (spec is None or spec[2] <= i <= spec[3]) else "u32"
            recs.append(mp_array(4) + mp_int(i, dfmt) + mp_int(ts_delta, fmt) + mp_array(0) + mp_bytes(b"%d" % i))
            i += 1
    buf = framed(mp_array(len(recs), "a16") + b"".join(recs), len(recs), base_offset=5, base_ts=-123)
    status, fast, slow = both_ways(buf, 1, 0, 1 << 40)
    assert status == 0 and fast == slow and len(fast[0]) == len(recs)


@pytest.mark.parametrize(
    "record, why",
    [
        (mp_array(4) + mp_int(0) + mp_int(2**63, "u64") + mp_array(0) + mp_bytes(b"x"), "uint64 past int64"),
        (mp_array(4) + mp_int(0) + b"\xcb" + bytes(8) + mp_array(0) + mp_bytes(b"x"), "float timestamp"),
        (mp_array(4) + mp_int(0) + mp_int(0) + mp_array(0) + b"\xc0", "nil body"),
        (mp_array(4) + mp_int(0) + mp_int(0) + b"\x80" + mp_bytes(b"x"), "headers as a map"),
        (mp_array(4) + mp_int(0) + mp_int(0) + mp_array(1) + mp_array(3) + mp_bytes(b"a") * 3 + mp_bytes(b"x"), "a header triple"),
        (mp_array(4) + mp_int(0) + mp_int(0) + mp_array(1) + mp_array(2) + mp_int(1) + mp_bytes(b"a") + mp_bytes(b"x"), "an int header name"),
        (mp_array(3) + mp_int(0) + mp_int(0) + mp_array(0), "a 3-field record"),
        (mp_array(5) + mp_int(0) + mp_int(0) + mp_array(0) + mp_bytes(b"x") + mp_int(0), "a 5-field record"),
        (mp_array(4) + mp_int(1) + mp_int(0) + mp_array(0) + mp_bytes(b"x"), "offset_delta 1 first"),
        (mp_array(4) + mp_int(0) + mp_int(0) + mp_array(0) + mp_bytes(b"x") + b"\x00", "a byte after the records"),
        (mp_array(4) + mp_int(0) + mp_int(0) + mp_array(0) + b"\xc4\x05ab", "a body running past the block"),
        (mp_array(0), "an empty record"),
    ],
)
def test_decoder_leaves_anything_else_to_msgpack(record, why):
    # The kernel refuses; fetch_to_arrow then gives exactly what the msgpack decoder gives (rows it
    # tolerates as it always did, or the same exception).
    block = mp_array(1) + record
    buf = framed(block, 1, base_offset=3)
    status, fast, slow = both_ways(buf, 1, 0, 10)
    assert status != 0, why
    assert fast == slow, why
    # and the same in the middle of a FETCH result with good batches around it
    good = record_batch.encode([(7, [(b"h", b"v")], b"ok")], base_offset=2)
    after = record_batch.encode([(8, [], b"ok2")], base_offset=4)
    status, fast, slow = both_ways(good + buf + after, 1, 0, 10)
    assert status != 0 and fast == slow, why


def test_decoder_refuses_what_the_headers_cannot_hold():
    good = record_batch.encode([(1, [], b"abc"), (2, [], b"")], base_offset=0)
    # record_count larger than the block could hold: refused before sizing anything by it
    lying = bytearray(good)
    lying[9:13] = (2**31 - 1).to_bytes(4, "big")
    for buf in (bytes(lying), good[:-1], good + good[:10], b"\x00" + good[1:]):
        status, fast, slow = both_ways(buf, 1, 0, 10)
        assert status != 0 and fast == slow == InvalidBatch


INT_FMT_ST = st.sampled_from(sorted(INT_FORMATS))
BYTES_FMT_ST = st.sampled_from(sorted(BYTES_FORMATS))
ARRAY_FMT_ST = st.sampled_from(sorted(ARRAY_FORMATS))


@st.composite
def encoded_int(draw, v):
    fits = [f for f, s in INT_FORMATS.items() if (-32 <= v <= 127 if s is None else s[2] <= v <= s[3])]
    return mp_int(v, draw(st.sampled_from(fits)))


@st.composite
def encoded_bytes(draw, b):
    fits = [f for f in BYTES_FORMATS if f != "fixstr" or len(b) < 32]
    fits = [f for f in fits if not f.endswith("8") or len(b) < 256]
    return mp_bytes(b, draw(st.sampled_from(fits)))


@st.composite
def encoded_array(draw, n):
    return mp_array(n, draw(st.sampled_from([f for f in ARRAY_FORMATS if f != "fix" or n < 16])))


@st.composite
def fetch_results(draw):
    """Concatenated batches of random records, each int/str/bin/array in a random encoding."""
    base = draw(st.integers(0, 2**40))
    offset = base
    out = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 12))
        parts = [draw(encoded_array(n))]
        for i in range(n):
            parts.append(draw(encoded_array(4)) + draw(encoded_int(i)))
            parts.append(draw(encoded_int(draw(st.integers(-(2**63), 2**63 - 1)))))
            headers = draw(st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=8)), max_size=3))
            parts.append(draw(encoded_array(len(headers))))
            for name, value in headers:
                parts.append(draw(encoded_array(2)) + draw(encoded_bytes(name)) + draw(encoded_bytes(value)))
            parts.append(draw(encoded_bytes(draw(st.binary(max_size=80)))))
        base_ts = draw(st.integers(-(2**62), 2**62))
        out.append(framed(b"".join(parts), n, base_offset=offset, base_ts=base_ts))
        offset += n
    lo = draw(st.integers(base, offset))
    hi = draw(st.integers(lo, offset + 2))
    return b"".join(out), lo, hi, offset


@given(fetch_results())
def test_decoder_equals_msgpack_decoder(case):
    buf, lo, hi, end = case
    status, fast, slow = both_ways(buf, 11, lo, hi)
    assert status == 0
    assert fast == slow
    assert fast[1] == end
