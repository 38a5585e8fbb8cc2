"""Toasty codec: hand-assembled little-endian byte vectors (CONTRACT §5), round trips, garbage."""

import socket
import pytest
from hypothesis import given, strategies as st

from protocols.toasty import codec
from protocols.toasty.codec import (
    AddrList,
    CodecError,
    Create,
    CreateChunk,
    CreateChunkSuccess,
    CreateSuccess,
    Delete,
    DeleteSuccess,
    DownloadChunk,
    DownloadChunkSuccess,
    ErrorReply,
    List_,
    ListItem,
    ListSuccess,
    Read,
    ReadChunk,
    ReadError,
    ReadSuccess,
    UploadChunk,
    UploadChunkSuccess,
    Write,
    WriteChunk,
    WriteSuccess,
)

H = bytes(range(32))


def hx(s):
    return bytes.fromhex(s.replace(" ", "").replace("\n", ""))


# (message, exact bytes). Header: u16 version=1 | u16 type | u32 total length, little-endian.
VECTORS = [
    # CREATE file "/a" chunk_size 4096 (CONTRACT §5 override: chunk_size only for files)
    (Create(b"/a", False, 4096), hx("0100 0000 11000000" "0200 2f61" "00" "00100000")),
    # CREATE dir "d": no chunk_size
    (Create(b"d", True), hx("0100 0000 0c000000" "0100 64" "01")),
    (Delete(7, b"/x"), hx("0100 0100 14000000" "0700000000000000" "0200 2f78")),
    (List_(2**64 - 1, b""), hx("0100 0200 12000000" "ffffffffffffffff" "0000")),
    (
        Read(1, b"f", 0x10, 0x2000),
        hx("0100 0300 1b000000" "0100000000000000" "0100 66" "10000000" "00200000"),
    ),
    (
        Write(5, codec.CREATE_IF_MISSING | codec.TRUNCATE_AFTER, b"f", 0, 3, [WriteChunk(H, [("127.0.0.1", 7703), ("::1", 0x1234)])]),
        hx("0100 0400")
        + (8 + 8 + 4 + 3 + 12 + 32 + 4 + 7 + 19).to_bytes(4, "little")
        + hx("0500000000000000" "03000000" "0100 66" "00000000" "03000000" "01000000")
        + H
        + hx("02000000" "01 7f000001 171e" "00 00000000000000000000000000000001 3412"),
    ),
    (CreateChunk(8, 2, b"ab"), hx("0100 0500 16000000" "08000000 02000000 02000000" "6162")),
    (UploadChunk(H, 1, b"z"), hx("0100 0600 31000000") + H + hx("01000000 01000000 7a")),
    (DownloadChunk(H, True), hx("0100 0700 29000000") + H + hx("01")),
    (DownloadChunk(H, False, 4, 5), hx("0100 0700 31000000") + H + hx("00 04000000 05000000")),
]

REPLY_VECTORS = [
    (ErrorReply(codec.CREATE_ERROR, "no"), hx("0100 0800 0c000000" "0200 6e6f")),
    (CreateSuccess(9), hx("0100 0900 10000000" "0900000000000000")),
    (DeleteSuccess(), hx("0100 0b00 08000000")),
    (
        ListSuccess(1, True, [ListItem(3, True, b"d"), ListItem(4, False, b"ef")]),
        hx("0100 0d00 2e000000" "0100000000000000 01 02000000" "0300000000000000 01 0100 64" "0400000000000000 00 0200 6566"),
    ),
    (
        ReadError("x", [AddrList([("10.0.0.1", 80)], [])]),
        hx("0100 0e00 1d000000" "0100 78" "01000000" "01000000 0a000001 5000" "00000000"),
    ),
    (
        ReadSuccess(2, 4096, 3, [ReadChunk(H, [AddrList([("127.0.0.1", 1)])]), ReadChunk(codec.ZERO_HASH, [])], [AddrList([("127.0.0.1", 1)])]),
        hx("0100 0f00")
        + (8 + 20 + 32 + 4 + 14 + 32 + 4 + 4 + 14).to_bytes(4, "little")
        + hx("0200000000000000 00100000 03000000 02000000")
        + H
        + hx("01000000" "01000000 7f000001 0100" "00000000")
        + codec.ZERO_HASH
        + hx("00000000")
        + hx("01000000" "01000000 7f000001 0100" "00000000"),
    ),
    (WriteSuccess(2**63), hx("0100 1100 10000000" "0000000000000080")),
    (CreateChunkSuccess(H), hx("0100 1a00 28000000") + H),
    (UploadChunkSuccess(H), hx("0100 1c00 28000000") + H),
    (DownloadChunkSuccess(b"hey"), hx("0100 1e00 0f000000" "03000000 686579")),
    (ErrorReply(codec.DOWNLOAD_CHUNK_ERROR, "Invalid range"), hx("0100 1d00 17000000 0d00") + b"Invalid range"),
]

ALL_TYPES = codec.META_REQUESTS | codec.CHUNK_REQUESTS


@pytest.mark.parametrize("msg,raw", VECTORS)
def test_request_vectors(msg, raw):
    assert codec.encode(msg) == raw
    assert codec.decode_message(raw, ALL_TYPES) == msg


@pytest.mark.parametrize("msg,raw", REPLY_VECTORS)
def test_reply_vectors(msg, raw):
    assert codec.encode(msg) == raw
    all_replies = set(range(8, 18)) | set(range(25, 31))
    assert codec.decode_message(raw, all_replies, reply=True) == msg


@pytest.mark.parametrize("msg,raw", VECTORS)
def test_every_truncation_and_extension_is_refused(msg, raw):
    for cut in range(len(raw)):
        with pytest.raises(CodecError):
            codec.decode_message(raw[:cut], ALL_TYPES)
    bad = bytearray(raw + b"\x00")
    bad[4:8] = len(bad).to_bytes(4, "little")
    with pytest.raises(CodecError):
        codec.decode_message(bytes(bad), ALL_TYPES)


def test_header_rules():
    ok = codec.encode(Delete(0, b"a"))
    with pytest.raises(CodecError):  # version 2
        codec.decode_message(b"\x02" + ok[1:], ALL_TYPES)
    with pytest.raises(CodecError):  # a reply type sent as a request
        codec.check_header(1, codec.CREATE_SUCCESS, 16, codec.META_REQUESTS)
    with pytest.raises(CodecError):  # the other listener's request
        codec.check_header(1, codec.CREATE_CHUNK, 20, codec.META_REQUESTS)
    with pytest.raises(CodecError):
        codec.check_header(1, codec.READ, 7, codec.META_REQUESTS)
    with pytest.raises(CodecError):
        codec.check_header(1, codec.READ, 16 * 1024 * 1024 + 1, codec.META_REQUESTS)
    codec.check_header(1, codec.READ, 16 * 1024 * 1024, codec.META_REQUESTS)


def test_huge_counts_do_not_loop():
    # WRITE claiming 2^32-1 chunks in a tiny body: refused by the size check, not by looping.
    body = hx("0100000000000000 00000000 0000 00000000 00000000 ffffffff")
    with pytest.raises(CodecError):
        codec.decode_request(codec.WRITE, body)


def test_chunk_span():
    assert codec.chunk_span(0, 0, 4096) == (0, 0)
    assert codec.chunk_span(0, 4096, 4096) == (0, 1)
    assert codec.chunk_span(4095, 2, 4096) == (0, 2)
    assert codec.chunk_span(8192, 1, 4096) == (2, 1)


addresses = st.one_of(
    st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
    # inet_ntop's spelling (it writes IPv4-mapped addresses dotted, ipaddress does not)
    st.tuples(st.ip_addresses(v=6).map(lambda a: socket.inet_ntop(socket.AF_INET6, a.packed)), st.integers(0, 65535)),
)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
names = st.binary(max_size=40)
requests = st.one_of(
    st.builds(Create, names, st.just(True)),
    st.builds(Create, names, st.just(False), u32),
    st.builds(Delete, u64, names),
    st.builds(List_, u64, names),
    st.builds(Read, u64, names, u32, u32),
    st.builds(Write, u64, u32, names, u32, u32, st.lists(st.builds(WriteChunk, st.binary(min_size=32, max_size=32), st.lists(addresses, max_size=3)), max_size=4)),
    st.builds(CreateChunk, u32, u32, st.binary(max_size=64)),
    st.builds(UploadChunk, st.binary(min_size=32, max_size=32), u32, st.binary(max_size=64)),
    st.builds(DownloadChunk, st.binary(min_size=32, max_size=32), st.just(False), u32, u32),
    st.builds(DownloadChunk, st.binary(min_size=32, max_size=32), st.just(True)),
)


@given(requests)
def test_request_round_trip(msg):
    assert codec.decode_message(codec.encode(msg), ALL_TYPES) == msg


@given(st.integers(0, 40), st.binary(max_size=200))
def test_garbage_bodies_raise_codec_error_only(mtype, body):
    for decode in (codec.decode_request, codec.decode_reply):
        try:
            decode(mtype, body)
        except CodecError:
            pass


def test_error_texts_are_defined_once_and_read_back_by_code():
    from protocols.toasty import file_tree, paths
    from protocols.toasty.errors import RETRYABLE, ErrorCode
    from protocols.toasty.planning import ToastyError, should_retry

    for code in ErrorCode:
        assert ErrorCode.of(code.message("some detail")) is code and ErrorCode.of(code.value) is code
    assert ErrorCode.of("chunk 3 lists 0 locations") is None
    assert str(file_tree.NotFound("/a does not exist")) == "No such file or directory: /a does not exist"
    assert file_tree.BadGeneration().code is ErrorCode.BAD_GENERATION
    try:
        paths.normalize(b"a/../b")
    except paths.InvalidPath as e:
        assert ErrorCode.of(str(e)) is ErrorCode.INVALID_PATH
    assert ToastyError(ErrorCode.CHUNK_NOT_FOUND.message("x")).code is ErrorCode.CHUNK_NOT_FOUND
    for code in ErrorCode:
        reply = codec.ErrorReply(codec.WRITE_ERROR, code.message("d"))
        assert should_retry(reply) == (code in RETRYABLE)
