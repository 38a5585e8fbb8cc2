"""Record batches (CONTRACT §3) to and from Arrow columns in the CONTRACT §8 row schema.

Pure functions, no I/O and no pyspark import, so they run in any Spark Python worker and unit-test
without a session. The read path builds one ``pyarrow.RecordBatch`` per FETCH result (many record
batches). It is decoded by the compiled kernel of node/spark/decode.py straight into Arrow buffers;
a FETCH result the kernel does not take (or a worker without numba) goes through msgpack: each
records block unpacked once, its fields taken column-wise with ``itemgetter`` maps.
"""

import gc
import time
from itertools import repeat
from operator import itemgetter

import msgpack
import numpy as np
import pyarrow as pa

from node.spark.decode import OK as KERNEL_OK, load_kernel
from storage.crc import crc32
from storage.record_batch import HEADER, HEADER_SIZE, MAGIC, InvalidBatch, encode_block

# CONTRACT §8, as Spark spells it; every column nullable, as a DDL string makes it.
SCHEMA_DDL = (
    "stream_id long, offset long, timestamp timestamp, "
    "headers array<struct<name:binary,value:binary>>, body binary"
)
HEADER_TYPE = pa.struct([pa.field("name", pa.binary()), pa.field("value", pa.binary())])
HEADERS_TYPE = pa.list_(pa.field("element", HEADER_TYPE))
TIMESTAMP_TYPE = pa.timestamp("us", tz="UTC")
# Must equal pyspark's to_arrow_schema(SCHEMA_DDL, timezone="UTC"): Spark refuses a RecordBatch
# whose schema differs (DATA_SOURCE_RETURN_SCHEMA_MISMATCH); tests/test_spark_arrow.py checks it.
ARROW_SCHEMA = pa.schema(
    [
        pa.field("stream_id", pa.int64()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", TIMESTAMP_TYPE),
        pa.field("headers", HEADERS_TYPE),
        pa.field("body", pa.binary()),
    ]
)

_unpackb = msgpack.unpackb
_get1 = itemgetter(1)
_get2 = itemgetter(2)
_get3 = itemgetter(3)


def fetch_to_arrow(buf, stream_id: int, lo: int, hi: int, check_crc: bool = True):
    """Decode one FETCH result (concatenated whole batches) into rows with ``lo <= offset < hi``.

    Returns ``(record_batch or None, next_offset)``, where next_offset is one past the last record
    of the last batch in ``buf`` (where the next FETCH starts). A batch may start before ``lo``
    (FETCH returns the batch holding the fetch offset, whole) or run past ``hi``; only the rows in
    ``[lo, hi)`` are kept. Raises InvalidBatch on a malformed batch or (with ``check_crc``) a
    records block CRC mismatch.
    """
    if check_crc:
        _check_crcs(buf, lo, hi)
    kernel = load_kernel()
    if kernel is not None:
        data = np.frombuffer(buf, np.uint8)
        data.flags.writeable = False  # one compiled signature (read-only), whatever buf is
        out = kernel(data, lo, hi)
        if out[0] == KERNEL_OK:
            return _kernel_to_arrow(out, stream_id)
    return fetch_to_arrow_msgpack(buf, stream_id, lo, hi)


def _check_crcs(buf, lo, hi):
    """The records block CRC of every batch holding rows in ``[lo, hi)``; malformed headers are
    left to the decoders, which refuse them."""
    view = memoryview(buf)
    size = len(view)
    pos = 0
    while size - pos >= HEADER_SIZE:
        magic, base, count, _, crc, rlen = HEADER.unpack_from(view, pos)
        end = pos + HEADER_SIZE + rlen
        if magic != MAGIC or rlen < 0 or end > size:
            return
        if max(lo - base, 0) < min(hi - base, count) and crc32(view[pos + HEADER_SIZE : end]) != crc:
            raise InvalidBatch("records block CRC mismatch in batch at offset %d" % base)
        pos = end


def _kernel_to_arrow(out, stream_id):
    """The kernel's arrays as one RecordBatch: every buffer is used as it is, without a copy."""
    _, next_offset, n, offsets, ts_us, body_offsets, body_data, list_offsets, nh, name_offsets, name_data, value_offsets, value_data = out
    if n == 0:
        return None, next_offset
    buf = pa.py_buffer
    if nh:
        names = pa.Array.from_buffers(pa.binary(), nh, [None, buf(name_offsets[: nh + 1]), buf(name_data[: name_offsets[nh]])])
        values = pa.Array.from_buffers(pa.binary(), nh, [None, buf(value_offsets[: nh + 1]), buf(value_data[: value_offsets[nh]])])
        pairs = pa.StructArray.from_arrays([names, values], fields=list(HEADER_TYPE))
        headers = pa.Array.from_buffers(HEADERS_TYPE, n, [None, buf(list_offsets[: n + 1])], children=[pairs])
    else:
        headers = _empty_headers(n)
    columns = [
        pa.array(np.full(n, stream_id, dtype=np.int64)),
        pa.Array.from_buffers(pa.int64(), n, [None, buf(offsets[:n])]),
        pa.Array.from_buffers(TIMESTAMP_TYPE, n, [None, buf(ts_us[:n])]),
        headers,
        pa.Array.from_buffers(pa.binary(), n, [None, buf(body_offsets[: n + 1]), buf(body_data[: body_offsets[n]])]),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA), next_offset


def fetch_to_arrow_msgpack(buf, stream_id: int, lo: int, hi: int):
    """``fetch_to_arrow`` through msgpack (see ``_fetch_to_arrow``), without the CRC check.

    The cyclic garbage collector is paused meanwhile: unpacking allocates tens of thousands of
    tuples, which would trigger collections scanning every live object (measured: about 40% of
    the decode time), while none of them can form a cycle.
    """
    if not gc.isenabled():
        return _fetch_to_arrow(buf, stream_id, lo, hi)
    gc.disable()
    try:
        return _fetch_to_arrow(buf, stream_id, lo, hi)
    finally:
        gc.enable()


def _fetch_to_arrow(buf, stream_id: int, lo: int, hi: int):
    view = memoryview(buf)
    size = len(view)
    pos = 0
    next_offset = lo
    offset_parts = []
    ts_parts = []
    headers = []
    bodies = []
    while pos < size:
        if size - pos < HEADER_SIZE:
            raise InvalidBatch("truncated batch header at byte %d" % pos)
        magic, base, count, base_ts, _, rlen = HEADER.unpack_from(view, pos)
        end = pos + HEADER_SIZE + rlen
        if magic != MAGIC or rlen < 0 or end > size or count < 1:
            raise InvalidBatch("malformed batch at byte %d" % pos)
        block = view[pos + HEADER_SIZE : end]
        pos = end
        next_offset = base + count
        first = max(lo - base, 0)
        last = min(hi - base, count)
        if first >= last:
            continue
        try:
            records = _unpackb(block, raw=True, use_list=False)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise InvalidBatch("records block is not msgpack: %s" % e) from None
        if type(records) is not tuple or len(records) != count:
            raise InvalidBatch("records block of batch at offset %d does not hold %d records" % (base, count))
        if first or last != count:
            records = records[first:last]
        n = last - first
        try:
            # The node validated every record at APPEND (CONTRACT §3); spot-check the shape here.
            if records[0][0] != first or records[-1][0] != last - 1 or len(records[-1]) != 4:
                raise InvalidBatch("offset_delta sequence broken in batch at offset %d" % base)
            ts_parts.append(np.fromiter(map(_get1, records), dtype=np.int64, count=n) + base_ts)
            if any(map(_get2, records)):
                headers.append((len(bodies), list(map(_get2, records))))
            bodies.extend(map(_get3, records))
        except (TypeError, IndexError, ValueError):
            raise InvalidBatch("malformed record in batch at offset %d" % base) from None
        offset_parts.append(np.arange(base + first, base + last, dtype=np.int64))
    if not bodies:
        return None, next_offset
    n = len(bodies)
    offsets = np.concatenate(offset_parts) if len(offset_parts) > 1 else offset_parts[0]
    ts_ms = np.concatenate(ts_parts) if len(ts_parts) > 1 else ts_parts[0]
    try:
        body_arr = pa.array(bodies, type=pa.binary())
    except (TypeError, pa.ArrowInvalid):
        raise InvalidBatch("a record body is not bytes") from None
    if headers:
        # Some batch carries headers: spell out every row's list (empty for the batches without).
        per_row = []
        for row, hdrs in headers:
            per_row.extend(repeat((), row - len(per_row)))
            per_row.extend(hdrs)
        per_row.extend(repeat((), n - len(per_row)))
        headers_arr = _headers_array(per_row)
    else:
        headers_arr = _empty_headers(n)
    columns = [
        pa.array(np.full(n, stream_id, dtype=np.int64)),
        pa.array(offsets),
        pa.array(ts_ms * 1000, type=TIMESTAMP_TYPE),
        headers_arr,
        body_arr,
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA), next_offset


def fetch_next_offset(buf) -> int:
    """One past the last record of the last batch in a FETCH result (header walk only)."""
    view = memoryview(buf)
    size = len(view)
    pos = 0
    next_offset = -1
    while pos < size:
        if size - pos < HEADER_SIZE:
            raise InvalidBatch("truncated batch header at byte %d" % pos)
        magic, base, count, _, _, rlen = HEADER.unpack_from(view, pos)
        if magic != MAGIC or rlen < 0:
            raise InvalidBatch("malformed batch at byte %d" % pos)
        pos += HEADER_SIZE + rlen
        next_offset = base + count
    if pos != size:
        raise InvalidBatch("truncated batch at the end of a FETCH result")
    return next_offset


def _empty_headers(n):
    """``n`` empty header lists (the common case): list offsets all zero."""
    empty = pa.StructArray.from_arrays([pa.array([], pa.binary()), pa.array([], pa.binary())], fields=list(HEADER_TYPE))
    return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, dtype=np.int32)), empty, type=HEADERS_TYPE)


def _headers_array(headers):
    """``list<struct<name, value>>`` from per-record header sequences of [name, value] pairs."""
    n = len(headers)
    if not any(headers):
        return _empty_headers(n)
    lengths = np.fromiter(map(len, headers), dtype=np.int32, count=n)
    list_offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=list_offsets[1:])
    names = []
    values = []
    for pairs in headers:
        for pair in pairs:
            if len(pair) != 2:
                raise InvalidBatch("a header is not a [name, value] pair")
            names.append(pair[0])
            values.append(pair[1])
    try:
        structs = pa.StructArray.from_arrays(
            [pa.array(names, pa.binary()), pa.array(values, pa.binary())], fields=list(HEADER_TYPE)
        )
    except (TypeError, pa.ArrowInvalid):
        raise InvalidBatch("a header name or value is not bytes") from None
    return pa.ListArray.from_arrays(pa.array(list_offsets), structs, type=HEADERS_TYPE)


# --- write path --------------------------------------------------------------------------------

_packb = msgpack.Packer(use_bin_type=True).pack


def _as_bytes_list(column):
    """A body/name/value column as a Python list of bytes (strings are UTF-8 encoded)."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return [None if v is None else v.encode() for v in column.to_pylist()]
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        return column.to_pylist()
    raise TypeError("column type %s is not binary or string" % column.type)


def arrow_to_records(batch: "pa.RecordBatch", now_ms=None):
    """Rows of an Arrow batch as ``(timestamp_ms, headers, body)`` triples for ``encode``.

    Reads ``body`` (binary or string, required), and ``headers`` (list of struct<name, value>) and
    ``timestamp`` if present; other columns (``stream_id``, ``offset``) are ignored. A null
    timestamp becomes ``now_ms``; a null body or header list is written empty.
    """
    names = batch.schema.names
    if "body" not in names:
        raise ValueError("writing to sbp needs a 'body' column (binary or string); got %s" % names)
    n = batch.num_rows
    bodies = [b if b is not None else b"" for b in _as_bytes_list(batch.column(names.index("body")))]
    if now_ms is None:
        now_ms = int(time.time() * 1000)
    if "timestamp" in names:
        ts_col = batch.column(names.index("timestamp"))
        if pa.types.is_timestamp(ts_col.type):
            ts_col = ts_col.cast(pa.timestamp("ms", tz=ts_col.type.tz), safe=False).cast(pa.int64())
        timestamps = [now_ms if t is None else t for t in ts_col.cast(pa.int64()).to_pylist()]
    else:
        timestamps = repeat(now_ms, n)
    if "headers" in names:
        headers = []
        for pairs in batch.column(names.index("headers")).to_pylist():
            if not pairs:
                headers.append(())
                continue
            headers.append([(_to_bytes(p["name"]), _to_bytes(p["value"])) for p in pairs])
    else:
        headers = repeat((), n)
    return list(zip(timestamps, headers, bodies))


def _to_bytes(v):
    if v is None:
        return b""
    return v.encode() if isinstance(v, str) else v


def encode_records(records, max_batch_bytes: int = 1 << 20, max_records: int = 65536):
    """Encode ``(timestamp_ms, headers, body)`` triples as record batches of bounded size.

    Yields ``(batch_bytes, record_count)``; a single record larger than ``max_batch_bytes`` gets a
    batch of its own (the server answers 1413 if it exceeds the node's --max-batch-bytes).
    """
    pending = []
    size = 0
    for rec in records:
        rec_size = len(rec[2]) + 16 + sum(len(n) + len(v) + 8 for n, v in rec[1])
        if pending and (size + rec_size > max_batch_bytes or len(pending) >= max_records):
            yield _encode(pending), len(pending)
            pending = []
            size = 0
        pending.append(rec)
        size += rec_size
    if pending:
        yield _encode(pending), len(pending)


def _encode(records):
    base_ts = records[0][0]
    block = _packb([[i, ts - base_ts, [[n, v] for n, v in hdrs], body] for i, (ts, hdrs, body) in enumerate(records)])
    return encode_block(block, len(records), base_ts)


def split_endpoint(endpoint: str):
    """``host:port`` (or ``[v6addr]:port``) as ``(host, port)``."""
    if not endpoint:
        raise ValueError("the sbp data source needs option endpoint=host:port")
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError("endpoint must be host:port, got %r" % endpoint)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def parse_streams(value) -> list:
    """The ``streams`` option: comma-separated stream ids, in the given order, without repeats."""
    if value is None or not str(value).strip():
        raise ValueError("the sbp data source needs option streams=<id>[,<id>...]")
    out = []
    for part in str(value).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            sid = int(part, 0)
        except ValueError:
            raise ValueError("stream id %r is not an integer" % part) from None
        if sid not in out:
            out.append(sid)
    if not out:
        raise ValueError("the streams option names no stream")
    return out

