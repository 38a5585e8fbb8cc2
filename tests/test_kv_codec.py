"""Primary_Partition codec: hand-assembled byte vectors (CONTRACT §4), round trips, fuzzed garbage."""

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.partition import codec as c


def hdr(total, cid, ne, cmd):
    return struct.pack(">QQQH", total, cid, ne, cmd)


# -- requests: exact bytes ----------------------------------------------------------------------


def test_set_vector():
    wire = c.encode_set(7, b"ab", b"xyz")
    expected = (
        b"\x00\x00\x00\x00\x00\x00\x00\x25"  # total_len 37 = 26 + 2+2 + 4+3
        b"\x00\x00\x00\x00\x00\x00\x00\x07"  # client_id
        b"\x00\x00\x00\x00\x00\x00\x00\x01"  # num_elems 1
        b"\x00\x03"  # SET
        b"\x00\x02ab"
        b"\x00\x00\x00\x03xyz"
    )
    assert wire == expected
    assert c.decode_request(wire) == c.Set(7, b"ab", b"xyz")


def test_get_and_remove_vectors():
    assert c.encode_get(1, b"k") == hdr(29, 1, 1, 2) + b"\x00\x01k"
    assert c.encode_remove(2, b"k") == hdr(29, 2, 1, 8) + b"\x00\x01k"
    assert c.decode_request(hdr(29, 1, 1, 2) + b"\x00\x01k") == c.Get(1, b"k")
    assert c.decode_request(hdr(29, 2, 99, 8) + b"\x00\x01k") == c.Remove(2, b"k")


def test_cursor_vectors():
    # CREATE_CURSOR: u8 name, u16 start key (0 = BEGIN)
    assert c.encode_create_cursor(3, b"cur", b"") == hdr(32, 3, 0, 9) + b"\x03cur\x00\x00"
    assert c.encode_create_cursor(3, b"c", b"k1") == hdr(32, 3, 0, 9) + b"\x01c\x00\x02k1"
    assert c.encode_delete_cursor(4, b"cur") == hdr(30, 4, 0, 10) + b"\x03cur"
    assert c.decode_request(hdr(32, 3, 0, 9) + b"\x01c\x00\x02k1") == c.CreateCursor(3, b"c", b"k1")
    assert c.decode_request(hdr(30, 4, 0, 10) + b"\x03cur") == c.DeleteCursor(4, b"cur")


def test_scan_vectors():
    # CONTRACT §4: NumElems = 6 reserved bytes then u16 count; cursor name, NextKey, [prefix].
    wire = c.encode_scan(c.GET_FF, 9, 1024, b"cu", b"")
    assert wire == hdr(31, 9, 1024, 6) + b"\x02cu\x00\x00"
    wire = c.encode_scan(c.GET_KEYS_PREFIX, 9, 5, b"cu", b"nk", b"pre")
    assert wire == hdr(38, 9, 5, 5) + b"\x02cu\x00\x02nk\x00\x03pre"
    assert c.decode_request(wire) == c.Scan(c.GET_KEYS_PREFIX, 9, 5, b"cu", b"nk", b"pre")
    # the 6 reserved bytes are ignored
    wire = struct.pack(">QQ", 31, 9) + b"\xff" * 6 + b"\x00\x02" + b"\x00\x07" + b"\x02cu\x00\x00"
    assert c.decode_request(wire) == c.Scan(c.GET_FB, 9, 2, b"cu", b"", b"")


@pytest.mark.parametrize("count", [0, 1025, 0xFFFF])
def test_scan_count_outside_range_is_err4(count):
    wire = c.encode_scan(c.GET_KEYS, 1, count, b"c")
    with pytest.raises(c.DecodeError) as ei:
        c.decode_request(wire)
    assert ei.value.code == c.E_TOO_MANY_ELEMENTS


def test_fields_past_total_len_are_err3():
    # key length says 5 but only 1 byte inside total_len
    with pytest.raises(c.DecodeError) as ei:
        c.decode_request(hdr(29, 1, 1, 2) + b"\x00\x05k")
    assert ei.value.code == c.E_MSG_TOO_SHORT
    # a SET without its value length
    with pytest.raises(c.DecodeError) as ei:
        c.decode_request(hdr(29, 1, 1, 3) + b"\x00\x01k" + b"\x00\x00\x00\x01v")
    assert ei.value.code == c.E_MSG_TOO_SHORT
    # total_len < 26
    with pytest.raises(c.DecodeError) as ei:
        c.decode_request(struct.pack(">Q", 20) + b"\x00" * 20)
    assert ei.value.code == c.E_MSG_TOO_SHORT


def test_trailing_bytes_inside_total_len_are_ignored():
    assert c.decode_request(hdr(33, 1, 1, 2) + b"\x00\x01k" + b"junk") == c.Get(1, b"k")


def test_value_over_16mib_is_err0():
    wire = hdr(26 + 3 + 4, 1, 1, 3) + b"\x00\x01k" + struct.pack(">I", 16 * 1024 * 1024 + 1)
    with pytest.raises(c.DecodeError) as ei:
        c.decode_request(wire)
    assert ei.value.code == c.E_UNKNOWN


@pytest.mark.parametrize("cmd", [0, 1, 11, 12, 13, 0xFFFF])
def test_unknown_commands_decode_as_invalid(cmd):
    assert c.decode_request(hdr(26, 5, 0, cmd)) == c.Invalid(5, cmd)


# -- replies: exact bytes -----------------------------------------------------------------------


def test_status_and_error_vectors():
    assert c.encode_status(7, c.OK) == hdr(26, 7, 0, 0)
    assert c.encode_status(7, c.DATA_NOT_FOUND) == hdr(26, 7, 0, 11)
    assert c.encode_status(7, c.INVALID_COMMAND) == hdr(26, 7, 0, 12)
    assert c.encode_error(7, c.E_CURSOR_NOT_FOUND) == hdr(28, 7, 0, 1) + b"\x00\x02"
    r = c.decode_reply(hdr(28, 7, 0, 1) + b"\x00\x03", c.GET)
    assert (r.cmd, r.client_id, r.error_code) == (c.ERR, 7, 3)


def test_get_reply_vector():
    wire = c.encode_get_reply(4, b"k", b"vv")
    assert wire == hdr(35, 4, 1, 0) + b"\x00\x01k\x00\x00\x00\x02vv"
    r = c.decode_reply(wire, c.GET)
    assert r.items == [(b"k", b"vv")]


def test_scan_reply_vectors_and_jump_bit():
    # both keys in partition 3 ('a' = 0x61 >> 5): no jump bit
    wire = c.encode_scan_reply(1, [(b"a", b"1"), (b"b", b"22")], True, b"c", b"cur")
    body = b"\x00\x01a\x00\x00\x00\x011" + b"\x00\x01b\x00\x00\x00\x0222" + b"\x00\x01c" + b"\x03cur"
    assert wire == hdr(26 + len(body), 1, 2, 0) + body
    # keys 0x1f.. (partition 0) and 0x20.. (partition 1): the jump bit is 0x01 at absolute offset 20
    wire = c.encode_scan_reply(1, [(b"\x1f", None), (b"\x20", None)], False, b"", b"c")
    body = b"\x00\x01\x1f\x00\x01\x20" + b"\x00\x00" + b"\x01c"
    assert wire == struct.pack(">QQ", 26 + len(body), 1) + b"\x00\x00\x00\x00\x01\x00\x00\x02" + b"\x00\x00" + body
    assert wire[20] == 0x01
    r = c.decode_reply(wire, c.GET_KEYS)
    assert r.jumped and r.count == 2 and r.items == [(b"\x1f", None), (b"\x20", None)]
    assert r.next_key == b"" and r.cursor == b"c"
    # an empty page
    wire = c.encode_scan_reply(1, [], True, b"", b"c")
    assert wire == hdr(30, 1, 0, 0) + b"\x00\x00\x01c"


def test_partition_of():
    assert [c.partition_of(bytes([b])) for b in (0, 0x1F, 0x20, 0x60, 0xE0, 0xFF)] == [0, 0, 1, 3, 7, 7]


# -- round trips and garbage --------------------------------------------------------------------

keys = st.binary(min_size=0, max_size=300)
names = st.binary(min_size=0, max_size=255)
cids = st.integers(0, 2**64 - 1)

requests = st.one_of(
    st.builds(c.Get, cids, keys),
    st.builds(c.Set, cids, keys, st.binary(max_size=2000)),
    st.builds(c.Remove, cids, keys),
    st.builds(c.CreateCursor, cids, names, keys),
    st.builds(c.DeleteCursor, cids, names),
    st.builds(c.Scan, st.sampled_from([c.GET_FF, c.GET_FB, c.GET_KEYS]), cids, st.integers(1, 1024), names, keys),
    st.builds(lambda *a: c.Scan(c.GET_KEYS_PREFIX, *a), cids, st.integers(1, 1024), names, keys, keys),
)


@given(requests)
def test_request_round_trip(req):
    wire = c.encode_request(req)
    assert struct.unpack_from(">Q", wire)[0] == len(wire)
    assert c.decode_request(wire) == req


@given(st.binary(min_size=8, max_size=400))
def test_decoder_garbage_is_request_or_decode_error(data):
    total = struct.unpack_from(">Q", data)[0]
    # the framer only hands over complete messages of 8..32 MiB bytes
    if total < 8 or total > len(data):
        data = struct.pack(">Q", len(data)) + data[8:]
    try:
        req = c.decode_request(data)
    except c.DecodeError as e:
        assert e.code in (c.E_UNKNOWN, c.E_MSG_TOO_SHORT, c.E_TOO_MANY_ELEMENTS)
    else:
        assert req.__class__ in (c.Get, c.Set, c.Remove, c.CreateCursor, c.DeleteCursor, c.Scan, c.Invalid)


@given(st.binary(min_size=8, max_size=400), st.sampled_from(sorted(c.COMMAND_NAMES)))
def test_reply_decoder_garbage_is_reply_or_reply_error(data, request_cmd):
    data = struct.pack(">Q", len(data)) + data[8:]
    try:
        c.decode_reply(data, request_cmd)
    except c.ReplyError:
        pass
