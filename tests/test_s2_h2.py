"""Protocol units for the S2 listener's connection layer: preface sniffing, HTTP/2 dispatch at
HEADERS time, incremental request bodies, flow control, resets. A stub handler stands in for the
request handlers (no store involved); an h2 client connection talks over StringTransport."""

import h2.config
import h2.connection
import h2.events
from twisted.internet.testing import StringTransport
from twisted.web import resource, server

from protocols.s2.h2conn import H2ServerProtocol
from protocols.s2.server import PREFACE, SniffingProtocol


class StubHandler:
    def __init__(self):
        self.responders = []

    def dispatch(self, r):
        self.responders.append(r)
        path = r.request.segments
        if path == ["echo"]:
            r.on_body = lambda body: r.respond(200, [("content-type", "text/plain")], b"got:" + body)
            r.body_too_large = lambda: r.respond(413, [], b"too large")
        elif path == ["session"]:
            r.start(200, [("content-type", "s2s/proto")])

            class Sink:
                def data(self, d):
                    r.write(d.upper())

                def end(self):
                    r.finish()

            r.attach_sink(Sink())
        elif path == ["big"]:
            r.on_body = lambda body: r.respond(200, [], b"z" * 300000)
        else:
            r.on_body = lambda body: r.respond(404, [], b"")


class Client:
    def __init__(self, proto_factory):
        self.c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.c.initiate_connection()
        self.t = StringTransport()
        self.p = proto_factory()
        self.p.makeConnection(self.t)
        self.events = []

    def send(self, byte_at_a_time=False):
        data = self.c.data_to_send()
        if byte_at_a_time:
            for i in range(len(data)):
                self.p.dataReceived(data[i:i + 1])
        else:
            self.p.dataReceived(data)
        self.recv()

    def recv(self):
        out = self.t.value()
        self.t.clear()
        if out:
            for ev in self.c.receive_data(out):
                if isinstance(ev, h2.events.DataReceived):
                    self.c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                self.events.append(ev)
            data = self.c.data_to_send()
            if data:
                self.p.dataReceived(data)
                self.recv()

    def request(self, method, path, body=None, headers=(), end=True):
        sid = self.c.get_next_available_stream_id()
        self.c.send_headers(sid, [(":method", method), (":path", path), (":scheme", "http"),
                                  (":authority", "x")] + list(headers), end_stream=body is None and end)
        if body is not None:
            self.c.send_data(sid, body, end_stream=end)
        return sid

    def response(self, sid):
        status, data, ended = None, b"", False
        for ev in self.events:
            if getattr(ev, "stream_id", None) != sid:
                continue
            if isinstance(ev, h2.events.ResponseReceived):
                status = dict(ev.headers)[":status"]
            elif isinstance(ev, h2.events.DataReceived):
                data += ev.data
            elif isinstance(ev, h2.events.StreamEnded):
                ended = True
        return status, data, ended


def h2proto():
    return H2ServerProtocol(StubHandler(), max_body=1000)


def test_unary_request_dispatch_and_body():
    cl = Client(h2proto)
    cl.send()
    sid = cl.request("POST", "/echo", b"hello")
    cl.send(byte_at_a_time=True)
    assert cl.response(sid) == ("200", b"got:hello", True)


def test_session_streams_before_the_body_ends():
    cl = Client(h2proto)
    cl.send()
    sid = cl.request("POST", "/session", b"abc", end=False)
    cl.send()
    status, data, ended = cl.response(sid)
    assert (status, data, ended) == ("200", b"ABC", False)  # response while the request is open
    cl.c.send_data(sid, b"def", end_stream=True)
    cl.send()
    assert cl.response(sid) == ("200", b"ABCDEF", True)


def test_body_limit():
    cl = Client(h2proto)
    cl.send()
    sid = cl.request("POST", "/echo", b"x" * 1001)
    cl.send()
    assert cl.response(sid) == ("413", b"too large", True)


def test_large_response_respects_flow_control():
    cl = Client(h2proto)
    cl.send()
    sid = cl.request("GET", "/big")
    cl.send()
    status, data, ended = cl.response(sid)
    assert status == "200" and len(data) == 300000 and ended


def test_reset_closes_responder():
    cl = Client(h2proto)
    cl.send()
    sid = cl.request("POST", "/session", b"a", end=False)
    cl.send()
    r = cl.p.handler.responders[-1]
    closed = []
    r.on_close.append(lambda: closed.append(True))
    cl.c.reset_stream(sid)
    cl.send()
    assert closed == [True] and r.closed
    r.write(b"ignored")  # writes after a reset are dropped, not errors


def test_garbage_after_preface_closes():
    t = StringTransport()
    p = h2proto()
    p.makeConnection(t)
    p.dataReceived(PREFACE + b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x")  # DATA on stream 0
    assert t.disconnecting


class FakeFactory:
    def __init__(self):
        root = resource.Resource()
        leaf = resource.Resource()
        leaf.render_GET = lambda req: b"h1 ok"
        root.putChild(b"hello", leaf)
        self.site = server.Site(root)
        self.api = StubHandler()
        self.max_body = 1000
        self.connections = set()


def test_sniffer_routes_http1():
    t = StringTransport()
    p = SniffingProtocol(FakeFactory())
    p.makeConnection(t)
    for b in b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n":
        p.dataReceived(bytes([b]))
    assert t.value().startswith(b"HTTP/1.1 200") and t.value().endswith(b"h1 ok")


def test_sniffer_routes_http2_prior_knowledge():
    factory = FakeFactory()
    cl = Client(lambda: SniffingProtocol(factory))
    cl.send(byte_at_a_time=True)
    sid = cl.request("POST", "/echo", b"x")
    cl.send()
    assert cl.response(sid) == ("200", b"got:x", True)
    assert isinstance(cl.p.inner, H2ServerProtocol)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 50))
def test_garbage_after_preface_never_raises(data, chunk):
    t = StringTransport()
    p = SniffingProtocol(FakeFactory())
    p.makeConnection(t)
    stream = PREFACE + data
    for i in range(0, len(stream), chunk):
        p.dataReceived(stream[i:i + chunk])  # must not raise; may close the connection
    p.connectionLost(None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b"POST /echo", b"GET /nope", b"/session"]), max_size=5), st.binary(max_size=100))
def test_valid_h2_requests_with_random_bodies(paths, body):
    cl = Client(h2proto)
    cl.send()
    sids = []
    for path in paths:
        method, _, target = path.rpartition(b" ")
        sids.append(cl.request((method or b"POST").decode(), target.decode(), body))
    cl.send()
    for sid in sids:
        assert cl.response(sid)[0] in ("200", "404", "413")


def test_non_utf8_path_gets_400():
    cl = Client(h2proto)
    cl.send()
    sid = cl.request("GET", "/v1/streams/%ff%fe")
    cl.send()
    status, data, ended = cl.response(sid)
    assert status == "400" and b"bad_path" in data and ended


def h1_channel(handler=None, max_body=1000):
    from protocols.s2.server import S2Site

    site = S2Site(handler or StubHandler(), max_body)
    t = StringTransport()
    ch = site.buildProtocol(None)
    ch.makeConnection(t)
    return ch, t


def test_http1_unary_and_streaming_session():
    ch, t = h1_channel()
    ch.dataReceived(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    out = t.value()
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"got:abc")
    t.clear()
    # An S2S-style "session" over HTTP/1.1: the whole body at once, a chunked streamed reply.
    ch.dataReceived(b"POST /session HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nxy")
    out = t.value()
    assert out.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in out and b"XY" in out
    assert out.endswith(b"0\r\n\r\n")


def test_http1_declared_body_over_the_limit_is_413_before_reading():
    ch, t = h1_channel()
    ch.dataReceived(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
    out = t.value()
    assert out.startswith(b"HTTP/1.1 413") and b'"code":"invalid"' in out and t.disconnecting
