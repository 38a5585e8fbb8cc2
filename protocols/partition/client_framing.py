"""yesSQL's client framing (CONTRACT §4.1) as a translation to and from the §4 framing.

Pure functions over bytes; no I/O, no Twisted. yesSQL's own clients (``cli.py``, ``cli.go``, the
HTTP bridge behind ``js_api``) talk to its primary with ``u64 total_len | u64 num_elems | u16 cmd
| payload`` (18 bytes, no client_id); replies are ``u64 total_len | u64 num_elems | u16 cmd |
elements``. The ``--kv-client`` listener serves them with the §4 server itself: each request is
rewritten into a §4 message whose client_id is the request's command (the *tag*: it tells the
reply's translation what was asked), and each §4 reply is rewritten back:

- a scan request (cursor name [+ prefix], no NextKey) gets an empty NextKey, so it continues
  from the cursor; its reply loses the footer and the partition-jump bit;
- REMOVE of a missing key is OK (yesSQL writes a tombstone either way);
- ERR is 20 bytes (the 18-byte header with NumElems 0, then ``u16 error_code``); the server
  answers an unknown cursor with ERR 0 here (``E_UNKNOWN``), as yesSQL's primary does;
- a message under 18 bytes or whose scan fields run past total_len becomes a 16-byte §4 message
  (ERR 3, the connection kept); total_len < 8 and total_len over 32 MiB become the §4 refusals
  (ERR 3, then the close).
"""

import struct

from protocols import framing
from protocols.partition import codec
from protocols.partition.codec import DATA_NOT_FOUND, ERR, GET_KEYS_PREFIX, MAX_MESSAGE, OK, REMOVE, SCAN_COMMANDS

HEADER = struct.Struct(">QQH")
HEADER_LEN = HEADER.size  # 18
ERR_LEN = HEADER_LEN + 2  # 20
_PARTITION_HEADER = codec.HEADER  # >QQQH, 26 bytes
_U8 = struct.Struct(">B").unpack_from
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q")

# A §4 message of 16 bytes: the server answers ERR 3 (client_id 0) and stays in sync.
SHORT = _U64.pack(16) + _U64.pack(0)


class Layout(framing.Layout):
    """u64 total_len (the whole message) in [8, 32 MiB]; outside it ``framing.FrameRefused``."""

    def __init__(self, min_total=codec.MIN_TOTAL_LEN, max_total=MAX_MESSAGE):
        super().__init__(_U64, 0, 0, min_total, max_total)


def refused(length: int) -> bytes:
    """The §4 bytes that make the server refuse as §4.1 says for a client total_len of ``length``:
    under 8 -> ERR 3 then close; over 32 MiB -> ERR 3 then close without reading the body."""
    if length < codec.MIN_TOTAL_LEN:
        return _U64.pack(0)
    return _U64.pack(MAX_MESSAGE + 1) + _U64.pack(0)


def translate(frames, data) -> tuple:
    """Feed ``data`` to ``frames`` (a ``framing.Framer`` over ``Layout``) and return ``(bytes,
    refused)``: the §4 messages for every complete client message, and whether a total_len out of
    bounds ended the stream (its §4 refusal is then the last message: ERR 3 after the replies
    before it, then the close; the framer is cleared and takes nothing more)."""
    frames.feed(data)
    out = []
    refused_now = False
    while True:
        try:
            span = frames.next()
        except framing.FrameRefused as e:
            out.append(refused(e.length))
            refused_now = True
            frames.clear()
            break
        if span is None:
            break
        out.append(to_partition(*span))
    return (out[0] if len(out) == 1 else b"".join(out)), refused_now


def to_partition(buf, pos: int, end: int) -> bytes:
    """The §4 message for the complete client message at ``buf[pos:end]`` (client_id = its cmd)."""
    total = end - pos
    if total < HEADER_LEN:
        return SHORT
    _t, num_elems, cmd = HEADER.unpack_from(buf, pos)
    body = pos + HEADER_LEN
    if cmd not in SCAN_COMMANDS:
        # the same payload; NumElems passes through (ignored by the server but for scans)
        return _PARTITION_HEADER.pack(total + 8, cmd, num_elems, cmd) + buf[body:end]
    # scans: cursor name [+ prefix]; the NextKey §4 expects goes in empty; the rest is ignored
    if body + 1 > end:
        return SHORT
    name_end = body + 1 + _U8(buf, body)[0]
    if name_end > end:
        return SHORT
    payload = [buf[body:name_end], b"\x00\x00"]
    if cmd == GET_KEYS_PREFIX:
        if name_end + 2 > end:
            return SHORT
        prefix_end = name_end + 2 + _U16.unpack_from(buf, name_end)[0]
        if prefix_end > end:
            return SHORT
        payload.append(buf[name_end:prefix_end])
    payload = b"".join(payload)
    return _PARTITION_HEADER.pack(codec.HEADER_LEN + len(payload), cmd, num_elems, cmd) + payload


def from_partition(data) -> bytes:
    """The client replies for ``data``: whole §4 replies whose client_id is the request's cmd."""
    out = []
    append = out.append
    pos = 0
    n = len(data)
    unpack = _PARTITION_HEADER.unpack_from
    pack = HEADER.pack
    while pos < n:
        total, tag, num_elems, cmd = unpack(data, pos)
        end = pos + total
        if cmd == ERR:
            append(pack(ERR_LEN, 0, ERR) + data[pos + 26 : pos + 28])
        elif cmd == OK and tag in SCAN_COMMANDS:
            count = num_elems & 0xFFFFFFFF & ~codec.JUMP_FLAG
            p = elements = pos + 26
            with_values = tag in codec.VALUE_SCANS
            for _ in range(count):
                p += 2 + _U16.unpack_from(data, p)[0]
                if with_values:
                    p += 4 + _U32(data, p)[0]
            append(pack(HEADER_LEN + p - elements, count, OK))
            append(data[elements:p])
        elif cmd == DATA_NOT_FOUND and tag == REMOVE:
            append(pack(HEADER_LEN, 0, OK))  # CONTRACT §4.1: REMOVE of a missing key -> OK
        else:
            append(pack(total - 8, num_elems, cmd))
            if total > 26:
                append(data[pos + 26 : end])
        pos = end
    return b"".join(out)


# -- requests as yesSQL's clients write them (tests, benchmarks) ---------------------------------


def _frame(num_elems: int, cmd: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(HEADER_LEN + len(payload), num_elems, cmd) + payload


def encode_get(key: bytes) -> bytes:
    return _frame(1, codec.GET, _U16.pack(len(key)) + key)


def encode_set(key: bytes, value: bytes) -> bytes:
    return _frame(1, codec.SET, _U16.pack(len(key)) + key + struct.pack(">I", len(value)) + value)


def encode_remove(key: bytes) -> bytes:
    return _frame(1, REMOVE, _U16.pack(len(key)) + key)


def encode_create_cursor(name: bytes, start_key: bytes = b"") -> bytes:
    return _frame(1, codec.CREATE_CURSOR, bytes([len(name)]) + name + _U16.pack(len(start_key)) + start_key)


def encode_delete_cursor(name: bytes) -> bytes:
    return _frame(1, codec.DELETE_CURSOR, bytes([len(name)]) + name)


def encode_scan(cmd: int, count: int, name: bytes, prefix: bytes = b"") -> bytes:
    payload = bytes([len(name)]) + name
    if cmd == GET_KEYS_PREFIX:
        payload += _U16.pack(len(prefix)) + prefix
    return _frame(count & 0xFFFF, cmd, payload)


def decode_reply(buf, request_cmd: int, pos: int = 0):
    """``(cmd, error_code or None, items)`` of the complete client reply at ``buf[pos:]``; items
    are (key, value or None) pairs (GET and the scans)."""
    total, num_elems, cmd = HEADER.unpack_from(buf, pos)
    if cmd == ERR:
        return cmd, (_U16.unpack_from(buf, pos + HEADER_LEN)[0] if total >= ERR_LEN else None), []
    items = []
    if cmd == OK and num_elems and (request_cmd == codec.GET or request_cmd in SCAN_COMMANDS):
        p = pos + HEADER_LEN
        with_values = request_cmd == codec.GET or request_cmd in codec.VALUE_SCANS
        for _ in range(num_elems):
            kl = _U16.unpack_from(buf, p)[0]
            key = bytes(buf[p + 2 : p + 2 + kl])
            p += 2 + kl
            value = None
            if with_values:
                vl = _U32(buf, p)[0]
                value = bytes(buf[p + 4 : p + 4 + vl])
                p += 4 + vl
            items.append((key, value))
        if p > pos + total:
            raise ValueError("reply elements run past total_len")
    return cmd, None, items
