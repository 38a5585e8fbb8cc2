"""S2 access tokens over the node's metadata (docs/protocols/s2.md, "Access tokens").

``/v1/access-tokens`` issues, lists and revokes tokens; every request is authenticated here.
Tokens live in the metadata table ``s2_access_tokens`` (id -> {hash, scope, auto_prefix_streams,
expires_ms, created_ms}): only the SHA-256 of a token is stored, and the presented token's hash is
compared with ``hmac.compare_digest``. ``--http-token`` is the root token (every operation).
Without ``--http-token`` the API is open, as S2's lite server is; a token this node issued is
still held to its scope there, and a revoked or expired one gets 401.
"""

import datetime
import hmac

from twisted.logger import Logger

from protocols.s2 import access, codec
from protocols.s2.codec import S2Error

TOKENS_TABLE = "s2_access_tokens"
JSON = ("content-type", "application/json")


class Auth:
    """Who a request is: the root (scope None) or an issued token."""

    __slots__ = ("token_id", "scope", "prefix", "expires_ms")

    def __init__(self, token_id=None, scope=None, prefix="", expires_ms=None):
        self.token_id = token_id
        self.scope = scope
        self.prefix = prefix  # auto_prefix_streams: added to stream names, stripped from listings
        self.expires_ms = expires_ms

    @property
    def root(self):
        return self.scope is None

    def require(self, op, basin=None, stream=None, token_id=None):
        if self.scope is not None:
            access.check(self.scope, op, basin, stream, token_id)

    def sees(self, key, name) -> bool:
        """Listings show only what the token's scope covers."""
        return self.scope is None or access.matches(self.scope.get(key), name)


ROOT = Auth()


def _now_ms():
    return int(datetime.datetime.now(datetime.timezone.utc).timestamp() * 1000)


def _parse_time(value):
    if value is None:
        return None
    if not isinstance(value, str):
        raise codec.bad("bad_json", "expires_at must be an RFC 3339 string")
    try:
        t = datetime.datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise codec.bad("bad_json", "expires_at is not an RFC 3339 time")
    if t.tzinfo is None:
        t = t.replace(tzinfo=datetime.timezone.utc)
    return int(t.timestamp() * 1000)


class AccessTokens:
    log = Logger()

    def __init__(self, store, root_token):
        self.store = store
        self.root_token = root_token
        self._by_hash = None  # token hash -> (id, record); loaded once from the table, kept by issue/revoke

    # -- authentication -------------------------------------------------------------------------

    def _hashes(self):
        if self._by_hash is None:
            rows = self.store.meta.read(lambda txn: list(txn.scan(TOKENS_TABLE)))
            self._by_hash = {rec["hash"]: (key.decode(), rec) for key, rec in rows}
        return self._by_hash

    def authenticate(self, req) -> Auth:
        header = req.header("authorization", "")
        presented = header[7:].strip() if header[:7].lower() == "bearer " else None
        if presented is not None and self._is_root(presented):
            return ROOT
        if presented is not None and presented.startswith(access.TOKEN_PREFIX):
            digest = access.hash_token(presented)
            token_id, rec = self._hashes().get(digest, (None, None))
            if rec is None or not hmac.compare_digest(rec["hash"], digest):
                raise S2Error(401, "authn", "unknown or revoked access token")
            if rec.get("expires_ms") is not None and rec["expires_ms"] <= _now_ms():
                raise S2Error(401, "authn", "access token expired")
            prefix = access.auto_prefix(rec["scope"]) if rec.get("auto_prefix_streams") else ""
            return Auth(token_id, rec["scope"], prefix, rec.get("expires_ms"))
        if self._open():
            return ROOT  # an open node (no --http-token), as S2's lite server
        raise S2Error(401, "authn", "missing or wrong bearer token")

    def _is_root(self, presented) -> bool:
        return self.root_token is not None and hmac.compare_digest(presented.encode(), self.root_token.encode())

    def _open(self) -> bool:
        return self.root_token is None

    # -- where tokens are kept (the node's metadata; etcd in a cluster: protocols/s2/cluster.py) --

    def _insert(self, token_id, rec):
        """Deferred[bool]: stored, or False if the id is taken."""
        key = token_id.encode()
        self._hashes()
        d = self.store.meta.transact(lambda txn: txn.put_new(TOKENS_TABLE, key, rec))

        def stored(ok):
            if ok:
                self._hashes()[rec["hash"]] = (token_id, rec)
            return ok

        return d.addCallback(stored)

    async def _rows(self, prefix):
        rows = self.store.meta.read(lambda txn: list(txn.scan(TOKENS_TABLE, prefix=prefix.encode() or None)))
        return [(k.decode(), rec) for k, rec in rows]

    def _remove(self, token_id):
        """Deferred[the removed record or None]."""
        key = token_id.encode()

        def fn(txn):
            rec = txn.get(TOKENS_TABLE, key)
            if rec is not None:
                txn.delete(TOKENS_TABLE, key)
            return rec

        def removed(rec):
            if rec is not None:
                self._hashes().pop(rec["hash"], None)
            return rec

        return self.store.meta.transact(fn).addCallback(removed)

    # -- handlers -------------------------------------------------------------------------------

    @staticmethod
    def info(token_id, rec):
        return {"id": token_id, "scope": rec["scope"], "auto_prefix_streams": bool(rec.get("auto_prefix_streams")),
                "expires_at": codec.rfc3339(rec["expires_ms"]) if rec.get("expires_ms") is not None else None}

    async def h_issue(self, req, responder, body):
        obj = codec.parse_json(body)
        if not isinstance(obj, dict):
            raise codec.bad("bad_json", "expected {\"id\": ..., \"scope\": {...}}")
        token_id = access.validate_id(obj.get("id"))
        scope = access.parse_scope(obj.get("scope"))
        auto = obj.get("auto_prefix_streams", False)
        if not isinstance(auto, bool):
            raise codec.bad("bad_json", "auto_prefix_streams must be a boolean")
        if auto:
            access.auto_prefix(scope)
        expires_ms = _parse_time(obj.get("expires_at"))
        if expires_ms is not None and expires_ms <= _now_ms():
            raise codec.invalid("expires_at is in the past")
        auth = req.auth
        auth.require("issue-access-token", token_id=token_id)
        if not auth.root:
            if not access.narrower(scope, auth.scope):
                raise S2Error(403, "permission_denied", "a token can only issue tokens with a narrower scope")
            if auth.expires_ms is not None:
                expires_ms = auth.expires_ms if expires_ms is None else min(expires_ms, auth.expires_ms)
        token = access.new_token()
        rec = {"hash": access.hash_token(token), "scope": scope, "auto_prefix_streams": auto,
               "expires_ms": expires_ms, "created_ms": _now_ms()}
        if not await self._insert(token_id, rec):
            raise S2Error(409, "resource_already_exists", "access token %s already exists" % token_id)
        self.log.info("S2 access token {id} issued", id=token_id)
        responder.respond(201, [JSON], codec.dumps({"access_token": token}))

    async def h_list(self, req, responder, body):
        prefix = req.query.get("prefix", "")
        start_after = req.query.get("start_after", "")
        try:
            limit = max(1, min(int(req.query.get("limit", "1000")), 1000))
        except ValueError:
            raise codec.bad("bad_query", "limit must be an integer")
        found = [(i, rec) for i, rec in await self._rows(prefix) if i > start_after]
        found = [(i, rec) for i, rec in found if req.auth.sees("access_tokens", i)]
        out = {"access_tokens": [self.info(i, rec) for i, rec in found[:limit]], "has_more": len(found) > limit}
        responder.respond(200, [JSON], codec.dumps(out))

    async def h_revoke(self, req, responder, body):
        token_id = req.segments[2]
        rec = await self._remove(token_id)
        if rec is None:
            raise S2Error(404, "access_token_not_found", "access token %s not found" % token_id)
        self.log.info("S2 access token {id} revoked", id=token_id)
        responder.respond(200, [JSON], codec.dumps(self.info(token_id, rec)))
