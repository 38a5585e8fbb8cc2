"""Swarm stream! codec (CONTRACT §6): hand-assembled byte vectors, bit vectors, round trips, garbage."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.swarm import codec
from protocols.swarm.codec import (
    ID,
    BatchDone,
    ChunkDelivery,
    GetRange,
    OfferedHashes,
    StreamDescriptor,
    StreamInfoReq,
    StreamInfoRes,
    StreamState,
    WantedHashes,
)
from protocols.swarm.intervals import Intervals

CHUNKS = b"\xa6CHUNKS"
ADDR = bytes(range(32))

VECTORS = [
    # [0, [["CHUNKS", ""], ["LOG", ""]]]
    (StreamInfoReq([ID("CHUNKS", ""), ID("LOG", "")]), b"\x92\x00\x92\x92" + CHUNKS + b"\xa0\x92\xa3LOG\xa0"),
    # [1, [[["CHUNKS", ""], 10000, false]]]
    (StreamInfoRes([StreamDescriptor(ID("CHUNKS", ""), 10000, False)]), b"\x92\x01\x91\x93\x92" + CHUNKS + b"\xa0\xcd\x27\x10\xc2"),
    # [2, 7, ["LOG", "5"], 1, nil, 64, true]: unbounded
    (GetRange(7, ID("LOG", "5"), 1, None, 64, True), b"\x97\x02\x07\x92\xa3LOG\xa15\x01\xc0\x40\xc3"),
    # [2, 70000, ["CHUNKS", ""], 1, 100, 1024, false]: bounded
    (GetRange(70000, ID("CHUNKS", ""), 1, 100, 1024, False), b"\x97\x02\xce\x00\x01\x11\x70\x92" + CHUNKS + b"\xa0\x01\x64\xcd\x04\x00\xc2"),
    # [3, 1, 3, bin(32)]
    (OfferedHashes(1, 3, b"\xaa" * 32), b"\x94\x03\x01\x03\xc4\x20" + b"\xaa" * 32),
    # [4, 1, 2, [[bin(addr), bin("hi")]]]
    (ChunkDelivery(1, 2, [(ADDR, b"hi")]), b"\x94\x04\x01\x02\x91\x92\xc4\x20" + ADDR + b"\xc4\x02hi"),
    # [5, 1, bin(0x05)]
    (WantedHashes(1, b"\x05"), b"\x93\x05\x01\xc4\x01\x05"),
    # [5, 2, bin()]: want nothing
    (WantedHashes(2, b""), b"\x93\x05\x02\xc4\x00"),
    # [6, 9, 300]
    (BatchDone(9, 300), b"\x93\x06\x09\xcd\x01\x2c"),
    # [7, ["LOG", "5"], 2, "no such stream"]
    (StreamState(ID("LOG", "5"), 2, "no such stream"), b"\x94\x07\x92\xa3LOG\xa15\x02\xaeno such stream"),
]


@pytest.mark.parametrize("msg,body", VECTORS, ids=[type(m).__name__ for m, _ in VECTORS])
def test_vectors(msg, body):
    frame = codec.encode(msg)
    assert frame == len(body).to_bytes(4, "big") + body
    assert codec.decode_body(body) == msg


def test_bitvector_lsb_first():
    # CONTRACT §6: bit i is 1 << (i % 8) of byte i // 8
    assert codec.bitvector_encode([False, False, False, True]) == b"\x08"
    assert codec.bitvector_encode([True] + [False] * 7 + [True]) == b"\x01\x01"
    assert codec.bitvector_encode([True, False, True]) == b"\x05"
    assert codec.bitvector_encode([True] * 8) == b"\xff"
    assert codec.bitvector_encode([False] * 10) == b""  # want nothing: the empty vector
    assert codec.bitvector_encode([]) == b""
    assert codec.bitvector_decode(b"\x08", 8) == [False, False, False, True, False, False, False, False]
    assert codec.bitvector_decode(b"\x01\x01", 9) == [True] + [False] * 7 + [True]
    # swarm's floor(n/8)+1 sizing (64 hashes -> 9 bytes) decodes too
    assert codec.bitvector_decode(b"\xff" * 8 + b"\x00", 64) == [True] * 64
    # missing bytes read as zero; the empty vector wants nothing
    assert codec.bitvector_decode(b"\x01", 12) == [True] + [False] * 11
    assert codec.bitvector_decode(b"", 5) == [False] * 5


@given(st.lists(st.booleans(), max_size=300))
def test_bitvector_round_trip(flags):
    v = codec.bitvector_encode(flags)
    assert codec.bitvector_decode(v, len(flags)) == flags
    assert len(v) == (0 if not any(flags) else (len(flags) + 7) // 8)


@pytest.mark.parametrize(
    "value",
    [
        [],  # empty message
        [99],  # unknown code
        ["x"],
        {"a": 1},
        [0, [["CHUNKS"]]],  # ID of one element
        [0, [[b"CHUNKS", b""]]],  # ID as bin, not str
        [2, 1, ["LOG", "1"], -1, None, 1, True],  # negative from
        [2, 1, ["LOG", "1"], 1, None, 1, 1],  # roundtrip not bool
        [2, 1, ["LOG", "1"], 1, None, 1],  # missing field
        [3, 1, 1, b"\x00" * 31],  # hashes not a multiple of 32
        [3, 1, 1, "x" * 32],  # hashes as str
        [4, 1, 1, [[b"\x00" * 31, b""]]],  # short address
        [4, 1, 1, [[b"\x00" * 32]]],
        [6, 1],
        [7, ["LOG", "1"], 70000, "x"],  # code above uint16
    ],
)
def test_malformed_bodies_refused(value):
    body = msgpack.packb(value, use_bin_type=True)
    with pytest.raises(codec.CodecError):
        codec.decode_body(body)


def test_trailing_bytes_and_invalid_utf8_refused():
    with pytest.raises(codec.CodecError):
        codec.decode_body(codec.encode_body(BatchDone(1, 2)) + b"\x00")
    with pytest.raises(codec.CodecError):
        codec.decode_body(b"\x94\x07\x92\xa3LOG\xa1\xff\x02\xa0")


@given(st.binary(max_size=200))
def test_garbage_only_raises_codec_error(data):
    try:
        codec.decode_body(data)
    except codec.CodecError:
        pass


_ids = st.builds(ID, st.text(max_size=8), st.text(max_size=8))
_u = st.integers(0, (1 << 64) - 1)
_messages = st.one_of(
    st.builds(StreamInfoReq, st.lists(_ids, max_size=4)),
    st.builds(StreamInfoRes, st.lists(st.builds(StreamDescriptor, _ids, _u, st.booleans()), max_size=4)),
    st.builds(GetRange, _u, _ids, _u, st.none() | _u, _u, st.booleans()),
    st.builds(OfferedHashes, _u, _u, st.integers(0, 5).map(lambda n: b"\x11" * 32 * n)),
    st.builds(ChunkDelivery, _u, _u, st.lists(st.tuples(st.binary(min_size=32, max_size=32), st.binary(max_size=64)), max_size=4)),
    st.builds(WantedHashes, _u, st.binary(max_size=16)),
    st.builds(BatchDone, _u, _u),
    st.builds(StreamState, _ids, st.integers(0, 0xFFFF), st.text(max_size=20)),
)


@given(_messages)
def test_round_trip(msg):
    frame = codec.encode(msg)
    assert codec.decode_body(frame[4:]) == msg


@given(st.lists(_messages, min_size=1, max_size=5), st.data())
def test_frame_reader_any_split(msgs, data):
    stream = b"".join(codec.encode(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    reader = codec.FrameReader()
    bodies = []
    prev = 0
    for c in cuts + [len(stream)]:
        bodies += reader.feed(stream[prev:c])
        prev = c
    assert [codec.decode_body(b) for b in bodies] == msgs
    assert reader.buffered() == 0


def test_frame_reader_byte_at_a_time_and_limit():
    stream = codec.encode(BatchDone(1, 2)) * 3
    reader = codec.FrameReader()
    got = []
    for i in range(len(stream)):
        got += reader.feed(stream[i : i + 1])
    assert len(got) == 3
    # CONTRACT §6: a declared length above 16 MiB closes the connection, before any body arrives
    with pytest.raises(codec.FrameTooLarge):
        codec.FrameReader().feed((16 * 1024 * 1024 + 1).to_bytes(4, "big"))
    assert codec.FrameReader().feed((16 * 1024 * 1024).to_bytes(4, "big")) == []


def test_log_stream_keys():
    assert codec.log_stream_id("4294967297") == 4294967297
    assert codec.log_stream_id("0") == 0
    for bad in ("", "01", "-1", "1.0", " 1", "x", "٣", str(1 << 63)):
        assert codec.log_stream_id(bad) is None


def test_intervals():
    iv = Intervals()
    assert iv.next_gap() == (1, None)
    iv.add(1, 5)
    iv.add(7, 9)
    assert iv.to_list() == [[1, 5], [7, 9]]
    assert iv.next_gap() == (6, 6)
    assert iv.next_gap(8) == (10, None)
    iv.add(6, 6)  # touching ranges merge
    assert iv.to_list() == [[1, 9]]
    iv.add(20, 30)
    iv.add(15, 25)
    assert iv.to_list() == [[1, 9], [15, 30]]
    assert iv.next_gap() == (10, 14)
    assert iv.top() == 30
    iv.add(0, 40)
    assert iv.to_list() == [[0, 40]]
    iv.add(5, 3)  # empty: ignored
    assert Intervals([(3, 4), (1, 2)]).to_list() == [[1, 4]]


@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 15)), max_size=12), st.integers(1, 80))
def test_intervals_match_a_set_model(adds, start):
    iv = Intervals()
    model = set()
    for a, n in adds:
        iv.add(a, a + n)
        model.update(range(a, a + n + 1))
    pairs = iv.to_list()
    assert set(i for a, b in pairs for i in range(a, b + 1)) == model
    assert all(pairs[k][1] + 1 < pairs[k + 1][0] for k in range(len(pairs) - 1))  # merged, sorted
    first, last = iv.next_gap(start)
    expect = start
    while expect in model:
        expect += 1
    assert first == expect
    if last is None:
        assert all(i <= first for i in model) or not [i for i in model if i > first]
    else:
        assert last + 1 in model and all(i not in model for i in range(first, last + 1))
    assert Intervals(pairs) == iv


# ChunkDelivery frames are laid out by hand (codec.encode_chunk_delivery); they must be exactly
# what msgpack.packb gives for the same array, at every size boundary of uint, array and bin.
_SIZES = [0, 1, 31, 32, 255, 256, 4096, 65535, 65536]


@pytest.mark.parametrize("ruid", [0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1])
def test_chunk_delivery_matches_msgpack_at_boundaries(ruid):
    for size in _SIZES:
        for n in (0, 1, 15, 16):
            chunks = [(bytes([i]) * 32, bytes([i]) * size) for i in range(n if size < 60000 else min(n, 2))]
            frame = codec.encode(ChunkDelivery(ruid, ruid, chunks))
            body = msgpack.packb([4, ruid, ruid, [[a, d] for a, d in chunks]], use_bin_type=True)
            assert frame == len(body).to_bytes(4, "big") + body
            assert codec.encode_body(ChunkDelivery(ruid, ruid, chunks)) == body


def test_chunk_delivery_array16_array32_and_odd_addr_lengths():
    for n in (65535, 65536):
        chunks = [(b"\x01" * 32, b"")] * n
        body = msgpack.packb([4, 1, 2, [[a, d] for a, d in chunks]], use_bin_type=True)
        assert codec.encode(ChunkDelivery(1, 2, chunks))[4:] == body
    odd = [(b"\x02" * 31, b"x"), (b"", b"y" * 300)]  # not decodable (addr must be 32 bytes), still exact
    assert codec.encode_body(ChunkDelivery(3, 4, odd)) == msgpack.packb([4, 3, 4, [list(c) for c in odd]], use_bin_type=True)
    with pytest.raises(codec.CodecError):
        codec.encode(ChunkDelivery(1, 1, [(b"\x01" * 32, b"z" * (8 << 20))] * 2))  # over 16 MiB


@given(_u, _u, st.lists(st.tuples(st.binary(min_size=32, max_size=32), st.binary(max_size=300)), max_size=20))
def test_chunk_delivery_matches_msgpack(ruid, last, chunks):
    body = msgpack.packb([4, ruid, last, [[a, d] for a, d in chunks]], use_bin_type=True)
    assert codec.encode(ChunkDelivery(ruid, last, chunks)) == len(body).to_bytes(4, "big") + body
