"""The record batch codec (CONTRACT §3): byte vectors, round trips, and garbage refused cleanly."""

import struct
import zlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage import record_batch as rb

# One record at ts 1000 with header (k, v) and body "hi"; hand-assembled from the contract's layout.
BLOCK = bytes.fromhex("91" "94" "00" "00" "91" "92" "c4016b" "c40176" "c4026869")
VECTOR = (
    bytes([0x22])
    + struct.pack(">q", 0)
    + struct.pack(">i", 1)
    + struct.pack(">q", 1000)
    + struct.pack(">I", zlib.crc32(BLOCK))
    + struct.pack(">i", len(BLOCK))
    + BLOCK
)


def test_encode_matches_the_hand_assembled_vector():
    assert rb.encode([(1000, [(b"k", b"v")], b"hi")]) == VECTOR
    assert rb.HEADER_SIZE == 29


def test_decode_of_the_vector():
    header, records = rb.decode(VECTOR)
    assert header == rb.BatchHeader(0, 1, 1000, zlib.crc32(BLOCK), len(BLOCK))
    assert records == [rb.Record(0, 1000, [(b"k", b"v")], b"hi")]


def test_base_offset_is_patched_without_touching_the_block():
    patched = rb.with_base_offset(VECTOR, 41)
    assert patched[1:9] == struct.pack(">q", 41)
    assert patched[9:] == VECTOR[9:]
    assert rb.decode(patched)[1][0].offset == 41


def test_str_is_accepted_on_input():
    block = msgpack.packb([[0, 5, [["name", "value"]], "body"]], use_bin_type=True)
    batch = rb.encode_block(block, 1, 10)
    assert rb.decode(batch)[1] == [rb.Record(0, 15, [(b"name", b"value")], b"body")]


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:-1], "length"),
        (lambda b: b + b"x", "length"),
        (lambda b: b[:20], "shorter"),
        (lambda b: b"\x23" + b[1:], "magic"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "CRC"),
        (lambda b: b[:9] + struct.pack(">i", 0) + b[13:], "record_count"),
        (lambda b: b[:9] + struct.pack(">i", 2) + b[13:], "record_count records"),
    ],
)
def test_invalid_batches_are_refused(mutate, reason):
    with pytest.raises(rb.InvalidBatch, match=reason):
        rb.validate(mutate(VECTOR))


def test_wrong_offset_delta_is_refused():
    block = msgpack.packb([[1, 0, [], b"x"]], use_bin_type=True)
    with pytest.raises(rb.InvalidBatch):
        rb.validate(rb.encode_block(block, 1, 0))


records_st = st.lists(
    st.tuples(
        st.integers(0, 2**40),
        st.lists(st.tuples(st.binary(max_size=8), st.binary(max_size=8)), max_size=3),
        st.binary(max_size=64),
    ),
    min_size=1,
    max_size=20,
)


@given(records_st, st.integers(0, 2**50))
def test_round_trip(records, base_offset):
    batch = rb.encode(records, base_offset=base_offset)
    header, decoded = rb.decode(batch)
    assert header.record_count == len(records)
    assert header.batch_length == len(batch)
    assert [(r.timestamp_ms, r.headers, r.body) for r in decoded] == [(t, list(h), b) for t, h, b in records]
    assert [r.offset for r in decoded] == list(range(base_offset, base_offset + len(records)))
    assert list(rb.split(batch + batch)) == [batch, batch]


@given(st.binary(max_size=200))
def test_garbage_is_refused_cleanly(data):
    try:
        rb.validate(data)
    except rb.InvalidBatch:
        pass


@given(st.binary(max_size=100))
def test_garbage_block_with_a_good_crc_is_refused_cleanly(block):
    try:
        rb.validate(rb.encode_block(block, 1, 0))
    except rb.InvalidBatch:
        pass
