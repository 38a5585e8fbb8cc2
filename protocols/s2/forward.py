"""Forwarding S2 requests to another node of the cluster (CONTRACT §9; docs/protocols/s2.md,
"In a cluster").

A node that is not a stream's primary sends the stream's appends to the primary's ``--http``
listener as the client sent them (method, path, query, ``authorization``, ``s2-basin``,
``s2-encryption-key``, ...), marked with the ``sbp-forwarded`` header so that the primary never
forwards them again. The primary authenticates them itself (tokens are cluster-wide). Unary calls
are relayed whole; read sessions are relayed as their bytes arrive; an S2S append session becomes
a series of HTTP/1.1 ``s2s/proto`` POSTs to the primary, one at a time, each carrying every
AppendInput that arrived while the previous one was out (``ForwardedAppendSession``), so the
inputs reach the sequencer in the order the client sent them and the acks come back in that order.
"""

from twisted.internet import defer, error as net_error
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer
from zope.interface import implementer

from protocols.s2 import codec
from protocols.s2.codec import S2Error

FORWARDED = "sbp-forwarded"
# hop-by-hop headers, and what the forwarded request recomputes (the body goes decompressed)
_NOT_FORWARDED = frozenset(("host", "content-length", "connection", "transfer-encoding", "te", "upgrade",
                            "keep-alive", "proxy-connection", "http2-settings", "content-encoding",
                            "accept-encoding", FORWARDED))
_RELAYED = ("content-type", "cache-control")
CONNECT_TIMEOUT_S = 3
REFUSED = (net_error.ConnectionRefusedError, net_error.ConnectError, net_error.TimeoutError)


def unknown_outcome(what="the append") -> S2Error:
    # S2's retryable 503: the SDKs retry it under their append retry policy ("all" may duplicate)
    return S2Error(503, "unavailable", "the stream's primary failed while forwarding; the outcome of %s is unknown" % what)


@implementer(IBodyProducer)
class _Bytes:
    def __init__(self, data):
        self.data = data
        self.length = len(data)

    def startProducing(self, consumer):
        consumer.write(self.data)
        return defer.succeed(None)

    def pauseProducing(self):
        pass

    def resumeProducing(self):
        pass

    def stopProducing(self):
        pass


class _Body(Protocol):
    """Hands a response body to ``on_data`` as it arrives; ``done`` fires at its end."""

    def __init__(self, on_data):
        self.on_data = on_data
        self.done = defer.Deferred()

    def dataReceived(self, data):
        self.on_data(data)

    def connectionLost(self, reason):
        if reason.check(ResponseDone, PotentialDataLoss):
            self.done.callback(None)
        else:
            self.done.errback(reason)

    def cancel(self):
        if self.transport is not None:
            self.transport.stopProducing()


class Forwarder:
    """The node's HTTP/1.1 client to the other nodes' ``--http`` listeners (persistent connections;
    never retries a request by itself: a POST resent after a lost connection could append twice)."""

    log = Logger()

    def __init__(self, reactor):
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 32
        self.pool.retryAutomatically = False
        self.agent = Agent(reactor, connectTimeout=CONNECT_TIMEOUT_S, pool=self.pool)

    def request(self, address, req, body=None, content_type=None):
        headers = Headers()
        for k, v in req.headers.items():
            if k not in _NOT_FORWARDED and not k.startswith(":"):
                headers.setRawHeaders(k, [v])
        if content_type is not None:
            headers.setRawHeaders("content-type", [content_type])
        headers.setRawHeaders(FORWARDED, ["1"])
        url = ("http://%s%s" % (address, req.raw_path)).encode("utf-8")
        return self.agent.request(req.method.encode("ascii"), url, headers,
                                  _Bytes(bytes(body)) if body is not None else None)

    @staticmethod
    def relayed_headers(response):
        out = []
        for name in _RELAYED:
            values = response.headers.getRawHeaders(name)
            if values:
                out.append((name, values[0].decode("latin-1") if isinstance(values[0], bytes) else values[0]))
        return out

    @staticmethod
    def read(response, on_data):
        """Deliver the body to ``on_data``; returns the _Body (``.done``, ``.cancel()``)."""
        body = _Body(on_data)
        response.deliverBody(body)
        return body

    async def content(self, response) -> bytes:
        parts = []
        await self.read(response, parts.append).done
        return b"".join(parts)

    async def unary(self, address, req, responder, body):
        """Relay a unary request and its answer."""
        response = await self.request(address, req, body)
        data = await self.content(response)
        responder.respond(response.code, self.relayed_headers(response), data)

    async def stream(self, address, req, responder):
        """Relay a read session (SSE or S2S) as its bytes arrive; ends with the remote's end."""
        response = await self.request(address, req)
        responder.start(response.code, self.relayed_headers(response))
        body = self.read(response, responder.write)
        responder.on_close.append(body.cancel)
        try:
            await body.done
        except Exception:
            if not responder.closed:
                responder.abort()  # the client sees the session break and resumes elsewhere
            return
        responder.finish()

    def close(self):
        return self.pool.closeCachedConnections()


class ForwardedAppendSession:
    """An S2S append session on a node that is not the stream's primary (a responder body sink).

    ``retarget(avoid)`` is the API's: a Deferred of the primary's address now (waiting out a
    failover), avoiding one that refused a connection."""

    log = Logger()

    def __init__(self, forwarder, responder, req, target, retarget):
        self.forwarder = forwarder
        self.responder = responder
        self.req = req
        self.target = target
        self.retarget = retarget
        self.reader = codec.S2SReader()
        self.queue = []  # AppendInput payloads not yet sent
        self.sending = False
        self.ended = False
        self.failed = False
        self.body = None
        responder.on_close.append(self._closed)

    def _closed(self):
        self.failed = True
        self.queue = []
        if self.body is not None:
            self.body.cancel()

    def data(self, data):
        if self.failed:
            return
        try:
            for terminal, payload in self.reader.feed(data):
                if terminal:
                    raise codec.bad("bad_frame", "clients do not send terminal frames")
                codec.decode_append_input_proto(payload)  # a bad input fails here, not on the primary
                self.queue.append(payload)
        except S2Error as e:
            self.fail(e)
            return
        self._pump()

    def end(self):
        self.ended = True
        if not self.failed and self.reader.buffered:
            self.fail(codec.bad("bad_frame", "request body ended inside an S2S frame"))
            return
        self._pump()

    def _pump(self):
        if self.sending or self.failed:
            return
        if not self.queue:
            if self.ended:
                self.responder.finish()
            return
        batch, self.queue = self.queue, []
        self.sending = True
        d = defer.ensureDeferred(self._send(batch))
        d.addCallbacks(self._sent, self._send_failed)

    def _sent(self, _):
        self.sending = False
        self._pump()

    def _send_failed(self, failure):
        self.sending = False
        err = failure.value
        if not isinstance(err, S2Error):
            if not isinstance(err, defer.CancelledError):
                self.log.warn("forwarded append session to {target} failed: {error}", target=self.target, error=err)
            err = unknown_outcome("the session's unacknowledged appends")
        self.fail(err)

    async def _send(self, batch):
        body = b"".join(codec.s2s_frame(p) for p in batch)
        while True:
            try:
                response = await self.forwarder.request(self.target, self.req, body, "s2s/proto")
                break
            except REFUSED:
                # nothing reached the old primary: wait for the new one and send there
                self.target = await self.retarget(self.target)
        if response.code != 200:
            data = await self.forwarder.content(response)
            raise _error_of(response.code, data)
        reader = codec.S2SReader()
        acks = [0]
        out = self.responder

        def got(chunk):
            frames = reader.feed(chunk)
            relay = []
            for terminal, payload in frames:
                if terminal:
                    if relay:
                        out.write(b"".join(relay))
                        relay = []
                    self.fail(codec.s2s_parse_terminal(payload))
                    return
                relay.append(codec.s2s_frame(payload))
                acks[0] += 1
            if relay and not self.failed:
                out.write(b"".join(relay))

        self.body = self.forwarder.read(response, got)
        try:
            await self.body.done
        finally:
            self.body = None
        if self.failed:
            return
        if acks[0] < len(batch):
            raise unknown_outcome("the session's unacknowledged appends")

    def fail(self, err):
        if self.failed:
            return
        self.failed = True
        self.queue = []
        self.responder.write(codec.s2s_terminal(err))
        self.responder.finish()


def _error_of(status, data) -> S2Error:
    try:
        obj = codec.parse_json(data)
    except S2Error:
        obj = None
    if isinstance(obj, dict):
        return S2Error(status, str(obj.get("code", "other")), str(obj.get("message", "")), obj)
    return S2Error(status, "other", data[:200].decode("utf-8", "replace"))
