"""HTTP/2 server connection for the S2 API, on the `h2` library (docs/protocols/s2.md).

Twisted's own HTTP/2 (``twisted.web._http2``) only runs behind TLS+ALPN and calls ``render()``
after the request body has ended, which cannot serve S2S append sessions (bidirectional: the
client keeps its body open while it waits for acks). This connection dispatches each stream at
HEADERS time and feeds DATA frames to the handler as they arrive.

Flow control: inbound DATA is acknowledged as it is consumed; outbound data waits in a per-stream
buffer until the peer's window opens (WindowUpdated) and the transport is not paused.
"""

import collections

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import ProtocolError, StreamClosedError
from h2.settings import SettingCodes
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from zope.interface import implementer

from protocols import tcp_internals
from protocols.s2.http import BaseResponder, HttpRequest

RECEIVE_WINDOW = 16 * 1024 * 1024
MAX_FRAME_SIZE = 1024 * 1024 - 1
MAX_CONCURRENT_STREAMS = 1000
MAX_HEADER_LIST_SIZE = 64 * 1024


class H2Responder(BaseResponder):
    """One HTTP/2 stream as seen by the request handlers."""

    def __init__(self, conn: "H2ServerProtocol", stream_id: int, request: HttpRequest):
        super().__init__(request)
        self.conn = conn
        self.stream_id = stream_id
        self.out = collections.deque()
        self.out_bytes = 0
        self.end_pending = False

    # BaseResponder primitives
    def _send_headers(self, status, headers, end):
        if self.closed:
            return
        hdrs = [(":status", str(status))] + [(k.lower(), v) for k, v in headers]
        try:
            self.conn.h2.send_headers(self.stream_id, hdrs, end_stream=end)
        except (ProtocolError, StreamClosedError):
            self._closed()
            return
        if end:
            self._done()
        self.conn.flush()

    def _send_data(self, data: bytes):
        if self.closed or not data:
            return
        self.out.append(data)
        self.out_bytes += len(data)
        self.conn.pump(self)

    def _send_end(self):
        if self.closed:
            return
        self.end_pending = True
        self.conn.pump(self)

    def pending(self) -> int:
        return self.out_bytes + (self.conn.transport_buffered_hint())

    def _done(self):
        self.conn.stream_done(self)

    def pause_input(self):
        self.conn.pause_input(self)

    def resume_input(self):
        self.conn.resume_input(self)

    def abort(self):
        if not self.closed:
            try:
                self.conn.h2.reset_stream(self.stream_id, ErrorCodes.INTERNAL_ERROR)
            except (ProtocolError, StreamClosedError):
                pass
            self.conn.flush()
            self._closed()
            self.conn.stream_done(self)


@implementer(IPushProducer)
class H2ServerProtocol(Protocol):
    log = Logger()

    def __init__(self, handler, max_body: int):
        self.handler = handler  # protocols.s2.api.Api-like: open(request, responder)
        self.max_body = max_body
        self.streams = {}
        self.paused = False
        self.input_holders = set()
        self.h2 = None
        self._flushing = False

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        self.h2 = H2Connection(config=H2Configuration(client_side=False, header_encoding="utf-8",
                                                      validate_inbound_headers=False))
        self.h2.initiate_connection()
        self.h2.update_settings({
            SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
            SettingCodes.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
            SettingCodes.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
            SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_SIZE,
        })
        self.h2.increment_flow_control_window(RECEIVE_WINDOW - 65535)
        self.transport.registerProducer(self, True)
        self.flush()

    def transport_buffered_hint(self) -> int:
        return 1 << 30 if self.paused else 0

    def flush(self):
        if self.h2 is None:
            return
        data = self.h2.data_to_send()
        if data:
            self.transport.write(data)

    def dataReceived(self, data: bytes):
        try:
            events = self.h2.receive_data(data)
        except ProtocolError as e:
            self.log.warn("HTTP/2 protocol error from {peer}: {error}", peer=self.transport.getPeer(), error=e)
            self.flush()
            self.transport.loseConnection()
            return
        for event in events:
            try:
                self._event(event)
            except Exception:
                self.log.failure("HTTP/2 event {event} failed", event=type(event).__name__)
        self.flush()

    def _event(self, event):
        if isinstance(event, RequestReceived):
            self._request(event)
        elif isinstance(event, DataReceived):
            r = self.streams.get(event.stream_id)
            if event.flow_controlled_length:
                try:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                except (ProtocolError, StreamClosedError):
                    pass
            if r is not None:
                r.body_received(event.data)
        elif isinstance(event, StreamEnded):
            r = self.streams.get(event.stream_id)
            if r is not None:
                r.body_ended()
        elif isinstance(event, StreamReset):
            r = self.streams.pop(event.stream_id, None)
            if r is not None:
                r._closed()
        elif isinstance(event, WindowUpdated):
            if event.stream_id == 0:
                for r in list(self.streams.values()):
                    self.pump(r)
            else:
                r = self.streams.get(event.stream_id)
                if r is not None:
                    self.pump(r)
        elif isinstance(event, RemoteSettingsChanged):
            for r in list(self.streams.values()):
                self.pump(r)
        elif isinstance(event, ConnectionTerminated):
            self.transport.loseConnection()

    def _request(self, event):
        headers = {}
        pseudo = {}
        for k, v in event.headers:
            if k.startswith(":"):
                pseudo[k] = v
            elif k in headers:
                headers[k] = headers[k] + ", " + v
            else:
                headers[k] = v
        try:
            request = HttpRequest(
                pseudo.get(":method", "GET"),
                pseudo.get(":path", "/"),
                headers,
                peer=str(self.transport.getPeer()),
                http_version="2",
                max_body=self.max_body,
            )
        except UnicodeDecodeError:
            request = HttpRequest("GET", "/", {}, http_version="2")
            responder = H2Responder(self, event.stream_id, request)
            self.streams[event.stream_id] = responder
            responder.respond(400, [("content-type", "application/json")],
                              b'{"code":"bad_path","message":"path segments are not UTF-8"}')
            return
        if ":authority" in pseudo and "host" not in headers:
            request.headers["host"] = pseudo[":authority"]
        responder = H2Responder(self, event.stream_id, request)
        self.streams[event.stream_id] = responder
        self.handler.dispatch(responder)
        if event.stream_ended is not None and event.stream_id in self.streams:
            responder.body_ended()

    def pump(self, r: H2Responder):
        """Move buffered response bytes into HTTP/2 DATA frames as the windows allow."""
        if r.closed:
            return
        h2 = self.h2
        sid = r.stream_id
        unflushed = 0
        try:
            while r.out and not self.paused:
                window = h2.local_flow_control_window(sid)
                if window <= 0:
                    break
                chunk = r.out[0]
                size = min(window, h2.max_outbound_frame_size)
                if len(chunk) > size:
                    piece = chunk[:size]
                    r.out[0] = chunk[size:]
                else:
                    piece = chunk
                    r.out.popleft()
                r.out_bytes -= len(piece)
                h2.send_data(sid, piece)
                unflushed += len(piece)
                if unflushed > 256 * 1024:
                    unflushed = 0
                    self.flush()
            if not r.out and r.end_pending:
                r.end_pending = False
                h2.end_stream(sid)
                self.flush()
                r._done()
                return
        except (ProtocolError, StreamClosedError):
            self.flush()
            r._closed()
            self.streams.pop(sid, None)
            return
        self.flush()
        r.maybe_drained()

    def pause_input(self, r):
        if not self.input_holders:
            self.transport.pauseProducing()
        self.input_holders.add(r.stream_id)

    def resume_input(self, r):
        if r.stream_id in self.input_holders:
            self.input_holders.discard(r.stream_id)
            if not self.input_holders:
                self.transport.resumeProducing()

    def stream_done(self, r: H2Responder):
        if self.streams.get(r.stream_id) is r:
            del self.streams[r.stream_id]
        r.finished = True
        r.closed = True
        r.on_close = []

    def connectionLost(self, reason):
        streams, self.streams = self.streams, {}
        for r in streams.values():
            r._closed()

    def goaway(self):
        if self.h2 is not None:
            try:
                self.h2.close_connection()
            except ProtocolError:
                pass
            self.flush()

    # IPushProducer: the transport asks us to stop writing when its buffer is full.
    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False
        for r in list(self.streams.values()):
            self.pump(r)

    def stopProducing(self):
        pass
