"""The replica channel's messages (protocols/replica/codec.py): byte vectors."""

import pytest
from hypothesis import given, settings, strategies as st

from protocols.replica import codec


def test_messages_round_trip_as_msgpack_arrays():
    assert codec.encode(codec.SYNC, 7) == b"\x92\xa1S\x07"
    assert codec.decode(b"\x92\xa1S\x07") == ["S", 7]
    raw = codec.encode(codec.APPEND, 1 << 32, 3, b"\x22batch")
    assert raw == b"\x94\xa1A\xcf\x00\x00\x00\x01\x00\x00\x00\x00\x03\xc4\x06\x22batch"
    assert codec.decode(raw) == ["A", 1 << 32, 3, b"\x22batch"]
    assert codec.decode(codec.encode(codec.ACK, 5, 10, 12)) == ["K", 5, 10, 12]
    assert codec.decode(codec.encode(codec.SEALED, 5, 2, 99)) == ["Z", 5, 2, 99]
    assert codec.encode(codec.START, 5, 20) == b"\x93\xa1T\x05\x14" and codec.decode(b"\x93\xa1T\x05\x14") == ["T", 5, 20]


@pytest.mark.parametrize("raw", [
    b"",  # nothing
    b"\xc1",  # never used msgpack byte
    b"\x91\xa1S",  # SYNC without a stream id
    b"\x92\xa1Q\x01",  # unknown kind
    b"\x92\xa1S\xa1x",  # stream id not an integer
    b"\x94\xa1A\x01\x00\xa1x",  # an append whose batch is a string, not bytes
    b"\x81\xa1S\x01",  # a map, not an array
])
def test_malformed_messages_are_refused(raw):
    with pytest.raises(codec.BadMessage):
        codec.decode(raw)


@pytest.mark.parametrize("batches", [[b"\x22x"], [b"a" * 300, b"b" * 70000, b"c"], [b"z"] * 20])
def test_batches_message_parts_join_to_the_msgpack_array(batches):
    import msgpack

    parts = codec.encode_batches(1 << 40, 300, batches)
    raw = b"".join(parts)
    assert raw == msgpack.packb(["B", 1 << 40, 300, batches], use_bin_type=True)
    assert codec.decode(memoryview(raw)) == ["B", 1 << 40, 300, batches]
    assert any(p is batches[0] for p in parts)  # the batches are handed over, not copied


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8), st.data())
def test_a_batches_message_in_pieces_decodes_as_the_whole_copying_only_cut_batches(batches, data):
    # a B message cut by reads' ends (framing.Framer.next_pieces): the same message, each batch a
    # view of the piece it lies in; only one cut between two pieces is joined
    raw = b"".join(codec.encode_batches(1 << 40, 300, batches))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=6)))
    bounds = [0] + cuts + [len(raw)]
    pieces = [memoryview(raw)[a:b] for a, b in zip(bounds, bounds[1:])]
    assert codec.decode_pieces(pieces) == codec.decode(raw)


def test_only_a_batch_cut_between_pieces_is_copied():
    batches = [b"a" * 70000, b"b" * 70000, b"c" * 70000]
    raw = b"".join(codec.encode_batches(9, 1, batches))
    cut = raw.index(b"b" * 100) + 100  # inside the second batch
    msg = codec.decode_pieces([memoryview(raw)[:cut], memoryview(raw)[cut:]])
    assert msg == ["B", 9, 1, batches]
    assert [type(b) for b in msg[3]] == [memoryview, bytes, memoryview]
    # not a B message, or a head cut short: joined and decoded as a whole
    assert codec.decode_pieces([memoryview(b"\x92\xa1"), memoryview(b"S\x07")]) == ["S", 7]
    assert codec.decode_pieces([memoryview(raw)[:5], memoryview(raw)[5:]]) == ["B", 9, 1, batches]
    with pytest.raises(codec.BadMessage):
        codec.decode_pieces([])


@pytest.mark.parametrize("raw", [
    b"\x94\xa1B\x01\x00\x90",  # no batches
    b"\x94\xa1B\x01\x00\x91\xa1x",  # a batch that is a string
    b"\x94\xa1B\x01\x00\xc4\x01x",  # batches that are not a list
])
def test_malformed_batches_messages_are_refused(raw):
    with pytest.raises(codec.BadMessage):
        codec.decode(raw)


def test_a_replica_takes_a_batch_only_with_its_records_crc():
    # node/cluster/replication.py: a received batch is stored only if its records block matches
    # the CRC in its header (the store then reuses that CRC for the WAL entry)
    import zlib

    from node.cluster.replication import checked_records_crc
    from storage import record_batch

    batch = record_batch.encode([(1, [], b"x" * 1000), (2, [(b"k", b"v")], b"y")])
    assert checked_records_crc(batch) == zlib.crc32(batch[record_batch.HEADER_SIZE:])
    assert checked_records_crc(memoryview(batch)) == zlib.crc32(batch[record_batch.HEADER_SIZE:])
    flipped = bytearray(batch)
    flipped[-3] ^= 0x10
    assert checked_records_crc(bytes(flipped)) is None
    assert checked_records_crc(batch[:-1]) is None  # records_len no longer its length
    assert checked_records_crc(batch[:20]) is None
