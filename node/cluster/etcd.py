"""A small Twisted client for etcd's v3 JSON gateway (`/v3/...`), through treq.

etcd 3.4 serves its gRPC API as JSON over HTTP/1.1 (grpc-gateway): keys and values are base64,
64-bit integers are decimal strings, a field equal to its default is left out (so a missing
``succeeded`` means false and a missing ``TTL`` in a keep-alive answer means the lease is gone).
Every request is one POST; a watch is one POST whose response streams JSON messages.

Unary requests go to the first URL that answers: a connection failure, a timeout or a 5xx moves on
to the next URL with exponential backoff (``backoff_min`` doubling to ``backoff_max``) until
``deadline`` seconds have passed, then fails with EtcdUnavailable. A retried write may have been
applied once already (the answer was lost); the cluster's writes are compare-and-swap
transactions, so a repeat fails its compare and the caller re-reads.
"""

import base64
import json

from twisted.internet import defer, task
from twisted.internet.error import ConnectError, ConnectionClosed, DNSLookupError, TimeoutError
from twisted.logger import Logger
from twisted.web.client import Agent, HTTPConnectionPool, ResponseFailed

import treq
from treq.client import HTTPClient
from twisted.web import client as _web_client

# one "Starting factory" / "Stopping factory" line per etcd connection is noise in the node's log
_web_client._HTTP11ClientFactory.noisy = False


class EtcdError(Exception):
    """etcd answered with an error (a gRPC status in the gateway's JSON)."""

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No URL answered within the deadline."""


def b64(data) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode("ascii")


def unb64(text) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix) -> bytes:
    """The range_end that makes a range request cover every key starting with ``prefix``."""
    if isinstance(prefix, str):
        prefix = prefix.encode()
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class KV:
    """One key-value as etcd returns it."""

    __slots__ = ("key", "value", "create_revision", "mod_revision", "version", "lease")

    def __init__(self, raw):
        self.key = unb64(raw.get("key"))
        self.value = unb64(raw.get("value"))
        self.create_revision = int(raw.get("create_revision", 0))
        self.mod_revision = int(raw.get("mod_revision", 0))
        self.version = int(raw.get("version", 0))
        self.lease = int(raw.get("lease", 0))

    def json(self):
        return json.loads(self.value)

    def __repr__(self):
        return "KV(%r, rev %d)" % (self.key, self.mod_revision)


# -- transaction building blocks (plain dicts in the gateway's JSON shape) ----------------------

def compare_version(key, version: int):
    """True iff ``key``'s version is ``version`` (0: the key does not exist)."""
    return {"key": b64(key), "target": "VERSION", "result": "EQUAL", "version": str(version)}


def compare_mod_revision(key, revision: int):
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def compare_value(key, value):
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def op_put(key, value, lease: int = 0):
    body = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def op_get(key):
    return {"request_range": {"key": b64(key)}}


def op_delete(key):
    return {"request_delete_range": {"key": b64(key)}}


class TxnResult:
    __slots__ = ("succeeded", "responses", "revision")

    def __init__(self, raw):
        self.succeeded = bool(raw.get("succeeded", False))
        self.responses = raw.get("responses", [])
        self.revision = int(raw.get("header", {}).get("revision", 0))

    def kvs(self, i):
        """The KVs of the i-th response (a request_range)."""
        return [KV(kv) for kv in self.responses[i].get("response_range", {}).get("kvs", [])]


class TlsPolicy:
    """IPolicyForHTTPS for mutual TLS to etcd: the cluster CA as the only trust root and this
    node's certificate as the client certificate (node/cluster/tls.py)."""

    def __init__(self, cert_path, key_path, ca_path):
        self._paths = (cert_path, key_path, ca_path)
        self.creatorForNetloc(b"127.0.0.1", 0)  # unreadable files fail here, at start

    def creatorForNetloc(self, hostname, port):
        from node.cluster.tls import client_options

        return client_options(hostname.decode("ascii"), *self._paths)


def _implements_policy(cls):
    from twisted.web.iweb import IPolicyForHTTPS
    from zope.interface import classImplements

    classImplements(cls, IPolicyForHTTPS)
    return cls


_implements_policy(TlsPolicy)

_RETRYABLE = (ConnectError, ConnectionClosed, DNSLookupError, TimeoutError, ResponseFailed,
              defer.CancelledError)


class EtcdClient:
    log = Logger()

    def __init__(self, urls, reactor=None, tls=None, request_timeout=3.0, deadline=10.0,
                 backoff_min=0.05, backoff_max=1.0, observe=None):
        if reactor is None:
            from twisted.internet import reactor
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        if not urls:
            raise ValueError("no etcd URL")
        self.urls = [u.strip().rstrip("/") for u in urls]
        self.reactor = reactor
        self.request_timeout = request_timeout
        self.deadline = deadline
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self.observe = observe  # observe(seconds) after each answered unary request (metrics)
        self._current = 0  # index of the URL that answered last
        self._pool = HTTPConnectionPool(reactor, persistent=True)
        self._pool.maxPersistentPerHost = 16
        self._pool.retryAutomatically = False
        policy = TlsPolicy(*tls) if tls else None
        agent = Agent(reactor, contextFactory=policy, pool=self._pool) if policy else Agent(reactor, pool=self._pool)
        self._http = HTTPClient(agent)
        # streaming requests (watch, campaign) get their own non-persistent connections
        stream_pool = HTTPConnectionPool(reactor, persistent=False)
        self._stream_http = HTTPClient(
            Agent(reactor, contextFactory=policy, pool=stream_pool) if policy else Agent(reactor, pool=stream_pool))
        self._watches = set()
        self.available = True  # False while requests are failing (status)

    # -- transport ------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def call(self, path, body, deadline=None, timeout=None):
        """POST ``body`` (a dict) to ``path`` on some URL; the decoded JSON answer."""
        deadline = self.deadline if deadline is None else deadline
        timeout = self.request_timeout if timeout is None else timeout
        start = self.reactor.seconds()
        delay = self.backoff_min
        data = json.dumps(body).encode()
        attempt = 0
        last = None
        while True:
            url = self.urls[self._current % len(self.urls)]
            sent = self.reactor.seconds()
            try:
                resp = yield self._http.post(url + path, data=data, timeout=timeout,
                                             headers={b"Content-Type": [b"application/json"]})
                text = yield treq.content(resp)
                if resp.code >= 500:
                    raise _Retry("HTTP %d from %s: %s" % (resp.code, url, text[:200].decode(errors="replace")))
                answer = json.loads(text) if text else {}
                if resp.code != 200 or "error" in answer and "header" not in answer:
                    raise EtcdError("etcd %s: %s" % (path, answer.get("error") or answer.get("message") or text[:200]),
                                    answer.get("code"))
                self.available = True
                if self.observe is not None:
                    self.observe(self.reactor.seconds() - sent)
                return answer
            except (_Retry,) + _RETRYABLE as e:
                last = e
            attempt += 1
            self._current += 1
            if self.reactor.seconds() - start + delay > deadline:
                self.available = False
                raise EtcdUnavailable("etcd unreachable at %s (%s)" % (",".join(self.urls), _describe(last)))
            if attempt % len(self.urls) == 0:
                yield task.deferLater(self.reactor, delay, lambda: None)
                delay = min(delay * 2, self.backoff_max)

    def close(self):
        for w in list(self._watches):
            w.stop()
        return self._pool.closeCachedConnections()

    # -- kv -------------------------------------------------------------------------------------

    def get(self, key):
        d = self.call("/v3/kv/range", {"key": b64(key)})
        return d.addCallback(lambda a: KV(a["kvs"][0]) if a.get("kvs") else None)

    def get_prefix(self, prefix):
        """(list of KV, revision) of every key under ``prefix``, in key order."""
        d = self.call("/v3/kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})
        return d.addCallback(lambda a: ([KV(kv) for kv in a.get("kvs", [])], int(a["header"]["revision"])))

    def newest_under(self, prefix):
        """The highest mod_revision of any key under ``prefix`` (0 when there is none)."""
        body = {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "limit": 1, "keys_only": True,
                "sort_order": "DESCEND", "sort_target": "MOD"}
        d = self.call("/v3/kv/range", body)
        return d.addCallback(lambda a: KV(a["kvs"][0]).mod_revision if a.get("kvs") else 0)

    def put(self, key, value, lease=0):
        body = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        return self.call("/v3/kv/put", body)

    def delete(self, key):
        return self.call("/v3/kv/deleterange", {"key": b64(key)})

    def delete_prefix(self, prefix):
        return self.call("/v3/kv/deleterange", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})

    def txn(self, compare, success, failure=()):
        body = {"compare": list(compare), "success": list(success), "failure": list(failure)}
        return self.call("/v3/kv/txn", body).addCallback(TxnResult)

    # -- leases ---------------------------------------------------------------------------------

    def lease_grant(self, ttl: int):
        return self.call("/v3/lease/grant", {"TTL": str(ttl)}).addCallback(lambda a: int(a["ID"]))

    def lease_keepalive(self, lease_id: int, deadline=None, timeout=None):
        """The lease's remaining TTL; 0 when it has expired (etcd answers without a TTL)."""
        d = self.call("/v3/lease/keepalive", {"ID": str(lease_id)}, deadline=deadline, timeout=timeout)
        return d.addCallback(lambda a: int(a.get("result", {}).get("TTL", 0)))

    def lease_revoke(self, lease_id: int, deadline=None):
        d = self.call("/v3/lease/revoke", {"ID": str(lease_id)}, deadline=deadline)

        def gone(f):
            f.trap(EtcdError)
            if isinstance(f.value, EtcdUnavailable) or "not found" not in str(f.value):
                return f
            return None

        return d.addErrback(gone)

    # -- election -------------------------------------------------------------------------------

    def campaign(self, name, lease_id: int, value):
        """etcd's election: fires with the leader key once this lease leads ``name`` (it waits,
        however long, for every earlier candidate's key to go)."""
        body = {"name": b64(name), "lease": str(lease_id), "value": b64(value)}
        url = self.urls[self._current % len(self.urls)]
        d = self._stream_http.post(url + "/v3/election/campaign", data=json.dumps(body).encode(),
                                   headers={b"Content-Type": [b"application/json"]})
        d.addCallback(treq.content)

        def parsed(text):
            answer = json.loads(text)
            if "leader" not in answer:
                raise EtcdError("campaign: %s" % (answer.get("error") or answer.get("message") or text[:200]))
            return unb64(answer["leader"]["key"])

        return d.addCallback(parsed)

    # -- watch ----------------------------------------------------------------------------------

    def watch_prefix(self, prefix, start_revision, on_events, on_reset=None):
        """Call ``on_events(list of (kind, KV))`` for every change under ``prefix`` from
        ``start_revision``; kind is "PUT" or "DELETE". The watch reconnects (with backoff) from the
        revision after the last one seen; if etcd has compacted that revision, ``on_reset()`` is
        called so the caller can re-read and restart. Returns a Watch (``stop()``)."""
        w = Watch(self, prefix, start_revision, on_events, on_reset)
        self._watches.add(w)
        w.start()
        return w


class _Retry(Exception):
    pass


def _describe(e):
    if e is None:
        return "no answer"
    return "%s: %s" % (type(e).__name__, e) if str(e) else type(e).__name__


class Watch:
    log = Logger()

    def __init__(self, client, prefix, start_revision, on_events, on_reset):
        self.client = client
        self.prefix = prefix.encode() if isinstance(prefix, str) else prefix
        self.next_revision = start_revision
        self.on_events = on_events
        self.on_reset = on_reset
        self._stopped = False
        self._request = None
        self._delay = client.backoff_min
        self.connected = False

    def start(self):
        if self._stopped:
            return
        c = self.client
        body = {"create_request": {"key": b64(self.prefix), "range_end": b64(prefix_end(self.prefix)),
                                   "start_revision": str(self.next_revision)}}
        url = c.urls[c._current % len(c.urls)]
        buf = bytearray()

        def got(chunk):
            if self._stopped:
                raise defer.CancelledError()  # treq closes the connection
            buf.extend(chunk)
            self._parse(buf)

        d = c._stream_http.post(url + "/v3/watch", data=json.dumps(body).encode(),
                                headers={b"Content-Type": [b"application/json"]})
        self._request = d
        d.addCallback(lambda resp: treq.collect(resp, got))
        d.addBoth(self._ended)

    def _parse(self, buf):
        decoder = json.JSONDecoder()
        text = buf.decode("utf-8", errors="replace")
        pos = 0
        while True:
            while pos < len(text) and text[pos] in " \r\n\t":
                pos += 1
            if pos >= len(text):
                break
            try:
                msg, pos = decoder.raw_decode(text, pos)
            except ValueError:
                break
            self._message(msg)
        del buf[:len(text[:pos].encode("utf-8"))]

    def _message(self, msg):
        result = msg.get("result", msg)
        if "error" in msg:
            self.log.warn("etcd watch error: {error}", error=msg["error"])
            return
        self.connected = True
        self._delay = self.client.backoff_min
        if result.get("compact_revision") and int(result["compact_revision"]) > 0:
            self.next_revision = int(result["compact_revision"])
            if self.on_reset is not None:
                self.on_reset()
            return
        events = []
        for ev in result.get("events", []):
            kv = KV(ev.get("kv", {}))
            events.append((ev.get("type", "PUT"), kv))
            self.next_revision = max(self.next_revision, kv.mod_revision + 1)
        if events:
            try:
                self.on_events(events)
            except Exception:
                self.log.failure("watch callback failed")

    def _ended(self, result):
        self.connected = False
        self._request = None
        if self._stopped:
            return None
        self.client._current += 1
        delay, self._delay = self._delay, min(self._delay * 2, self.client.backoff_max)
        self.client.reactor.callLater(delay, self.start)
        return None

    def stop(self):
        self._stopped = True
        self.client._watches.discard(self)
        if self._request is not None:
            self._request.cancel()
