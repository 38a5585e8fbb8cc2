"""Forwarding S2 requests to another node of the cluster (CONTRACT §9; docs/protocols/s2.md,
"In a cluster").

A node that is not a stream's primary sends the stream's appends to the primary's S2 forwarding
port (a node-to-node listener of its own, the member record's ``s2_peer``) as the client sent them
(method, path, query, ``authorization``, ``s2-basin``, ``s2-encryption-key``, ...); what arrives
on that port is a forwarded request, which the primary never forwards again. The primary
authenticates it itself (tokens are cluster-wide). With the cluster TLS options the forwarder
speaks HTTPS with the node's certificate and trusts only the cluster CA (``tls``: the node's
``host -> client TLS options``, node/cluster/tls.py); the port requires a CA-signed client
certificate. Unary calls are relayed whole; read sessions are relayed as their bytes arrive; an
S2S append session becomes a series of HTTP/1.1 ``s2s/proto`` POSTs to the primary, one at a
time, each carrying every AppendInput that arrived while the previous one was out
(``ForwardedAppendSession``), so the inputs reach the sequencer in the order the client sent them
and the acks come back in that order.
"""

import time

from twisted.internet import defer, error as net_error
from twisted.internet.task import deferLater
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.web.client import Agent, HTTPConnectionPool, ResponseDone
from twisted.web.http import PotentialDataLoss
from twisted.web.http_headers import Headers
from twisted.web.iweb import IBodyProducer, IPolicyForHTTPS
from zope.interface import implementer

from protocols.s2 import codec
from protocols.s2.codec import S2Error

# hop-by-hop headers, and what the forwarded request recomputes (the body goes decompressed)
_NOT_FORWARDED = frozenset(("host", "content-length", "connection", "transfer-encoding", "te", "upgrade",
                            "keep-alive", "proxy-connection", "http2-settings", "content-encoding",
                            "accept-encoding"))
_RELAYED = ("content-type", "cache-control")
CONNECT_TIMEOUT_S = 3
# A forwarded session POST with inputs out and no acknowledgement for this long is given up: a
# primary that stops without closing its connections (paused, cut off) would hold it forever.
FORWARD_STALL_S = 10.0
REFUSED_RETRY_S = 20.0  # a primary-to-be answering 503 before reading (its view lags): retried this long
RETRY_PAUSE_S = 0.1
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


@implementer(IPolicyForHTTPS)
class _ClusterTls:
    """The HTTPS policy of the forwarder: the cluster's client TLS options for each peer host."""

    def __init__(self, options_for):
        self.options_for = options_for

    def creatorForNetloc(self, hostname, port):
        return self.options_for(hostname.decode("ascii"))


class Forwarder:
    """The node's HTTP/1.1 client to the other nodes' S2 forwarding ports (persistent connections;
    never retries a request by itself: a POST resent after a lost connection could append twice).
    ``tls``: None (plain HTTP) or ``host -> `` client TLS options (HTTPS, mutual TLS)."""

    log = Logger()

    def __init__(self, reactor, tls=None):
        self.reactor = reactor
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.pool.maxPersistentPerHost = 32
        self.pool.retryAutomatically = False
        self.scheme = "https" if tls is not None else "http"
        kw = {"contextFactory": _ClusterTls(tls)} if tls is not None else {}
        self.agent = Agent(reactor, connectTimeout=CONNECT_TIMEOUT_S, pool=self.pool, **kw)

    def request(self, address, req, body=None, content_type=None):
        headers = Headers()
        for k, v in req.headers.items():
            if k not in _NOT_FORWARDED and not k.startswith(":"):
                headers.setRawHeaders(k, [v])
        if content_type is not None:
            headers.setRawHeaders("content-type", [content_type])
        url = ("%s://%s%s" % (self.scheme, address, req.raw_path)).encode("utf-8")
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

    The API gives it three functions: ``retarget(avoid)``, a Deferred of where appends go now
    (the primary's address, or None: this node; waiting out a failover, avoiding ``avoid``);
    ``open_range()``, the (epoch, start) of the stream's open range; and ``take_over(payloads,
    ended)``, which hands the rest of the session to a local AppendSession when this node
    became the primary.

    The client's session is ended (S2's retryable 503) only when the outcome of inputs it sent
    is unknown. Where the outcome is known the inputs are sent again, to the new primary, with
    the client's session kept open (issue 18): a connection refused (nothing was sent), a
    primary that refused the whole POST before reading it (a non-200 answer), and a failover
    whose new range starts exactly at the end of the acknowledgements relayed so far (nothing
    past them was kept). Every POST with inputs out is bounded: no acknowledgement for
    FORWARD_STALL_S (a primary that hangs without closing its connection) counts as broken."""

    log = Logger()

    def __init__(self, forwarder, responder, req, target, retarget, open_range=None, take_over=None):
        self.forwarder = forwarder
        self.responder = responder
        self.req = req
        self.target = target  # None: not known yet (a failover was pending when the session opened)
        self.retarget = retarget
        self.open_range = open_range or (lambda: None)
        self.take_over = take_over
        self.reader = codec.S2SReader()
        self.queue = []  # AppendInput payloads not yet sent
        self.sending = False
        self.ended = False
        self.failed = False
        self.local = None  # the AppendSession this node runs once it became the primary
        self.acked_end = None  # seq_num end of the last acknowledgement relayed to the client
        self.body = None
        self.request_d = None
        responder.on_close.append(self._closed)

    def _closed(self):
        self.failed = True
        self.queue = []
        if self.request_d is not None:
            self.request_d.cancel()
        if self.body is not None:
            self.body.cancel()

    def data(self, data):
        if self.failed:
            return
        try:
            # a bad input fails here, not on the primary
            payloads = self.reader.inputs(data, check=codec.decode_append_input_proto)
        except S2Error as e:
            self.fail(e)
            return
        if self.local is not None:
            self.local.take(payloads)
            return
        self.queue.extend(payloads)
        self._pump()

    def end(self):
        self.ended = True
        if not self.failed and self.reader.buffered:
            self.fail(codec.bad("bad_frame", "request body ended inside an S2S frame"))
            return
        if self.local is not None:
            self.local.end()
            return
        self._pump()

    def _pump(self):
        if self.sending or self.failed or self.local is not None:
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
            if not isinstance(err, defer.CancelledError) or not self.failed:
                self.log.warn("forwarded append session to {target} failed: {error}", target=self.target, error=err)
            err = unknown_outcome("the session's unacknowledged appends")
        self.fail(err)

    def _take_over(self, batch):
        """This node became the primary: the inputs not sent (``batch`` first, then the queue)
        go to a local session on the same client stream, in order."""
        payloads, self.queue = list(batch) + self.queue, []
        self.local = self.take_over(payloads, self.ended)

    async def _send(self, batch):
        reactor = self.forwarder.reactor
        avoid = None
        refused_until = None
        while batch and not self.failed:
            if self.target is None or avoid is not None:
                self.target = await self.retarget(avoid)
                avoid = None
                if self.failed:
                    return
                if self.target is None:
                    self._take_over(batch)
                    return
            sent_range = self.open_range()
            try:
                acks = await self._post(batch)
            except REFUSED:
                avoid = self.target  # nothing reached that node: wait for the primary, send there
                continue
            except _Refused as e:
                # the node read no input: it is not the primary (yet, or any more) in its view
                now = time.monotonic()
                refused_until = refused_until or now + REFUSED_RETRY_S
                if e.err.status != 503 or now > refused_until:
                    raise e.err
                await deferLater(reactor, RETRY_PAUSE_S, lambda: None)
                self.target = None
                continue
            except _Broken as e:
                if self.failed:
                    return
                self.log.info("forwarded append session to {target} broke after {acks} of {n} acknowledgement(s): "
                              "{why}", target=self.target, acks=e.acks, n=len(batch), why=e.why)
                # the rest of the batch reached a primary that failed: it was not kept if a
                # failover opened a new range exactly where the relayed acknowledgements end
                if e.terminal is None:
                    self.target = await self.retarget(self.target)  # a dead primary is waited out
                    if self.failed:
                        return
                now = self.open_range()
                if not (sent_range is not None and now is not None and now[0] > sent_range[0]
                        and self.acked_end is not None and now[1] == self.acked_end):
                    self.log.info("forwarded append session: outcome unknown (open range {now}, relayed acks end "
                                  "at {end}): 503 to the client", now=now, end=self.acked_end)
                    raise e.terminal or unknown_outcome("the session's unacknowledged appends")
                self.log.info("forwarded append session: the new range starts at {end}, where the relayed acks "
                              "end: {n} input(s) not kept, sent again", end=self.acked_end, n=len(batch) - e.acks)
                if e.terminal is not None:
                    self.target = None  # the new range's primary
                acks = e.acks
            if self.failed:
                return
            batch = batch[acks:]
            refused_until = None

    async def _post(self, batch):
        """Send ``batch``; the number of acknowledgements relayed: all of them, else _Broken."""
        body = b"".join(codec.s2s_frame(p) for p in batch)
        acks = [0]
        terminal = [None]
        timer = self.forwarder.reactor.callLater(FORWARD_STALL_S, self._stalled)
        try:
            self.request_d = self.forwarder.request(self.target, self.req, body, "s2s/proto")
            try:
                response = await self.request_d
            except REFUSED:
                raise
            except Exception as e:
                raise _Broken(0, e)
            finally:
                self.request_d = None
            if response.code != 200:
                data = await self.forwarder.content(response)
                raise _Refused(_error_of(response.code, data))
            reader = codec.S2SReader()
            out = self.responder

            def got(chunk):
                if terminal[0] is not None or self.failed:
                    return
                if timer.active():
                    timer.reset(FORWARD_STALL_S)
                relay = []
                for is_terminal, payload in reader.feed(chunk):
                    if is_terminal:
                        terminal[0] = codec.s2s_parse_terminal(payload)
                        break
                    relay.append(codec.s2s_frame(payload))
                    acks[0] += 1
                    ack = codec.PbAppendAck()
                    ack.ParseFromString(payload)
                    self.acked_end = ack.end.seq_num
                if relay:
                    out.write(b"".join(relay))

            self.body = self.forwarder.read(response, got)
            try:
                await self.body.done
            except Exception as e:
                if terminal[0] is None:
                    raise _Broken(acks[0], e)
            finally:
                self.body = None
            err = terminal[0]
            if err is not None:
                if err.status == 503 and err.code == "unavailable":
                    raise _Broken(acks[0], err.message or err.code, err)  # e.g. its range was sealed
                self.fail(err)
            elif acks[0] < len(batch):
                raise _Broken(acks[0], "the response ended before every acknowledgement")
            return acks[0]
        finally:
            if timer.active():
                timer.cancel()

    def _stalled(self):
        self.log.warn("forwarded append session to {target}: no acknowledgement in {s} s; giving it up",
                      target=self.target, s=FORWARD_STALL_S)
        if self.request_d is not None:
            self.request_d.cancel()
        if self.body is not None:
            self.body.cancel()

    def fail(self, err):
        if self.failed:
            return
        self.failed = True
        self.queue = []
        self.responder.write(codec.s2s_terminal(err))
        self.responder.finish()


class _Refused(Exception):
    """The primary answered a forwarded session POST with an error (it read no input)."""

    def __init__(self, err):
        super().__init__(err)
        self.err = err


class _Broken(Exception):
    """A forwarded session POST failed after it was sent: ``acks`` inputs were acknowledged;
    ``terminal``: the primary's own retryable error, if it sent one."""

    def __init__(self, acks, why, terminal=None):
        super().__init__(why)
        self.acks = acks
        self.why = why
        self.terminal = terminal


def _error_of(status, data) -> S2Error:
    try:
        obj = codec.parse_json(data)
    except S2Error:
        obj = None
    if isinstance(obj, dict):
        return S2Error(status, str(obj.get("code", "other")), str(obj.get("message", "")), obj)
    return S2Error(status, "other", data[:200].decode("utf-8", "replace"))
