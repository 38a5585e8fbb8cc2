"""S2 REST API v1 wire formats (CONTRACT §7, docs/protocols/s2.md): pure functions, no I/O.

- protobuf messages of package ``s2.v1`` (built from a descriptor here, so no generated module),
- JSON shapes with ``s2-format`` raw/base64,
- S2S session framing (``[u24 length][u8 flags][payload]``),
- SSE events,
- read query parameters, stream/basin configuration JSON, error bodies.

Records travel between this module and the request handlers as tuples: appends as
``(timestamp_or_None, headers, body)`` and reads as ``(seq_num, timestamp, headers, body)`` with
``headers`` a sequence of ``(name, value)`` bytes pairs.
"""

import base64
import binascii
import json
import re
import struct
import zlib
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from protocols import framing

# ---------------------------------------------------------------------------------------------
# Errors


class S2Error(Exception):
    """An error reply: HTTP status + S2 code string, or a structured body (412, 416)."""

    def __init__(self, status: int, code: str, message: str = "", body: Optional[dict] = None):
        super().__init__(message or code)
        self.status = status
        self.code = code
        self.message = message or code
        self._body = body

    def body(self) -> dict:
        if self._body is not None:
            return self._body
        return {"code": self.code, "message": self.message}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), separators=(",", ":")).encode()


def seq_num_mismatch(expected: int) -> S2Error:
    return S2Error(412, "seq_num_mismatch", "sequence number mismatch", {"seq_num_mismatch": expected})


def fencing_token_mismatch(expected: str) -> S2Error:
    return S2Error(412, "fencing_token_mismatch", "fencing token mismatch", {"fencing_token_mismatch": expected})


def read_unwritten(tail: Tuple[int, int]) -> S2Error:
    return S2Error(416, "read_unwritten", "read from unwritten position", {"tail": position(tail)})


def bad(code: str, message: str, status: int = 400) -> S2Error:
    return S2Error(status, code, message)


def invalid(message: str) -> S2Error:
    return S2Error(422, "invalid", message)


def position(pos: Tuple[int, int]) -> dict:
    return {"seq_num": pos[0], "timestamp": pos[1]}


# ---------------------------------------------------------------------------------------------
# Protobuf (s2/v1/s2.proto field numbers; proto3 optional fields are synthetic oneofs)


def _build_messages():
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="sbpnode/s2/v1/s2.proto", package="s2.v1", syntax="proto3")

    def message(name, fields):
        m = fd.message_type.add(name=name)
        for num, fname, ftype, label, type_name, optional in fields:
            f = m.field.add(name=fname, number=num, type=ftype, label=label)
            if type_name:
                f.type_name = ".s2.v1." + type_name
            if optional:
                f.proto3_optional = True
                f.oneof_index = len(m.oneof_decl)
                m.oneof_decl.add(name="_" + fname)
        return m

    OPT, REP = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    U64, BYT, STR, MSG = F.TYPE_UINT64, F.TYPE_BYTES, F.TYPE_STRING, F.TYPE_MESSAGE
    message("StreamPosition", [(1, "seq_num", U64, OPT, None, False), (2, "timestamp", U64, OPT, None, False)])
    message("Header", [(1, "name", BYT, OPT, None, False), (2, "value", BYT, OPT, None, False)])
    message("AppendRecord", [
        (1, "timestamp", U64, OPT, None, True),
        (2, "headers", MSG, REP, "Header", False),
        (3, "body", BYT, OPT, None, False),
    ])
    message("AppendInput", [
        (1, "records", MSG, REP, "AppendRecord", False),
        (2, "match_seq_num", U64, OPT, None, True),
        (3, "fencing_token", STR, OPT, None, True),
    ])
    message("AppendAck", [
        (1, "start", MSG, OPT, "StreamPosition", False),
        (2, "end", MSG, OPT, "StreamPosition", False),
        (3, "tail", MSG, OPT, "StreamPosition", False),
    ])
    message("SequencedRecord", [
        (1, "seq_num", U64, OPT, None, False),
        (2, "timestamp", U64, OPT, None, False),
        (3, "headers", MSG, REP, "Header", False),
        (4, "body", BYT, OPT, None, False),
    ])
    message("ReadBatch", [
        (1, "records", MSG, REP, "SequencedRecord", False),
        (2, "tail", MSG, OPT, "StreamPosition", False),
    ])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    names = ["StreamPosition", "Header", "AppendRecord", "AppendInput", "AppendAck", "SequencedRecord", "ReadBatch"]
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName("s2.v1." + n)) for n in names}


PB = _build_messages()
PbHeader = PB["Header"]
PbAppendInput = PB["AppendInput"]
PbAppendAck = PB["AppendAck"]
PbSequencedRecord = PB["SequencedRecord"]
PbReadBatch = PB["ReadBatch"]
PbStreamPosition = PB["StreamPosition"]


@dataclass
class AppendInput:
    records: list  # [(timestamp or None, [(name, value)], body)]
    match_seq_num: Optional[int] = None
    fencing_token: Optional[str] = None


def decode_append_input_proto(data: bytes) -> AppendInput:
    msg = PbAppendInput()
    try:
        msg.ParseFromString(data)
    except Exception as e:
        raise bad("bad_proto", "invalid AppendInput protobuf: %s" % e)
    records = [
        (r.timestamp if r.HasField("timestamp") else None,
         [(h.name, h.value) for h in r.headers] if len(r.headers) else [], r.body)
        for r in msg.records
    ]
    return AppendInput(
        records,
        msg.match_seq_num if msg.HasField("match_seq_num") else None,
        msg.fencing_token if msg.HasField("fencing_token") else None,
    )


def encode_append_input_proto(inp: AppendInput) -> bytes:
    """Used by tests and the benchmark's raw clients."""
    msg = PbAppendInput()
    for ts, headers, body in inp.records:
        r = msg.records.add(body=body)
        if ts is not None:
            r.timestamp = ts
        for n, v in headers:
            r.headers.add(name=n, value=v)
    if inp.match_seq_num is not None:
        msg.match_seq_num = inp.match_seq_num
    if inp.fencing_token is not None:
        msg.fencing_token = inp.fencing_token
    return msg.SerializeToString()


def encode_append_ack_proto(start, end, tail) -> bytes:
    msg = PbAppendAck()
    msg.start.seq_num, msg.start.timestamp = start
    msg.end.seq_num, msg.end.timestamp = end
    msg.tail.seq_num, msg.tail.timestamp = tail
    return msg.SerializeToString()


def _b(x) -> bytes:
    # CONTRACT §3: SBP clients may store str where bin is expected; serve it as UTF-8 bytes.
    return x if isinstance(x, bytes) else (x.encode() if isinstance(x, str) else bytes(x))


def encode_read_batch_proto(records: Sequence, tail: Optional[Tuple[int, int]] = None) -> bytes:
    """ReadBatch bytes. A heartbeat (no records) must still carry ``tail`` even at (0, 0)."""
    msg = PbReadBatch()
    add = msg.records.add
    for seq, ts, headers, body in records:
        try:
            r = add(seq_num=seq, timestamp=ts, body=body)
        except TypeError:
            r = add(seq_num=seq, timestamp=ts, body=_b(body))
        for n, v in headers:
            r.headers.add(name=_b(n), value=_b(v))
    if tail is not None:
        msg.tail.seq_num, msg.tail.timestamp = tail
        msg.tail.SetInParent()
    return msg.SerializeToString()


def decode_read_batch_proto(data: bytes):
    """(records, tail or None) from ReadBatch bytes (tests and clients)."""
    msg = PbReadBatch()
    msg.ParseFromString(data)
    records = [(r.seq_num, r.timestamp, [(h.name, h.value) for h in r.headers], r.body) for r in msg.records]
    tail = (msg.tail.seq_num, msg.tail.timestamp) if msg.HasField("tail") else None
    return records, tail


# ---------------------------------------------------------------------------------------------
# JSON with s2-format

FORMATS = {"raw": "raw", "json": "raw", "base64": "base64", "json-binsafe": "base64"}


def parse_format(value: Optional[str]) -> str:
    if value is None or value == "":
        return "raw"
    fmt = FORMATS.get(value.strip().lower())
    if fmt is None:
        raise bad("bad_header", "s2-format must be raw or base64, not %r" % value)
    return fmt


def _dec(s, fmt: str, what: str) -> bytes:
    if not isinstance(s, str):
        raise bad("bad_json", "%s must be a string" % what)
    if fmt == "raw":
        return s.encode("utf-8", "surrogatepass")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise bad("bad_json", "%s is not valid base64" % what)


def _enc(b, fmt: str) -> str:
    b = _b(b)
    if fmt == "raw":
        return b.decode("utf-8", "replace")
    return base64.b64encode(b).decode("ascii")


def _uint(v, what: str) -> int:
    if type(v) is not int or v < 0 or v >= 1 << 64:
        raise bad("bad_json", "%s must be an unsigned 64-bit integer" % what)
    return v


def parse_json(data: bytes):
    try:
        return json.loads(data) if data else None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad("bad_json", "request body is not valid JSON: %s" % e)


def decode_append_input_json(data: bytes, fmt: str) -> AppendInput:
    obj = parse_json(data)
    if not isinstance(obj, dict) or not isinstance(obj.get("records"), list):
        raise bad("bad_json", "AppendInput must be an object with a records array")
    records = []
    for rec in obj["records"]:
        if not isinstance(rec, dict):
            raise bad("bad_json", "each record must be an object")
        ts = rec.get("timestamp")
        if ts is not None:
            ts = _uint(ts, "timestamp")
        headers = []
        for h in rec.get("headers") or []:
            if not isinstance(h, list) or len(h) != 2:
                raise bad("bad_json", "a header must be a [name, value] pair")
            headers.append((_dec(h[0], fmt, "header name"), _dec(h[1], fmt, "header value")))
        body = rec.get("body")
        records.append((ts, headers, b"" if body is None else _dec(body, fmt, "body")))
    msn = obj.get("match_seq_num")
    if msn is not None:
        msn = _uint(msn, "match_seq_num")
    token = obj.get("fencing_token")
    if token is not None and not isinstance(token, str):
        raise bad("bad_json", "fencing_token must be a string")
    return AppendInput(records, msn, token)


def append_ack_json(start, end, tail) -> dict:
    return {"start": position(start), "end": position(end), "tail": position(tail)}


def read_batch_json(records: Sequence, fmt: str, tail: Optional[Tuple[int, int]] = None) -> dict:
    out = []
    for seq, ts, headers, body in records:
        r = {"seq_num": seq, "timestamp": ts}
        if headers:
            r["headers"] = [[_enc(n, fmt), _enc(v, fmt)] for n, v in headers]
        if body:
            r["body"] = _enc(body, fmt)
        out.append(r)
    batch = {"records": out}
    if tail is not None:
        batch["tail"] = position(tail)
    return batch


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


# ---------------------------------------------------------------------------------------------
# Records: metering and command records

MAX_BATCH_RECORDS = 1000
MAX_BATCH_METERED = 1024 * 1024
MAX_FENCING_TOKEN = 36


def metered_size(headers, body) -> int:
    """S2's metered bytes of one record: 8 + 2*len(headers) + names + values + body."""
    n = 8 + len(body)
    for name, value in headers:
        n += 2 + len(name) + len(value)
    return n


def validate_append(records) -> int:
    """Batch limits and command-record rules; returns the metered size. Raises S2Error 422."""
    if not 1 <= len(records) <= MAX_BATCH_RECORDS:
        raise invalid("a batch holds 1..1000 records, not %d" % len(records))
    total = 0
    for _ts, headers, body in records:
        total += metered_size(headers, body)
        if headers:
            command = None
            for name, value in headers:
                if name == b"":
                    if len(headers) != 1:
                        raise invalid("a header with an empty name is allowed only as a command record's sole header")
                    command = value
            if command is not None:
                command_payload(command, body)
    if total > MAX_BATCH_METERED:
        raise invalid("batch metered size %d exceeds 1 MiB" % total)
    return total


def command_of(headers) -> Optional[bytes]:
    """The command operation if this is a command record (sole header, empty name)."""
    if len(headers) == 1 and headers[0][0] == b"":
        return headers[0][1]
    return None


def command_payload(op: bytes, body: bytes):
    """Validate a command record; returns the fencing token str or the trim point int."""
    if op == b"fence":
        if len(body) > MAX_FENCING_TOKEN:
            raise invalid("fencing token longer than 36 bytes")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid("fencing token is not UTF-8")
    if op == b"trim":
        if len(body) != 8:
            raise invalid("trim command body must be 8 bytes")
        return struct.unpack(">Q", body)[0]
    raise invalid("unknown command record %r" % op.decode("utf-8", "replace"))


# ---------------------------------------------------------------------------------------------
# S2S framing: [u24 length = 1 + len(payload)][u8 flags][payload]

S2S_TERMINAL = 0x80
S2S_COMPRESSION_MASK = 0x60
S2S_COMPRESSION_SHIFT = 5
S2S_MAX_FRAME = 8 * 1024 * 1024  # payload cap we accept (24-bit field allows 16 MiB)


def s2s_frame(payload: bytes, terminal: bool = False) -> bytes:
    n = len(payload) + 1
    return bytes(((n >> 16) & 0xFF, (n >> 8) & 0xFF, n & 0xFF, S2S_TERMINAL if terminal else 0)) + payload


def s2s_terminal(error: S2Error) -> bytes:
    return s2s_frame(struct.pack(">H", error.status) + error.json_bytes(), terminal=True)


def _gunzip(data: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = d.decompress(data, limit + 1)
    if len(out) > limit:
        raise ValueError("decompresses to more than %d bytes" % limit)
    if not d.eof:
        raise ValueError("truncated gzip data")
    return out


def _unzstd(data: bytes, limit: int) -> bytes:
    import zstandard

    with zstandard.ZstdDecompressor().stream_reader(data) as reader:
        out = reader.read(limit + 1)
    if len(out) > limit:
        raise ValueError("decompresses to more than %d bytes" % limit)
    return out


def decompress(encoding: str, data: bytes, limit: int, code: str = "bad_header") -> bytes:
    """Undo ``content-encoding`` (gzip, zstd, identity) with a cap on the output size."""
    encoding = (encoding or "identity").strip().lower()
    try:
        if encoding in ("identity", ""):
            return data
        if encoding in ("gzip", "x-gzip"):
            return _gunzip(data, limit)
        if encoding == "zstd":
            return _unzstd(data, limit)
    except ImportError:
        pass
    except Exception as e:
        raise bad(code, "%s data does not decompress: %s" % (encoding, e))
    raise bad("bad_header", "unsupported content-encoding %r" % encoding)


def _decompress(codec: int, payload: bytes) -> bytes:
    if codec == 0:
        return payload
    if codec == 1:
        return decompress("zstd", payload, S2S_MAX_FRAME, "bad_frame")
    if codec == 2:
        return decompress("gzip", payload, S2S_MAX_FRAME, "bad_frame")
    raise bad("bad_frame", "unknown S2S compression code %d" % codec)


class _S2SLayout(framing.Layout):
    """``[u24 length = 1 + len(payload)][u8 flags][payload]``: checked once its 4 bytes are in."""

    def __init__(self, max_frame):
        super().__init__(struct.Struct(">I"), 0, 3, 1, max_frame + 1, 4)

    def frame_size(self, buf, pos, peek):
        n = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
        if n < 1:
            raise bad("bad_frame", "S2S frame length 0")
        if n > self.max_length:
            raise bad("bad_frame", "S2S frame of %d bytes exceeds %d" % (n - 1, self.max_length - 1))
        return 3 + n


class S2SReader:
    """Incremental S2S deframer (``protocols/framing.Framer``); yields (terminal, payload)."""

    def __init__(self, max_frame: int = S2S_MAX_FRAME):
        self.max_frame = max_frame
        self._frames = framing.Framer(_S2SLayout(max_frame))

    def feed(self, data: bytes) -> List[Tuple[bool, bytes]]:
        self._frames.feed(data)
        out = []
        for buf, pos, end in self._frames.spans():
            flags = buf[pos + 3]
            if flags & 0x0F:
                raise bad("bad_frame", "reserved S2S flag bits set")
            payload = buf[pos + 4:end]
            out.append((bool(flags & S2S_TERMINAL), _decompress((flags & S2S_COMPRESSION_MASK) >> S2S_COMPRESSION_SHIFT, payload)))
        return out

    def inputs(self, data: bytes, check=None) -> List[bytes]:
        """The AppendInput payloads of a client's S2S append session in ``data`` (clients send no
        terminal frames: ``bad_frame``); ``check(payload)``, if given, runs on each in order."""
        out = []
        for terminal, payload in self.feed(data):
            if terminal:
                raise bad("bad_frame", "clients do not send terminal frames")
            if check is not None:
                check(payload)
            out.append(payload)
        return out

    @property
    def buffered(self) -> int:
        return self._frames.buffered()


def s2s_parse_terminal(payload: bytes) -> S2Error:
    status = struct.unpack(">H", payload[:2])[0]
    body = json.loads(payload[2:])
    return S2Error(status, body.get("code", "") if isinstance(body, dict) else "", "", body)


# ---------------------------------------------------------------------------------------------
# SSE


def sse_event(event: Optional[str], data: bytes, id: Optional[str] = None) -> bytes:
    parts = []
    if event:
        parts.append(b"event: " + event.encode() + b"\n")
    if id is not None:
        parts.append(b"id: " + id.encode() + b"\n")
    parts.append(b"data: " + data + b"\n\n")
    return b"".join(parts)


SSE_DONE = b"data: [DONE]\n\n"


def parse_last_event_id(value: Optional[str]):
    """``seq,count,bytes`` -> (seq, count, bytes); None if absent."""
    if not value:
        return None
    parts = value.strip().split(",")
    try:
        if len(parts) != 3:
            raise ValueError
        seq, count, nbytes = (int(p) for p in parts)
        if min(seq, count, nbytes) < 0:
            raise ValueError
    except ValueError:
        raise bad("bad_header", "Last-Event-ID must be seq_num,count,bytes")
    return seq, count, nbytes


# ---------------------------------------------------------------------------------------------
# Read parameters

UNARY_MAX_COUNT = 1000
UNARY_MAX_BYTES = 1024 * 1024
UNARY_MAX_WAIT = 60


@dataclass
class ReadParams:
    seq_num: Optional[int] = None
    timestamp: Optional[int] = None
    tail_offset: Optional[int] = None
    clamp: bool = False
    count: Optional[int] = None
    bytes: Optional[int] = None
    until: Optional[int] = None
    wait: Optional[int] = None

    @property
    def bounded(self) -> bool:
        return self.count is not None or self.bytes is not None or self.until is not None


def _qint(query: dict, name: str, bits: int = 64) -> Optional[int]:
    v = query.get(name)
    if v is None:
        return None
    try:
        if not v.isdigit():
            raise ValueError
        n = int(v)
        if n >= 1 << bits:
            raise ValueError
    except ValueError:
        raise bad("bad_query", "%s must be an unsigned %d-bit integer" % (name, bits))
    return n


def parse_read_params(query: dict) -> ReadParams:
    p = ReadParams(
        seq_num=_qint(query, "seq_num"),
        timestamp=_qint(query, "timestamp"),
        tail_offset=_qint(query, "tail_offset"),
        count=_qint(query, "count"),
        bytes=_qint(query, "bytes"),
        until=_qint(query, "until"),
        wait=_qint(query, "wait", 32),
    )
    clamp = query.get("clamp")
    if clamp is not None:
        c = clamp.lower()
        if c not in ("true", "false", "1", "0", ""):
            raise bad("bad_query", "clamp must be true or false")
        p.clamp = c in ("true", "1")
    starts = sum(x is not None for x in (p.seq_num, p.timestamp, p.tail_offset))
    if starts > 1:
        raise invalid("only one of seq_num, timestamp and tail_offset may be given")
    if p.timestamp is not None and p.until is not None and p.timestamp >= p.until:
        raise invalid("start `timestamp` exceeds or equal to `until`")
    return p


# ---------------------------------------------------------------------------------------------
# Names and configuration

BASIN_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{6,46})[a-z0-9]$")
TIMESTAMPING_MODES = ("client-prefer", "client-require", "arrival")


def validate_basin_name(name: str) -> str:
    if not isinstance(name, str) or not BASIN_RE.match(name):
        raise invalid("basin names are 8..48 characters of a-z, 0-9 and -, not starting or ending with -")
    return name


def validate_stream_name(name) -> str:
    if not isinstance(name, str) or not name or len(name.encode()) > 512 or "\0" in name:
        raise invalid("stream names are 1..512 bytes without NUL")
    return name


DEFAULT_RETENTION_SECS = 7 * 24 * 3600
STREAM_CIPHERS = ("aegis-256", "aes-256-gcm")


def default_stream_config() -> dict:
    # CONTRACT §2: streams created through S2 get S2's defaults, express and 7-day age retention.
    return {
        "storage_class": "express",
        "retention_policy": {"age": DEFAULT_RETENTION_SECS},
        "timestamping": {"mode": "client-prefer", "uncapped": False},
        "delete_on_empty": {"min_age_secs": 0},
    }


def merge_stream_config(base: dict, patch) -> dict:
    """Apply a (partial) StreamConfig JSON object to ``base``; validates; returns a new dict."""
    if patch is None:
        return dict(base)
    if not isinstance(patch, dict):
        raise bad("bad_json", "stream config must be an object")
    out = json.loads(json.dumps(base))
    sc = patch.get("storage_class")
    if sc is not None:
        if sc not in ("standard", "express"):
            raise invalid("storage_class must be standard or express")
        out["storage_class"] = sc
    rp = patch.get("retention_policy")
    if rp is not None:
        if not isinstance(rp, dict) or len(rp) != 1:
            raise invalid("retention_policy must be {\"age\": secs} or {\"infinite\": {}}")
        if "age" in rp:
            age = rp["age"]
            if type(age) is not int or age <= 0:
                raise invalid("retention age must be a positive number of seconds")
            out["retention_policy"] = {"age": age}
        elif "infinite" in rp:
            out["retention_policy"] = {"infinite": {}}
        else:
            raise invalid("retention_policy must be age or infinite")
    ts = patch.get("timestamping")
    if ts is not None:
        if not isinstance(ts, dict):
            raise invalid("timestamping must be an object")
        cur = dict(out.get("timestamping") or {})
        if ts.get("mode") is not None:
            if ts["mode"] not in TIMESTAMPING_MODES:
                raise invalid("timestamping mode must be one of %s" % ", ".join(TIMESTAMPING_MODES))
            cur["mode"] = ts["mode"]
        if ts.get("uncapped") is not None:
            if not isinstance(ts["uncapped"], bool):
                raise invalid("timestamping.uncapped must be a boolean")
            cur["uncapped"] = ts["uncapped"]
        out["timestamping"] = cur
    doe = patch.get("delete_on_empty")
    if doe is not None:
        if not isinstance(doe, dict) or type(doe.get("min_age_secs", 0)) is not int or doe.get("min_age_secs", 0) < 0:
            raise invalid("delete_on_empty.min_age_secs must be a non-negative integer")
        out["delete_on_empty"] = {"min_age_secs": doe.get("min_age_secs", 0)}
    return out


def retention_ms(config: dict) -> int:
    """CONTRACT §2: S2 age (seconds) <-> retention_period_ms; infinite is 0."""
    rp = config.get("retention_policy") or {}
    if "age" in rp:
        return int(rp["age"]) * 1000
    return 0


def retention_policy(ms: int) -> dict:
    if ms is None or ms <= 0:
        return {"infinite": {}}
    return {"age": max(1, ms // 1000)}


def default_basin_config() -> dict:
    return {"default_stream_config": None, "create_stream_on_append": False, "create_stream_on_read": False}


def merge_basin_config(base: dict, patch) -> dict:
    if patch is None:
        return dict(base)
    if not isinstance(patch, dict):
        raise bad("bad_json", "basin config must be an object")
    out = dict(base)
    if patch.get("default_stream_config") is not None:
        out["default_stream_config"] = merge_stream_config(
            out.get("default_stream_config") or default_stream_config(), patch["default_stream_config"]
        )
    for key in ("create_stream_on_append", "create_stream_on_read"):
        if patch.get(key) is not None:
            if not isinstance(patch[key], bool):
                raise invalid("%s must be a boolean" % key)
            out[key] = patch[key]
    if "stream_cipher" in patch:
        cipher = patch["stream_cipher"]
        if cipher is not None and cipher not in STREAM_CIPHERS:
            raise invalid("stream_cipher must be one of %s" % ", ".join(STREAM_CIPHERS))
        out["stream_cipher"] = cipher
    return out


def basin_config_json(config: dict) -> dict:
    out = {
        "create_stream_on_append": bool(config.get("create_stream_on_append")),
        "create_stream_on_read": bool(config.get("create_stream_on_read")),
    }
    if config.get("default_stream_config"):
        out["default_stream_config"] = config["default_stream_config"]
    if config.get("stream_cipher"):
        out["stream_cipher"] = config["stream_cipher"]
    return out


def rfc3339(ms: int) -> str:
    import datetime

    t = datetime.datetime.fromtimestamp(ms / 1000.0, tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + "%03dZ" % (ms % 1000)
