"""S2 codec units: protobuf byte vectors (research/s2-api.md §2, checked against s2-sdk's own
generated classes), JSON shapes with s2-format, S2S framing, SSE, read parameters, command
records, configuration."""

import base64
import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.s2 import codec
from protocols.s2.codec import AppendInput, S2Error


def test_append_input_proto_vector():
    inp = AppendInput([(None, [(b"k", b"v")], b"hi"), (5, [], b"")], match_seq_num=0, fencing_token="t")
    data = codec.encode_append_input_proto(inp)
    assert data.hex(" ") == "0a 0c 12 06 0a 01 6b 12 01 76 1a 02 68 69 0a 02 08 05 10 00 1a 01 74"
    back = codec.decode_append_input_proto(data)
    assert back == inp


def test_append_input_presence():
    back = codec.decode_append_input_proto(codec.encode_append_input_proto(AppendInput([(None, [], b"x")])))
    assert back.match_seq_num is None and back.fencing_token is None and back.records[0][0] is None
    back = codec.decode_append_input_proto(codec.encode_append_input_proto(AppendInput([(0, [], b"")], 0, "")))
    assert back.match_seq_num == 0 and back.fencing_token == "" and back.records[0][0] == 0


def test_append_ack_and_heartbeat_vectors():
    assert codec.encode_append_ack_proto((0, 10), (2, 10), (2, 10)).hex(" ") == (
        "0a 02 10 0a 12 04 08 02 10 0a 1a 04 08 02 10 0a")
    assert codec.encode_read_batch_proto([], (2, 10)).hex(" ") == "12 04 08 02 10 0a"
    # A heartbeat at an empty stream's tail still carries the tail field.
    assert codec.encode_read_batch_proto([], (0, 0)) == b"\x12\x00"
    assert codec.encode_read_batch_proto([]) == b""


def test_read_batch_matches_sdk_generated_classes():
    pb = pytest.importorskip("s2_sdk._generated.s2.v1.s2_pb2")
    data = codec.encode_read_batch_proto([(7, 99, ((b"a", b"b"), (b"", b"fence")), b"body"), (8, 100, (), b"")], (9, 100))
    msg = pb.ReadBatch()
    msg.ParseFromString(data)
    assert [(r.seq_num, r.timestamp, [(h.name, h.value) for h in r.headers], r.body) for r in msg.records] == [
        (7, 99, [(b"a", b"b"), (b"", b"fence")], b"body"), (8, 100, [], b"")]
    assert msg.HasField("tail") and msg.tail.seq_num == 9
    ai = pb.AppendInput(records=[pb.AppendRecord(timestamp=3, body=b"z", headers=[pb.Header(name=b"n", value=b"v")])],
                        fencing_token="tok")
    assert codec.decode_append_input_proto(ai.SerializeToString()) == AppendInput([(3, [(b"n", b"v")], b"z")], None, "tok")


def test_read_batch_accepts_str_fields_from_sbp_clients():
    data = codec.encode_read_batch_proto([(0, 1, (("n", "v"),), "text")])
    records, tail = codec.decode_read_batch_proto(data)
    assert records == [(0, 1, [(b"n", b"v")], b"text")] and tail is None


def test_bad_proto_is_400():
    with pytest.raises(S2Error) as e:
        codec.decode_append_input_proto(b"\xff\xff\xff")
    assert e.value.status == 400 and e.value.code == "bad_proto"


def test_json_append_raw_and_base64():
    body = json.dumps({"records": [{"body": "héllo", "headers": [["a", "b"]], "timestamp": 5}, {}],
                       "match_seq_num": 3, "fencing_token": "f"}).encode()
    inp = codec.decode_append_input_json(body, "raw")
    assert inp.records == [(5, [(b"a", b"b")], "héllo".encode()), (None, [], b"")]
    assert inp.match_seq_num == 3 and inp.fencing_token == "f"
    b64 = json.dumps({"records": [{"body": base64.b64encode(b"\x00\xff").decode(),
                                   "headers": [[base64.b64encode(b"k").decode(), ""]]}]}).encode()
    assert codec.decode_append_input_json(b64, "base64").records == [(None, [(b"k", b"")], b"\x00\xff")]


@pytest.mark.parametrize("body", [
    b"not json", b"[]", b'{"records": 1}', b'{"records": [1]}', b'{"records": [{"body": 1}]}',
    b'{"records": [{"headers": [["a"]]}]}', b'{"records": [{"timestamp": -1}]}',
    b'{"records": [], "match_seq_num": "x"}', b'{"records": [], "fencing_token": 5}',
])
def test_json_append_rejects(body):
    with pytest.raises(S2Error) as e:
        codec.decode_append_input_json(body, "raw")
    assert e.value.status == 400 and e.value.code == "bad_json"


def test_json_base64_rejects_bad_base64():
    with pytest.raises(S2Error):
        codec.decode_append_input_json(b'{"records": [{"body": "!!"}]}', "base64")


def test_read_batch_json_formats():
    recs = [(0, 1, ((b"k", b"v"),), b"\xff"), (1, 2, (), b"")]
    raw = codec.read_batch_json(recs, "raw", (2, 2))
    assert raw == {"records": [{"seq_num": 0, "timestamp": 1, "headers": [["k", "v"]], "body": "\ufffd"},
                               {"seq_num": 1, "timestamp": 2}], "tail": {"seq_num": 2, "timestamp": 2}}
    b64 = codec.read_batch_json(recs, "base64")
    assert b64["records"][0]["body"] == "/w==" and "tail" not in b64


def test_format_header():
    assert codec.parse_format(None) == "raw"
    assert codec.parse_format("json-binsafe") == "base64"
    with pytest.raises(S2Error) as e:
        codec.parse_format("hex")
    assert e.value.code == "bad_header"


def test_error_bodies():
    assert json.loads(codec.seq_num_mismatch(2).json_bytes()) == {"seq_num_mismatch": 2}
    assert json.loads(codec.fencing_token_mismatch("x").json_bytes()) == {"fencing_token_mismatch": "x"}
    assert json.loads(codec.read_unwritten((3, 4)).json_bytes()) == {"tail": {"seq_num": 3, "timestamp": 4}}
    e = codec.invalid("nope")
    assert e.status == 422 and json.loads(e.json_bytes()) == {"code": "invalid", "message": "nope"}


def test_s2s_frame_vectors():
    payload = codec.encode_append_input_proto(AppendInput([(None, [(b"k", b"v")], b"hi"), (5, [], b"")], 0, "t"))
    assert codec.s2s_frame(payload)[:4] == b"\x00\x00\x18\x00"
    term = codec.s2s_terminal(codec.seq_num_mismatch(2))
    assert term == b"\x00\x00\x19\x80\x01\x9c" + b'{"seq_num_mismatch":2}'
    err = codec.s2s_parse_terminal(term[4:])
    assert err.status == 412 and err.body() == {"seq_num_mismatch": 2}


def test_s2s_reader_byte_at_a_time_and_many_at_once():
    frames = [codec.s2s_frame(bytes([i]) * i) for i in range(1, 40)]
    stream = b"".join(frames)
    r = codec.S2SReader()
    got = []
    for i in range(len(stream)):
        got.extend(r.feed(stream[i:i + 1]))
    assert got == [(False, bytes([i]) * i) for i in range(1, 40)]
    assert codec.S2SReader().feed(stream) == got


def test_s2s_reader_gzip_and_limits():
    import gzip

    r = codec.S2SReader(max_frame=100)
    comp = gzip.compress(b"a" * 50)
    frame = bytes((0, 0, len(comp) + 1, 0x40)) + comp
    assert r.feed(frame) == [(False, b"a" * 50)]
    with pytest.raises(S2Error) as e:
        codec.S2SReader(max_frame=100).feed(b"\x00\x10\x00\x00")
    assert e.value.code == "bad_frame"
    with pytest.raises(S2Error):
        codec.S2SReader().feed(b"\x00\x00\x02\x01x")  # reserved bits
    with pytest.raises(S2Error):
        codec.S2SReader().feed(b"\x00\x00\x02\x60x")  # compression code 3


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_s2s_reader_garbage_fails_cleanly(data):
    try:
        codec.S2SReader(max_frame=1000).feed(data)
    except S2Error as e:
        assert e.status == 400


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_proto_garbage_fails_cleanly(data):
    try:
        codec.decode_append_input_proto(data)
    except S2Error as e:
        assert e.code == "bad_proto"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 2**64 - 1)),
                          st.lists(st.tuples(st.binary(max_size=5), st.binary(max_size=5)), max_size=3),
                          st.binary(max_size=20)), min_size=1, max_size=10),
       st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.one_of(st.none(), st.text(max_size=36)))
def test_append_input_round_trip(records, msn, token):
    inp = AppendInput(records, msn, token)
    assert codec.decode_append_input_proto(codec.encode_append_input_proto(inp)) == inp


def test_sse_events():
    assert codec.sse_event("batch", b"{}", "1,2,3") == b"event: batch\nid: 1,2,3\ndata: {}\n\n"
    assert codec.SSE_DONE == b"data: [DONE]\n\n"
    assert codec.parse_last_event_id("4,5,6") == (4, 5, 6)
    assert codec.parse_last_event_id(None) is None
    with pytest.raises(S2Error):
        codec.parse_last_event_id("4:5:6")


def test_read_params():
    p = codec.parse_read_params({"seq_num": "3", "count": "10", "clamp": "true", "wait": "5"})
    assert (p.seq_num, p.count, p.clamp, p.wait, p.bounded) == (3, 10, True, 5, True)
    assert not codec.parse_read_params({}).bounded
    with pytest.raises(S2Error) as e:
        codec.parse_read_params({"seq_num": "1", "tail_offset": "1"})
    assert e.value.status == 422
    with pytest.raises(S2Error) as e:
        codec.parse_read_params({"timestamp": "5", "until": "5"})
    assert e.value.status == 422
    for bad in ({"count": "-1"}, {"seq_num": "x"}, {"wait": str(2**32)}, {"clamp": "maybe"}):
        with pytest.raises(S2Error) as e:
            codec.parse_read_params(bad)
        assert e.value.code == "bad_query"


def test_command_records():
    assert codec.command_payload(b"fence", b"tok") == "tok"
    assert codec.command_payload(b"trim", struct.pack(">Q", 9)) == 9
    for op, body in ((b"fence", b"x" * 37), (b"trim", b"1234567"), (b"bogus", b"")):
        with pytest.raises(S2Error) as e:
            codec.command_payload(op, body)
        assert e.value.status == 422
    with pytest.raises(S2Error):
        codec.validate_append([(None, [(b"", b"fence"), (b"a", b"b")], b"")])
    with pytest.raises(S2Error):
        codec.validate_append([])
    with pytest.raises(S2Error):
        codec.validate_append([(None, [], b"")] * 1001)
    with pytest.raises(S2Error):
        codec.validate_append([(None, [], b"x" * (1024 * 1024))])
    assert codec.validate_append([(None, [(b"ab", b"c")], b"xyz")]) == 8 + 2 + 3 + 3


def test_stream_config_merge_and_retention():
    cfg = codec.merge_stream_config(codec.default_stream_config(),
                                    {"retention_policy": {"age": 60}, "timestamping": {"mode": "arrival"}})
    assert cfg["retention_policy"] == {"age": 60} and cfg["timestamping"] == {"mode": "arrival", "uncapped": False}
    assert codec.retention_ms(cfg) == 60000 and codec.retention_ms(codec.default_stream_config()) == 7 * 24 * 3600 * 1000
    assert codec.default_stream_config()["storage_class"] == "express"
    assert codec.retention_policy(0) == {"infinite": {}} and codec.retention_policy(-5) == {"infinite": {}}
    assert codec.retention_policy(7000) == {"age": 7}
    for bad in ({"retention_policy": {"age": 0}}, {"timestamping": {"mode": "x"}}, {"storage_class": "cold"}):
        with pytest.raises(S2Error):
            codec.merge_stream_config(codec.default_stream_config(), bad)


def test_names():
    assert codec.validate_basin_name("my-basin-1") == "my-basin-1"
    for bad in ("short", "-abcdefgh", "abcdefgh-", "ABCDEFGHI", "a" * 49):
        with pytest.raises(S2Error):
            codec.validate_basin_name(bad)
    assert codec.validate_stream_name("a/b") == "a/b"
    for bad in ("", "a\0b", "x" * 513, None):
        with pytest.raises(S2Error):
            codec.validate_stream_name(bad)


def test_rfc3339_parses_with_fromisoformat():
    import datetime

    t = datetime.datetime.fromisoformat(codec.rfc3339(1795325368533))
    assert t.microsecond == 533000 and t.tzinfo is not None
