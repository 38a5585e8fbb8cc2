"""Primary_Partition key-value wire format (shared/specs/partition-kv.txt as settled by CONTRACT §4).

Pure functions: bytes in, dataclasses out, and back. No I/O, no Twisted.

Every message is ``u64 total_len (counts itself) | u64 client_id | u64 num_elems | u16 cmd |
payload``, big-endian. Strings: cursor name ``u8 len``, key ``u16 len``, value ``u32 len``.
"""

import struct
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from protocols import framing

# Command codes (spec §2).
OK = 0
ERR = 1
GET = 2
SET = 3
GET_KEYS = 4
GET_KEYS_PREFIX = 5
GET_FF = 6
GET_FB = 7
REMOVE = 8
CREATE_CURSOR = 9
DELETE_CURSOR = 10
DATA_NOT_FOUND = 11
INVALID_COMMAND = 12

COMMAND_NAMES = {
    OK: "OK",
    ERR: "ERR",
    GET: "GET",
    SET: "SET",
    GET_KEYS: "GET_KEYS",
    GET_KEYS_PREFIX: "GET_KEYS_PREFIX",
    GET_FF: "GET_FF",
    GET_FB: "GET_FB",
    REMOVE: "REMOVE",
    CREATE_CURSOR: "CREATE_CURSOR",
    DELETE_CURSOR: "DELETE_CURSOR",
    DATA_NOT_FOUND: "DATA_NOT_FOUND",
    INVALID_COMMAND: "INVALID_COMMAND",
}

SCAN_COMMANDS = frozenset((GET_KEYS, GET_KEYS_PREFIX, GET_FF, GET_FB))
# Scans whose elements carry values (the others are keys only).
VALUE_SCANS = frozenset((GET_FF, GET_FB))

# ERR codes (CONTRACT §4).
E_UNKNOWN = 0
E_PARTITION_DIED = 1
E_CURSOR_NOT_FOUND = 2
E_MSG_TOO_SHORT = 3
E_TOO_MANY_ELEMENTS = 4

ERROR_NAMES = {
    E_UNKNOWN: "UNKNOWN",
    E_PARTITION_DIED: "PARTITION_DIED",
    E_CURSOR_NOT_FOUND: "CURSOR_NOT_FOUND",
    E_MSG_TOO_SHORT: "MSG_TOO_SHORT",
    E_TOO_MANY_ELEMENTS: "TOO_MANY_ELEMENTS",
}

HEADER = struct.Struct(">QQQH")
HEADER_LEN = HEADER.size  # 26
ERR_LEN = HEADER_LEN + 2  # 28
MAX_MESSAGE = 32 * 1024 * 1024  # CONTRACT §4: total_len over this -> ERR 3 and close
MIN_TOTAL_LEN = 8  # below this the connection is closed
MAX_KEY = 0xFFFF  # CONTRACT §2: keys are 1..65535 bytes
_TOTAL = struct.Struct(">Q")


class TotalRefused(framing.FrameRefused):
    """A total_len outside the layout's limits; ``client_id`` is the message's (None if its
    bytes 8..15 never came: a total_len under 16)."""

    def __init__(self, message, length, client_id=None):
        super().__init__(message, length)
        self.client_id = client_id


class Layout(framing.Layout):
    """CONTRACT §4 framing for ``protocols/framing.Framer``: u64 total_len (the whole message) in
    ``[min_total, max_total]``. The server refuses a total_len over MAX_MESSAGE once the client_id
    after it is in (``echo_client_id``: it answers ERR 3 with it), one under MIN_TOTAL_LEN at once;
    a client refuses a bad reply at once."""

    def __init__(self, min_total=MIN_TOTAL_LEN, max_total=MAX_MESSAGE, echo_client_id=True):
        super().__init__(_TOTAL, 0, 0, min_total, max_total)
        self.echo_client_id = echo_client_id

    def refuse(self, peek, length):
        if length < self.min_length or not self.echo_client_id:
            raise TotalRefused("total_len %d outside %d..%d" % (length, self.min_length, self.max_length), length)
        head = peek(16)
        if len(head) < 16:
            return None  # the client_id is not in yet
        raise TotalRefused("total_len %d over %d" % (length, self.max_length), length, _TOTAL.unpack_from(head, 8)[0])

MAX_VALUE = 16 * 1024 * 1024  # CONTRACT §2: values 0..16 MiB
MAX_CURSOR_NAME = 0xFF
MAX_COUNT = 1024  # CONTRACT §4: scan count 1..1024
PARTITIONS = 8
# CONTRACT §4 (override): bit 0x01 of the 5th byte of NumElems (absolute offset 20) is set iff a
# scan reply's elements fall in two or more partitions. As a u64 that byte holds bits 24..31.
JUMP_FLAG = 0x01 << 24

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


def partition_of(key: bytes) -> int:
    """CONTRACT §2: partition = the first key byte >> 5, so partition order equals key order."""
    return key[0] >> 5


class DecodeError(Exception):
    """A request the server answers with ERR ``code`` (the connection stays in sync)."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code
        self.reason = reason


# -- requests ---------------------------------------------------------------------------------


@dataclass
class Get:
    client_id: int
    key: bytes
    cmd: int = GET


@dataclass
class Set:
    client_id: int
    key: bytes
    value: bytes
    cmd: int = SET


@dataclass
class Remove:
    client_id: int
    key: bytes
    cmd: int = REMOVE


@dataclass
class CreateCursor:
    client_id: int
    name: bytes
    start_key: bytes  # empty = BEGIN
    cmd: int = CREATE_CURSOR


@dataclass
class DeleteCursor:
    client_id: int
    name: bytes
    cmd: int = DELETE_CURSOR


@dataclass
class Scan:
    """GET_FF, GET_FB, GET_KEYS or GET_KEYS_PREFIX (``cmd`` says which)."""

    cmd: int
    client_id: int
    count: int
    name: bytes
    next_key: bytes = b""  # empty = continue from the cursor's position
    prefix: bytes = b""  # GET_KEYS_PREFIX only


@dataclass
class Invalid:
    """A well-framed request whose cmd is outside 2..10: answered with INVALID_COMMAND."""

    client_id: int
    cmd: int


class _Reader:
    """Reads length-prefixed fields from ``buf[pos:end]``; running past ``end`` is ERR 3."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf, pos, end):
        self.buf = buf
        self.pos = pos
        self.end = end

    def _take(self, n, what):
        pos = self.pos
        if pos + n > self.end:
            raise DecodeError(E_MSG_TOO_SHORT, "%s runs past total_len" % what)
        self.pos = pos + n
        return pos

    def u8_bytes(self, what):
        (n,) = _U8.unpack_from(self.buf, self._take(1, what + " length"))
        p = self._take(n, what)
        return bytes(self.buf[p : p + n])

    def u16_bytes(self, what):
        (n,) = _U16.unpack_from(self.buf, self._take(2, what + " length"))
        p = self._take(n, what)
        return bytes(self.buf[p : p + n])

    def u32_bytes(self, what):
        (n,) = _U32.unpack_from(self.buf, self._take(4, what + " length"))
        if n > MAX_VALUE:
            # CONTRACT §2: values are at most 16 MiB.
            raise DecodeError(E_UNKNOWN, "value of %d bytes is over 16 MiB" % n)
        p = self._take(n, what)
        return bytes(self.buf[p : p + n])


def decode_request(buf, pos: int = 0):
    """Decode the one complete message at ``buf[pos:]`` (``total_len`` bytes must be present).

    Returns a request dataclass (``Invalid`` for an unknown cmd). Raises ``DecodeError`` for a
    message to be answered with ERR; the caller still skips exactly ``total_len`` bytes, so the
    connection never desynchronises. Trailing bytes inside total_len are ignored (CONTRACT §4).
    """
    (total_len,) = _U64.unpack_from(buf, pos)
    if total_len < HEADER_LEN:
        raise DecodeError(E_MSG_TOO_SHORT, "total_len %d is shorter than the header" % total_len)
    _, client_id, num_elems, cmd = HEADER.unpack_from(buf, pos)
    end = pos + total_len
    r = _Reader(buf, pos + HEADER_LEN, end)
    if cmd == GET:
        return Get(client_id, r.u16_bytes("key"))
    if cmd == SET:
        key = r.u16_bytes("key")
        return Set(client_id, key, r.u32_bytes("value"))
    if cmd == REMOVE:
        return Remove(client_id, r.u16_bytes("key"))
    if cmd in SCAN_COMMANDS:
        # CONTRACT §4: NumElems = 6 reserved bytes (ignored) then u16 count.
        count = num_elems & 0xFFFF
        name = r.u8_bytes("cursor name")
        next_key = r.u16_bytes("next key")
        prefix = r.u16_bytes("prefix") if cmd == GET_KEYS_PREFIX else b""
        if not 1 <= count <= MAX_COUNT:
            raise DecodeError(E_TOO_MANY_ELEMENTS, "count %d is outside 1..1024" % count)
        return Scan(cmd, client_id, count, name, next_key, prefix)
    if cmd == CREATE_CURSOR:
        name = r.u8_bytes("cursor name")
        return CreateCursor(client_id, name, r.u16_bytes("start key"))
    if cmd == DELETE_CURSOR:
        return DeleteCursor(client_id, r.u8_bytes("cursor name"))
    return Invalid(client_id, cmd)


def _frame(client_id: int, num_elems: int, cmd: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(HEADER_LEN + len(payload), client_id, num_elems, cmd) + payload


def encode_get(client_id: int, key: bytes) -> bytes:
    return _frame(client_id, 1, GET, _U16.pack(len(key)) + key)


def encode_set(client_id: int, key: bytes, value: bytes) -> bytes:
    return _frame(client_id, 1, SET, _U16.pack(len(key)) + key + _U32.pack(len(value)) + value)


def encode_remove(client_id: int, key: bytes) -> bytes:
    return _frame(client_id, 1, REMOVE, _U16.pack(len(key)) + key)


def encode_create_cursor(client_id: int, name: bytes, start_key: bytes = b"") -> bytes:
    return _frame(client_id, 0, CREATE_CURSOR, _U8.pack(len(name)) + name + _U16.pack(len(start_key)) + start_key)


def encode_delete_cursor(client_id: int, name: bytes) -> bytes:
    return _frame(client_id, 0, DELETE_CURSOR, _U8.pack(len(name)) + name)


def encode_scan(cmd: int, client_id: int, count: int, name: bytes, next_key: bytes = b"", prefix: bytes = b"") -> bytes:
    payload = _U8.pack(len(name)) + name + _U16.pack(len(next_key)) + next_key
    if cmd == GET_KEYS_PREFIX:
        payload += _U16.pack(len(prefix)) + prefix
    return _frame(client_id, count & 0xFFFF, cmd, payload)


def encode_request(req) -> bytes:
    """Encode any request dataclass (the inverse of ``decode_request``)."""
    if isinstance(req, Get):
        return encode_get(req.client_id, req.key)
    if isinstance(req, Set):
        return encode_set(req.client_id, req.key, req.value)
    if isinstance(req, Remove):
        return encode_remove(req.client_id, req.key)
    if isinstance(req, CreateCursor):
        return encode_create_cursor(req.client_id, req.name, req.start_key)
    if isinstance(req, DeleteCursor):
        return encode_delete_cursor(req.client_id, req.name)
    if isinstance(req, Scan):
        return encode_scan(req.cmd, req.client_id, req.count, req.name, req.next_key, req.prefix)
    if isinstance(req, Invalid):
        return _frame(req.client_id, 0, req.cmd)
    raise TypeError("not a request: %r" % (req,))


# -- replies ----------------------------------------------------------------------------------


def encode_status(client_id: int, cmd: int) -> bytes:
    """OK without elements, DATA_NOT_FOUND or INVALID_COMMAND: the bare 26-byte header."""
    return HEADER.pack(HEADER_LEN, client_id, 0, cmd)


def encode_error(client_id: int, code: int) -> bytes:
    """CONTRACT §4: ERR is the header with NumElems 0 plus ``u16 error_code`` (total_len 28)."""
    return HEADER.pack(ERR_LEN, client_id, 0, ERR) + _U16.pack(code)


def encode_get_reply(client_id: int, key: bytes, value: bytes) -> bytes:
    return b"".join(
        (HEADER.pack(HEADER_LEN + 6 + len(key) + len(value), client_id, 1, OK), _U16.pack(len(key)), key, _U32.pack(len(value)), value)
    )


def encode_scan_reply(client_id: int, items, with_values: bool, next_key: bytes, name: bytes, jump: Optional[bool] = None) -> bytes:
    """A GET_X reply: OK, the elements, then the footer (NextKey, cursor name).

    ``items`` are (key, value) pairs (values ignored unless ``with_values``) in the order sent.
    ``jump`` defaults to CONTRACT §4's rule: set iff the elements span two or more partitions.
    """
    parts = [None]
    n = 0
    u16 = _U16.pack
    if with_values:
        u32 = _U32.pack
        for k, v in items:
            parts.append(u16(len(k)))
            parts.append(k)
            parts.append(u32(len(v)))
            parts.append(v)
            n += 1
    else:
        for k, _v in items:
            parts.append(u16(len(k)))
            parts.append(k)
            n += 1
    parts.append(u16(len(next_key)))
    parts.append(next_key)
    parts.append(_U8.pack(len(name)))
    parts.append(name)
    if jump is None:
        jump = n > 1 and (items[0][0][0] >> 5) != (items[-1][0][0] >> 5)
    parts[0] = b""
    body = b"".join(parts)
    return HEADER.pack(HEADER_LEN + len(body), client_id, n | (JUMP_FLAG if jump else 0), OK) + body


@dataclass
class Reply:
    client_id: int
    cmd: int
    num_elems: int = 0
    error_code: Optional[int] = None  # ERR only (None if the 2 bytes are missing)
    items: List[Tuple[bytes, Optional[bytes]]] = field(default_factory=list)
    next_key: Optional[bytes] = None  # scan replies only
    cursor: Optional[bytes] = None  # scan replies only

    @property
    def count(self) -> int:
        return self.num_elems & 0xFFFFFFFF & ~JUMP_FLAG

    @property
    def jumped(self) -> bool:
        return bool(self.num_elems & JUMP_FLAG)


class ReplyError(Exception):
    """A reply that does not parse: the client should drop the connection."""


def decode_reply(buf, request_cmd: int, pos: int = 0) -> Reply:
    """Decode the complete reply at ``buf[pos:]`` to a request with command ``request_cmd``.

    The reply's shape depends on what was asked: GET -> one key+value; scans -> elements (values
    for GET_FF/GET_FB) and a footer; everything else a status.
    """
    (total_len,) = _U64.unpack_from(buf, pos)
    if total_len < HEADER_LEN:
        raise ReplyError("reply total_len %d is shorter than the header" % total_len)
    _, client_id, num_elems, cmd = HEADER.unpack_from(buf, pos)
    end = pos + total_len
    r = _Reader(buf, pos + HEADER_LEN, end)
    reply = Reply(client_id, cmd, num_elems)
    try:
        if cmd == ERR:
            if total_len >= ERR_LEN:
                (reply.error_code,) = _U16.unpack_from(buf, pos + HEADER_LEN)
            return reply
        if cmd != OK:
            return reply
        if request_cmd == GET:
            if num_elems:
                key = r.u16_bytes("key")
                reply.items.append((key, _read_value(r)))
            return reply
        if request_cmd in SCAN_COMMANDS:
            n = num_elems & 0xFFFFFFFF & ~JUMP_FLAG
            p = pos + HEADER_LEN
            if n * 2 > end - p:
                raise ReplyError("%d elements cannot fit in total_len %d" % (n, total_len))
            reply.items, r.pos = _scan_elements(buf, p, end, n, request_cmd in VALUE_SCANS)
            reply.next_key = r.u16_bytes("next key")
            reply.cursor = r.u8_bytes("cursor name")
            return reply
        return reply
    except DecodeError as e:
        raise ReplyError(e.reason)


def _scan_elements(buf, p, end, n, with_values):
    """The ``n`` elements of a scan reply from ``buf[p:end]`` -> (items, position after them)."""
    items = []
    append = items.append
    u16 = _U16.unpack_from
    u32 = _U32.unpack_from
    with memoryview(buf) as mv:
        try:
            if with_values:
                for _ in range(n):
                    (kl,) = u16(mv, p)
                    p += 2
                    k = bytes(mv[p : p + kl])
                    p += kl
                    (vl,) = u32(mv, p)
                    p += 4
                    append((k, bytes(mv[p : p + vl])))
                    p += vl
                    if p > end:
                        break
            else:
                for _ in range(n):
                    (kl,) = u16(mv, p)
                    p += 2
                    append((bytes(mv[p : p + kl]), None))
                    p += kl
                    if p > end:
                        break
        except struct.error:
            p = end + 1
    if p > end:
        raise ReplyError("scan elements run past total_len")
    return items, p


def _read_value(r: _Reader) -> bytes:
    # Replies carry stored values (at most 16 MiB), but a client need not enforce that here.
    (n,) = _U32.unpack_from(r.buf, r._take(4, "value length"))
    p = r._take(n, "value")
    return bytes(r.buf[p : p + n])
