"""Swarm stream! wire codec (CONTRACT §6): pure functions, bytes in, dataclasses out, and back.

Every message is ``u32 length (big-endian, counting only the msgpack bytes after it; at most
16 MiB) | msgpack array [code, fields...]`` with the fields in the spec's struct order. An ID is
``[name, key]`` (msgpack str); hashes, addresses, data and bit vectors are msgpack bin; ``to`` is nil
for an unbounded range.

No I/O and no Twisted here: the server and the syncer frame with :class:`FrameReader` and call
:func:`decode_body` / :func:`encode`.
"""

import struct
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Sequence, Tuple

import msgpack

from protocols import framing

MAX_FRAME = 16 * 1024 * 1024  # CONTRACT §6: a larger declared length closes the connection
HASH_SIZE = 32
MAX_BATCH_SIZE = 1024  # CONTRACT §6: GetRange.batch_size is clamped to 1..1024
MAX_UINT64 = (1 << 64) - 1

_LENGTH = struct.Struct(">I")

# Message codes (CONTRACT §6 table).
STREAM_INFO_REQ = 0
STREAM_INFO_RES = 1
GET_RANGE = 2
OFFERED_HASHES = 3
CHUNK_DELIVERY = 4
WANTED_HASHES = 5
BATCH_DONE = 6
STREAM_STATE = 7

# StreamState codes (CONTRACT §6).
STATE_BOUNDED = 1
STATE_NO_SUCH_STREAM = 2
STATE_INVALID_RANGE = 3
STATE_BATCH_IN_PROGRESS = 4
STATE_MESSAGES = {
    STATE_BOUNDED: "stream became bounded",
    STATE_NO_SUCH_STREAM: "no such stream",
    STATE_INVALID_RANGE: "invalid range",
    STATE_BATCH_IN_PROGRESS: "batch in progress",
}

# Provider names (CONTRACT §6).
CHUNKS = "CHUNKS"
LOG = "LOG"


class CodecError(ValueError):
    """The bytes are not a well-formed stream! message (the peer is dropped)."""


class FrameTooLarge(CodecError):
    """A declared frame length above MAX_FRAME (CONTRACT §6: close the connection)."""


class ID(NamedTuple):
    """A stream identifier: provider name and provider-specific key."""

    name: str
    key: str

    def __str__(self):
        return "%s|%s" % (self.name, self.key)


class StreamDescriptor(NamedTuple):
    stream: ID
    cursor: int
    bounded: bool


@dataclass(frozen=True)
class StreamInfoReq:
    streams: List[ID]
    code = STREAM_INFO_REQ


@dataclass(frozen=True)
class StreamInfoRes:
    streams: List[StreamDescriptor]
    code = STREAM_INFO_RES


@dataclass(frozen=True)
class GetRange:
    ruid: int
    stream: ID
    from_: int
    to: Optional[int]  # None: unbounded
    batch_size: int
    roundtrip: bool
    code = GET_RANGE


@dataclass(frozen=True)
class OfferedHashes:
    ruid: int
    last_index: int
    hashes: bytes  # 32-byte hashes concatenated
    code = OFFERED_HASHES

    def hash_list(self) -> List[bytes]:
        h = self.hashes
        return [h[i : i + HASH_SIZE] for i in range(0, len(h), HASH_SIZE)]


@dataclass(frozen=True)
class ChunkDelivery:
    ruid: int
    last_index: int
    chunks: List[Tuple[bytes, bytes]] = field(default_factory=list)  # (addr, data)
    code = CHUNK_DELIVERY


@dataclass(frozen=True)
class WantedHashes:
    ruid: int
    bitvector: bytes
    code = WANTED_HASHES


@dataclass(frozen=True)
class BatchDone:
    ruid: int
    last: int
    code = BATCH_DONE


@dataclass(frozen=True)
class StreamState:
    stream: ID
    code_: int  # the StreamState code (1..4); ``code`` is the message code
    message: str
    code = STREAM_STATE


# ---------------------------------------------------------------------------------------------
# bit vectors (CONTRACT §6: bit i is bit 1 << (i % 8) of byte i // 8, least significant first)


def bitvector_encode(wanted: Sequence[bool]) -> bytes:
    """The bit vector for ``wanted`` (one flag per offered hash, in offer order).

    Wanting nothing is the empty vector (CONTRACT §6: answered by BatchDone at once); otherwise the
    shortest vector holding every bit, ceil(n / 8) bytes.
    """
    if not any(wanted):
        return b""
    out = bytearray((len(wanted) + 7) // 8)
    for i, w in enumerate(wanted):
        if w:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def bitvector_decode(vector: bytes, n: int) -> List[bool]:
    """The n flags a vector carries. Bytes missing at the end read as zero (not wanted); bits past
    n are ignored, so swarm's floor(n/8)+1 sizing and the minimal sizing both decode."""
    flags = []
    for i in range(n):
        byte = i >> 3
        flags.append(byte < len(vector) and bool(vector[byte] & (1 << (i & 7))))
    return flags


# ---------------------------------------------------------------------------------------------
# encoding


def _id(i: ID):
    return [i.name, i.key]


def _fields(msg) -> list:
    c = msg.code
    if c == STREAM_INFO_REQ:
        return [c, [_id(i) for i in msg.streams]]
    if c == STREAM_INFO_RES:
        return [c, [[_id(d.stream), d.cursor, bool(d.bounded)] for d in msg.streams]]
    if c == GET_RANGE:
        return [c, msg.ruid, _id(msg.stream), msg.from_, msg.to, msg.batch_size, bool(msg.roundtrip)]
    if c == OFFERED_HASHES:
        return [c, msg.ruid, msg.last_index, bytes(msg.hashes)]
    if c == CHUNK_DELIVERY:
        return [c, msg.ruid, msg.last_index, [[bytes(a), bytes(d)] for a, d in msg.chunks]]
    if c == WANTED_HASHES:
        return [c, msg.ruid, bytes(msg.bitvector)]
    if c == BATCH_DONE:
        return [c, msg.ruid, msg.last]
    if c == STREAM_STATE:
        return [c, _id(msg.stream), msg.code_, msg.message]
    raise TypeError("not a stream! message: %r" % (msg,))


def encode_body(msg) -> bytes:
    """The msgpack body of ``msg`` (no length prefix)."""
    if msg.code == CHUNK_DELIVERY:
        return encode_chunk_delivery(msg.ruid, msg.last_index, msg.chunks)[4:]
    return msgpack.packb(_fields(msg), use_bin_type=True)


def encode(msg) -> bytes:
    """One complete frame: the u32 big-endian length, then the msgpack body."""
    if msg.code == CHUNK_DELIVERY:
        return encode_chunk_delivery(msg.ruid, msg.last_index, msg.chunks)
    body = encode_body(msg)
    if len(body) > MAX_FRAME:
        raise CodecError("message of %d bytes exceeds the 16 MiB frame limit" % len(body))
    return _LENGTH.pack(len(body)) + body


# ChunkDelivery is most of the bytes of a sync; msgpack.packb copies every bin through its growing
# buffer (10x slower than one join), so its frame is laid out here, byte for byte what packb gives
# (smallest uint, array and bin forms; tests/test_swarm_codec.py checks it against msgpack).


def _msgpack_array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n <= 0xFFFF:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _msgpack_uint(v: int) -> bytes:
    if type(v) is not int or v < 0 or v > MAX_UINT64:
        raise CodecError("%r is not an unsigned integer" % (v,))
    if v < 0x80:
        return bytes((v,))
    if v <= 0xFF:
        return b"\xcc" + bytes((v,))
    if v <= 0xFFFF:
        return b"\xcd" + v.to_bytes(2, "big")
    if v <= 0xFFFFFFFF:
        return b"\xce" + v.to_bytes(4, "big")
    return b"\xcf" + v.to_bytes(8, "big")


_BIN16 = struct.Struct(">BH")
_ITEM_ADDR = b"\x92\xc4\x20"  # [addr, data] with a 32-byte addr: fixarray 2, bin 8 of length 32


def _msgpack_bin_header(n: int) -> bytes:
    if n <= 0xFF:
        return b"\xc4" + bytes((n,))
    if n <= 0xFFFF:
        return _BIN16.pack(0xC5, n)
    if n <= 0xFFFFFFFF:
        return b"\xc6" + n.to_bytes(4, "big")
    raise CodecError("bin of %d bytes is too long for msgpack" % n)


def chunk_delivery_parts(ruid: int, last_index: int, chunks) -> list:
    """The whole ChunkDelivery frame (length prefix included) for ``[(addr, data), ...]`` as a
    list of byte strings to write in order (the chunks' data are not copied)."""
    parts = [b"", b"\x94\x04", _msgpack_uint(ruid), _msgpack_uint(last_index), _msgpack_array_header(len(chunks))]
    add = parts.append
    bin_header = _msgpack_bin_header
    for addr, data in chunks:
        if len(addr) == HASH_SIZE:
            add(_ITEM_ADDR)
        else:
            add(b"\x92" + bin_header(len(addr)))
        add(addr)
        add(bin_header(len(data)))
        add(data)
    size = sum(map(len, parts))
    if size > MAX_FRAME:
        raise CodecError("message of %d bytes exceeds the 16 MiB frame limit" % size)
    parts[0] = _LENGTH.pack(size)
    return parts


def encode_chunk_delivery(ruid: int, last_index: int, chunks) -> bytes:
    """The whole ChunkDelivery frame (length prefix included) for ``[(addr, data), ...]``."""
    return b"".join(chunk_delivery_parts(ruid, last_index, chunks))


def chunk_delivery_overhead(n_chunks: int) -> int:
    """An upper bound on a ChunkDelivery frame's bytes besides its chunks' data (for splitting)."""
    return 4 + 1 + 1 + 9 + 9 + 5 + n_chunks * (1 + 2 + HASH_SIZE + 5)


# ---------------------------------------------------------------------------------------------
# decoding


def _uint(v, what: str) -> int:
    if type(v) is not int or v < 0 or v > MAX_UINT64:
        raise CodecError("%s must be an unsigned integer, got %r" % (what, v))
    return v


def _bool(v, what: str) -> bool:
    if type(v) is not bool:
        raise CodecError("%s must be a boolean, got %r" % (what, v))
    return v


def _bin(v, what: str) -> bytes:
    if type(v) is not bytes:
        raise CodecError("%s must be msgpack bin" % what)
    return v


def _str(v, what: str) -> str:
    if type(v) is not str:
        raise CodecError("%s must be msgpack str" % what)
    return v


def _list(v, what: str) -> list:
    if type(v) is not list:
        raise CodecError("%s must be an array" % what)
    return v


def _decode_id(v) -> ID:
    v = _list(v, "ID")
    if len(v) != 2:
        raise CodecError("ID must be [name, key]")
    return ID(_str(v[0], "ID name"), _str(v[1], "ID key"))


def _arity(a: list, n: int, name: str):
    if len(a) != n:
        raise CodecError("%s has %d fields, expected %d" % (name, len(a) - 1, n - 1))


def decode_body(body) -> object:
    """Decode one msgpack body into its message dataclass; CodecError if it is not one."""
    try:
        a = msgpack.unpackb(bytes(body), raw=False, use_list=True, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, UnicodeDecodeError) as e:
        raise CodecError("not a msgpack value: %s" % e)
    except Exception as e:  # msgpack raises a few odd types on garbage (e.g. TypeError on unhashable keys)
        raise CodecError("not a msgpack value: %s" % e)
    a = _list(a, "message")
    if not a:
        raise CodecError("empty message array")
    code = a[0]
    if type(code) is not int:
        raise CodecError("message code must be an integer")
    if code == STREAM_INFO_REQ:
        _arity(a, 2, "StreamInfoReq")
        return StreamInfoReq([_decode_id(i) for i in _list(a[1], "streams")])
    if code == STREAM_INFO_RES:
        _arity(a, 2, "StreamInfoRes")
        out = []
        for d in _list(a[1], "streams"):
            d = _list(d, "StreamDescriptor")
            if len(d) != 3:
                raise CodecError("StreamDescriptor must be [ID, cursor, bounded]")
            out.append(StreamDescriptor(_decode_id(d[0]), _uint(d[1], "cursor"), _bool(d[2], "bounded")))
        return StreamInfoRes(out)
    if code == GET_RANGE:
        _arity(a, 7, "GetRange")
        to = None if a[4] is None else _uint(a[4], "to")
        return GetRange(
            _uint(a[1], "ruid"), _decode_id(a[2]), _uint(a[3], "from"), to,
            _uint(a[5], "batch_size"), _bool(a[6], "roundtrip"),
        )
    if code == OFFERED_HASHES:
        _arity(a, 4, "OfferedHashes")
        hashes = _bin(a[3], "hashes")
        if len(hashes) % HASH_SIZE:
            raise CodecError("hashes length %d is not a multiple of 32" % len(hashes))
        return OfferedHashes(_uint(a[1], "ruid"), _uint(a[2], "last_index"), hashes)
    if code == CHUNK_DELIVERY:
        _arity(a, 4, "ChunkDelivery")
        chunks = []
        add = chunks.append
        for c in _list(a[3], "chunks"):  # inlined checks: this loop runs once per synced item
            if type(c) is not list:
                raise CodecError("chunk must be an array")
            if len(c) != 2:
                raise CodecError("a delivered chunk must be [addr, data]")
            addr, data = c
            if type(addr) is not bytes:
                raise CodecError("addr must be msgpack bin")
            if len(addr) != HASH_SIZE:
                raise CodecError("addr must be 32 bytes")
            if type(data) is not bytes:
                raise CodecError("data must be msgpack bin")
            add((addr, data))
        return ChunkDelivery(_uint(a[1], "ruid"), _uint(a[2], "last_index"), chunks)
    if code == WANTED_HASHES:
        _arity(a, 3, "WantedHashes")
        return WantedHashes(_uint(a[1], "ruid"), _bin(a[2], "bitvector"))
    if code == BATCH_DONE:
        _arity(a, 3, "BatchDone")
        return BatchDone(_uint(a[1], "ruid"), _uint(a[2], "last"))
    if code == STREAM_STATE:
        _arity(a, 4, "StreamState")
        c = _uint(a[2], "code")
        if c > 0xFFFF:
            raise CodecError("StreamState code must be a uint16")
        return StreamState(_decode_id(a[1]), c, _str(a[3], "message"))
    raise CodecError("unknown message code %r" % (code,))


class _Layout(framing.Layout):
    """CONTRACT §6: u32 body length, then the body; a length over the limit closes the connection."""

    def __init__(self, max_frame):
        super().__init__(_LENGTH, 0, 4, 0, max_frame)

    def refuse(self, peek, length):
        raise FrameTooLarge("declared frame length %d exceeds %d" % (length, self.max_length))


class FrameReader:
    """Splits a byte stream into message bodies (``protocols/framing.Framer``): a body that arrives
    whole within one read is copied out of it once; a body spread over reads is joined once when
    complete. The declared length is checked against MAX_FRAME before any of the body is buffered."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self.max_frame = max_frame
        self._frames = framing.Framer(_Layout(max_frame))

    def feed(self, data: bytes) -> List[bytes]:
        """Add bytes; return the complete bodies now available. FrameTooLarge if a declared length
        is above the limit (the caller closes the connection)."""
        self._frames.feed(data)
        return [buf[pos + 4 : end] for buf, pos, end in self._frames.spans()]

    def buffered(self) -> int:
        return self._frames.buffered()


# ---------------------------------------------------------------------------------------------
# provider keys


def log_stream_id(key: str) -> Optional[int]:
    """The stream id a LOG key names (canonical decimal), or None if it is not one."""
    if not key or not key.isdigit() or (len(key) > 1 and key[0] == "0") or not key.isascii():
        return None
    sid = int(key)
    return sid if sid < (1 << 63) else None


def log_id(stream_id: int) -> ID:
    return ID(LOG, str(stream_id))


CHUNKS_ID = ID(CHUNKS, "")
ALL_LOGS_ID = ID(LOG, "")
