"""The ``--http`` listener: S2 REST API over HTTP/1.1 and HTTP/2 on one port (CONTRACT §7).

Each connection starts in a sniffer: the 24-byte HTTP/2 client preface (cleartext "prior
knowledge", as s2-sdk sends it; also after TLS+ALPN ``h2``) hands the connection to the `h2`-based
``H2ServerProtocol``; anything else goes to twisted.web's HTTP/1.1 channel. With
``http_tls_cert``/``http_tls_key`` configured the listener speaks TLS with ALPN h2 and http/1.1.
"""

from twisted.internet import defer
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.web import resource, server
from zope.interface import implementer

from protocols import tcp_internals
from protocols.s2.api import S2Api
from protocols.s2.h2conn import H2ServerProtocol
from protocols.s2.http import BaseResponder, HttpRequest

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_BODY = 8 * 1024 * 1024


@implementer(IPushProducer)
class H1Responder(BaseResponder):
    """A twisted.web request as seen by the handlers; a push producer so the channel's
    backpressure reaches read sessions."""

    def __init__(self, web_request, request: HttpRequest):
        super().__init__(request)
        self.web = web_request
        self.paused = False
        web_request.notifyFinish().addBoth(self._web_finished)

    def _web_finished(self, result):
        if not self.finished:
            self._closed()
        return None

    def _send_headers(self, status, headers, end):
        if self.closed:
            return
        self.web.setResponseCode(status)
        for k, v in headers:
            self.web.setHeader(k, v)
        if not end and not any(k.lower() == "content-length" for k, _ in headers):
            # A streamed reply (SSE, S2S): let the channel pause us when its buffer is full.
            self.web.registerProducer(self, True)
            self._producing = True
        if end:
            self._send_end()

    def _send_data(self, data):
        if not self.closed:
            self.web.write(data)

    def _send_end(self):
        if self.closed:
            return
        self.finished = True
        self.closed = True
        if getattr(self, "_producing", False):
            self.web.unregisterProducer()
        self.web.finish()

    def pending(self) -> int:
        return 1 << 30 if self.paused else 0

    def abort(self):
        if not self.closed:
            self.closed = True
            channel = self.web.channel
            if channel is not None and channel.transport is not None:
                channel.transport.abortConnection()

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False
        self.maybe_drained()

    def stopProducing(self):
        self._closed()


class S2Request(server.Request):
    """Refuses a declared body above the limit before buffering it."""

    def gotLength(self, length):
        limit = self.channel.site.max_body
        if length is not None and length > limit:
            body = b'{"code":"invalid","message":"request body exceeds %d bytes"}' % limit
            self.channel.transport.write(
                b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
            )
            self.channel.transport.pauseProducing()
            self.channel.transport.loseConnection()
            length = 0
        super().gotLength(length)


class S2Resource(resource.Resource):
    isLeaf = True

    def __init__(self, api: S2Api, max_body: int, forwarded=False):
        super().__init__()
        self.api = api
        self.max_body = max_body
        self.forwarded = forwarded

    def render(self, web):
        headers = {}
        for k, vs in web.requestHeaders.getAllRawHeaders():
            headers[k.decode("latin-1").lower()] = ", ".join(v.decode("utf-8", "replace") for v in vs)
        peer = web.getClientAddress()
        try:
            req = HttpRequest(web.method.decode("latin-1"), web.uri.decode("utf-8", "replace"), headers,
                              peer=str(peer), http_version="1.1", max_body=self.max_body)
        except UnicodeDecodeError:
            web.setResponseCode(400)
            web.setHeader("content-type", "application/json")
            return b'{"code":"bad_path","message":"path is not UTF-8"}'
        req.forwarded = self.forwarded
        responder = H1Responder(web, req)
        self.api.dispatch(responder)
        web.content.seek(0)
        body = web.content.read()
        if body:
            responder.body_received(body)
        responder.body_ended()
        return server.NOT_DONE_YET


class S2Site(server.Site):
    requestFactory = S2Request

    def __init__(self, api, max_body, forwarded=False):
        super().__init__(S2Resource(api, max_body, forwarded))
        self.max_body = max_body
        self.noisy = False

    def log(self, request):
        pass  # access logging off: one line per request would dominate the node log


class ForwardedSite(S2Site):
    """The node-to-node S2 port of a cluster node (docs/cluster.md, "S2 across the cluster"):
    HTTP/1.1 only (the forwarder's client, protocols/s2/forward.py), every request marked
    ``forwarded``, served by the same API object as the ``--http`` listener (one S2 state per
    stream on its primary). The node listens with it on a port of its own, with the cluster's
    mutual TLS when it has the TLS options (node/cluster/s2_catalog.py)."""

    def __init__(self, api, max_body):
        super().__init__(api, max_body, forwarded=True)

    def buildProtocol(self, addr):
        channel = super().buildProtocol(addr)
        make_connection = channel.makeConnection

        def no_delay_first(transport):
            tcp_internals.set_no_delay(transport)  # acks leave at once, as on --http (SniffingProtocol)
            make_connection(transport)

        channel.makeConnection = no_delay_first
        return channel


class SniffingProtocol(Protocol):
    """Picks HTTP/2 (connection preface) or HTTP/1.1 from the first bytes."""

    def __init__(self, factory):
        self.factory = factory
        self.buf = b""
        self.inner = None
        self._lost = []  # Deferreds of close_if_idle, fired by connectionLost

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        self.factory.connections.add(self)

    def dataReceived(self, data):
        if self.inner is not None:
            self.inner.dataReceived(data)
            return
        self.buf += data
        n = min(len(self.buf), len(PREFACE))
        if self.buf[:n] != PREFACE[:n]:
            self.inner = self.factory.site.buildProtocol(self.transport.getPeer())
        elif n == len(PREFACE):
            self.inner = H2ServerProtocol(self.factory.api, self.factory.max_body)
            self.inner.factory = self.factory
        else:
            return
        buf, self.buf = self.buf, b""
        self.inner.makeConnection(self.transport)
        self.inner.dataReceived(buf)

    def connectionLost(self, reason):
        self.factory.connections.discard(self)
        if self.inner is not None:
            self.inner.connectionLost(reason)
        lost, self._lost = self._lost, []
        for d in lost:
            d.callback(None)

    def goaway(self):
        if isinstance(self.inner, H2ServerProtocol):
            self.inner.goaway()

    def close_if_idle(self):
        """At shutdown, after GOAWAY: an HTTP/2 connection with no stream left open is closed
        (``loseConnection`` first writes out what is buffered, such as a session's last frame);
        a Deferred that fires once it is gone, or None if it stays (a request still running)."""
        if not isinstance(self.inner, H2ServerProtocol) or self.inner.streams:
            return None
        d = defer.Deferred()
        self._lost.append(d)
        self.transport.loseConnection()
        return d


class S2Factory(Factory):
    log = Logger()
    noisy = False

    def __init__(self, node, max_body=MAX_BODY, api_class=S2Api):
        self.node = node
        self.api = api_class(node)
        self.max_body = max_body
        self.site = S2Site(self.api, max_body)
        self.connections = set()

    def buildProtocol(self, addr):
        return SniffingProtocol(self)

    def startFactory(self):
        self.api.ensure_default_basin().addErrback(lambda f: self.log.failure("creating the default basin failed", f))

    def shutdown(self):
        """The node's shutdown hook: read sessions end with their ``server_draining`` frame and
        every HTTP/2 connection gets GOAWAY; once the sessions have written their last frames,
        the connections left with nothing open are closed, their buffered bytes written first
        (the hook is bounded by ``--shutdown-timeout``; without the wait, a session's last
        frame could still be in a transport's buffer when the process ended)."""
        ended = self.api.shutdown()
        for c in list(self.connections):
            c.goaway()
        return ended.addCallback(lambda _: self._close_idle())

    def _close_idle(self):
        gone = [d for d in (c.close_if_idle() for c in list(self.connections)) if d is not None]
        return defer.DeferredList(gone) if gone else None


def _tls_wrap(factory, cert_path, key_path):
    from twisted.internet import ssl
    from twisted.protocols.tls import TLSMemoryBIOFactory

    with open(cert_path, "rb") as f:
        cert_pem = f.read()
    with open(key_path, "rb") as f:
        key_pem = f.read()
    cert = ssl.PrivateCertificate.loadPEM(cert_pem + b"\n" + key_pem)
    options = ssl.CertificateOptions(
        privateKey=cert.privateKey.original,
        certificate=cert.original,
        acceptableProtocols=[b"h2", b"http/1.1"],
    )
    return TLSMemoryBIOFactory(options, False, factory)


def build_factory(node):
    api_class = S2Api
    if getattr(node, "cluster", None) is not None:
        # CONTRACT §9: one account on every node (protocols/s2/cluster.py); loaded only with --cluster
        from protocols.s2.cluster import ClusterS2Api

        api_class = ClusterS2Api
    factory = S2Factory(node, api_class=api_class)
    node.on_shutdown(factory.shutdown)
    if api_class is not S2Api:
        # the port other nodes forward to (opened by the node with the cluster's TLS options)
        node.cluster.s2_catalog.serve_forwarded(ForwardedSite(factory.api, factory.max_body))
    cert = getattr(node.config, "http_tls_cert", None)
    if cert:
        return _tls_wrap(factory, cert, node.config.http_tls_key or cert)
    return factory
