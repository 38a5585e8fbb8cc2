"""SBP codec (shared/specs/sbp.md, CONTRACT §3): frames, and the FlatBuffers extended headers.

Pure functions and plain classes: bytes in, objects out, and back. No I/O, no Twisted.

Frame, all big-endian::

    u32 frame_length | u8 magic=23 | u16 opcode | u8 flags | u32 stream_id
    | u8 header_format=1 | u24 header_length | header | payload | u32 crc

``frame_length`` counts every byte after itself (16 + header + payload); ``crc`` is zlib CRC-32 of
the payload, 0 when the payload is empty.

Extended headers are FlatBuffers root tables of ``sbp.fbs``. The flatc-generated package
``protocols.sbp.fb`` is committed (and checked by ``.ci/check-flatc``), but its per-field accessors
cost microseconds each, so the headers are read and written here by a schema-driven codec over
``struct`` (wire-identical; tests/test_sbp_codec.py checks it against the generated code). Each
table decodes to an instance of a generated dataclass named as in the schema (``codec.T.AppendInfo``).
"""

import dataclasses
import struct
from typing import List, Optional

import flatbuffers

from protocols import framing

# -- opcodes (CONTRACT §3: the spec's table, 0x2004 CREATE_RANGE, 0x2005 DESCRIBE_RANGES) --------
PING = 0x0001
GOAWAY = 0x0002
HEARTBEAT = 0x0003
ALLOCATE_ID = 0x0004
APPEND = 0x1001
FETCH = 0x1002
LIST_RANGES = 0x2001
SEAL_RANGES = 0x2002
SYNC_RANGES = 0x2003
CREATE_RANGE = 0x2004
DESCRIBE_RANGES = 0x2005
CREATE_STREAMS = 0x3001
DELETE_STREAMS = 0x3002
UPDATE_STREAMS = 0x3003
DESCRIBE_STREAMS = 0x3004
TRIM_STREAMS = 0x3005
REPORT_METRICS = 0x4001
DESCRIBE_PD_CLUSTER = 0x4002

# opcode -> (name, request table, response table); PING and GOAWAY carry no table of their own.
OPCODES = {
    PING: ("PING", None, None),
    GOAWAY: ("GOAWAY", None, None),
    HEARTBEAT: ("HEARTBEAT", "HeartbeatRequest", "HeartbeatResponse"),
    ALLOCATE_ID: ("ALLOCATE_ID", "IdAllocationRequest", "IdAllocationResponse"),
    APPEND: ("APPEND", "AppendRequest", "AppendResponse"),
    FETCH: ("FETCH", "FetchRequest", "FetchResponse"),
    LIST_RANGES: ("LIST_RANGES", "ListRangesRequest", "ListRangesResponse"),
    SEAL_RANGES: ("SEAL_RANGES", "SealRangesRequest", "SealRangesResponse"),
    SYNC_RANGES: ("SYNC_RANGES", "SyncRangesRequest", "SyncRangesResponse"),
    CREATE_RANGE: ("CREATE_RANGE", "CreateRangeRequest", "CreateRangeResponse"),
    DESCRIBE_RANGES: ("DESCRIBE_RANGES", "DescribeRangesRequest", "DescribeRangesResponse"),
    CREATE_STREAMS: ("CREATE_STREAMS", "CreateStreamsRequest", "CreateStreamsResponse"),
    DELETE_STREAMS: ("DELETE_STREAMS", "DeleteStreamsRequest", "DeleteStreamsResponse"),
    UPDATE_STREAMS: ("UPDATE_STREAMS", "UpdateStreamsRequest", "UpdateStreamsResponse"),
    DESCRIBE_STREAMS: ("DESCRIBE_STREAMS", "DescribeStreamsRequest", "DescribeStreamsResponse"),
    TRIM_STREAMS: ("TRIM_STREAMS", "TrimStreamsRequest", "TrimStreamsResponse"),
    REPORT_METRICS: ("REPORT_METRICS", "ReportMetricsRequest", "ReportMetricsResponse"),
    DESCRIBE_PD_CLUSTER: ("DESCRIBE_PD_CLUSTER", "DescribePdClusterRequest", "DescribePdClusterResponse"),
}

# -- flags ----------------------------------------------------------------------------------------
FLAG_RESPONSE = 0x01
FLAG_END = 0x02
FLAG_SYSTEM_ERROR = 0x04
RESPONSE_LAST = FLAG_RESPONSE | FLAG_END  # 0x03
SYSTEM_ERROR = FLAG_RESPONSE | FLAG_END | FLAG_SYSTEM_ERROR  # 0x07

# -- status codes (CONTRACT §3) --------------------------------------------------------------------
OK = 0
UNKNOWN = 1
INVALID_REQUEST = 2
UNSUPPORTED_VERSION = 3
PD_NOT_LEADER = 5
NO_NEW_RECORD = 1204
STREAM_NOT_FOUND = 1404
PAYLOAD_TOO_LARGE = 1413
TOO_MANY_REQUESTS = 1429
RANGE_ALREADY_SEALED = 1460
RANGE_NOT_FOUND = 1462
OFFSET_OUT_OF_RANGE = 1463
CORRUPT_BATCH = 1480
NO_AVAILABLE_RS = 1502  # CONTRACT §9: fewer live nodes than the stream's replica_nums
DATA_CORRUPTED = 2502

STATUS_NAMES = {
    OK: "NONE",
    UNKNOWN: "UNKNOWN",
    INVALID_REQUEST: "INVALID_REQUEST",
    UNSUPPORTED_VERSION: "UNSUPPORTED_VERSION",
    PD_NOT_LEADER: "PD_NOT_LEADER",
    NO_NEW_RECORD: "NO_NEW_RECORD",
    STREAM_NOT_FOUND: "STREAM_NOT_FOUND",
    PAYLOAD_TOO_LARGE: "PAYLOAD_TOO_LARGE",
    NO_AVAILABLE_RS: "NO_AVAILABLE_RS",
    TOO_MANY_REQUESTS: "TOO_MANY_REQUESTS",
    RANGE_ALREADY_SEALED: "RANGE_ALREADY_SEALED",
    RANGE_NOT_FOUND: "RANGE_NOT_FOUND",
    OFFSET_OUT_OF_RANGE: "OFFSET_OUT_OF_RANGE",
    CORRUPT_BATCH: "CORRUPT_BATCH",
    DATA_CORRUPTED: "DATA_CORRUPTED",
}

MAGIC = 23
HEADER_FORMAT_FLATBUFFERS = 1
MIN_FRAME_LENGTH = 16
MAX_FRAME_LENGTH = 16 * 1024 * 1024
# Bytes asked of the socket per read by the server and the clients. An APPEND of 64 x 1 KiB is
# ~66 KB: with Twisted's default of 64 KiB every such frame took two reads and two passes through
# the framer; 1 MiB takes a window of them at once (interval appends: -25% node CPU per record).
READ_SIZE = 1 << 20
MAX_HEADER_LENGTH = (1 << 24) - 1
# The fixed part of a frame: u32 frame_length, u8 magic, u16 opcode, u8 flags, u32 stream_id and
# the u32 holding header_format (top byte) and header_length (low 24 bits).
PREFIX = struct.Struct(">IBHBII")
PREFIX_SIZE = PREFIX.size  # 16
_CRC = struct.Struct(">I")
_I32BE = struct.Struct(">i")
_LENGTH = struct.Struct(">I")  # a frame's u32 frame_length
# Bytes a frame costs beyond header + payload: prefix + crc.
FRAME_OVERHEAD = PREFIX_SIZE + 4


# CRC-32 (zlib's polynomial and values, computed by zlib-ng) and zlib's crc32_combine (ctypes,
# ~0.7 us): storage/crc.py
from storage.crc import crc32, crc32_combine  # noqa: E402


_BATCH_CRC_AT = 21  # record batch: u8 magic, i64 base_offset, i32 count, i64 base_ts, then u32 crc
_BATCH_HEADER_SIZE = 29


def batch_crc_from_header(header, batch_length, crc=0):
    """``crc`` extended over one record batch of ``batch_length`` bytes known only by its 29-byte
    ``header`` (whose stored records-block CRC stands in for the block). ValueError if the
    header's records_len does not match ``batch_length``."""
    (stored,) = _CRC.unpack_from(header, _BATCH_CRC_AT)
    (records_len,) = _I32BE.unpack_from(header, 25)
    if records_len != batch_length - _BATCH_HEADER_SIZE:
        raise ValueError("batch header does not match its length")
    return crc32_combine(crc32(memoryview(header)[:_BATCH_HEADER_SIZE], crc), stored, records_len)


def batches_crc(buf, start, end, crc=0, verify=False):
    """CRC-32 of ``buf[start:end]`` when it holds whole record batches, from each batch's 29-byte
    header and its stored records-block CRC (combined, no pass over the blocks). With ``verify``,
    each block's CRC is computed and checked instead (one pass; ValueError on a mismatch).
    Raises ValueError if the bytes are not whole batches."""
    view = memoryview(buf)
    pos = start
    while pos < end:
        if end - pos < _BATCH_HEADER_SIZE:
            raise ValueError("truncated batch header")
        (stored,) = _CRC.unpack_from(buf, pos + _BATCH_CRC_AT)
        (records_len,) = _I32BE.unpack_from(buf, pos + 25)
        bend = pos + _BATCH_HEADER_SIZE + records_len
        if records_len < 0 or bend > end:
            raise ValueError("truncated batch")
        crc = crc32(view[pos:pos + _BATCH_HEADER_SIZE], crc)
        if verify:
            actual = crc32(view[pos + _BATCH_HEADER_SIZE:bend])
            if actual != stored:
                raise ValueError("batch at %d fails its CRC" % pos)
        crc = crc32_combine(crc, stored, records_len)
        pos = bend
    return crc

# -- frame ----------------------------------------------------------------------------------------


class Frame:
    __slots__ = ("opcode", "flags", "stream_id", "header", "payload", "header_format", "crc", "request")

    def __init__(self, opcode, flags=0, stream_id=0, header=b"", payload=b"", header_format=HEADER_FORMAT_FLATBUFFERS, crc=None):
        # crc: set only when the frame's payload CRC was NOT checked by the decoder (the receiver
        # promised to check it: FrameBuffer(defer_crc=...)); None once checked.
        self.crc = crc
        self.request = None  # the decoded header, once ``request_of`` decoded it (not compared)
        self.opcode = opcode
        self.flags = flags
        self.stream_id = stream_id
        self.header = header
        self.payload = payload
        self.header_format = header_format

    def __eq__(self, other):
        return isinstance(other, Frame) and all(getattr(self, k) == getattr(other, k) for k in self.__slots__
                                                if k != "crc" and k != "request")

    def __repr__(self):
        return "Frame(opcode=0x%04x, flags=0x%02x, stream_id=%d, header=%d B, payload=%d B)" % (
            self.opcode, self.flags, self.stream_id, len(self.header), len(self.payload))

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)

    @property
    def is_end(self) -> bool:
        return bool(self.flags & FLAG_END)

    @property
    def is_system_error(self) -> bool:
        return bool(self.flags & FLAG_SYSTEM_ERROR)


class FrameError(ValueError):
    """A frame the contract refuses. ``action`` says what the receiver does (CONTRACT §3)."""

    action = "system_error"
    status = INVALID_REQUEST

    def __init__(self, message, opcode=0, stream_id=0):
        super().__init__(message)
        self.opcode = opcode
        self.stream_id = stream_id


class FrameLengthError(FrameError):
    """frame_length out of [16, 16 MiB]: GOAWAY, then close."""

    action = "goaway"


class BadMagic(FrameError):
    """Not an SBP frame: discard it."""

    action = "discard"


class UnknownOpcode(FrameError):
    """The spec's MUST: ignore and discard; keep the connection."""

    action = "discard"


class BadFrame(FrameError):
    """Bad CRC or header_length beyond the frame: system error with status 2."""


class BadCrc(BadFrame):
    """A whole frame whose payload fails its CRC. The frame was consumed, so the connection stays
    usable. In a FETCH reply it means the stored batches changed since they were written: the
    server sends big batches straight from its files with a frame CRC derived from the CRCs they
    were stored with, so the reader's check is what catches a records block corrupted on disk."""


class UnsupportedHeaderFormat(FrameError):
    """header_format other than 1: system error with status 3."""

    status = UNSUPPORTED_VERSION


def encode_frame_parts(opcode, flags, stream_id, header=b"", payload_parts=(), header_format=HEADER_FORMAT_FLATBUFFERS,
                       payload_crc=None, payload_len=None) -> list:
    """The frame as a list of ``bytes`` for ``transport.writeSequence`` (payload not copied).
    ``payload_crc``: the payload's CRC when already known (e.g. from ``batches_crc``), and with
    it ``payload_len``, the parts' total length, when known."""
    plen = 0
    crc = 0
    if payload_crc is None:
        for p in payload_parts:
            plen += len(p)
            crc = crc32(p, crc)
    else:
        if payload_len is not None:
            plen = payload_len
        else:
            for p in payload_parts:
                plen += len(p)
        crc = payload_crc if plen else 0
    hlen = len(header)
    length = 16 + hlen + plen
    if length > MAX_FRAME_LENGTH:
        raise FrameLengthError("frame of %d bytes is over 16 MiB" % length, opcode, stream_id)
    if hlen > MAX_HEADER_LENGTH:
        raise FrameLengthError("header of %d bytes does not fit 24 bits" % hlen, opcode, stream_id)
    out = [PREFIX.pack(length, MAGIC, opcode, flags, stream_id, (header_format << 24) | hlen)]
    if hlen:
        out.append(bytes(header))
    out.extend(payload_parts)
    out.append(_CRC.pack(crc))
    return out


def encode_frame(opcode, flags=0, stream_id=0, header=b"", payload=b"", header_format=HEADER_FORMAT_FLATBUFFERS) -> bytes:
    return b"".join(encode_frame_parts(opcode, flags, stream_id, header, (payload,) if payload else (), header_format))


def encode(frame: Frame) -> bytes:
    return encode_frame(frame.opcode, frame.flags, frame.stream_id, frame.header, frame.payload, frame.header_format)


def check_length(frame_length, opcode=0, stream_id=0):
    if frame_length < MIN_FRAME_LENGTH or frame_length > MAX_FRAME_LENGTH:
        raise FrameLengthError("frame_length %d out of [16, 16 MiB]" % frame_length, opcode, stream_id)


def parse_frame(buf, pos=0, end=None, known_opcodes=OPCODES, defer_crc=(), view_payload=()) -> Frame:
    """Decode the one complete frame at ``buf[pos:end]`` (``end`` = pos + 4 + frame_length).

    Raises FrameError subclasses in the contract's check order. For opcodes in ``defer_crc`` the
    payload CRC is not checked here: the frame carries it in ``frame.crc`` and the caller must
    check it (before acting on the frame) and answer a mismatch as BadFrame. For opcodes in
    ``view_payload``, when ``buf`` is bytes (immutable), the payload is a view of it, not a copy
    (an APPEND's batches go to the store, and to the replicas, as they were received).
    """
    length, magic, opcode, flags, stream_id, fmt_hlen = PREFIX.unpack_from(buf, pos)
    check_length(length)
    if end is None:
        end = pos + 4 + length
    if end - pos != 4 + length:
        raise BadFrame("frame_length %d does not match the %d bytes given" % (length, end - pos - 4), opcode, stream_id)
    if magic != MAGIC:
        raise BadMagic("bad magic %d" % magic, opcode, stream_id)
    if opcode not in known_opcodes:
        raise UnknownOpcode("unknown opcode 0x%04x" % opcode, opcode, stream_id)
    hlen = fmt_hlen & 0xFFFFFF
    if hlen > length - 16:
        raise BadFrame("header_length %d > frame_length - 16" % hlen, opcode, stream_id)
    hstart = pos + PREFIX_SIZE
    pstart = hstart + hlen
    pend = end - 4
    (crc,) = _CRC.unpack_from(buf, pend)
    view = memoryview(buf)
    if pend <= pstart:
        payload = b""
    elif opcode in view_payload and type(buf) is bytes:
        payload = memoryview(buf)[pstart:pend]
    else:
        payload = bytes(view[pstart:pend])  # one copy (a bytearray slice would copy twice)
    deferred = opcode in defer_crc and payload
    if not deferred:
        expect = crc32(payload) if payload else 0
        if crc != expect:
            raise BadCrc("payload crc 0x%08x != 0x%08x" % (crc, expect), opcode, stream_id)
    fmt = fmt_hlen >> 24
    if fmt != HEADER_FORMAT_FLATBUFFERS:
        raise UnsupportedHeaderFormat("header format %d is not FlatBuffers (1)" % fmt, opcode, stream_id)
    header = bytes(view[hstart:pstart]) if hlen else b""
    view.release()
    return Frame(opcode, flags, stream_id, header, payload, fmt, crc if deferred else None)


def decode(data: bytes) -> Frame:
    """Decode exactly one whole frame."""
    if len(data) < 4:
        raise BadFrame("shorter than 4 bytes")
    (length,) = struct.unpack_from(">I", data)
    check_length(length)
    if len(data) != 4 + length:
        raise BadFrame("frame_length %d but %d bytes follow" % (length, len(data) - 4))
    return parse_frame(data, 0, len(data))


class _SbpLayout(framing.Layout):
    """CONTRACT §3: u32 frame_length (the bytes after it), 16..16 MiB, checked once its 4 bytes are
    in; a refusal names the frame's opcode if its bytes 5..6 are in too."""

    def __init__(self):
        super().__init__(_LENGTH, 0, 4, MIN_FRAME_LENGTH, MAX_FRAME_LENGTH)

    def refuse(self, peek, length):
        head = peek(7)
        check_length(length, struct.unpack_from(">H", head, 5)[0] if len(head) >= 7 else 0)


LAYOUT = _SbpLayout()
_framer_next = framing.Framer.next


class FrameBuffer(framing.Framer):
    """SBP frames over the received reads (``protocols/framing.Framer``): a frame wholly inside one
    read is decoded where it lies (its payload is the one copy made); a frame cut by the end of a
    read is joined once, when all of it is in. A declared length is checked as soon as its 4 bytes
    are in, before its body is buffered."""

    __slots__ = ("known_opcodes", "defer_crc", "view_payload")

    def __init__(self, known_opcodes=OPCODES, defer_crc=(), view_payload=()):
        super().__init__(LAYOUT)
        self.known_opcodes = known_opcodes
        self.defer_crc = defer_crc
        self.view_payload = view_payload  # opcodes whose payload is a view of the read (parse_frame)

    def next(self) -> Optional[Frame]:
        """The next whole frame, None if incomplete. A FrameError means the frame was consumed
        (except FrameLengthError, after which the stream cannot be resynchronised)."""
        span = _framer_next(self)
        if span is None:
            return None
        return parse_frame(span[0], span[1], span[2], self.known_opcodes, self.defer_crc, self.view_payload)

    def next_span(self):
        """``next`` in two steps: the next whole frame's span ``(buf, start, end)`` (None if
        incomplete; FrameLengthError as ``next``), which a reader may take in place..."""
        return _framer_next(self)

    def parse(self, span) -> Frame:
        """...or decode as ``next`` would have (the same FrameErrors)."""
        return parse_frame(span[0], span[1], span[2], self.known_opcodes, self.defer_crc, self.view_payload)


# -- FlatBuffers headers ---------------------------------------------------------------------------

# The schema of sbp.fbs as data: table -> [(field, type, default)]. Types: "byte" "ubyte" "bool"
# "short" "int" "long" "string" "[ubyte]" "[long]" "ClientRole" (a byte enum), a table name, or
# "[Table]". tests/test_sbp_codec.py checks this against sbp.fbs.
SCHEMA = {
    "Status": [("code", "short", 0), ("message", "string", None), ("detail", "[ubyte]", b"")],
    "RangeServer": [("server_id", "int", 0), ("advertise_addr", "string", None)],
    "Stream": [("stream_id", "long", 0), ("replica_nums", "byte", 0), ("retention_period_ms", "long", 0)],
    "RangeReplica": [("server", "RangeServer", None), ("is_primary", "bool", False)],
    "Range": [
        ("stream_id", "long", 0), ("range_index", "int", 0), ("start_offset", "long", 0),
        ("next_offset", "long", 0), ("end_offset", "long", -1), ("servers", "[RangeReplica]", None),
    ],
    "RangeId": [("stream_id", "long", 0), ("range_index", "int", 0)],
    "SystemErrorResponse": [("status", "Status", None)],
    "HeartbeatRequest": [("client_id", "string", None), ("client_role", "ClientRole", 0), ("range_server", "RangeServer", None)],
    "HeartbeatResponse": [
        ("client_id", "string", None), ("client_role", "ClientRole", 0), ("range_server", "RangeServer", None),
        ("status", "Status", None),
    ],
    "IdAllocationRequest": [("timeout_ms", "int", 0), ("host", "string", None)],
    "IdAllocationResponse": [("id", "int", 0), ("status", "Status", None)],
    "AppendInfo": [("stream_id", "long", 0), ("request_index", "int", 0), ("batch_length", "int", 0)],
    "AppendRequest": [("timeout_ms", "int", 0), ("append_requests", "[AppendInfo]", None)],
    "AppendResult": [
        ("stream_id", "long", 0), ("request_index", "int", 0), ("base_offset", "long", 0),
        ("stream_append_time_ms", "long", 0), ("status", "Status", None),
    ],
    "AppendResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("append_responses", "[AppendResult]", None)],
    "FetchInfo": [("stream_id", "long", 0), ("request_index", "int", 0), ("fetch_offset", "long", 0), ("batch_max_bytes", "int", 0)],
    "FetchRequest": [("max_wait_ms", "int", 0), ("min_bytes", "int", 0), ("fetch_requests", "[FetchInfo]", None)],
    "FetchResult": [("stream_id", "long", 0), ("request_index", "int", 0), ("batch_length", "int", 0), ("status", "Status", None)],
    "FetchResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("fetch_responses", "[FetchResult]", None)],
    "RangeOwner": [("stream_id", "long", -1), ("range_server", "RangeServer", None)],
    "ListRangesRequest": [("timeout_ms", "int", 0), ("range_owners", "[RangeOwner]", None)],
    "ListRangesResult": [("stream_id", "long", 0), ("status", "Status", None), ("ranges", "[Range]", None)],
    "ListRangesResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("list_responses", "[ListRangesResult]", None)],
    "SealRangesRequest": [("timeout_ms", "int", 0), ("ranges", "[RangeId]", None)],
    "SealRangesResult": [("stream_id", "long", 0), ("status", "Status", None), ("range", "Range", None)],
    "SealRangesResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("seal_responses", "[SealRangesResult]", None)],
    "StreamRanges": [("stream_id", "long", 0), ("ranges", "[Range]", None)],
    "SyncRangesRequest": [("timeout_ms", "int", 0), ("stream_ranges", "[StreamRanges]", None)],
    "SyncRangesResult": [("stream_id", "long", 0), ("status", "Status", None), ("ranges", "[Range]", None)],
    "SyncRangesResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("sync_responses", "[SyncRangesResult]", None)],
    "CreateRangeRequest": [("timeout_ms", "int", 0), ("range", "Range", None)],
    "CreateRangeResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("range", "Range", None)],
    "DescribeRangesRequest": [("timeout_ms", "int", 0), ("ranges", "[RangeId]", None)],
    "DescribeRangesResult": [("stream_id", "long", 0), ("status", "Status", None), ("range", "Range", None)],
    "DescribeRangesResponse": [
        ("throttle_time_ms", "int", 0), ("status", "Status", None), ("describe_responses", "[DescribeRangesResult]", None),
    ],
    "CreateStreamsRequest": [("timeout_ms", "int", 0), ("streams", "[Stream]", None)],
    "CreateStreamResult": [("stream", "Stream", None), ("status", "Status", None)],
    "CreateStreamsResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("create_responses", "[CreateStreamResult]", None)],
    "DeleteStreamsRequest": [("timeout_ms", "int", 0), ("streams", "[Stream]", None)],
    "DeleteStreamResult": [("deleted_stream", "Stream", None), ("status", "Status", None)],
    "DeleteStreamsResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("responses", "[DeleteStreamResult]", None)],
    "UpdateStreamsRequest": [("timeout_ms", "int", 0), ("streams", "[Stream]", None)],
    "UpdateStreamResult": [("updated_stream", "Stream", None), ("status", "Status", None)],
    "UpdateStreamsResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("update_responses", "[UpdateStreamResult]", None)],
    "DescribeStreamsRequest": [("timeout_ms", "int", 0), ("stream_ids", "[long]", None)],
    "DescribeStreamResult": [("stream", "Stream", None), ("status", "Status", None)],
    "DescribeStreamsResponse": [
        ("throttle_time_ms", "int", 0), ("status", "Status", None), ("describe_responses", "[DescribeStreamResult]", None),
    ],
    "TrimmedStream": [("stream_id", "long", 0), ("trim_offset", "long", 0)],
    "TrimStreamsRequest": [("timeout_ms", "int", 0), ("trimmed_streams", "[TrimmedStream]", None)],
    "TrimStreamResult": [("trimmed_stream", "Stream", None), ("status", "Status", None), ("range", "Range", None)],
    "TrimStreamsResponse": [("throttle_time_ms", "int", 0), ("status", "Status", None), ("streams", "[TrimStreamResult]", None)],
    "ReportMetricsRequest": [
        ("range_server", "RangeServer", None),
        ("disk_in_rate", "long", 0), ("disk_out_rate", "long", 0), ("disk_free_space", "long", 0),
        ("disk_unindexed_data_size", "long", 0), ("memory_used", "long", 0),
        ("uring_task_rate", "short", 0), ("uring_inflight_task_cnt", "short", 0), ("uring_pending_task_cnt", "int", 0),
        ("uring_task_avg_latency", "short", 0), ("network_append_rate", "short", 0), ("network_fetch_rate", "short", 0),
        ("network_failed_append_rate", "short", 0), ("network_failed_fetch_rate", "short", 0),
        ("network_append_avg_latency", "short", 0), ("network_fetch_avg_latency", "short", 0),
        ("range_missing_replica_cnt", "short", 0), ("range_active_cnt", "short", 0),
    ],
    "ReportMetricsResponse": [("range_server", "RangeServer", None), ("status", "Status", None)],
    "PlacementDriverNode": [("name", "string", None), ("advertise_addr", "string", None), ("is_leader", "bool", False)],
    "PlacementDriverCluster": [("nodes", "[PlacementDriverNode]", None)],
    "DescribePdClusterRequest": [("range_server", "RangeServer", None), ("timeout_ms", "int", 0)],
    "DescribePdClusterResponse": [("status", "Status", None), ("cluster", "PlacementDriverCluster", None)],
}

ENUMS = {"ClientRole": {"UNSPECIFIED": 0, "RANGE_SERVER": 1, "CLIENT": 2}}
CLIENT_ROLE_UNSPECIFIED, CLIENT_ROLE_RANGE_SERVER, CLIENT_ROLE_CLIENT = 0, 1, 2

# scalar type -> (struct format, size, Builder.Prepend<X>Slot name)
_SCALARS = {
    "bool": ("<?", 1, "PrependBoolSlot"),
    "byte": ("<b", 1, "PrependInt8Slot"),
    "ubyte": ("<B", 1, "PrependUint8Slot"),
    "ClientRole": ("<b", 1, "PrependInt8Slot"),
    "short": ("<h", 2, "PrependInt16Slot"),
    "int": ("<i", 4, "PrependInt32Slot"),
    "long": ("<q", 8, "PrependInt64Slot"),
}
_STRUCTS = {name: struct.Struct(fmt) for name, (fmt, _, _) in _SCALARS.items()}
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U16 = struct.Struct("<H")


class HeaderDecodeError(ValueError):
    """The extended header is not a valid table of the expected type (system error, status 2)."""


def _make_class(name, fields):
    specs = []
    for fname, ftype, default in fields:
        if ftype.startswith("[") and ftype != "[ubyte]":
            specs.append((fname, list, dataclasses.field(default_factory=list)))
        else:
            specs.append((fname, object, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(name, specs, slots=True)


class _Types:
    pass


T = _Types()
for _name, _fields in SCHEMA.items():
    setattr(T, _name, _make_class(_name, _fields))
del _name, _fields

# Compiled per-table decode plans: (attribute name, kind, arg, default)
_KIND_SCALAR, _KIND_STRING, _KIND_BYTES, _KIND_TABLE, _KIND_TABLES, _KIND_LONGS = range(6)


def _plan(name):
    plan = []
    for fname, ftype, default in SCHEMA[name]:
        if ftype in _SCALARS:
            plan.append((fname, _KIND_SCALAR, _STRUCTS[ftype], default))
        elif ftype == "string":
            plan.append((fname, _KIND_STRING, None, None))
        elif ftype == "[ubyte]":
            plan.append((fname, _KIND_BYTES, None, b""))
        elif ftype == "[long]":
            plan.append((fname, _KIND_LONGS, None, None))
        elif ftype.startswith("["):
            plan.append((fname, _KIND_TABLES, ftype[1:-1], None))
        else:
            plan.append((fname, _KIND_TABLE, ftype, None))
    return plan


# per table: (plan, the vtable's full length, a Struct of its field offsets, the class)
_PLANS = {name: (tuple(_plan(name)), 4 + 2 * len(SCHEMA[name]), struct.Struct("<%dH" % len(SCHEMA[name])), getattr(T, name))
          for name in SCHEMA}
_HH = struct.Struct("<HH")


class _Budget:
    """Guards against headers whose offsets share one sub-table or string many times over: a table
    written by a plain builder decodes to at most as many elements and bytes as it has bytes."""

    __slots__ = ("items", "nbytes")

    def __init__(self, size):
        self.items = size // 4 + 64
        self.nbytes = size

    def take(self, items, nbytes=0):
        self.items -= items
        self.nbytes -= nbytes
        if self.items < 0 or self.nbytes < 0:
            raise HeaderDecodeError("header decodes to more than it holds (shared offsets)")


def _uoffset_target(buf, at, size):
    if at < 0 or at + 4 > size:
        raise HeaderDecodeError("offset out of bounds")
    target = at + _U32.unpack_from(buf, at)[0]
    if target >= size:
        raise HeaderDecodeError("offset target out of bounds")
    return target


def _vector(buf, pos, size, elem_size):
    start = _uoffset_target(buf, pos, size)
    if start + 4 > size:
        raise HeaderDecodeError("vector length out of bounds")
    n = _U32.unpack_from(buf, start)[0]
    start += 4
    if start + n * elem_size > size:
        raise HeaderDecodeError("vector runs past the header")
    return start, n




def _read_table(buf, pos, size, name, budget):
    # The hot path of every request: one unpack for the whole vtable (its field offsets padded
    # with 0 when a builder wrote a shorter one), scalars unpacked inline.
    if pos < 0 or pos + 4 > size:
        raise HeaderDecodeError("table out of bounds")
    vt = pos - _I32.unpack_from(buf, pos)[0]
    if vt < 0 or vt + 4 > size:
        raise HeaderDecodeError("vtable out of bounds")
    vt_len, obj_len = _HH.unpack_from(buf, vt)
    if vt_len < 4 or vt_len & 1 or vt + vt_len > size or pos + obj_len > size:
        raise HeaderDecodeError("bad vtable")
    budget.take(1)
    plan, full, vt_struct, cls = _PLANS[name]
    if vt_len >= full:
        offsets = vt_struct.unpack_from(buf, vt + 4)
    else:
        n = (vt_len - 4) >> 1
        offsets = struct.unpack_from("<%dH" % n, buf, vt + 4) + (0,) * (len(plan) - n)
    values = []
    for o, (fname, kind, arg, default) in zip(offsets, plan):
        if o == 0:
            values.append([] if kind == _KIND_TABLES or kind == _KIND_LONGS else default)
            continue
        if o >= obj_len:
            raise HeaderDecodeError("field %s.%s outside its table" % (name, fname))
        p = pos + o
        if kind == _KIND_SCALAR:
            if p + arg.size > size:
                raise HeaderDecodeError("scalar out of bounds")
            values.append(arg.unpack_from(buf, p)[0])
        elif kind == _KIND_TABLES:
            start, n = _vector(buf, p, size, 4)
            budget.take(n)
            values.append([_read_table(buf, _uoffset_target(buf, start + 4 * j, size), size, arg, budget) for j in range(n)])
        elif kind == _KIND_STRING or kind == _KIND_BYTES:
            start, n = _vector(buf, p, size, 1)
            budget.take(1, n)
            raw = bytes(buf[start:start + n])
            if kind == _KIND_STRING:
                try:
                    raw = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise HeaderDecodeError("%s.%s is not UTF-8" % (name, fname)) from None
            values.append(raw)
        elif kind == _KIND_LONGS:
            start, n = _vector(buf, p, size, 8)
            budget.take(n)
            values.append(list(struct.unpack_from("<%dq" % n, buf, start)))
        else:  # one table
            values.append(_read_table(buf, _uoffset_target(buf, p, size), size, arg, budget))
    return cls(*values)


_Q64 = struct.Struct("<q")


def _vtable_offsets(buf, pos, size, fields):
    """(the table's field offsets, padded with 0 as the generic decoder pads them, its object
    length) for a table at ``pos`` whose vtable holds at most ``fields`` offsets; None if
    anything is out of bounds or unusual."""
    if pos + 4 > size:
        return None
    vt = pos - _I32.unpack_from(buf, pos)[0]
    if vt < 0 or vt + 4 > size:
        return None
    vt_len, obj_len = _HH.unpack_from(buf, vt)
    k = (vt_len - 4) >> 1
    if vt_len < 4 or vt_len & 1 or k > fields or vt + vt_len > size or pos + obj_len > size:
        return None
    return struct.unpack_from(_OFFSETS[k], buf, vt + 4) + (0,) * (fields - k), obj_len


_OFFSETS = ["<%dH" % k for k in range(4)]


def _append_request_plain(buf, size):
    """``decode_table("AppendRequest", buf)`` for the header every APPEND carries (at most 16
    entries, every field inside its table), several times faster: no plan walked, no budget (16
    entries cannot exhaust it). None for any other form: the generic decoder then decides, so
    this never accepts what it would refuse, and gives the same values where it accepts."""
    pos = _U32.unpack_from(buf, 0)[0]
    got = _vtable_offsets(buf, pos, size, 2)
    if got is None:
        return None
    (o_timeout, o_infos), obj_len = got
    if not o_infos or o_infos + 4 > obj_len or o_timeout + 4 > obj_len:
        return None
    timeout = _I32.unpack_from(buf, pos + o_timeout)[0] if o_timeout else 0
    at = pos + o_infos
    start = at + _U32.unpack_from(buf, at)[0]
    if start + 4 > size:
        return None
    n = _U32.unpack_from(buf, start)[0]
    start += 4
    if n > 16 or start + 4 * n > size:
        return None
    infos = []
    for j in range(n):
        at = start + 4 * j
        tp = at + _U32.unpack_from(buf, at)[0]
        got = _vtable_offsets(buf, tp, size, 3)
        if got is None:
            return None
        (o_sid, o_idx, o_len), ol = got
        if o_sid + 8 > ol or o_idx + 4 > ol or o_len + 4 > ol:
            return None
        infos.append(T.AppendInfo(_Q64.unpack_from(buf, tp + o_sid)[0] if o_sid else 0,
                                  _I32.unpack_from(buf, tp + o_idx)[0] if o_idx else 0,
                                  _I32.unpack_from(buf, tp + o_len)[0] if o_len else 0))
    return T.AppendRequest(timeout, infos)


def request_of(frame, name: str):
    """The frame's header decoded as a ``name`` table, decoded once: a cluster node's router and
    then the handler both read an APPEND's or FETCH's header (protocols/sbp/cluster.py)."""
    req = frame.request
    if req is None:
        req = frame.request = decode_table(name, frame.header)
    return req


# Headers of one-entry APPENDs already decoded: header bytes -> (stream_id, request_index,
# batch_length). A pipelining client sends the same header over and over (same stream, same
# batch size); the table is a pure function of its bytes, so a header seen before is not decoded
# again (reactor thread only; emptied when full).
_APPEND_ONE_SEEN = {}
_APPEND_ONE_SEEN_MAX = 4096


def append_one(header: bytes):
    """(stream_id, request_index, batch_length) of an AppendRequest header (bytes) holding exactly
    one entry, as ``decode_table`` decodes it; None for any other header (more entries, or one
    ``decode_table`` refuses)."""
    got = _APPEND_ONE_SEEN.get(header)
    if got is not None:
        return got
    try:
        infos = decode_table("AppendRequest", header).append_requests
    except Exception:
        return None
    if not infos or len(infos) != 1:
        return None
    info = infos[0]
    got = (info.stream_id, info.request_index, info.batch_length)
    if len(_APPEND_ONE_SEEN) >= _APPEND_ONE_SEEN_MAX:
        _APPEND_ONE_SEEN.clear()
    _APPEND_ONE_SEEN[header] = got
    return got


def decode_table(name: str, buf):
    """Decode a root table of type ``name`` (raises HeaderDecodeError on anything malformed)."""
    if name not in SCHEMA:
        raise KeyError(name)
    size = len(buf)
    if size < 8:
        raise HeaderDecodeError("header shorter than a root table")
    if name == "AppendRequest":
        try:
            req = _append_request_plain(buf, size)
        except struct.error:
            req = None
        if req is not None:
            return req
    try:
        return _read_table(buf, _U32.unpack_from(buf, 0)[0], size, name, _Budget(size))
    except struct.error as e:
        raise HeaderDecodeError(str(e)) from None
    except RecursionError:
        raise HeaderDecodeError("header nests too deeply") from None


def _build(builder, name, obj):
    """Write ``obj`` (a T.<name> instance, or a dict) and return its offset."""
    get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
    fields = SCHEMA[name]
    refs = {}
    # children first (FlatBuffers builds bottom-up)
    for fname, ftype, default in fields:
        v = get(fname)
        if v is None or ftype in _SCALARS:
            continue
        if ftype == "string":
            refs[fname] = builder.CreateString(v)
        elif ftype == "[ubyte]":
            if v:
                refs[fname] = builder.CreateByteVector(bytes(v))
        elif ftype == "[long]":
            if v:
                builder.StartVector(8, len(v), 8)
                for x in reversed(v):
                    builder.PrependInt64(x)
                refs[fname] = builder.EndVector()
        elif ftype.startswith("["):
            if v:
                sub = ftype[1:-1]
                offs = [_build(builder, sub, x) for x in v]
                builder.StartVector(4, len(offs), 4)
                for off in reversed(offs):
                    builder.PrependUOffsetTRelative(off)
                refs[fname] = builder.EndVector()
        else:
            refs[fname] = _build(builder, ftype, v)
    builder.StartObject(len(fields))
    for i, (fname, ftype, default) in enumerate(fields):
        if ftype in _SCALARS:
            v = get(fname)
            if v is None:
                continue
            getattr(builder, _SCALARS[ftype][2])(i, v, default)
        elif fname in refs:
            builder.PrependUOffsetTRelativeSlot(i, refs[fname], 0)
    return builder.EndObject()


def encode_table(name: str, obj) -> bytes:
    """Encode ``obj`` (a T.<name> instance or a dict of its fields) as a root table."""
    builder = flatbuffers.Builder(256)
    builder.Finish(_build(builder, name, obj))
    return bytes(builder.Output())


def decode_header(frame: Frame):
    """The frame's extended header as its table (request or response by the flags)."""
    entry = OPCODES.get(frame.opcode)
    if entry is None:
        raise HeaderDecodeError("unknown opcode 0x%04x" % frame.opcode)
    if frame.is_system_error:
        name = "SystemErrorResponse"
    else:
        name = entry[2] if frame.is_response else entry[1]
    if name is None:
        raise HeaderDecodeError("opcode 0x%04x carries no header table" % frame.opcode)
    return decode_table(name, frame.header)


# -- hot-path encoders ----------------------------------------------------------------------------


class _Template:
    """A table encoded once with sentinel values, then re-rendered by patching the scalars in place
    (wire-identical to ``encode_table`` for the same values when none is the field's default, and
    still a valid table when one is: the field is then present with that value)."""

    def __init__(self, name, obj, slots):
        self.buf = encode_table(name, obj)
        self.slots = []
        for sentinel, fmt in slots:
            st = struct.Struct(fmt)
            packed = st.pack(sentinel)
            pos = self.buf.find(packed)
            if pos < 0 or self.buf.find(packed, pos + 1) >= 0:
                raise AssertionError("template sentinel %r not unique" % sentinel)
            self.slots.append((pos, st))

    def render(self, *values):
        out = bytearray(self.buf)
        for (pos, st), v in zip(self.slots, values):
            st.pack_into(out, pos, v)
        return bytes(out)


_APPEND_ONE = _Template(
    "AppendResponse",
    T.AppendResponse(0x5A5B5C5D, T.Status(0, None, b""), [
        T.AppendResult(0x1111111111111101, 0x22222202, 0x3333333333333303, 0x4444444444444404, T.Status(0, None, b""))]),
    [(0x5A5B5C5D, "<i"), (0x1111111111111101, "<q"), (0x22222202, "<i"), (0x3333333333333303, "<q"), (0x4444444444444404, "<q")],
)

_FETCH_ONE = _Template(
    "FetchResponse",
    T.FetchResponse(0x5A5B5C5D, T.Status(0, None, b""), [
        T.FetchResult(0x1111111111111101, 0x22222202, 0x33333303, T.Status(0, None, b""))]),
    [(0x5A5B5C5D, "<i"), (0x1111111111111101, "<q"), (0x22222202, "<i"), (0x33333303, "<i")],
)


def encode_append_response_one(throttle_time_ms, stream_id, request_index, base_offset, append_time_ms) -> bytes:
    """AppendResponse with one successful AppendResult (the hot path), about 20x faster than
    ``encode_table``."""
    return _APPEND_ONE.render(throttle_time_ms, stream_id, request_index, base_offset, append_time_ms)


# The whole reply frame to a one-batch APPEND (prefix, the header above, the CRC of the empty
# payload: 0), rendered in one pass: the reply every pipelined APPEND gets (issue 24).
_APPEND_ACK = bytes(encode_frame(APPEND, RESPONSE_LAST, 0, _APPEND_ONE.buf))
_APPEND_ACK_SLOTS = [(PREFIX_SIZE + pos, st) for pos, st in _APPEND_ONE.slots]
_U32_BE = struct.Struct(">I")
_ACK_SID_AT = 4 + 1 + 2 + 1  # the prefix's stream_id: after frame_length, magic, opcode, flags


def append_ack_frame(frame_stream_id, throttle_time_ms, stream_id, request_index, base_offset, append_time_ms) -> bytes:
    """``encode_frame(APPEND, RESPONSE_LAST, frame_stream_id, encode_append_response_one(...))``,
    byte for byte, from one template."""
    out = bytearray(_APPEND_ACK)
    _U32_BE.pack_into(out, _ACK_SID_AT, frame_stream_id)
    (p0, s0), (p1, s1), (p2, s2), (p3, s3), (p4, s4) = _APPEND_ACK_SLOTS
    s0.pack_into(out, p0, throttle_time_ms)
    s1.pack_into(out, p1, stream_id)
    s2.pack_into(out, p2, request_index)
    s3.pack_into(out, p3, base_offset)
    s4.pack_into(out, p4, append_time_ms)
    return bytes(out)


def _merged_slots(slots):
    """The template's (position, Struct) slots, in the order of ``append_ack_frame``'s values,
    merged where they lie back to back into one Struct each: [(position, Struct, value indexes)]."""
    order = sorted(range(len(slots)), key=lambda k: slots[k][0])
    merged = []
    for k in order:
        pos, st = slots[k]
        if merged and merged[-1][0] + struct.calcsize(merged[-1][1]) == pos:
            at, fmt, idx = merged[-1]
            merged[-1] = (at, fmt + st.format[1:], idx + (k,))
        else:
            merged.append((pos, st.format, (k,)))
    return [(at, struct.Struct(fmt), idx) for at, fmt, idx in merged]


_ACK_SIZE = len(_APPEND_ACK)
# throttle_time_ms; the AppendResult's append time and base_offset, then its request_index and
# stream_id, each pair back to back in the template: three packs per ack instead of five
(_ACK_T_AT, _ACK_T, _), (_ACK_TB_AT, _ACK_TB, _ACK_TB_IDX), (_ACK_IS_AT, _ACK_IS, _ACK_IS_IDX) = _merged_slots(_APPEND_ACK_SLOTS)
if (_ACK_TB_IDX, _ACK_IS_IDX) != ((4, 3), (2, 1)):
    raise AssertionError("the APPEND ack template's layout changed: %r" % (_merged_slots(_APPEND_ACK_SLOTS),))


def append_ack_frames(acks) -> bytes:
    """``b"".join(append_ack_frame(*ack) for ack in acks)``, byte for byte, rendered into one
    buffer: the replies to a run of one-batch APPENDs, written with one transport write."""
    out = bytearray(_APPEND_ACK * len(acks))
    pack_sid, pack_t, pack_tb, pack_is = _U32_BE.pack_into, _ACK_T.pack_into, _ACK_TB.pack_into, _ACK_IS.pack_into
    sid_at, t_at, tb_at, is_at = _ACK_SID_AT, _ACK_T_AT, _ACK_TB_AT, _ACK_IS_AT
    at = 0
    for frame_stream_id, throttle_time_ms, stream_id, request_index, base_offset, append_time_ms in acks:
        pack_sid(out, at + sid_at, frame_stream_id)
        pack_t(out, at + t_at, throttle_time_ms)
        pack_tb(out, at + tb_at, append_time_ms, base_offset)
        pack_is(out, at + is_at, request_index, stream_id)
        at += _ACK_SIZE
    return bytes(out)


def encode_fetch_response_one(throttle_time_ms, stream_id, request_index, batch_length) -> bytes:
    """FetchResponse with one successful FetchResult (the hot path)."""
    return _FETCH_ONE.render(throttle_time_ms, stream_id, request_index, batch_length)


# -- convenience constructors --------------------------------------------------------------------


def status(code=OK, message=None, detail=b""):
    return T.Status(code, message, detail)


def system_error_frame(opcode, stream_id, code, message=None) -> bytes:
    """CONTRACT §3: echoes opcode and stream_id, flags 0x07, SystemErrorResponse, no payload."""
    header = encode_table("SystemErrorResponse", T.SystemErrorResponse(status(code, message)))
    return encode_frame(opcode, SYSTEM_ERROR, stream_id, header)


def goaway_frame() -> bytes:
    """CONTRACT §3: opcode 0x0002, flags 0x00, stream_id 0, no header, no payload."""
    return encode_frame(GOAWAY, 0, 0)


# -- payload helpers ----------------------------------------------------------------------------

def append_payload(infos_and_batches) -> tuple:
    """(AppendRequest.append_requests, payload parts) for [(stream_id, request_index, batch), ...]."""
    infos = []
    parts = []
    for sid, idx, batch in infos_and_batches:
        infos.append(T.AppendInfo(sid, idx, len(batch)))
        parts.append(batch)
    return infos, parts


def split_payload(payload, lengths: List[int]):
    """Slice ``payload`` by lengths; None if they do not add up to it exactly."""
    total = 0
    for n in lengths:
        if n < 0:
            return None
        total += n
    if total != len(payload):
        return None
    if len(lengths) == 1:
        return [payload]  # the common single-entry frame: no copy
    out = []
    pos = 0
    mv = memoryview(payload)
    for n in lengths:
        out.append(bytes(mv[pos:pos + n]))
        pos += n
    return out
