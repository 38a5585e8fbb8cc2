"""The record batch: the unit every interface appends, stores and serves (CONTRACT §3).

Layout, big-endian::

    u8 magic=0x22 | i64 base_offset | i32 record_count | i64 base_timestamp_ms
    | u32 crc (CRC-32 of the records block) | i32 records_len | records block

The records block is a msgpack array of ``record_count`` records
``[offset_delta, timestamp_delta_ms, [[name, value], ...], body]``. The block is stored and served
exactly as the client sent it; only ``base_offset`` (bytes 1..8) is written by the server.

Pure functions over bytes: no I/O.
"""

import struct
from itertools import chain
from operator import itemgetter
from typing import Iterable, List, NamedTuple, Sequence, Tuple

import msgpack

from storage import block_check
from storage.crc import crc32

MAGIC = 0x22
HEADER = struct.Struct(">BqiqIi")
HEADER_SIZE = HEADER.size  # 29
_BASE_OFFSET = struct.Struct(">q")
BASE_OFFSET_POS = 1


class InvalidBatch(ValueError):
    """The bytes are not a valid record batch (CONTRACT §3: CORRUPT_BATCH)."""


class BatchHeader(NamedTuple):
    base_offset: int
    record_count: int
    base_timestamp_ms: int
    crc: int
    records_len: int

    @property
    def batch_length(self) -> int:
        return HEADER_SIZE + self.records_len

    @property
    def next_offset(self) -> int:
        return self.base_offset + self.record_count


class Record(NamedTuple):
    offset: int
    timestamp_ms: int
    headers: List[Tuple[bytes, bytes]]
    body: bytes


def encode(
    records: Sequence[Tuple[int, Sequence[Tuple[bytes, bytes]], bytes]],
    base_offset: int = 0,
    base_timestamp_ms: int = None,
) -> bytes:
    """Encode ``(timestamp_ms, headers, body)`` triples as one batch.

    ``base_timestamp_ms`` defaults to the first record's timestamp.
    """
    if not records:
        raise InvalidBatch("a batch holds at least one record")
    if base_timestamp_ms is None:
        base_timestamp_ms = records[0][0]
    block = msgpack.packb(
        [
            [i, ts - base_timestamp_ms, [[n, v] for n, v in headers], body]
            for i, (ts, headers, body) in enumerate(records)
        ],
        use_bin_type=True,
    )
    return encode_block(block, len(records), base_timestamp_ms, base_offset)


def encode_block(block: bytes, record_count: int, base_timestamp_ms: int, base_offset: int = 0) -> bytes:
    """Frame an already-packed records block."""
    return HEADER.pack(
        MAGIC, base_offset, record_count, base_timestamp_ms, crc32(block), len(block)
    ) + block


def read_header(buf, pos: int = 0) -> BatchHeader:
    """The header fields at ``pos``, unvalidated (raises InvalidBatch if too short)."""
    if len(buf) - pos < HEADER_SIZE:
        raise InvalidBatch("shorter than the 29-byte batch header")
    magic, base_offset, count, base_ts, crc, records_len = HEADER.unpack_from(buf, pos)
    if magic != MAGIC:
        raise InvalidBatch("bad batch magic 0x%02x" % magic)
    return BatchHeader(base_offset, count, base_ts, crc, records_len)


def validate(buf, check_records: bool = True) -> BatchHeader:
    """Check a whole batch as CONTRACT §3 defines validity; return its header.

    Valid iff batch_length = 29 + records_len, the crc matches, record_count >= 1 and (with
    ``check_records``) the block decodes as ``record_count`` well-formed records.
    """
    header = read_header(buf)
    if header.records_len < 0 or len(buf) != HEADER_SIZE + header.records_len:
        raise InvalidBatch("batch length %d != 29 + records_len %d" % (len(buf), header.records_len))
    if header.record_count < 1:
        raise InvalidBatch("record_count must be >= 1")
    block = memoryview(buf)[HEADER_SIZE:]
    if crc32(block) != header.crc:
        raise InvalidBatch("records block CRC mismatch")
    if check_records:
        _decode_block(block, header)
    return header


_G0, _G1, _G2, _G3 = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)
_LIST, _INT, _BYTES, _FOUR, _TWO = {list}, {int}, {bytes}, {4}, {2}


def validate_count(batch, block_crc=None) -> int:
    """``validate``'s verdicts, fast, for the reactor's APPEND path; returns record_count.

    ``block_crc``: CRC-32 of ``batch[29:]`` if the caller has it (the SBP server computes it with
    the frame's payload CRC). The records block is checked by the compiled walker once it is loaded
    (``block_check``), and otherwise, or when that one says no, by msgpack with column-wise checks
    (map/itemgetter run in C: no per-record Python frame). Messages are shorter than ``validate``'s;
    the verdicts are the same (tests/test_sbp_server.py checks that).
    """
    if len(batch) < HEADER_SIZE:
        raise InvalidBatch("shorter than the batch header")
    magic, _base, count, _ts, crc, records_len = HEADER.unpack_from(batch, 0)
    if magic != MAGIC:
        raise InvalidBatch("bad batch magic")
    if records_len < 0 or len(batch) != HEADER_SIZE + records_len:
        raise InvalidBatch("batch length != 29 + records_len")
    if count < 1:
        raise InvalidBatch("record_count must be >= 1")
    block = memoryview(batch)[HEADER_SIZE:]
    if (crc32(block) if block_crc is None else block_crc) != crc:
        raise InvalidBatch("records block CRC mismatch")
    block_ok = block_check.records_block_ok
    if block_ok is not None and block_ok(batch, HEADER_SIZE, count):
        return count
    try:
        raw = msgpack.unpackb(block, raw=True, use_list=True, strict_map_key=False)
    except Exception:
        raise InvalidBatch("records block is not msgpack") from None
    if type(raw) is not list or len(raw) != count:
        raise InvalidBatch("records block does not hold record_count records")
    if set(map(type, raw)) != _LIST or set(map(len, raw)) != _FOUR:
        raise InvalidBatch("a record is not [offset_delta, timestamp_delta_ms, headers, body]")
    if list(map(_G0, raw)) != list(range(count)):
        raise InvalidBatch("offset_delta is not 0..n-1")
    if set(map(type, map(_G1, raw))) != _INT or set(map(type, map(_G3, raw))) != _BYTES:
        raise InvalidBatch("malformed timestamp delta or body")
    headers = list(map(_G2, raw))
    if set(map(type, headers)) != _LIST:
        raise InvalidBatch("malformed record headers")
    pairs = list(chain.from_iterable(headers))
    if pairs:
        if set(map(type, pairs)) != _LIST or set(map(len, pairs)) != _TWO:
            raise InvalidBatch("malformed record header")
        if set(map(type, chain.from_iterable(pairs))) != _BYTES:
            raise InvalidBatch("malformed record header")
    return count


def decode(buf) -> Tuple[BatchHeader, List[Record]]:
    """Validate and decode a whole batch into records with absolute offsets and timestamps."""
    header = validate(buf, check_records=False)
    return header, _decode_block(memoryview(buf)[HEADER_SIZE:], header)


def _decode_block(block, header: BatchHeader) -> List[Record]:
    try:
        raw = msgpack.unpackb(block, raw=True, use_list=True, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise InvalidBatch("records block is not msgpack: %s" % e) from None
    if not isinstance(raw, list) or len(raw) != header.record_count:
        raise InvalidBatch("records block does not hold record_count records")
    records = []
    for i, rec in enumerate(raw):
        if not isinstance(rec, list) or len(rec) != 4:
            raise InvalidBatch("record %d is not [offset_delta, ts_delta, headers, body]" % i)
        delta, ts_delta, headers, body = rec
        if delta != i or type(ts_delta) is not int:
            raise InvalidBatch("record %d has offset_delta %r" % (i, delta))
        if not isinstance(headers, list) or not isinstance(body, bytes):
            raise InvalidBatch("record %d has malformed headers or body" % i)
        pairs = []
        for h in headers:
            if not isinstance(h, list) or len(h) != 2 or not all(isinstance(x, bytes) for x in h):
                raise InvalidBatch("record %d has a malformed header" % i)
            pairs.append((h[0], h[1]))
        records.append(Record(header.base_offset + i, header.base_timestamp_ms + ts_delta, pairs, body))
    return records


def with_base_offset(buf, base_offset: int) -> bytes:
    """A copy of the batch with ``base_offset`` written into bytes 1..8."""
    out = bytearray(buf)
    _BASE_OFFSET.pack_into(out, BASE_OFFSET_POS, base_offset)
    return bytes(out)


def split(buf) -> Iterable[bytes]:
    """Split concatenated whole batches (e.g. a FETCH result) into single batches."""
    view = memoryview(buf)
    pos = 0
    while pos < len(view):
        header = read_header(view, pos)
        end = pos + HEADER_SIZE + header.records_len
        if header.records_len < 0 or end > len(view):
            raise InvalidBatch("truncated batch at byte %d" % pos)
        yield bytes(view[pos:end])
        pos = end
