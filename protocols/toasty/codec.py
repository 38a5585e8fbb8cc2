"""Toasty wire format (CONTRACT §5 over shared/specs/toasty-metadata.txt): pure functions, no I/O.

Every message is ``u16 version=1 | u16 type | u32 length`` then a body; all integers little-endian
(ports too), IPv4/IPv6 addresses are their bytes in network order, ``length`` counts the whole
message including the 8-byte header. ``decode_request``/``decode_reply`` take a message type and
its body and return a dataclass, or raise ``CodecError`` when the body does not parse to exactly
its length; ``encode`` turns any message dataclass back into bytes.
"""

import socket
import struct
from dataclasses import dataclass, field
from typing import List, Tuple

from protocols import framing

VERSION = 1
HEADER = struct.Struct("<HHI")
HEADER_LEN = HEADER.size
MAX_MESSAGE = 16 * 1024 * 1024  # CONTRACT §5: a length > 16 MiB closes the connection

# CONTRACT §5: message types.
CREATE = 0
DELETE = 1
LIST = 2
READ = 3
WRITE = 4
CREATE_CHUNK = 5
UPLOAD_CHUNK = 6
DOWNLOAD_CHUNK = 7
CREATE_ERROR = 8
CREATE_SUCCESS = 9
DELETE_ERROR = 10
DELETE_SUCCESS = 11
LIST_ERROR = 12
LIST_SUCCESS = 13
READ_ERROR = 14
READ_SUCCESS = 15
WRITE_ERROR = 16
WRITE_SUCCESS = 17
CREATE_CHUNK_ERROR = 25
CREATE_CHUNK_SUCCESS = 26
UPLOAD_CHUNK_ERROR = 27
UPLOAD_CHUNK_SUCCESS = 28
DOWNLOAD_CHUNK_ERROR = 29
DOWNLOAD_CHUNK_SUCCESS = 30

META_REQUESTS = frozenset((CREATE, DELETE, LIST, READ, WRITE))
CHUNK_REQUESTS = frozenset((CREATE_CHUNK, UPLOAD_CHUNK, DOWNLOAD_CHUNK))
ERROR_TYPES = frozenset(
    (CREATE_ERROR, DELETE_ERROR, LIST_ERROR, WRITE_ERROR, CREATE_CHUNK_ERROR, UPLOAD_CHUNK_ERROR, DOWNLOAD_CHUNK_ERROR)
)
# The reply type(s) each request may get.
REPLIES = {
    CREATE: (CREATE_SUCCESS, CREATE_ERROR),
    DELETE: (DELETE_SUCCESS, DELETE_ERROR),
    LIST: (LIST_SUCCESS, LIST_ERROR),
    READ: (READ_SUCCESS, READ_ERROR),
    WRITE: (WRITE_SUCCESS, WRITE_ERROR),
    CREATE_CHUNK: (CREATE_CHUNK_SUCCESS, CREATE_CHUNK_ERROR),
    UPLOAD_CHUNK: (UPLOAD_CHUNK_SUCCESS, UPLOAD_CHUNK_ERROR),
    DOWNLOAD_CHUNK: (DOWNLOAD_CHUNK_SUCCESS, DOWNLOAD_CHUNK_ERROR),
}

# Write flags (spec §2.1).
CREATE_IF_MISSING = 0x01
TRUNCATE_AFTER = 0x02

# CONTRACT §5 generations: 0 = skip the check (refused by WRITE), 2^64-1 = "must not exist".
NO_GENERATION = 0
MISSING_GENERATION = 2**64 - 1

MAX_WRITE_CHUNKS = 1024  # CONTRACT §5
MAX_READ_CHUNKS = 1024  # CONTRACT §5
MAX_LIST_ITEMS = 128  # CONTRACT §5
HASH_LEN = 32
ZERO_HASH = b"\x00" * HASH_LEN

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_READ = struct.Struct("<II")
_CREATE_CHUNK = struct.Struct("<III")
_LIST_HEAD = struct.Struct("<QBI")
_LIST_ITEM = struct.Struct("<QBH")
_READ_HEAD = struct.Struct("<QIII")
_WRITE_HEAD = struct.Struct("<QI")
_WRITE_RANGE = struct.Struct("<III")
_V4 = struct.Struct("<4sH")
_V6 = struct.Struct("<16sH")


class CodecError(ValueError):
    """The bytes are not a well-formed message (CONTRACT §5: the connection is closed, no reply)."""


# -- addresses ---------------------------------------------------------------------------------

Address = Tuple[str, int]  # ("127.0.0.1", 7703) or ("::1", 7703)


def is_ipv6(host: str) -> bool:
    return ":" in host


def _pack_ip(host: str) -> bytes:
    try:
        return socket.inet_pton(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET, host)
    except OSError:
        raise ValueError("not an IP address: %r" % (host,))


@dataclass
class AddrList:
    """A ChunkServerAddrList: the addresses of one chunk server."""

    ipv4: List[Address] = field(default_factory=list)
    ipv6: List[Address] = field(default_factory=list)

    @classmethod
    def of(cls, addresses):
        out = cls()
        for host, port in addresses:
            (out.ipv6 if is_ipv6(host) else out.ipv4).append((host, port))
        return out

    def addresses(self) -> List[Address]:
        return list(self.ipv4) + list(self.ipv6)


def parse_host_port(text: str) -> Address:
    """``host:port`` or ``[v6]:port`` (as node.advertised returns) -> (host, port)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def _encode_addr_list(out: list, a: AddrList) -> None:
    out.append(_U32.pack(len(a.ipv4)))
    for host, port in a.ipv4:
        out.append(_V4.pack(_pack_ip(host), port))
    out.append(_U32.pack(len(a.ipv6)))
    for host, port in a.ipv6:
        out.append(_V6.pack(_pack_ip(host), port))


def _encode_addr_lists(out: list, lists) -> None:
    out.append(_U32.pack(len(lists)))
    for a in lists:
        _encode_addr_list(out, a)


# -- messages ----------------------------------------------------------------------------------


@dataclass
class Create:
    path: bytes
    is_dir: bool
    chunk_size: int = 0  # CONTRACT §5 (override): on the wire only for files
    TYPE = CREATE


@dataclass
class Delete:
    expect_gen: int
    path: bytes
    TYPE = DELETE


@dataclass
class List_:
    expect_gen: int
    path: bytes
    TYPE = LIST


@dataclass
class Read:
    expect_gen: int
    path: bytes
    offset: int
    length: int
    TYPE = READ


@dataclass
class WriteChunk:
    hash: bytes
    locations: List[Address] = field(default_factory=list)


@dataclass
class Write:
    expect_gen: int
    flags: int
    path: bytes
    offset: int
    length: int
    chunks: List[WriteChunk] = field(default_factory=list)
    TYPE = WRITE


@dataclass
class CreateChunk:
    chunk_size: int
    offset: int
    data: bytes
    TYPE = CREATE_CHUNK


@dataclass
class UploadChunk:
    hash: bytes
    offset: int
    data: bytes
    TYPE = UPLOAD_CHUNK


@dataclass
class DownloadChunk:
    hash: bytes
    full: bool
    offset: int = 0
    length: int = 0
    TYPE = DOWNLOAD_CHUNK


@dataclass
class ErrorReply:
    """CREATE/DELETE/LIST/WRITE/*_CHUNK_ERROR: ``u16 len | text``."""

    type: int
    message: str

    @property
    def TYPE(self):
        return self.type


@dataclass
class ReadError:
    message: str
    write_locations: List[AddrList] = field(default_factory=list)
    TYPE = READ_ERROR


@dataclass
class CreateSuccess:
    gen: int
    TYPE = CREATE_SUCCESS


@dataclass
class DeleteSuccess:
    TYPE = DELETE_SUCCESS


@dataclass
class ListItem:
    gen: int
    is_dir: bool
    name: bytes


@dataclass
class ListSuccess:
    gen: int
    truncated: bool
    items: List[ListItem] = field(default_factory=list)
    TYPE = LIST_SUCCESS


@dataclass
class ReadChunk:
    hash: bytes
    holders: List[AddrList] = field(default_factory=list)


@dataclass
class ReadSuccess:
    gen: int
    chunk_size: int
    file_length: int
    chunks: List[ReadChunk] = field(default_factory=list)
    write_locations: List[AddrList] = field(default_factory=list)
    TYPE = READ_SUCCESS


@dataclass
class WriteSuccess:
    gen: int
    TYPE = WRITE_SUCCESS


@dataclass
class CreateChunkSuccess:
    hash: bytes
    TYPE = CREATE_CHUNK_SUCCESS


@dataclass
class UploadChunkSuccess:
    hash: bytes
    TYPE = UPLOAD_CHUNK_SUCCESS


@dataclass
class DownloadChunkSuccess:
    data: bytes
    TYPE = DOWNLOAD_CHUNK_SUCCESS


# -- encoding ----------------------------------------------------------------------------------


def _path(out: list, path: bytes) -> None:
    if len(path) > 0xFFFF:
        raise ValueError("path longer than 65535 bytes")
    out.append(_U16.pack(len(path)))
    out.append(path)


def _text(out: list, message: str) -> None:
    raw = message.encode("utf-8", "replace")[:0xFFFF]
    out.append(_U16.pack(len(raw)))
    out.append(raw)


def _hash(h: bytes) -> bytes:
    if len(h) != HASH_LEN:
        raise ValueError("a hash is 32 bytes")
    return bytes(h)


def _body(msg) -> list:
    out = []
    t = msg.TYPE
    if t == CREATE:
        _path(out, msg.path)
        out.append(_U8.pack(1 if msg.is_dir else 0))
        if not msg.is_dir:
            out.append(_U32.pack(msg.chunk_size))
    elif t in (DELETE, LIST):
        out.append(_U64.pack(msg.expect_gen))
        _path(out, msg.path)
    elif t == READ:
        out.append(_U64.pack(msg.expect_gen))
        _path(out, msg.path)
        out.append(_READ.pack(msg.offset, msg.length))
    elif t == WRITE:
        out.append(_WRITE_HEAD.pack(msg.expect_gen, msg.flags))
        _path(out, msg.path)
        out.append(_WRITE_RANGE.pack(msg.offset, msg.length, len(msg.chunks)))
        for c in msg.chunks:
            out.append(_hash(c.hash))
            out.append(_U32.pack(len(c.locations)))
            for host, port in c.locations:
                if is_ipv6(host):
                    out.append(b"\x00" + _V6.pack(_pack_ip(host), port))
                else:
                    out.append(b"\x01" + _V4.pack(_pack_ip(host), port))
    elif t == CREATE_CHUNK:
        out.append(_CREATE_CHUNK.pack(msg.chunk_size, msg.offset, len(msg.data)))
        out.append(msg.data)
    elif t == UPLOAD_CHUNK:
        out.append(_hash(msg.hash))
        out.append(_READ.pack(msg.offset, len(msg.data)))
        out.append(msg.data)
    elif t == DOWNLOAD_CHUNK:
        out.append(_hash(msg.hash))
        if msg.full:
            out.append(b"\x01")
        else:
            out.append(b"\x00" + _READ.pack(msg.offset, msg.length))
    elif t in ERROR_TYPES:
        _text(out, msg.message)
    elif t == READ_ERROR:
        _text(out, msg.message)
        _encode_addr_lists(out, msg.write_locations)
    elif t in (CREATE_SUCCESS, WRITE_SUCCESS):
        out.append(_U64.pack(msg.gen))
    elif t == DELETE_SUCCESS:
        pass
    elif t == LIST_SUCCESS:
        out.append(_LIST_HEAD.pack(msg.gen, 1 if msg.truncated else 0, len(msg.items)))
        for item in msg.items:
            out.append(_LIST_ITEM.pack(item.gen, 1 if item.is_dir else 0, len(item.name)))
            out.append(item.name)
    elif t == READ_SUCCESS:
        out.append(_READ_HEAD.pack(msg.gen, msg.chunk_size, msg.file_length, len(msg.chunks)))
        for c in msg.chunks:
            out.append(_hash(c.hash))
            _encode_addr_lists(out, c.holders)
        _encode_addr_lists(out, msg.write_locations)
    elif t in (CREATE_CHUNK_SUCCESS, UPLOAD_CHUNK_SUCCESS):
        out.append(_hash(msg.hash))
    elif t == DOWNLOAD_CHUNK_SUCCESS:
        out.append(_U32.pack(len(msg.data)))
        out.append(msg.data)
    else:
        raise ValueError("unknown message type %r" % (t,))
    return out


def encode_parts(msg) -> list:
    """A whole message as a list of buffers (header first), for scatter-gather sends: a chunk's
    data is not copied."""
    body = _body(msg)
    length = HEADER_LEN + sum(len(b) for b in body)
    if length > MAX_MESSAGE:
        raise ValueError("message of %d bytes is over the 16 MiB limit" % length)
    body.insert(0, HEADER.pack(VERSION, msg.TYPE, length))
    return body


def encode(msg) -> bytes:
    """A whole message: header (with the total length) and body."""
    return b"".join(encode_parts(msg))


# -- decoding ----------------------------------------------------------------------------------


_ADDR_CACHE = {}


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, body):
        self.buf = memoryview(body)
        self.pos = 0

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int) -> memoryview:
        if n > len(self.buf) - self.pos:
            raise CodecError("message body is truncated")
        v = self.buf[self.pos : self.pos + n]
        self.pos += n
        return v

    def unpack(self, s: struct.Struct):
        if s.size > len(self.buf) - self.pos:
            raise CodecError("message body is truncated")
        v = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return v

    def u8(self) -> int:
        return self.unpack(_U8)[0]

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def u64(self) -> int:
        return self.unpack(_U64)[0]

    def path(self) -> bytes:
        (n,) = self.unpack(_U16)
        return bytes(self.take(n))

    def text(self) -> str:
        (n,) = self.unpack(_U16)
        return bytes(self.take(n)).decode("utf-8", "replace")

    def count(self, min_item_size: int) -> int:
        """A u32 item count, checked against the bytes left so garbage cannot make us loop 2^32 times."""
        n = self.u32()
        if n * min_item_size > self.remaining():
            raise CodecError("item count %d does not fit in the message" % n)
        return n

    def addr_list(self) -> AddrList:
        # The same few server lists repeat in every READ reply (one per chunk): decode each
        # distinct byte string once. AddrLists handed out are shared; treat them as read-only.
        buf, pos = self.buf, self.pos
        if len(buf) - pos >= 8:
            (n4,) = _U32.unpack_from(buf, pos)
            at6 = pos + 4 + n4 * _V4.size
            if n4 <= 16 and at6 + 4 <= len(buf):
                (n6,) = _U32.unpack_from(buf, at6)
                end = at6 + 4 + n6 * _V6.size
                if n6 <= 16 and end <= len(buf):
                    key = bytes(buf[pos:end])
                    cached = _ADDR_CACHE.get(key)
                    if cached is None:
                        cached = self._addr_list()
                        if len(_ADDR_CACHE) < 1024:
                            _ADDR_CACHE[key] = cached
                    else:
                        self.pos = end
                    return cached
        return self._addr_list()

    def _addr_list(self) -> AddrList:
        a = AddrList()
        for _ in range(self.count(_V4.size)):
            ip, port = self.unpack(_V4)
            a.ipv4.append((socket.inet_ntop(socket.AF_INET, ip), port))
        for _ in range(self.count(_V6.size)):
            ip, port = self.unpack(_V6)
            a.ipv6.append((socket.inet_ntop(socket.AF_INET6, ip), port))
        return a

    def addr_lists(self) -> List[AddrList]:
        return [self.addr_list() for _ in range(self.count(8))]

    def end(self):
        if self.pos != len(self.buf):
            raise CodecError("%d trailing bytes after the message body" % (len(self.buf) - self.pos))


def decode_request(mtype: int, body):
    """A request body (header removed) -> a request dataclass; CodecError if it is not exactly one."""
    r = _Reader(body)
    if mtype == CREATE:
        path = r.path()
        is_dir = r.u8() != 0
        msg = Create(path, is_dir, 0 if is_dir else r.u32())
    elif mtype == DELETE:
        msg = Delete(r.u64(), r.path())
    elif mtype == LIST:
        msg = List_(r.u64(), r.path())
    elif mtype == READ:
        gen = r.u64()
        path = r.path()
        offset, length = r.unpack(_READ)
        msg = Read(gen, path, offset, length)
    elif mtype == WRITE:
        gen, flags = r.unpack(_WRITE_HEAD)
        path = r.path()
        offset, length, n = r.unpack(_WRITE_RANGE)
        if n * (HASH_LEN + 4) > r.remaining():
            raise CodecError("num_chunks %d does not fit in the message" % n)
        chunks = []
        for _ in range(n):
            h = bytes(r.take(HASH_LEN))
            locations = []
            for _ in range(r.count(7)):
                if r.u8():
                    ip, port = r.unpack(_V4)
                    locations.append((socket.inet_ntop(socket.AF_INET, ip), port))
                else:
                    ip, port = r.unpack(_V6)
                    locations.append((socket.inet_ntop(socket.AF_INET6, ip), port))
            chunks.append(WriteChunk(h, locations))
        msg = Write(gen, flags, path, offset, length, chunks)
    elif mtype == CREATE_CHUNK:
        chunk_size, offset, n = r.unpack(_CREATE_CHUNK)
        msg = CreateChunk(chunk_size, offset, bytes(r.take(n)))
    elif mtype == UPLOAD_CHUNK:
        h = bytes(r.take(HASH_LEN))
        offset, n = r.unpack(_READ)
        msg = UploadChunk(h, offset, bytes(r.take(n)))
    elif mtype == DOWNLOAD_CHUNK:
        h = bytes(r.take(HASH_LEN))
        if r.u8():
            msg = DownloadChunk(h, True)
        else:
            offset, length = r.unpack(_READ)
            msg = DownloadChunk(h, False, offset, length)
    else:
        raise CodecError("type %d is not a request" % mtype)
    r.end()
    return msg


def decode_reply(mtype: int, body):
    """A reply body (header removed) -> a reply dataclass; CodecError if it is not exactly one."""
    r = _Reader(body)
    if mtype in ERROR_TYPES:
        msg = ErrorReply(mtype, r.text())
    elif mtype == READ_ERROR:
        msg = ReadError(r.text(), r.addr_lists())
    elif mtype == CREATE_SUCCESS:
        msg = CreateSuccess(r.u64())
    elif mtype == WRITE_SUCCESS:
        msg = WriteSuccess(r.u64())
    elif mtype == DELETE_SUCCESS:
        msg = DeleteSuccess()
    elif mtype == LIST_SUCCESS:
        gen, truncated, n = r.unpack(_LIST_HEAD)
        if n * _LIST_ITEM.size > r.remaining():
            raise CodecError("item_count %d does not fit in the message" % n)
        items = []
        for _ in range(n):
            igen, is_dir, name_len = r.unpack(_LIST_ITEM)
            items.append(ListItem(igen, is_dir != 0, bytes(r.take(name_len))))
        msg = ListSuccess(gen, truncated != 0, items)
    elif mtype == READ_SUCCESS:
        gen, chunk_size, file_length, n = r.unpack(_READ_HEAD)
        if n * (HASH_LEN + 4) > r.remaining():
            raise CodecError("num_hashes %d does not fit in the message" % n)
        chunks = [ReadChunk(bytes(r.take(HASH_LEN)), r.addr_lists()) for _ in range(n)]
        msg = ReadSuccess(gen, chunk_size, file_length, chunks, r.addr_lists())
    elif mtype in (CREATE_CHUNK_SUCCESS, UPLOAD_CHUNK_SUCCESS):
        h = bytes(r.take(HASH_LEN))
        msg = CreateChunkSuccess(h) if mtype == CREATE_CHUNK_SUCCESS else UploadChunkSuccess(h)
    elif mtype == DOWNLOAD_CHUNK_SUCCESS:
        n = r.u32()
        msg = DownloadChunkSuccess(bytes(r.take(n)))
    else:
        raise CodecError("type %d is not a reply" % mtype)
    r.end()
    return msg


def check_header(version: int, mtype: int, length: int, allowed) -> None:
    """CONTRACT §5: version 1, 8 <= length <= 16 MiB, a type this side accepts; else CodecError."""
    if version != VERSION:
        raise CodecError("version %d is not 1" % version)
    if length < HEADER_LEN or length > MAX_MESSAGE:
        raise CodecError("length %d is outside 8..16 MiB" % length)
    if mtype not in allowed:
        raise CodecError("message type %d is not accepted here" % mtype)


class Layout(framing.Layout):
    """Toasty framing for ``protocols/framing.Framer``: the 8-byte header is checked (version,
    length, a type of ``allowed``) before the body is buffered; ``length`` is the whole message."""

    def __init__(self, allowed):
        super().__init__(HEADER, 4, 0, HEADER_LEN, MAX_MESSAGE, HEADER_LEN)
        self.allowed = allowed

    def frame_size(self, buf, pos, peek):
        version, mtype, length = HEADER.unpack_from(buf, pos)
        check_header(version, mtype, length, self.allowed)
        return length


def decode_message(data: bytes, allowed, reply: bool = False):
    """One whole message (header included) -> dataclass; for tests and simple callers."""
    if len(data) < HEADER_LEN:
        raise CodecError("shorter than a header")
    version, mtype, length = HEADER.unpack_from(data, 0)
    check_header(version, mtype, length, allowed)
    if length != len(data):
        raise CodecError("length field %d but %d bytes" % (length, len(data)))
    body = memoryview(data)[HEADER_LEN:]
    return decode_reply(mtype, body) if reply else decode_request(mtype, body)


def chunk_span(offset: int, length: int, chunk_size: int) -> Tuple[int, int]:
    """CONTRACT §5 (override): the chunk indexes [first, first+count) a byte range touches."""
    if length == 0:
        return offset // chunk_size, 0
    first = offset // chunk_size
    last = (offset + length - 1) // chunk_size
    return first, last - first + 1
