"""Raw HTTP/1.1 and HTTP/2 requests against a real node, for what the s2-sdk does not exercise:
JSON with s2-format, protobuf over HTTP/1.1, SSE (events, ids, [DONE], ping, Last-Event-ID
resume), error bodies and codes, size limits, /health, h2c by hand, replica streams (403)."""

import base64
import http.client
import json
import socket
import struct
import time
import uuid

import h2.config
import h2.connection
import h2.events
import pytest

from protocols.s2 import codec
from tests.nodeproc import NodeProcess
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = NodeProcess(tmp_path_factory.mktemp("s2http"), fsync="never")
    n.start()
    try:
        yield n
    finally:
        n.terminate()


def call(node, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=30)
    hdrs = {"content-type": "application/json"}
    hdrs.update(headers or {})
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def new_stream(node):
    name = "h-" + uuid.uuid4().hex[:10]
    status, headers, body = call(node, "POST", "/v1/streams", {"stream": name})
    assert status == 201, body
    assert int(headers["sbp-stream-id"]) > 0
    return name


def test_health_and_unknown_routes(node):
    status, headers, body = call(node, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, headers, body = call(node, "GET", "/v2/nothing")
    assert status == 404 and headers["content-type"] == "application/json" and json.loads(body)["code"]
    status, _, body = call(node, "DELETE", "/v1/streams/x/records")
    assert status == 405 and "code" in json.loads(body)
    status, _, body = call(node, "GET", "/v1/streams/%ff%fe/records")
    assert status == 400 and json.loads(body)["code"] == "bad_path"


def test_json_raw_and_base64_formats(node):
    name = new_stream(node)
    status, _, body = call(node, "POST", "/v1/streams/%s/records" % name,
                           {"records": [{"body": "hi", "headers": [["a", "b"]]}, {"body": "\u00e9"}]})
    assert status == 200
    ack = json.loads(body)
    assert ack["start"]["seq_num"] == 0 and ack["end"]["seq_num"] == 2 and ack["tail"]["seq_num"] == 2
    b64 = base64.b64encode(b"\x00\xffbin").decode()
    status, _, body = call(node, "POST", "/v1/streams/%s/records" % name,
                           {"records": [{"body": b64}]}, {"s2-format": "base64"})
    assert status == 200
    status, _, body = call(node, "GET", "/v1/streams/%s/records?seq_num=0&count=10" % name, headers={"s2-format": "base64"})
    recs = json.loads(body)["records"]
    assert [base64.b64decode(r.get("body", "")) for r in recs] == [b"hi", "\u00e9".encode(), b"\x00\xffbin"]
    assert recs[0]["headers"] == [[base64.b64encode(b"a").decode(), base64.b64encode(b"b").decode()]]
    status, _, body = call(node, "GET", "/v1/streams/%s/records?seq_num=2" % name)
    assert json.loads(body)["records"][0]["body"] == "\x00\ufffdbin"  # lossy raw view of binary data
    status, headers, body = call(node, "GET", "/v1/streams/%s" % name)
    assert status == 200 and "sbp-stream-id" in headers
    # CONTRACT §2: S2's default stream config.
    assert json.loads(body)["retention_policy"] == {"age": 7 * 24 * 3600}
    assert json.loads(body)["storage_class"] == "express"


def test_protobuf_over_http1(node):
    name = new_stream(node)
    payload = codec.encode_append_input_proto(codec.AppendInput([(None, [(b"k", b"v")], b"p1"), (None, [], b"p2")]))
    status, headers, body = call(node, "POST", "/v1/streams/%s/records" % name, payload,
                                 {"content-type": "application/proto", "accept": "application/protobuf"})
    assert status == 200 and headers["content-type"] == "application/protobuf"
    ack = codec.PbAppendAck()
    ack.ParseFromString(body)
    assert ack.end.seq_num == 2
    status, headers, body = call(node, "GET", "/v1/streams/%s/records?seq_num=0" % name,
                                 headers={"accept": "application/x-protobuf"})
    records, tail = codec.decode_read_batch_proto(body)
    assert [(r[0], r[2], r[3]) for r in records] == [(0, [(b"k", b"v")], b"p1"), (1, [], b"p2")]
    # Errors stay JSON even when protobuf was asked for.
    status, headers, body = call(node, "GET", "/v1/streams/%s/records?seq_num=9" % name,
                                 headers={"accept": "application/protobuf"})
    assert status == 416 and json.loads(body) == {"tail": {"seq_num": 2, "timestamp": tail[1]}}


def test_error_bodies(node):
    name = new_stream(node)
    path = "/v1/streams/%s/records" % name
    status, _, body = call(node, "POST", path, b"{nope")
    assert status == 400 and json.loads(body)["code"] == "bad_json"
    status, _, body = call(node, "POST", path, {"records": [{"body": "x"}]}, {"s2-format": "hex"})
    assert status == 400 and json.loads(body)["code"] == "bad_header"
    status, _, body = call(node, "POST", path, {"records": []})
    assert status == 422 and json.loads(body)["code"] == "invalid"
    call(node, "POST", path, {"records": [{"body": "x"}]})
    status, _, body = call(node, "POST", path, {"records": [{"body": "x"}], "match_seq_num": 0})
    assert status == 412 and json.loads(body) == {"seq_num_mismatch": 1}
    status, _, body = call(node, "POST", path, {"records": [{"body": "x"}], "fencing_token": "t"})
    assert status == 412 and json.loads(body) == {"fencing_token_mismatch": ""}
    status, _, body = call(node, "GET", path + "?seq_num=x")
    assert status == 400 and json.loads(body)["code"] == "bad_query"
    status, _, body = call(node, "GET", "/v1/streams/%s/records" % "missing-x")
    assert status == 404 and json.loads(body)["code"] == "stream_not_found"
    status, _, body = call(node, "GET", "/v1/streams", headers={"s2-basin": "no-such-basin"})
    assert status == 404 and json.loads(body)["code"] == "basin_not_found"


def test_body_size_limit(node):
    s = socket.create_connection(("127.0.0.1", node.ports["http"]), timeout=10)
    s.sendall(b"POST /v1/streams/x/records HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 100000000\r\n\r\n")
    reply = s.recv(4096)
    s.close()
    assert reply.startswith(b"HTTP/1.1 413") and b'"code":"invalid"' in reply


def sse(node, path, headers=None, timeout=30, on_event=None):
    """The events of an SSE read, once it ends; ``on_event(name)`` is called as each arrives."""
    conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=timeout)
    hdrs = {"accept": "text/event-stream"}
    hdrs.update(headers or {})
    conn.request("GET", path, headers=hdrs)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type") == "text/event-stream"
    if on_event is None:
        body = resp.read().decode()
    else:
        lines = []
        for raw in resp:
            lines.append(raw.decode())
            if lines[-1].startswith("event: "):
                on_event(lines[-1][7:].strip())
        body = "".join(lines)
    conn.close()
    events = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        ev = {}
        for line in block.split("\n"):
            k, _, v = line.partition(": ")
            ev[k] = v
        events.append(ev)
    return events


def test_sse_batches_done_and_resume(node):
    name = new_stream(node)
    for i in range(3):
        call(node, "POST", "/v1/streams/%s/records" % name, {"records": [{"body": "r%d%d" % (i, j)} for j in range(4)]})
    events = sse(node, "/v1/streams/%s/records?seq_num=0&count=6" % name)
    assert events[-1] == {"data": "[DONE]"}
    batches = [e for e in events if e.get("event") == "batch"]
    seqs = [r["seq_num"] for e in batches for r in json.loads(e["data"])["records"]]
    assert seqs == [0, 1, 2, 3, 4, 5]
    last_id = batches[-1]["id"]
    assert last_id.split(",")[:2] == ["5", "6"]
    # Resume: start after the last seen record, with the count lowered by what was delivered.
    events = sse(node, "/v1/streams/%s/records?seq_num=0&count=8" % name, {"last-event-id": last_id})
    seqs = [r["seq_num"] for e in events if e.get("event") == "batch" for r in json.loads(e["data"])["records"]]
    assert seqs == [6, 7] and events[-1] == {"data": "[DONE]"}


def test_sse_ping_at_tail_then_done_after_wait(node):
    name = new_stream(node)
    call(node, "POST", "/v1/streams/%s/records" % name, {"records": [{"body": "x"}]})
    t0 = time.monotonic()
    events = sse(node, "/v1/streams/%s/records?seq_num=0&wait=1" % name)
    assert time.monotonic() - t0 >= 0.9
    kinds = [e.get("event", e.get("data")) for e in events]
    assert kinds == ["batch", "ping", "[DONE]"]
    ping = json.loads(events[1]["data"])
    assert ping["tail"]["seq_num"] == 1 and ping["timestamp"] > 0


def test_sse_preflight_errors_are_plain_json(node):
    name = new_stream(node)
    status, headers, body = call(node, "GET", "/v1/streams/%s/records?seq_num=5&count=1" % name,
                                 headers={"accept": "text/event-stream"})
    assert status == 416 and json.loads(body) == {"tail": {"seq_num": 0, "timestamp": 0}}


class H2:
    """A tiny blocking h2c (prior knowledge) client."""

    def __init__(self, port):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.c.initiate_connection()
        self.s.sendall(self.c.data_to_send())
        self.responses = {}

    def request(self, method, path, body=None, headers=(), end=True):
        sid = self.c.get_next_available_stream_id()
        self.c.send_headers(sid, [(":method", method), (":path", path), (":scheme", "http"), (":authority", "x")]
                            + list(headers), end_stream=body is None and end)
        if body is not None:
            self.c.send_data(sid, body, end_stream=end)
        self.s.sendall(self.c.data_to_send())
        self.responses[sid] = {"status": None, "data": b"", "ended": False}
        return sid

    def pump(self, until):
        while not until():
            data = self.s.recv(65536)
            if not data:
                return
            for ev in self.c.receive_data(data):
                r = self.responses.get(getattr(ev, "stream_id", None))
                if isinstance(ev, h2.events.ResponseReceived):
                    r["status"] = dict(ev.headers)[":status"]
                elif isinstance(ev, h2.events.DataReceived):
                    r["data"] += ev.data
                    self.c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                elif isinstance(ev, h2.events.StreamEnded):
                    r["ended"] = True
            self.s.sendall(self.c.data_to_send())


def test_h2c_unary_and_s2s_read_heartbeat(node):
    name = new_stream(node)
    cl = H2(node.ports["http"])
    sid = cl.request("GET", "/health")
    cl.pump(lambda: cl.responses[sid]["ended"])
    assert cl.responses[sid]["status"] == "200" and json.loads(cl.responses[sid]["data"]) == {"status": "ok"}
    # An S2S read session on an empty stream: a heartbeat (tail only) comes first.
    sid = cl.request("GET", "/v1/streams/%s/records?seq_num=0" % name, headers=[("content-type", "s2s/proto")])
    cl.pump(lambda: len(cl.responses[sid]["data"]) >= 4)
    frames = codec.S2SReader().feed(cl.responses[sid]["data"])
    assert cl.responses[sid]["status"] == "200"
    assert frames[0] == (False, b"\x12\x00")  # ReadBatch{tail: (0, 0)}
    # Append over unary h2 and watch it arrive on the session.
    sid2 = cl.request("POST", "/v1/streams/%s/records" % name, json.dumps({"records": [{"body": "live"}]}).encode(),
                      headers=[("content-type", "application/json")])
    cl.pump(lambda: cl.responses[sid2]["ended"] and len(codec.S2SReader().feed(cl.responses[sid]["data"])) >= 2)
    frames = codec.S2SReader().feed(cl.responses[sid]["data"])
    records, tail = codec.decode_read_batch_proto(frames[1][1])
    assert [(r[0], r[3]) for r in records] == [(0, b"live")]
    cl.c.reset_stream(sid)
    cl.s.sendall(cl.c.data_to_send())
    cl.s.close()


def test_h2c_append_session_terminal_frame(node):
    name = new_stream(node)
    cl = H2(node.ports["http"])
    frame = codec.s2s_frame(codec.encode_append_input_proto(codec.AppendInput([(None, [], b"a")], match_seq_num=0)))
    sid = cl.request("POST", "/v1/streams/%s/records" % name, frame + frame, headers=[("content-type", "s2s/proto")],
                     end=False)
    cl.pump(lambda: cl.responses[sid]["ended"])
    frames = codec.S2SReader().feed(cl.responses[sid]["data"])
    ack = codec.PbAppendAck()
    ack.ParseFromString(frames[0][1])
    assert (ack.start.seq_num, ack.end.seq_num) == (0, 1)
    assert frames[1][0] is True
    status = struct.unpack(">H", frames[1][1][:2])[0]
    assert status == 412 and json.loads(frames[1][1][2:]) == {"seq_num_mismatch": 1}
    cl.s.close()


def test_replica_streams_refuse_appends(tmp_path, node):
    """A stream synced from a peer is read-only here: appends and trims get 403 permission_denied."""
    name = new_stream(node)
    call(node, "POST", "/v1/streams/%s/records" % name, {"records": [{"body": "x"}]})
    status, headers, _ = call(node, "GET", "/v1/streams/%s" % name)
    sid = int(headers["sbp-stream-id"])
    follower = NodeProcess(tmp_path, name="follower", fsync="never", peer=[node.peer_endpoint()])
    follower.start()
    try:
        def replicated():
            _, _, body = call(follower, "GET", "/v1/streams?limit=1000")
            return next((s["name"] for s in json.loads(body)["streams"] if s["name"] in (name, str(sid))), None)

        found = wait_until(replicated, timeout=30, interval=0.2, what="the stream to replicate")
        path = "/v1/streams/%s/records" % found
        status, _, body = call(follower, "POST", path, {"records": [{"body": "y"}]})
        assert status == 403 and json.loads(body)["code"] == "permission_denied"
        trim = base64.b64encode(struct.pack(">Q", 1)).decode()
        status, _, body = call(follower, "POST", path, {"records": [{"headers": [["", "dHJpbQ=="]], "body": trim}]},
                               {"s2-format": "base64"})
        assert status == 403
        status, _, body = wait_until(lambda: (lambda got: got if got[0] == 200 else None)(call(follower, "GET", path + "?seq_num=0")),
                                     timeout=10, interval=0.2, what="the replica to be readable")
        assert [r["body"] for r in json.loads(body)["records"]] == ["x"]
    finally:
        follower.terminate()


def test_sbp_interop_same_records_both_ways(node):
    """CONTRACT §2: an SBP stream is in the default basin under its decimal id; a record appended
    through one interface is read back, identical, through the other."""
    from protocols.sbp.client import BlockingSbpClient
    from storage import record_batch

    with BlockingSbpClient("127.0.0.1", node.ports["sbp"]) as sbp:
        sid = sbp.create_stream()["stream_id"]
        batch = record_batch.encode([(1000, [(b"h", b"v")], b"from-sbp"), (1001, [], b"two")])
        assert sbp.append(sid, batch) == 0
        status, headers, body = call(node, "GET", "/v1/streams/%d/records?seq_num=0" % sid)
        assert status == 200, body
        recs = json.loads(body)["records"]
        assert recs == [{"seq_num": 0, "timestamp": 1000, "headers": [["h", "v"]], "body": "from-sbp"},
                        {"seq_num": 1, "timestamp": 1001, "body": "two"}]
        _, _, body = call(node, "GET", "/v1/streams?prefix=%d" % sid)
        assert [s["name"] for s in json.loads(body)["streams"]] == [str(sid)]
        # CONTRACT §2: an SBP-created stream keeps its own retention (infinite here).
        _, _, body = call(node, "GET", "/v1/streams/%d" % sid)
        assert json.loads(body)["retention_policy"] == {"infinite": {}}
        status, _, body = call(node, "POST", "/v1/streams/%d/records" % sid,
                               {"records": [{"body": "from-s2", "headers": [["k", "w"]], "timestamp": 2000}]})
        assert status == 200 and json.loads(body)["start"]["seq_num"] == 2
        data = sbp.fetch(sid, 2)
        records = [r for b in record_batch.split(data) for r in record_batch.decode(b)[1]]
        assert [(r.offset, r.timestamp_ms, r.headers, r.body) for r in records] == [(2, 2000, [(b"k", b"w")], b"from-s2")]


def test_restart_keeps_basins_streams_fence_and_timestamps(tmp_path):
    n = NodeProcess(tmp_path, fsync="always")
    n.start()
    try:
        status, _, body = call(n, "POST", "/v1/basins", {"basin": "kept-basin-1"})
        assert status == 201, body
        status, _, _ = call(n, "POST", "/v1/streams", {"stream": "s"}, {"s2-basin": "kept-basin-1"})
        assert status == 201
        fence = base64.b64encode(b"fence").decode()
        status, _, body = call(n, "POST", "/v1/streams/s/records",
                               {"records": [{"headers": [["", fence]], "body": base64.b64encode(b"tok").decode(),
                                             "timestamp": 5000}]}, {"s2-basin": "kept-basin-1", "s2-format": "base64"})
        assert status == 200, body
        # the token's stream-attrs write was queued before the ack went out; a clean stop drains it
        assert n.terminate() == 0
        n.start()
        _, _, body = call(n, "GET", "/v1/basins")
        assert "kept-basin-1" in [b["name"] for b in json.loads(body)["basins"]]
        status, _, body = call(n, "POST", "/v1/streams/s/records", {"records": [{"body": "x"}], "fencing_token": "bad"},
                               {"s2-basin": "kept-basin-1"})
        assert status == 412 and json.loads(body) == {"fencing_token_mismatch": "tok"}
        status, _, body = call(n, "POST", "/v1/streams/s/records",
                               {"records": [{"body": "x", "timestamp": 10}], "fencing_token": "tok"},
                               {"s2-basin": "kept-basin-1"})
        assert status == 200 and json.loads(body)["end"]["timestamp"] == 5000  # never below the last
        status, _, body = call(n, "GET", "/v1/streams/s/records/tail", headers={"s2-basin": "kept-basin-1"})
        assert json.loads(body) == {"tail": {"seq_num": 2, "timestamp": 5000}}
    finally:
        n.terminate()


def test_retention_by_age(node):
    name = new_stream(node)
    call(node, "POST", "/v1/streams/%s/records" % name, {"records": [{"body": "old", "timestamp": 1000}]})
    status, _, body = call(node, "PATCH", "/v1/streams/%s" % name, {"retention_policy": {"age": 1}})
    assert status == 200 and json.loads(body)["retention_policy"] == {"age": 1}
    def trimmed():
        got = call(node, "GET", "/v1/streams/%s/records?seq_num=0&wait=1" % name)
        return got if got[0] == 200 and not json.loads(got[2])["records"] else None

    status, _, body = wait_until(trimmed, timeout=20, interval=0.5, what="retention to trim the old record")
    assert status == 200 and json.loads(body)["records"] == [], body


def test_sigterm_ends_live_sessions(tmp_path):
    n = NodeProcess(tmp_path, fsync="never")
    n.start()
    try:
        name = new_stream(n)
        cl = H2(n.ports["http"])
        sid = cl.request("GET", "/v1/streams/%s/records" % name, headers=[("content-type", "s2s/proto")])
        cl.pump(lambda: len(cl.responses[sid]["data"]) >= 4)  # the heartbeat at the tail
        t0 = time.monotonic()
        n.proc.send_signal(15)
        cl.pump(lambda: cl.responses[sid]["ended"])
        frames = codec.S2SReader().feed(cl.responses[sid]["data"])
        assert frames[-1][0] is True and struct.unpack(">H", frames[-1][1][:2])[0] == 503
        assert json.loads(frames[-1][1][2:])["code"] == "server_draining"
        assert n.terminate() == 0 and time.monotonic() - t0 < 10
    finally:
        n.terminate()


def test_sbpctl_s2(node, capsys):
    from node.cli import main

    ep = ["s2", "--endpoint", "127.0.0.1:%d" % node.ports["http"]]
    name = "cli-" + uuid.uuid4().hex[:8]
    assert main(ep + ["create-stream", name, "--retention-secs", "3600"]) == 0
    assert "sbp stream id" in capsys.readouterr().out
    assert main(ep + ["append", name, "one", "two", "--header", "k=v"]) == 0
    assert capsys.readouterr().out.strip() == "appended seq_nums 0..1"
    assert main(ep + ["read", name, "--count", "5"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["seq_num"], r["body"], r["headers"]) for r in lines] == [(0, "one", [["k", "v"]]), (1, "two", [["k", "v"]])]
    assert main(ep + ["read", name, "--count", "2", "--follow"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(ep + ["tail", name]) == 0
    assert capsys.readouterr().out.startswith("seq_num 2 ")
    assert main(ep + ["config", name]) == 0
    assert json.loads(capsys.readouterr().out)["retention_policy"] == {"age": 3600}
    assert main(ep + ["streams", "--prefix", name]) == 0
    assert capsys.readouterr().out.split("\t")[0] == name
    assert main(ep + ["basins"]) == 0
    assert "sbpnode-default" in capsys.readouterr().out
    assert main(ep + ["delete-stream", name]) == 0
    capsys.readouterr()
    assert main(ep + ["tail", name]) == 1
    assert "stream_not_found" in capsys.readouterr().err


def test_basin_from_host_subdomain(node):
    status, _, _ = call(node, "POST", "/v1/basins", {"basin": "host-basin-1"})
    assert status == 201
    status, _, body = call(node, "POST", "/v1/streams", {"stream": "hs"}, {"host": "host-basin-1.b.example:80"})
    assert status == 201, body
    _, _, body = call(node, "GET", "/v1/streams", headers={"s2-basin": "host-basin-1"})
    assert [s["name"] for s in json.loads(body)["streams"]] == ["hs"]


def test_sse_error_event_when_the_stream_is_deleted(node):
    import threading

    name = new_stream(node)
    call(node, "POST", "/v1/streams/%s/records" % name, {"records": [{"body": "x"}]})
    out = {}
    at_tail = threading.Event()  # the reader got the record and its first ping: it waits at the tail

    def read():
        out.update(events=sse(node, "/v1/streams/%s/records?seq_num=0" % name,
                              on_event=lambda e: e == "ping" and at_tail.set()))

    t = threading.Thread(target=read)
    t.start()
    assert at_tail.wait(20)
    status, _, _ = call(node, "DELETE", "/v1/streams/%s" % name)
    assert status == 202
    t.join(20)
    events = out["events"]
    assert [e.get("event") for e in events] == ["batch", "ping", "error"]
    assert json.loads(events[-1]["data"])["code"] == "stream_not_found"
