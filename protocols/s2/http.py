"""Transport-neutral request/response objects shared by the HTTP/1.1 and HTTP/2 front ends.

The request handlers (protocols/s2/api.py) see an ``HttpRequest`` and a responder with
``respond / start / write / finish``, a ``pending()`` byte count for backpressure, ``on_drain`` and
``on_close`` callbacks, and either a buffered body (unary calls) or a ``body_sink`` fed as DATA
arrives (S2S append sessions).
"""

from urllib.parse import parse_qsl, unquote

from twisted.logger import Logger

DRAIN_LOW_WATER = 1024 * 1024


class HttpRequest:
    __slots__ = ("method", "raw_path", "segments", "query", "headers", "peer", "http_version", "body", "max_body",
                 "auth", "forwarded")

    def __init__(self, method, raw_path, headers, peer="", http_version="1.1", max_body=8 * 1024 * 1024):
        self.method = method.upper()
        self.raw_path = raw_path
        path, _, qs = raw_path.partition("?")
        # Split on '/' first, then percent-decode each segment: stream names may hold '/' (%2F).
        self.segments = [unquote(s, errors="strict") for s in path.split("/") if s != ""]
        self.query = dict(parse_qsl(qs, keep_blank_values=True))
        self.headers = headers  # lower-case name -> str
        self.peer = peer
        self.http_version = http_version
        self.body = bytearray()
        self.max_body = max_body
        self.auth = None  # protocols.s2.tokens.Auth, set when the request is authenticated
        # True: another node of the cluster forwarded it (it came in on the node-to-node S2 port,
        # protocols/s2/server.py's forwarded site), so it is answered here, never forwarded again
        self.forwarded = False

    def header(self, name, default=None):
        return self.headers.get(name, default)


class BaseResponder:
    log = Logger()

    def __init__(self, request: HttpRequest):
        self.request = request
        self.closed = False  # no more output possible (client gone or response finished)
        self.finished = False
        self.started = False
        self.on_close = []
        self.on_drain = None
        self.on_body = None  # fn(bytes) once the whole body arrived (unary)
        self.body_sink = None  # object with data(bytes) and end() (sessions)
        self.body_too_large = None  # fn() when the buffered body exceeds max_body
        self.body_done = False
        # {"route group status": count} the API counts responses in (sbpnode_responses_total,
        # node/metrics.py), and this request's route group; None: not counted
        self.statuses = None
        self.route = None

    # --- primitives implemented per HTTP version
    def _send_headers(self, status, headers, end):
        raise NotImplementedError

    def _send_data(self, data):
        raise NotImplementedError

    def _send_end(self):
        raise NotImplementedError

    def pending(self) -> int:
        return 0

    def abort(self):
        raise NotImplementedError

    def pause_input(self):
        """Stop reading request bytes (the whole connection) until resume_input()."""

    def resume_input(self):
        pass

    def _count(self, status):
        statuses = self.statuses
        if statuses is not None:
            key = "%s %d" % (self.route, status)
            statuses[key] = statuses.get(key, 0) + 1

    # --- API for handlers
    def respond(self, status: int, headers, body: bytes = b""):
        if self.started or self.closed:
            return
        self.started = True
        self._count(status)
        headers = list(headers) + [("content-length", str(len(body)))]
        if body:
            self._send_headers(status, headers, False)
            self._send_data(body)
            self._send_end()
        else:
            self._send_headers(status, headers, True)

    def start(self, status: int, headers):
        if self.started or self.closed:
            return
        self.started = True
        self._count(status)
        self._send_headers(status, list(headers), False)

    def write(self, data: bytes):
        if not self.closed and data:
            self._send_data(data)

    def finish(self):
        if not self.closed:
            self._send_end()

    def when_drained(self, fn):
        """Call fn once pending() falls below the low-water mark (at once if it already is)."""
        if self.closed:
            return
        if self.pending() < DRAIN_LOW_WATER:
            fn()
        else:
            self.on_drain = fn

    def maybe_drained(self):
        fn = self.on_drain
        if fn is not None and self.pending() < DRAIN_LOW_WATER:
            self.on_drain = None
            fn()

    # --- called by the transport
    def body_received(self, data: bytes):
        if self.body_sink is not None:
            self.body_sink.data(data)
            return
        if self.body_too_large is False or self.closed:
            return
        body = self.request.body
        if len(body) + len(data) > self.request.max_body:
            fn, self.body_too_large = self.body_too_large, False
            if fn is not None:
                fn()
            return
        body += data

    def attach_sink(self, sink):
        """Start feeding the request body to ``sink`` (bytes that arrived before are replayed)."""
        self.body_sink = sink
        if self.request.body:
            data = bytes(self.request.body)
            self.request.body = bytearray()
            sink.data(data)
        if self.body_done:
            sink.end()

    def body_ended(self):
        self.body_done = True
        if self.body_sink is not None:
            self.body_sink.end()
            return
        if self.body_too_large is False:
            return
        fn, self.on_body = self.on_body, None
        if fn is not None:
            fn(bytes(self.request.body))

    def _closed(self):
        if self.closed:
            return
        self.closed = True
        callbacks, self.on_close = self.on_close, []
        if not self.finished:
            for fn in callbacks:
                try:
                    fn()
                except Exception:
                    self.log.failure("close callback failed")
