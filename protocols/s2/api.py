"""S2 REST API v1 request handlers over the shared store (CONTRACT §2, §7; docs/protocols/s2.md).

Transport-neutral: the HTTP/1.1 and HTTP/2 front ends hand ``dispatch`` a responder (see
protocols/s2/http.py). An S2 stream IS a store stream: records are stored as record batches
(one batch per S2 AppendInput), and basin, name, config and fencing token live in
``StreamMeta.attrs`` (keys ``s2_basin``, ``s2_name``, ``s2_config``, ``s2_fence``). Streams created
through SBP appear in the default basin under their decimal id. Basins live in the metadata table
``s2_basins``.

Ordering: every append for a stream is checked (fencing token, match_seq_num), timestamped and
handed to ``store.log.append`` in one reactor turn, so the store assigns offsets in arrival order.
The only wait before that is loading a stream's last timestamp once (``_StreamState``), and
appends queued behind that load are released in arrival order.
"""

import re
import time

import msgpack
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from protocols.s2 import codec, crypto
from protocols.s2.basins import BASINS_TABLE, LocalBasins
from protocols.s2.codec import S2Error
from protocols.s2.metrics import MetricsApi, S2Counters
from protocols.s2.sessions import READ_CHUNK_BYTES, AppendSession, ReadSession, now_ms
from protocols.s2.tokens import AccessTokens
from storage import errors, record_batch

DEFAULT_BASIN = "sbpnode-default"
PROTO_TYPES = ("application/protobuf", "application/x-protobuf", "application/proto")
JSON = ("content-type", "application/json")
PROTO = ("content-type", "application/protobuf")


def _media(value) -> str:
    if not value:
        return ""
    return value.split(",")[0].split(";")[0].strip().lower()


class _StreamState:
    """Per-stream S2 state kept in memory: fencing token, last timestamp, next seq we know of."""

    __slots__ = ("sid", "fence", "last_ts", "tail_ts", "assigned", "ready", "waiters", "loading")

    def __init__(self, sid, fence):
        self.sid = sid
        self.fence = fence
        self.last_ts = 0  # highest timestamp handed out (stamping keeps timestamps non-decreasing)
        self.tail_ts = 0  # timestamp of the last durable record (the tail's timestamp)
        # The next seq_num S2 appends will get: the store's next_offset advances only once a
        # batch is durable, while offsets are assigned at call time.
        self.assigned = -1
        self.ready = False
        self.loading = False
        self.waiters = []


class S2Api:
    log = Logger()

    def __init__(self, node):
        self.node = node
        self.store = node.store
        self.reactor = node.reactor
        self.token = node.config.http_token
        self.max_batch_bytes = node.config.max_batch_bytes
        self.states = {}
        self.index = None  # (basin, name) -> stream id of S2-named streams; see _names()
        self.creating = set()
        self.sessions = set()
        self._sessions_gone = []  # Deferreds of shutdown(): fired once no read session is left
        self.metrics = node.metrics.setdefault("s2", {"requests": 0, "appended_records": 0, "read_records": 0})
        self.statuses = node.metrics.setdefault("s2_responses", {})  # "route status" -> responses
        self.tokens = AccessTokens(self.store, self.token)
        self.basins = LocalBasins(self.store, self._delete_streams_of)  # protocols/s2/basins.py
        self.counters = S2Counters(self.metrics)
        self.metrics_api = MetricsApi(self, self.counters)
        self.node_pages = getattr(node, "http_pages", None)  # /metrics and the status page, outside the S2 routes

    # -----------------------------------------------------------------------------------------
    # Start-up

    def ensure_default_basin(self):
        """CONTRACT §7: the basin ``sbpnode-default`` exists from first start."""
        key = DEFAULT_BASIN.encode()

        def fn(txn):
            if txn.get(BASINS_TABLE, key) is None:
                txn.put(BASINS_TABLE, key, {"created_ms": now_ms(), "config": codec.default_basin_config()})

        return self.store.meta.transact(fn)

    # -----------------------------------------------------------------------------------------
    # Dispatch

    def dispatch(self, responder):
        responder.statuses = self.statuses
        responder.route = route_group(responder.request.segments)
        if self.node_pages is not None and self.node_pages(responder):
            return
        req = responder.request
        self.metrics["requests"] += 1
        try:
            handler = self._route(req, responder)
        except S2Error as e:
            err = e
            responder.on_body = lambda body: self.send_error(responder, err)
            return
        if handler is None:
            return
        responder.body_too_large = lambda: self.send_error(
            responder, S2Error(413, "invalid", "request body exceeds %d bytes" % req.max_body)
        )
        responder.on_body = lambda body: self._run(responder, self._call(handler, req, responder, body))

    async def _call(self, handler, req, responder, body):
        encoding = req.header("content-encoding")
        if encoding and body:
            body = codec.decompress(encoding, body, req.max_body)
        await handler(req, responder, body)

    def _run(self, responder, coro):
        d = defer.ensureDeferred(coro)
        d.addErrback(self._failed, responder)

    def _failed(self, failure, responder):
        err = self.to_s2(failure)
        if responder.started:
            if not responder.closed:
                responder.abort()
            return
        self.send_error(responder, err)

    def to_s2(self, failure) -> S2Error:
        e = failure.value
        if isinstance(e, S2Error):
            return e
        if isinstance(e, errors.StreamNotFound):
            return S2Error(404, "stream_not_found", "stream not found")
        if isinstance(e, errors.ReadOnlyStream):
            return S2Error(403, "permission_denied", "stream is a read-only replica of %s" % (e.args[0] if e.args else "a peer"))
        if isinstance(e, errors.PayloadTooLarge):
            return codec.invalid("batch too large")
        if isinstance(e, errors.InvalidRequest):
            return codec.invalid(str(e))
        if isinstance(e, errors.StoreBusy):
            return S2Error(503, "unavailable", "the store is busy; retry")
        if isinstance(e, errors.DiskFault):  # a full disk, or read-only after a disk error (issue 21)
            err = S2Error(503, "unavailable", str(e))
            err.logged = True  # the store logged the condition once; no line per request
            return err
        if isinstance(e, errors.StoreClosed):
            return S2Error(503, "server_draining", "the node is shutting down")
        if isinstance(e, errors.OffsetOutOfRange):
            return S2Error(416, "read_unwritten", "read position out of range")
        if isinstance(e, defer.CancelledError):
            return S2Error(503, "unavailable", "request cancelled")
        self.log.failure("S2 request failed", failure)
        return S2Error(500, "storage" if isinstance(e, errors.StoreError) else "other", str(e) or type(e).__name__)

    def send_error(self, responder, err: S2Error):
        if (err.status >= 500 or err.status in (401, 403)) and not getattr(err, "logged", False):
            self.log.warn(
                "S2 {method} {path} from {peer}: {status} {code} {message}",
                method=responder.request.method, path=responder.request.raw_path,
                peer=responder.request.peer, status=err.status, code=err.code, message=err.message,
            )
        responder.respond(err.status, [JSON], err.json_bytes())

    def _route(self, req, responder):
        seg = req.segments
        m = req.method
        if seg == ["health"] and m == "GET":
            return self.h_health
        req.auth = auth = self.tokens.authenticate(req)
        if len(seg) < 2 or seg[0] != "v1":
            raise S2Error(404, "bad_path", "no such resource")
        handler, op, basin, stream = self._resolve(req, responder, seg, m)
        if op is not None:
            auth.require(op, basin=basin, stream=stream)
        self.counters.op(op, basin)
        if handler == self._start_append_session:
            # An S2S append session starts before its request body ends (it is the session).
            self._run(responder, self.open_append_session(req, responder))
            return None
        return handler

    def _start_append_session(self):
        raise AssertionError("dispatched in _route")

    def _resolve(self, req, responder, seg, m):
        """(handler, S2 operation, basin, stream) of a request; the handler checks resources it
        only learns from the body (names of new basins, streams, tokens) and filters listings."""
        kind = seg[1]
        if kind == "basins":
            if len(seg) == 2:
                return _pick(m, {"GET": (self.h_list_basins, "list-basins"),
                                 "POST": (self.h_create_basin, "create-basin")}) + (None, None)
            if len(seg) == 3:
                handler, op = _pick(m, {
                    "GET": (self.h_get_basin, "get-basin-config"),
                    "PUT": (self.h_ensure_basin, "create-basin"),
                    "PATCH": (self.h_reconfigure_basin, "reconfigure-basin"),
                    "DELETE": (self.h_delete_basin, "delete-basin"),
                })
                return handler, op, seg[2], None
        elif kind == "streams":
            basin = self._req_basin(req)
            if len(seg) == 2:
                return _pick(m, {"GET": (self.h_list_streams, "list-streams"),
                                 "POST": (self.h_create_stream, "create-stream")}) + (basin, None)
            if len(seg) >= 3:
                # An auto_prefix_streams token names its streams without its prefix.
                seg[2] = req.auth.prefix + seg[2]
            stream = seg[2] if len(seg) >= 3 else None
            if len(seg) == 3:
                handler, op = _pick(m, {
                    "GET": (self.h_get_stream, "get-stream-config"),
                    "PUT": (self.h_ensure_stream, "create-stream"),
                    "PATCH": (self.h_reconfigure_stream, "reconfigure-stream"),
                    "DELETE": (self.h_delete_stream, "delete-stream"),
                })
                return handler, op, basin, stream
            if len(seg) == 4 and seg[3] == "records":
                s2s = _media(req.header("content-type")) == "s2s/proto"
                if m == "POST" and s2s:
                    return self._start_append_session, "append", basin, stream
                if m == "GET":
                    if s2s:
                        return self.h_read_s2s, "read", basin, stream
                    if _media(req.header("accept")) == "text/event-stream":
                        return self.h_read_sse, "read", basin, stream
                    return self.h_read, "read", basin, stream
                if m == "POST":
                    return self.h_append, "append", basin, stream
                _no_method()
            if len(seg) == 5 and seg[3] == "records" and seg[4] == "tail":
                if m == "GET":
                    return self.h_tail, "check-tail", basin, stream
                _no_method()
        elif kind == "access-tokens":
            if len(seg) == 2:
                return _pick(m, {"GET": (self.tokens.h_list, "list-access-tokens"),
                                 "POST": (self.tokens.h_issue, "issue-access-token")}) + (None, None)
            if len(seg) == 3 and m == "DELETE":
                req.auth.require("revoke-access-token", token_id=seg[2])
                return self.tokens.h_revoke, "revoke-access-token", None, None
            if len(seg) == 3:
                _no_method()
        elif kind == "metrics":
            if 2 <= len(seg) <= 4:
                if m != "GET":
                    _no_method()
                op = ("account-metrics", "basin-metrics", "stream-metrics")[len(seg) - 2]
                if len(seg) == 4:
                    seg[3] = req.auth.prefix + seg[3]  # auto_prefix_streams, as on stream paths
                return self.metrics_api.h_metrics, op, (seg[2] if len(seg) > 2 else None), \
                    (seg[3] if len(seg) > 3 else None)
        elif kind == "locations":
            if len(seg) == 2:
                return _pick(m, {"GET": (self.h_list_locations, "list-locations")}) + (None, None)
            if len(seg) == 3 and seg[2] == "default":
                return _pick(m, {"GET": (self.h_get_default_location, "get-default-location"),
                                 "PUT": (self.h_set_default_location, "set-default-location")}) + (None, None)
        raise S2Error(404, "bad_path", "no such resource")

    # -----------------------------------------------------------------------------------------
    # Locations: the node is one location, "local" (every basin's location), private to it.

    async def h_list_locations(self, req, responder, body):
        responder.respond(200, [JSON], codec.dumps([LOCAL_LOCATION]))

    async def h_get_default_location(self, req, responder, body):
        responder.respond(200, [JSON], codec.dumps(LOCAL_LOCATION))

    async def h_set_default_location(self, req, responder, body):
        check_location(codec.parse_json(body))
        responder.respond(200, [JSON], codec.dumps(LOCAL_LOCATION))

    # -----------------------------------------------------------------------------------------
    # Basins

    async def _basin(self, name, fresh=False):
        rec = await self.basins.get(name, fresh)
        if rec is None and name == DEFAULT_BASIN:
            rec = {"created_ms": 0, "config": codec.default_basin_config()}
        return rec

    async def _require_basin(self, name, fresh=False):
        """``fresh``: a read that must see every write acknowledged before it, on any node (a
        cluster's control-plane GETs); the data path may use a cache that trails by milliseconds."""
        rec = await self._basin(name, fresh)
        if rec is None:
            raise S2Error(404, "basin_not_found", "basin %s not found" % name)
        return rec

    def _basin_info(self, name, rec):
        return {"name": name, "location": "local", "created_at": codec.rfc3339(rec.get("created_ms", 0)),
                "deleted_at": None, "state": "active"}

    async def h_health(self, req, responder, body):
        responder.respond(200, [JSON], b'{"status":"ok"}')

    async def h_list_basins(self, req, responder, body):
        prefix = req.query.get("prefix", "")
        start_after = req.query.get("start_after", "")
        limit = limit_param(req.query)
        names = dict(await self.basins.list(prefix))
        if DEFAULT_BASIN not in names and DEFAULT_BASIN.startswith(prefix):
            names[DEFAULT_BASIN] = await self._basin(DEFAULT_BASIN)
        ordered = [n for n in sorted(names) if n > start_after and req.auth.sees("basins", n)]
        page = ordered[:limit]
        out = {"basins": [self._basin_info(n, names[n]) for n in page], "has_more": len(ordered) > limit}
        responder.respond(200, [JSON], codec.dumps(out))

    async def h_create_basin(self, req, responder, body):
        obj = codec.parse_json(body)
        if not isinstance(obj, dict):
            raise codec.bad("bad_json", "expected {\"basin\": name}")
        name = codec.validate_basin_name(obj.get("basin"))
        req.auth.require("create-basin", basin=name)
        check_location(obj.get("location"))
        config = codec.merge_basin_config(codec.default_basin_config(), obj.get("config"))
        check_cipher(config)
        rec = {"created_ms": now_ms(), "config": config}
        if name == DEFAULT_BASIN or not await self.basins.create(name, rec):
            raise S2Error(409, "resource_already_exists", "basin %s already exists" % name)
        responder.respond(201, [JSON], codec.dumps(self._basin_info(name, rec)))

    async def h_ensure_basin(self, req, responder, body):
        name = codec.validate_basin_name(req.segments[2])
        obj = codec.parse_json(body) or {}
        if not isinstance(obj, dict):
            raise codec.bad("bad_json", "expected an object")
        patch = obj.get("config")
        check_location(obj.get("location"))
        check_cipher(codec.merge_basin_config({}, patch))
        if await self.basins.get(name) is not None or name == DEFAULT_BASIN:
            req.auth.require("reconfigure-basin", basin=name)  # ensure of an existing basin

        def fn(rec):
            if rec is None:
                if name != DEFAULT_BASIN:
                    return "created", {"created_ms": now_ms(),
                                       "config": codec.merge_basin_config(codec.default_basin_config(), patch)}
                rec = {"created_ms": 0, "config": codec.default_basin_config()}  # implied (a cluster)
            new = codec.merge_basin_config(rec["config"], patch)
            if new == rec["config"]:
                return "noop", None
            return "updated", dict(rec, config=new)

        result, rec = await self.basins.change(name, fn)
        if rec is None:
            rec = await self._basin(name)
        responder.respond(201 if result == "created" else 200, [JSON, ("s2-provision-result", result)],
                          codec.dumps(self._basin_info(name, rec)))

    async def h_get_basin(self, req, responder, body):
        rec = await self._require_basin(req.segments[2], fresh=True)
        responder.respond(200, [JSON], codec.dumps(codec.basin_config_json(rec["config"])))

    async def h_reconfigure_basin(self, req, responder, body):
        name = req.segments[2]
        await self._require_basin(name)
        patch = codec.parse_json(body) or {}
        check_cipher(codec.merge_basin_config({}, patch))

        def fn(rec):
            rec = rec or {"created_ms": 0, "config": codec.default_basin_config()}
            return None, dict(rec, config=codec.merge_basin_config(rec["config"], patch))

        _, rec = await self.basins.change(name, fn)
        responder.respond(200, [JSON], codec.dumps(codec.basin_config_json(rec["config"])))

    async def h_delete_basin(self, req, responder, body):
        name = req.segments[2]
        await self._require_basin(name)
        if name == DEFAULT_BASIN:
            raise S2Error(403, "permission_denied", "the default basin cannot be deleted")
        await self.basins.delete(name)
        responder.respond(202, [JSON], b"{}")

    async def _delete_streams_of(self, basin):
        for meta in self.store.log.streams():
            if self._name_of(meta)[0] == basin and meta.origin is None:
                await self.store.log.delete_stream(meta.stream_id)
                self._forget(meta)

    # -----------------------------------------------------------------------------------------
    # Streams: names and configuration

    @staticmethod
    def _name_of(meta):
        attrs = meta.attrs or {}
        name = attrs.get("s2_name")
        if name is None:
            return DEFAULT_BASIN, str(meta.stream_id)
        return attrs.get("s2_basin", DEFAULT_BASIN), name

    def _names(self):
        """The (basin, name) -> stream id index of S2-named streams, built once from the store.

        Only S2 creates S2-named streams (swarm replicas and SBP streams carry no ``s2_name``;
        they are found by their decimal id), so the index is kept exact by ``_create`` and
        ``h_delete_stream``: a lookup or a create costs O(1) whatever the number of streams."""
        if self.index is None:
            self.index = {}
            for m in self.store.log.streams():
                if (m.attrs or {}).get("s2_name") is not None:
                    self.index[self._name_of(m)] = m.stream_id
        return self.index

    def _forget(self, meta):
        # After the store deleted it; a create of the same name meanwhile keeps its new entry.
        key = self._name_of(meta)
        if self._names().get(key) == meta.stream_id:
            del self.index[key]
        self.states.pop(meta.stream_id, None)

    def _find(self, basin, name):
        key = (basin, name)
        sid = self._names().get(key)
        if sid is None and basin == DEFAULT_BASIN and name.isdigit() and name == str(int(name)):
            sid = int(name)  # an SBP-created (or replicated) stream under its decimal id
        if sid is None:
            return None
        try:
            meta = self.store.log.stream(sid)
        except errors.StreamNotFound:
            self.index.pop(key, None)  # deleted through another interface (SBP)
            return None
        if self._name_of(meta) != key:
            return None
        return meta

    async def find_stream(self, basin, name, fresh=False):
        """The stream's meta (S2 attrs included), or None (``fresh``: see _require_basin)."""
        return self._find(basin, name)

    def _req_basin(self, req):
        # s2-basin first (s2-sdk with a plain endpoint, s2-lite style); else S2's cloud form
        # {basin}.b.<host> in Host / :authority; else the default basin.
        basin = req.header("s2-basin")
        if basin:
            return basin
        m = _BASIN_HOST.match(req.header("host", ""))
        return m.group(1) if m else DEFAULT_BASIN

    async def _stream(self, req, auto_create=None, fresh=False):
        basin = self._req_basin(req)
        rec = await self._require_basin(basin, fresh)
        name = req.segments[2]
        meta = await self.find_stream(basin, name, fresh)
        if meta is None:
            if auto_create and rec["config"].get(auto_create):
                config = self._initial_config(rec, req.header("s2-stream-config"))
                meta = await self._create(basin, name, config, rec)
                if meta is not None:
                    return meta
                meta = await self.find_stream(basin, name)
                if meta is not None:
                    return meta
            raise S2Error(404, "stream_not_found", "stream %s not found in basin %s" % (name, basin))
        return meta

    def _config_of(self, meta):
        config = dict((meta.attrs or {}).get("s2_config") or codec.default_stream_config())
        config["retention_policy"] = codec.retention_policy(meta.retention_period_ms)
        return config

    def _stream_info(self, meta, auth=None):
        name = self._name_of(meta)[1]
        if auth is not None and auth.prefix and name.startswith(auth.prefix):
            name = name[len(auth.prefix):]  # an auto_prefix_streams token sees its names bare
        info = {"name": name, "created_at": codec.rfc3339(meta.created_ms or 0), "deleted_at": None}
        cipher = (meta.attrs or {}).get("s2_cipher")
        if cipher:
            info["cipher"] = cipher
        return info

    def streams_of(self, basin):
        return [m for m in self.store.log.streams() if self._name_of(m)[0] == basin]

    def _initial_config(self, basin_rec, patch):
        base = basin_rec["config"].get("default_stream_config") or codec.default_stream_config()
        if isinstance(patch, (str, bytes)):
            try:
                patch = codec.parse_json(patch.encode() if isinstance(patch, str) else patch)
            except S2Error:
                raise codec.bad("bad_header", "s2-stream-config is not JSON")
        return codec.merge_stream_config(base, patch)

    async def _create(self, basin, name, config, basin_rec):
        """Create the store stream; None if the name is taken. The stream takes the basin's
        ``stream_cipher`` for its lifetime (S2: later basin changes only affect new streams)."""
        key = (basin, name)
        if self._find(basin, name) is not None or key in self.creating:
            return None
        attrs = {"s2_basin": basin, "s2_name": name, "s2_config": config, "s2_fence": ""}
        cipher = basin_rec["config"].get("stream_cipher")
        if cipher:
            attrs["s2_cipher"] = cipher
        self.creating.add(key)
        try:
            meta = await self.store.log.create_stream(retention_period_ms=codec.retention_ms(config), attrs=attrs)
            self._names()[key] = meta.stream_id
        finally:
            self.creating.discard(key)
        return meta

    async def h_create_stream(self, req, responder, body):
        obj = codec.parse_json(body)
        if not isinstance(obj, dict):
            raise codec.bad("bad_json", "expected {\"stream\": name}")
        basin = self._req_basin(req)
        rec = await self._require_basin(basin)
        name = codec.validate_stream_name(req.auth.prefix + codec.validate_stream_name(obj.get("stream")))
        req.auth.require("create-stream", basin=basin, stream=name)
        config = self._initial_config(rec, obj.get("config"))
        meta = await self._create(basin, name, config, rec)
        if meta is None:
            raise S2Error(409, "resource_already_exists", "stream %s already exists" % name)
        responder.respond(201, [JSON, ("sbp-stream-id", str(meta.stream_id))],
                          codec.dumps(self._stream_info(meta, req.auth)))

    async def h_ensure_stream(self, req, responder, body):
        basin = self._req_basin(req)
        rec = await self._require_basin(basin)
        name = codec.validate_stream_name(req.segments[2])
        patch = codec.parse_json(body)
        meta = await self.find_stream(basin, name)
        result = "noop"
        if meta is None:
            meta = await self._create(basin, name, self._initial_config(rec, patch), rec)
            if meta is None:
                meta = await self.find_stream(basin, name)
            else:
                result = "created"
        if result != "created" and patch:
            old = self._config_of(meta)
            new = codec.merge_stream_config(old, patch)
            if new != old:
                req.auth.require("reconfigure-stream", basin=basin, stream=name)
                meta = await self._reconfigure(meta, new)
                result = "updated"
        responder.respond(201 if result == "created" else 200,
                          [JSON, ("s2-provision-result", result), ("sbp-stream-id", str(meta.stream_id))],
                          codec.dumps(self._stream_info(meta, req.auth)))

    async def h_list_streams(self, req, responder, body):
        basin = self._req_basin(req)
        await self._require_basin(basin)
        auth = req.auth
        prefix = auth.prefix + req.query.get("prefix", "")
        start_after = req.query.get("start_after", "")
        start_after = auth.prefix + start_after if start_after else ""
        limit = limit_param(req.query)
        found = [(n, meta) for n, meta in await self.streams_named(basin, prefix)
                 if n > start_after and auth.sees("streams", n)]
        found.sort(key=lambda x: x[0])
        out = {"streams": [self._stream_info(m, auth) for _, m in found[:limit]], "has_more": len(found) > limit}
        responder.respond(200, [JSON], codec.dumps(out))

    async def h_get_stream(self, req, responder, body):
        meta = await self._stream(req, fresh=True)
        responder.respond(200, [JSON, ("sbp-stream-id", str(meta.stream_id))], codec.dumps(self._config_of(meta)))

    async def _reconfigure(self, meta, config):
        if meta.origin is not None:
            raise S2Error(403, "permission_denied", "stream is a read-only replica of %s" % meta.origin)
        return await self.store.log.update_stream(
            meta.stream_id, retention_period_ms=codec.retention_ms(config), attrs={"s2_config": config}
        )

    async def h_reconfigure_stream(self, req, responder, body):
        meta = await self._stream(req)
        config = codec.merge_stream_config(self._config_of(meta), codec.parse_json(body) or {})
        meta = await self._reconfigure(meta, config)
        responder.respond(200, [JSON, ("sbp-stream-id", str(meta.stream_id))], codec.dumps(self._config_of(meta)))

    async def h_delete_stream(self, req, responder, body):
        meta = await self._stream(req)
        await self.delete_stream(meta)
        responder.respond(202, [JSON], b"{}")

    # Where stream names live: the store's stream attrs on one node (below); the etcd catalog in
    # a cluster (protocols/s2/cluster.py overrides find_stream, _create, _reconfigure and these).

    async def streams_named(self, basin, prefix):
        """[(name, meta)] of the basin's streams whose name starts with ``prefix``."""
        out = []
        for meta in self.store.log.streams():
            b, n = self._name_of(meta)
            if b == basin and n.startswith(prefix):
                out.append((n, meta))
        return out

    async def delete_stream(self, meta):
        await self.store.log.delete_stream(meta.stream_id)
        self._forget(meta)

    # -----------------------------------------------------------------------------------------
    # Stream state: fencing token and last timestamp

    def _state_now(self, meta):
        """The stream's state if usable without waiting, else None."""
        st = self.states.get(meta.stream_id)
        if st is not None and st.ready and meta.next_offset <= st.assigned:
            return st
        return None

    async def _state(self, meta):
        sid = meta.stream_id
        st = self.states.get(sid)
        if st is None:
            st = self.states[sid] = _StreamState(sid, self._fence_of(meta))
        if st.ready and meta.next_offset <= st.assigned:
            return st
        # Someone else (SBP, or a restart) moved the tail: reload the last timestamp. Waiters are
        # released in arrival order, so queued appends keep their order.
        st.ready = False
        d = defer.Deferred()
        st.waiters.append(d)
        if not st.loading:
            st.loading = True
            self._run_load(st)
        await d
        return st

    def _run_load(self, st):
        d = defer.ensureDeferred(self._load(st))

        def done(result):
            st.loading = False
            waiters, st.waiters = st.waiters, []
            for w in waiters:
                if isinstance(result, Failure):
                    w.errback(result)
                else:
                    w.callback(st)
            return None

        d.addBoth(done)

    async def _load(self, st):
        while True:
            meta = self.store.log.stream(st.sid)
            nxt = meta.next_offset
            last_ts = st.tail_ts  # kept if the stream is empty or trimmed to its tail
            if nxt > meta.trim_offset:
                try:
                    batches = await self.store.log.read(st.sid, nxt - 1, 1)
                except errors.OffsetOutOfRange:
                    batches = []
                for b in batches[-1:]:
                    header = record_batch.read_header(b)
                    recs = msgpack.unpackb(memoryview(b)[record_batch.HEADER_SIZE:], use_list=False)
                    last_ts = header.base_timestamp_ms + recs[-1][1]
            if self.store.log.stream(st.sid).next_offset == nxt:
                st.last_ts = max(st.last_ts, last_ts)
                st.tail_ts = last_ts
                st.assigned = max(st.assigned, nxt)
                st.ready = True
                return

    def _fence_of(self, meta):
        return (meta.attrs or {}).get("s2_fence", "")

    async def _tail(self, meta):
        st = await self._state(meta)
        return (self.store.log.stream(meta.stream_id).next_offset, st.tail_ts)

    # -----------------------------------------------------------------------------------------
    # Append

    def _decode_append(self, req, body):
        if _media(req.header("content-type")) in PROTO_TYPES:
            return codec.decode_append_input_proto(body)
        return codec.decode_append_input_json(body, codec.parse_format(req.header("s2-format")))

    def cipher_for(self, meta, req):
        """The stream's RecordCipher keyed by the request's s2-encryption-key, or None."""
        name = (meta.attrs or {}).get("s2_cipher")
        if not name:
            return None
        return crypto.RecordCipher(name, crypto.parse_key(req.header(crypto.KEY_HEADER)), meta.stream_id)

    async def append(self, sid, inp, auth=None, cipher=None):
        """Append one AppendInput; returns (start, end, tail) positions once durable."""
        meta = self._append_meta(sid)
        if meta.origin is not None:
            raise S2Error(403, "permission_denied", "stream is a read-only replica of %s" % meta.origin)
        metered = codec.validate_append(inp.records)
        if inp.fencing_token is not None and len(inp.fencing_token.encode()) > codec.MAX_FENCING_TOKEN:
            raise codec.invalid("fencing token longer than 36 bytes")
        st = self._state_now(meta)
        if st is None:
            st = await self._state(meta)
            meta = self._append_meta(sid)
        # From here to store.log.append: no waiting (the store assigns offsets at call time).
        if inp.fencing_token is not None and inp.fencing_token != st.fence:
            raise codec.fencing_token_mismatch(st.fence)
        start = st.assigned
        if inp.match_seq_num is not None and inp.match_seq_num != start:
            raise codec.seq_num_mismatch(start)
        config = (meta.attrs or {}).get("s2_config") or {}
        ts_cfg = config.get("timestamping") or {}
        mode = ts_cfg.get("mode") or "client-prefer"
        uncapped = bool(ts_cfg.get("uncapped"))
        now = now_ms()
        last = st.last_ts
        rows = []  # CONTRACT §3 records block rows: [offset_delta, timestamp_delta, headers, body]
        first = None
        commands = None
        for i, (ts, headers, body) in enumerate(inp.records):
            if ts is None or mode == "arrival":
                if ts is None and mode == "client-require":
                    raise codec.invalid("timestamping mode client-require: record %d has no timestamp" % i)
                t = now
            else:
                t = ts if uncapped or ts <= now else now
            if t < last:
                t = last  # S2: timestamps never decrease on a stream
            last = t
            if first is None:
                first = t
            rows.append((i, t - first, headers, body))
            if headers and len(headers) == 1 and headers[0][0] == b"":
                if commands is None:
                    commands = []
                commands.append((i, headers[0][1], body))
            elif cipher is not None:
                rows[-1] = (i, t - first, (), cipher.seal(headers, body))  # S2: commands stay plaintext
        if commands and auth is not None:
            # Command records need their own operations (fence, trim) besides append.
            basin, name = self._name_of(meta)
            for op in {op.decode("utf-8", "replace") for _i, op, _b in commands}:
                if op in ("fence", "trim"):
                    auth.require(op, basin=basin, stream=name)
        # One S2 AppendInput = one record batch (headers as (name, value) pairs pack as arrays).
        n = len(rows)
        if cipher is not None and cipher.name == "aes-256-gcm" and start + n > crypto.AES_GCM_MAX_RECORDS:
            raise codec.invalid("an aes-256-gcm stream holds at most 2^32 records")
        batch = record_batch.encode_block(msgpack.packb(rows, use_bin_type=True), n, first)
        if len(batch) > self.max_batch_bytes:
            raise codec.invalid("batch of %d bytes exceeds --max-batch-bytes" % len(batch))
        d = self._log_append(sid, batch, inp.match_seq_num)
        st.last_ts = last
        st.assigned = start + n
        if commands:
            self._apply_fences(st, commands)
        try:
            base = await d
        except errors.ExpectationFailed:
            st.ready = False  # another writer (SBP) got there first: reload before the next append
            raise codec.seq_num_mismatch(max(st.assigned, self.store.log.stream(sid).next_offset))
        if base + n > st.assigned:
            st.assigned = base + n
        if last > st.tail_ts:
            st.tail_ts = last
        self.counters.appended(self._name_of(meta)[0], n, metered)
        if commands:
            persisted = self._persist_fence(st, commands)
            if persisted is not None:
                await persisted  # cluster mode: the token is in etcd before the ack
            self._apply_trims(sid, base, commands)
        tail_seq = max(self.store.log.stream(sid).next_offset, base + n)
        return (base, first), (base + n, last), (tail_seq, st.tail_ts)

    def _append_meta(self, sid):
        """The meta an append works with (S2 attrs: config, cipher)."""
        return self.store.log.stream(sid)

    def _log_append(self, sid, batch, expect_offset):
        """Deferred[base offset] once the batch is durable (cluster mode: acknowledged)."""
        return self.store.log.append(sid, batch, expect_offset=expect_offset)

    def _apply_fences(self, st, commands):
        # Fencing is strongly consistent: appends after this one (even in the same session) are
        # checked against the new token at once.
        for _seq, op, body in commands:
            if op == b"fence":
                st.fence = body.decode("utf-8")

    def _persist_fence(self, st, commands):
        # Once the fence record is durable, the token goes into the stream attrs (restarts).
        if any(op == b"fence" for _seq, op, _body in commands):
            self.store.log.update_stream(st.sid, attrs={"s2_fence": st.fence}).addErrback(
                lambda f: self.log.failure("persisting a fencing token failed", f))

    def _apply_trims(self, sid, base, commands):
        for i, op, body in commands:
            if op == b"trim":
                point = min(codec.command_payload(op, body), base + i + 1)
                try:
                    current = self.store.log.stream(sid).trim_offset
                except errors.StreamNotFound:
                    return
                if point > current:
                    self.store.log.trim(sid, point).addErrback(
                        lambda f: self.log.failure("trim command failed", f))

    async def h_append(self, req, responder, body):
        inp = self._decode_append(req, body)
        meta = await self._stream(req, auto_create="create_stream_on_append")
        start, end, tail = await self.append(meta.stream_id, inp, req.auth, self.cipher_for(meta, req))
        if _media(req.header("accept")) in PROTO_TYPES:
            responder.respond(200, [PROTO], codec.encode_append_ack_proto(start, end, tail))
        else:
            responder.respond(200, [JSON], codec.dumps(codec.append_ack_json(start, end, tail)))

    async def open_append_session(self, req, responder):
        meta = await self._stream(req, auto_create="create_stream_on_append")
        if meta.origin is not None:
            raise S2Error(403, "permission_denied", "stream is a read-only replica of %s" % meta.origin)
        session = AppendSession(self, responder, meta.stream_id, req.auth, self.cipher_for(meta, req))
        responder.start(200, [("content-type", "s2s/proto")])
        responder.attach_sink(session)

    # -----------------------------------------------------------------------------------------
    # Read

    async def h_tail(self, req, responder, body):
        meta = await self._stream(req, auto_create="create_stream_on_read")
        tail = await self._tail(meta)
        responder.respond(200, [JSON], codec.dumps({"tail": codec.position(tail)}))

    async def _resolve_start(self, meta, p, can_follow):
        """(start seq, skip-until timestamp or None, tail) for read params; 416 as S2 defines."""
        tail = await self._tail(meta)
        meta = self.store.log.stream(meta.stream_id)
        trim = meta.trim_offset
        min_ts = None
        if p.seq_num is not None:
            if p.seq_num > tail[0]:
                if not p.clamp:
                    raise codec.read_unwritten(tail)
                start = tail[0]
            else:
                start = max(p.seq_num, trim)
        elif p.timestamp is not None:
            if p.timestamp > tail[1] and not p.clamp:
                raise codec.read_unwritten(tail)
            start, min_ts = await self._seek_timestamp(meta, p.timestamp, tail)
        elif p.tail_offset is not None:
            start = max(tail[0] - p.tail_offset, trim, 0)
        else:
            start = tail[0]
        if start >= tail[0] and not can_follow:
            raise codec.read_unwritten(tail)
        return start, min_ts, tail

    async def _seek_timestamp(self, meta, ts, tail):
        """Binary search the stored batches by their base timestamp, then scan by record."""
        if ts > tail[1]:
            return tail[0], None
        sid = meta.stream_id
        entries = self.store.log.batches(sid, meta.trim_offset, 1 << 30)
        lo, hi = 0, len(entries)
        while lo < hi:  # first batch whose base timestamp >= ts
            mid = (lo + hi) // 2
            try:
                got = await self.store.log.read(sid, entries[mid][0], 1)
            except errors.OffsetOutOfRange:
                got = []
            if got and record_batch.read_header(got[0]).base_timestamp_ms < ts:
                lo = mid + 1
            else:
                hi = mid
        start = entries[lo - 1][0] if lo > 0 else meta.trim_offset
        return max(start, meta.trim_offset), ts

    async def read_records(self, sid, pos, max_bytes, min_ts=None, cipher=None):
        """Records at seq >= pos from one store read: [(seq, ts, headers, body)], next pos."""
        try:
            batches = await self.store.log.read(sid, pos, max_bytes)
        except errors.OffsetOutOfRange:
            meta = self.store.log.stream(sid)
            if pos < meta.trim_offset:
                pos = meta.trim_offset
                batches = await self.store.log.read(sid, pos, max_bytes)
            else:
                raise
        out = []
        nxt = pos
        unpackb = msgpack.unpackb
        hsize = record_batch.HEADER_SIZE
        for b in batches:
            header = record_batch.read_header(b)
            base = header.base_offset
            bts = header.base_timestamp_ms
            nxt = max(nxt, base + header.record_count)
            recs = unpackb(memoryview(b)[hsize:], use_list=False)
            if base >= pos and min_ts is None:
                out.extend([(base + r[0], bts + r[1], r[2], r[3]) for r in recs])
                continue
            for r in recs:
                seq = base + r[0]
                if seq < pos:
                    continue
                t = bts + r[1]
                if min_ts is not None:
                    if t < min_ts:
                        continue
                    min_ts = None
                out.append((seq, t, r[2], r[3]))
        if cipher is not None:
            out = [r if crypto.is_command(r[2]) else (r[0], r[1]) + cipher.open(r[3]) for r in out]
        return out, nxt, min_ts

    @staticmethod
    def _limit_records(records, count, nbytes, until):
        """Cut records at the count/bytes/until limits; returns (records, used bytes, hit limit)."""
        used = 0
        if count is not None and len(records) >= count:
            records = records[:count]
            hit = True
        else:
            hit = False
        if nbytes is None and until is None:
            return records, None, hit
        for i, (seq, ts, headers, body) in enumerate(records):
            if until is not None and ts >= until:
                return records[:i], used, True
            if nbytes is not None:
                size = codec.metered_size(headers, body)
                if used + size > nbytes:
                    return records[:i], used, True
                used += size
        return records, used, hit

    async def h_read(self, req, responder, body):
        p = codec.parse_read_params(req.query)
        fmt = codec.parse_format(req.header("s2-format"))
        meta = await self._stream(req, auto_create="create_stream_on_read")
        cipher = self.cipher_for(meta, req)
        sid = meta.stream_id
        count = min(p.count if p.count is not None else codec.UNARY_MAX_COUNT, codec.UNARY_MAX_COUNT)
        nbytes = min(p.bytes if p.bytes is not None else codec.UNARY_MAX_BYTES, codec.UNARY_MAX_BYTES)
        wait = min(p.wait or 0, codec.UNARY_MAX_WAIT)
        start, min_ts, tail = await self._resolve_start(meta, p, wait > 0)
        records = []
        pos = start
        deadline = time.monotonic() + wait
        while True:
            meta = self.store.log.stream(sid)
            if pos < meta.next_offset and count > 0:
                got, pos, min_ts = await self.read_records(sid, pos, min(nbytes, READ_CHUNK_BYTES), min_ts, cipher)
                got, used, hit = self._limit_records(got, count - len(records), nbytes, p.until)
                records.extend(got)
                if used is not None:
                    nbytes -= used
                if hit or len(records) >= count:
                    break
                continue
            if records or count <= 0:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if not await self._wait_data(sid, pos, remaining, responder):
                break
        self.counters.read(self._name_of(meta)[0], len(records),
                           sum(codec.metered_size(h, b) for _, _, h, b in records))
        tail = await self._tail(self.store.log.stream(sid))
        if _media(req.header("accept")) in PROTO_TYPES:
            responder.respond(200, [PROTO], codec.encode_read_batch_proto(records, tail))
        else:
            responder.respond(200, [JSON], codec.dumps(codec.read_batch_json(records, fmt, tail)))

    def _wait_data(self, sid, pos, timeout, responder=None):
        """Deferred[bool]: True once data exists past ``pos``, False on timeout or client close."""
        result = defer.Deferred()
        waiting = self.store.log.wait_for_data(sid, pos)

        def fired(_):
            if not result.called:
                result.callback(True)

        def failed(f):
            if not result.called:
                result.callback(False)

        waiting.addCallbacks(fired, failed)
        timer = self.reactor.callLater(timeout, waiting.cancel)

        def on_close():
            if not result.called:
                result.callback(False)

        def cleanup(r):
            if timer.active():
                timer.cancel()
            if not waiting.called:
                waiting.cancel()
            if responder is not None and on_close in responder.on_close:
                responder.on_close.remove(on_close)
            return r

        if responder is not None:
            responder.on_close.append(on_close)
        result.addBoth(cleanup)
        return result

    async def h_read_sse(self, req, responder, body):
        await self._read_session(req, responder, "sse")

    async def h_read_s2s(self, req, responder, body):
        await self._read_session(req, responder, "s2s")

    async def _read_session(self, req, responder, kind):
        p = codec.parse_read_params(req.query)
        fmt = codec.parse_format(req.header("s2-format"))
        resume = codec.parse_last_event_id(req.header("last-event-id")) if kind == "sse" else None
        seen_count = seen_bytes = 0
        if resume is not None:
            # Resume after the last event the client saw, with limits lowered by what it got.
            p.seq_num, p.timestamp, p.tail_offset, p.clamp = resume[0] + 1, None, None, True
            seen_count, seen_bytes = resume[1], resume[2]
            if p.count is not None:
                p.count = max(0, p.count - seen_count)
            if p.bytes is not None:
                p.bytes = max(0, p.bytes - seen_bytes)
        meta = await self._stream(req, auto_create="create_stream_on_read")
        wait = p.wait if p.wait is not None else (0 if p.bounded else None)
        start, min_ts, tail = await self._resolve_start(meta, p, wait is None or wait > 0)
        cipher = self.cipher_for(meta, req)
        session = ReadSession(self, responder, kind, meta.stream_id, p, fmt, start, min_ts, wait,
                              seen_count, seen_bytes)
        session.basin = self._name_of(meta)[0]
        session.cipher = cipher
        if kind == "sse":
            responder.start(200, [("content-type", "text/event-stream"), ("cache-control", "no-cache, no-transform"),
                                  ("x-accel-buffering", "no")])
        else:
            responder.start(200, [("content-type", "s2s/proto")])
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            if not self.sessions and self._sessions_gone:
                waiters, self._sessions_gone = self._sessions_gone, []
                for d in waiters:
                    d.callback(None)

    def shutdown(self):
        """End every read session with its ``server_draining`` frame; a Deferred that fires once
        they have all written it (a session waiting on a store read ends when that read returns),
        so the node's shutdown hooks (bounded by ``--shutdown-timeout``) wait for it before the
        connections close."""
        for s in list(self.sessions):
            s.stop(draining=True)
        if not self.sessions:
            return defer.succeed(None)
        d = defer.Deferred()
        self._sessions_gone.append(d)
        return d


_BASIN_HOST = re.compile(r"^([a-z0-9][a-z0-9-]{6,46}[a-z0-9])\.b\.")


def _no_method():
    raise S2Error(405, "bad_path", "method not allowed on this resource")


LOCAL_LOCATION = {"name": "local", "is_private": True, "storage_classes": ["standard", "express"],
                  "default_storage_class": "express"}


def check_location(value):
    if value is not None and value != LOCAL_LOCATION["name"]:
        raise codec.invalid("unknown location %r: this node is the location %r" % (value, LOCAL_LOCATION["name"]))


def check_cipher(config):
    cipher = config.get("stream_cipher")
    if cipher and not crypto.available(cipher):
        raise S2Error(501, "not_implemented", "%s is not available on this node" % cipher)


_ROUTE_GROUPS = frozenset(("basins", "streams", "access-tokens", "metrics", "locations"))
_NODE_PAGES = frozenset(("metrics", "ui"))


def route_group(segments):
    """The label of a request's route in sbpnode_responses_total: bounded, whatever the path
    (docs/observability.md)."""
    if len(segments) >= 2 and segments[0] == "v1":
        kind = segments[1]
        if kind == "streams" and len(segments) >= 4 and segments[3] == "records":
            return "records"
        return kind if kind in _ROUTE_GROUPS else "other"
    if segments == ["health"]:
        return "health"
    if not segments or segments[0] in _NODE_PAGES:
        return "node_pages"
    return "other"


def response_labels(key):
    """(route group, HTTP status, ok) of a key of ``S2Api.statuses`` (node/metrics.py)."""
    route, status = key.split(" ", 1)
    return route, status, int(status) < 400


def _pick(method, table):
    got = table.get(method)
    if got is None:
        _no_method()
    return got


def limit_param(query):
    try:
        limit = int(query.get("limit", "1000"))
    except ValueError:
        raise codec.bad("bad_query", "limit must be an integer")
    return max(1, min(limit, 1000))
