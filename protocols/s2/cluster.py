"""The S2 API in cluster mode (CONTRACT §9 "Every interface, every node"; docs/protocols/s2.md,
"In a cluster"): every node serves one account.

With ``--cluster`` the ``--http`` listener's API is ``ClusterS2Api``; without it this module is
never loaded and nothing changes. The control plane (basins, stream names and configs, fencing
tokens, access tokens) lives in etcd behind ``node.cluster.s2_catalog``
(node/cluster/s2_catalog.py), injected by the node; an S2 stream is a replicated stream of the
placement driver (R = ``--replication-factor``), and this module sees it as a ``StreamView``:
the catalog entry plus this node's replica, if it holds one.

Data: appends are sequenced on the open range's primary, through the replicator (an S2 append
there is acknowledged once a majority holds it); the primary alone keeps a stream's S2 state
(fencing token, last timestamp, next seq_num), so ``match_seq_num``, fencing and timestamps mean
what they mean on one node. Another node forwards the append, the append session, and the
check-tail to the primary (protocols/s2/forward.py). Reads and read sessions are served from a
local replica of the open range (up to the confirm offset it has learned); a unary read starting
at or past that replica's tail is forwarded to the primary, so a record acknowledged anywhere is
readable everywhere at once; a node without a replica forwards every read.
"""

import hmac

from twisted.internet import defer
from twisted.logger import Logger

from protocols.s2 import access, codec
from protocols.s2.api import DEFAULT_BASIN, S2Api
from protocols.s2.codec import S2Error
from protocols.s2.forward import REFUSED, ForwardedAppendSession, Forwarder, unknown_outcome
from protocols.s2.sessions import AppendSession
from protocols.s2.tokens import AccessTokens
from storage import errors

# what the catalog says a cluster error is (S2Catalog.classify) -> the S2 error
_ERRORS = {
    "no_available_rs": (503, "unavailable"),
    "stream_not_found": (404, "stream_not_found"),
    "not_here": (503, "unavailable"),
    "unavailable": (503, "unavailable"),
    "no_primary": (503, "unavailable"),
    "error": (503, "unavailable"),
}


class StreamView:
    """An S2 stream of the cluster as the handlers see a stream's meta: the S2 attrs from the
    catalog, offsets from this node's replica (0 without one)."""

    __slots__ = ("stream_id", "attrs", "created_ms", "retention_period_ms", "origin", "_log")

    def __init__(self, log, basin, name, entry):
        config = entry.get("config") or codec.default_stream_config()
        self.stream_id = entry["stream_id"]
        self.attrs = {"s2_basin": basin, "s2_name": name, "s2_config": config, "s2_fence": entry.get("fence") or ""}
        if entry.get("cipher"):
            self.attrs["s2_cipher"] = entry["cipher"]
        self.created_ms = entry.get("created_ms", 0)
        self.retention_period_ms = codec.retention_ms(config)
        self.origin = None
        self._log = log

    def _local(self):
        try:
            return self._log.stream(self.stream_id)
        except errors.StreamNotFound:
            return None

    @property
    def next_offset(self):
        m = self._local()
        return m.next_offset if m is not None else 0

    @property
    def trim_offset(self):
        m = self._local()
        return m.trim_offset if m is not None else 0


class CatalogBasins:
    """The basin calls of protocols/s2/basins.py, served by the etcd catalog."""

    def __init__(self, catalog):
        self.catalog = catalog

    def get(self, name, fresh=False):
        return self.catalog.basin(name, fresh)

    def list(self, prefix=""):
        return self.catalog.list_basins(prefix)

    def create(self, name, rec):
        return self.catalog.create_basin(name, rec)

    def change(self, name, fn):
        return self.catalog.change_basin(name, fn)

    def delete(self, name):
        return self.catalog.delete_basin(name)  # its streams too


class ClusterAccessTokens(AccessTokens):
    """Access tokens in etcd: issued on any node, valid on every node; every node's
    ``--http-token`` is a root token on all of them, and the API is open only while no node has one."""

    def __init__(self, catalog, root_token):
        super().__init__(None, root_token)
        self.catalog = catalog

    def _hashes(self):
        return self.catalog.token_hashes

    def _is_root(self, presented) -> bool:
        if super()._is_root(presented):
            return True
        digest = access.hash_token(presented)
        found = False
        for h in self.catalog.root_hashes():
            found |= hmac.compare_digest(digest, h)
        return found

    def _open(self) -> bool:
        return self.root_token is None and not self.catalog.root_hashes()

    def _insert(self, token_id, rec):
        return self.catalog.issue_token(token_id, rec)

    async def _rows(self, prefix):
        return await self.catalog.list_tokens(prefix)

    def _remove(self, token_id):
        return self.catalog.revoke_token(token_id)


class ClusterS2Api(S2Api):
    log = Logger()

    def __init__(self, node):
        super().__init__(node)
        self.catalog = node.cluster.s2_catalog
        self.forwarder = Forwarder(self.reactor, tls=self.catalog.forward_tls())
        self.tokens = ClusterAccessTokens(self.catalog, self.token)
        self.basins = CatalogBasins(self.catalog)
        self.epochs = {}  # stream id -> the epoch its S2 state was loaded under (this node as primary)

    def shutdown(self):
        ended = super().shutdown()
        self.forwarder.close()
        return ended

    # -- dispatch: a token issued on another node a moment ago ----------------------------------

    def dispatch(self, responder):
        header = responder.request.header("authorization", "")
        presented = header[7:].strip() if header[:7].lower() == "bearer " else None
        if presented and presented.startswith(access.TOKEN_PREFIX) and \
                access.hash_token(presented) not in self.catalog.token_hashes:
            # this node's watch may not have delivered it yet: read etcd before saying 401
            held = _Sink()
            responder.body_sink = held
            d = self.catalog.refresh_tokens()
            d.addErrback(lambda f: self.log.warn("reading access tokens from etcd failed: {e}", e=f.value))
            d.addCallback(lambda _: self._dispatch_held(responder, held))
            return
        super().dispatch(responder)

    def _dispatch_held(self, responder, held):
        responder.body_sink = None
        if responder.closed:
            return
        responder.body_done = False
        super().dispatch(responder)
        if held.buf:
            responder.body_received(bytes(held.buf))
        if held.ended:
            responder.body_ended()

    def to_s2(self, failure):
        e = failure.value
        kind = self.catalog.classify(e)
        if kind is not None:
            status, code = _ERRORS[kind[0]]
            return S2Error(status, code, kind[1])
        if isinstance(e, errors.RangeAlreadySealed):
            return S2Error(503, "unavailable", "the stream's range was sealed (failover); retry")
        if isinstance(e, REFUSED):
            return S2Error(503, "unavailable", "the stream's primary is unreachable; retry")
        if isinstance(e, Exception) and type(e).__module__.startswith("twisted.web"):
            return unknown_outcome("the request")
        return super().to_s2(failure)

    # -- basins ---------------------------------------------------------------------------------

    def ensure_default_basin(self):
        return defer.succeed(None)  # implied on every node (a catalog record once reconfigured)

    # -- streams --------------------------------------------------------------------------------

    def _name_of(self, meta):
        attrs = meta.attrs or {}
        if attrs.get("s2_name") is None:
            known = self.catalog.name_of(meta.stream_id)
            if known is not None:
                return known
        return S2Api._name_of(meta)

    def _fence_of(self, meta):
        attrs = meta.attrs or {}
        if attrs.get("s2_name") is None:
            entry = self.catalog.entry_of(meta.stream_id)
            return (entry or {}).get("fence") or ""
        return attrs.get("s2_fence", "")

    def _view(self, sid):
        key = self.catalog.name_of(sid)
        entry = self.catalog.entry_of(sid)
        if key is None or entry is None:
            return StreamView(self.store.log, DEFAULT_BASIN, str(sid), {"stream_id": sid})
        return StreamView(self.store.log, key[0], key[1], entry)

    async def find_stream(self, basin, name, fresh=False):
        entry = await self.catalog.stream(basin, name, fresh)
        if entry is not None:
            return StreamView(self.store.log, basin, name, entry)
        if basin == DEFAULT_BASIN and name.isdigit() and name == str(int(name)):
            # a stream made through SBP, under its decimal id (as on a single node)
            sid = int(name)
            rec = await self.catalog.sbp_stream(sid)
            if rec is not None and self.catalog.name_of(sid) is None:
                return StreamView(self.store.log, basin, name, {"stream_id": sid, "created_ms": rec.get("created_ms", 0)})
        return None

    async def _create(self, basin, name, config, basin_rec):
        key = (basin, name)
        if key in self.creating:
            return None
        self.creating.add(key)
        try:
            entry = await self.catalog.create_stream(basin, name, config, basin_rec["config"].get("stream_cipher"),
                                                     codec.retention_ms(config))
        finally:
            self.creating.discard(key)
        return StreamView(self.store.log, basin, name, entry) if entry is not None else None

    async def streams_named(self, basin, prefix):
        out = [(n, StreamView(self.store.log, basin, n, e)) for n, e in await self.catalog.list_streams(basin, prefix)]
        if basin == DEFAULT_BASIN:
            # the streams made through SBP, under their decimal id (as find_stream reaches them)
            for name, rec in await self.catalog.sbp_streams(prefix):
                entry = {"stream_id": rec["stream_id"], "created_ms": rec.get("created_ms", 0)}
                out.append((name, StreamView(self.store.log, basin, name, entry)))
        return out

    def streams_of(self, basin):
        out = []
        for (b, n), entry in list(self.catalog.streams.items()):
            if b == basin:
                view = StreamView(self.store.log, b, n, entry)
                if view._local() is not None:
                    out.append(view)  # the bytes this node holds (metrics are per node)
        return out

    async def _reconfigure(self, meta, config):
        basin, name = self._name_of(meta)
        if self.catalog.name_of(meta.stream_id) is None:
            raise S2Error(403, "permission_denied", "an SBP stream is reconfigured through SBP in a cluster")
        entry = await self.catalog.set_config(basin, name, config, codec.retention_ms(config))
        return StreamView(self.store.log, basin, name, entry)

    async def delete_stream(self, meta):
        basin, name = self._name_of(meta)
        await self.catalog.delete_stream(basin, name)
        self.states.pop(meta.stream_id, None)

    # -- append: on the primary, through the replicator; forwarded elsewhere -----------------------

    def _append_meta(self, sid):
        local = self.store.log.stream(sid)  # StreamNotFound if this node lost the stream
        view = self._view(sid)
        view.origin = local.origin
        return view

    def _log_append(self, sid, batch, expect_offset):
        return self.catalog.append(sid, batch, expect_offset)

    def _persist_fence(self, st, commands):
        if any(op == b"fence" for _seq, op, _body in commands):
            key = self.catalog.name_of(st.sid)
            if key is not None:
                return self.catalog.set_fence(key[0], key[1], st.fence)
        return None

    def _apply_trims(self, sid, base, commands):
        for i, op, body in commands:
            if op == b"trim":
                point = min(codec.command_payload(op, body), base + i + 1)
                self.catalog.trim(sid, point).addErrback(lambda f: self.log.warn("trim command failed: {e}", e=f.value))

    async def append(self, sid, inp, auth=None, cipher=None):
        if not self.catalog.is_primary(sid):
            raise S2Error(503, "unavailable", "this node no longer sequences the stream (failover); retry")
        epoch = self.catalog.epoch(sid)
        if self.epochs.get(sid) != epoch:
            # a range this node sequences anew: reload the fencing token, last timestamp and next
            # seq_num from the catalog and the stream (CONTRACT §9 Failover)
            st = self.states.get(sid)
            if st is not None and not st.loading:
                del self.states[sid]
            self.epochs[sid] = epoch
        return await super().append(sid, inp, auth, cipher)

    @staticmethod
    def _forwarded(req):
        return req.forwarded  # it came in on this node's S2 forwarding port

    async def _primary(self, req, sid):
        """None: this node sequences ``sid``; else the primary's forwarding port. A forwarded
        request is answered at once (503) when this node does not sequence the stream: the
        forwarding node waits out a failover and retries, not this one."""
        if self._forwarded(req):
            if await self._target_now(sid) is not None:
                raise S2Error(503, "unavailable", "the stream's primary moved; retry")
            return None
        return await self.catalog.append_target(sid)

    async def _target_now(self, sid):
        """``append_target`` without waiting: None (here), the primary's forwarding port, or ""
        (no live primary: a failover is under way)."""
        try:
            return await self.catalog.append_target(sid, wait_s=0)
        except Exception as e:
            kind = self.catalog.classify(e)
            if kind is None or kind[0] != "no_primary":
                raise
            return ""

    async def _retarget(self, sid, avoid):
        """Where appends to ``sid`` go now (None: here), waiting out a failover; 503 after it."""
        try:
            return await self.catalog.append_target(sid, avoid=avoid)
        except Exception as e:
            kind = self.catalog.classify(e)
            if kind is not None and kind[0] == "no_primary":
                raise S2Error(503, "unavailable", "the stream has no live primary yet (failover); retry")
            raise

    async def _forward_unary(self, req, responder, sid, target, body=None):
        while True:
            try:
                return await self.forwarder.unary(target, req, responder, body)
            except REFUSED:
                target = await self._retarget(sid, target)  # nothing was sent: the next primary
                if target is None:
                    raise S2Error(503, "unavailable", "this node became the stream's primary; retry")

    async def h_append(self, req, responder, body):
        meta = await self._stream(req, auto_create="create_stream_on_append")
        target = await self._primary(req, meta.stream_id)
        if target is None:
            return await super().h_append(req, responder, body)
        await self._forward_unary(req, responder, meta.stream_id, target, body)

    async def open_append_session(self, req, responder):
        meta = await self._stream(req, auto_create="create_stream_on_append")
        sid = meta.stream_id
        if self._forwarded(req):
            await self._primary(req, sid)  # 503 unless this node sequences the stream
            return await super().open_append_session(req, responder)
        target = await self._target_now(sid)  # "": a failover is under way, the session waits for it
        if target is None:
            return await super().open_append_session(req, responder)
        # The session starts at once whatever the failover does: the SDKs give up on a session
        # whose response headers take longer than their request timeout (5 s by default), and
        # do not retry that; its inputs wait for the new primary inside the session instead.
        session = ForwardedAppendSession(
            self.forwarder, responder, req, target or None,
            lambda avoid: defer.ensureDeferred(self._retarget(sid, avoid)),
            open_range=lambda: self.catalog.open_range(sid),
            take_over=lambda payloads, ended: self._take_over(req, responder, sid, payloads, ended))
        responder.start(200, [("content-type", "s2s/proto")])
        responder.attach_sink(session)

    def _take_over(self, req, responder, sid, payloads, ended):
        """This node became the primary during a forwarded session: a local session goes on
        with the client's stream (the forwarded one hands it every input it did not send)."""
        session = AppendSession(self, responder, sid, req.auth, self.cipher_for(self._view(sid), req))
        session.take(payloads)
        if ended:
            session.end()
        return session

    # -- reads: a local replica, else the primary ---------------------------------------------------

    async def h_tail(self, req, responder, body):
        meta = await self._stream(req, auto_create="create_stream_on_read")
        if self._forwarded(req) or await self.catalog.read_here(meta.stream_id) and self.catalog.is_primary(meta.stream_id):
            return await super().h_tail(req, responder, body)
        # the tail as the sequencer knows it (a replica learns the confirm offset a moment later)
        target = await self._primary(req, meta.stream_id)
        if target is None:
            return await super().h_tail(req, responder, body)
        await self._forward_unary(req, responder, meta.stream_id, target)

    async def h_read(self, req, responder, body):
        meta = await self._stream(req, auto_create="create_stream_on_read")
        sid = meta.stream_id
        if self._forwarded(req) or self.catalog.is_primary(sid):
            return await super().h_read(req, responder, body)
        if await self.catalog.read_here(sid):
            p = codec.parse_read_params(req.query)
            if p.seq_num is None or p.seq_num < meta.next_offset:
                return await super().h_read(req, responder, body)
        target = await self._primary(req, sid)
        if target is None:
            return await super().h_read(req, responder, body)
        await self._forward_unary(req, responder, sid, target)

    async def _read_session(self, req, responder, kind):
        meta = await self._stream(req, auto_create="create_stream_on_read")
        sid = meta.stream_id
        if self._forwarded(req) or await self.catalog.read_here(sid):
            return await super()._read_session(req, responder, kind)
        target = await self._primary(req, sid)
        if target is None:
            return await super()._read_session(req, responder, kind)
        while True:
            try:
                return await self.forwarder.stream(target, req, responder)
            except REFUSED:
                target = await self._retarget(sid, target)


class _Sink:
    """Request bytes that arrive while a request waits for the token cache."""

    def __init__(self):
        self.buf = bytearray()
        self.ended = False

    def data(self, data):
        self.buf += data

    def end(self):
        self.ended = True
