"""S2 access tokens (docs/protocols/s2.md, "Access tokens"): scopes, operations and op groups.

Pure functions over JSON values and names; no store, no wire. A scope is the JSON object S2
defines (``AccessTokenScope``): resource sets ``basins``, ``streams``, ``access_tokens`` (each
``{"exact": name}`` or ``{"prefix": p}``; absent = none; an empty prefix matches every name, an
empty exact name none), ``op_groups`` (``account`` / ``basin`` / ``stream`` -> ``{"read", "write"}``)
and ``ops`` (operation names). A token may do an operation iff the operation is in ``ops`` or
in a granted group, and every resource the operation names is in the matching set.
"""

import hashlib
import secrets

from protocols.s2.codec import S2Error, bad, invalid

# S2's operations and the op group (level, read|write) each belongs to; the groups follow S2's
# own authorization policy (s2-lite's token plan): metrics and locations sit with reads/writes of
# their level.
OP_GROUPS = {
    "list-basins": ("account", "read"),
    "account-metrics": ("account", "read"),
    "list-locations": ("account", "read"),
    "get-default-location": ("account", "read"),
    "create-basin": ("account", "write"),
    "delete-basin": ("account", "write"),
    "set-default-location": ("account", "write"),
    "get-basin-config": ("basin", "read"),
    "list-streams": ("basin", "read"),
    "list-access-tokens": ("basin", "read"),
    "basin-metrics": ("basin", "read"),
    "reconfigure-basin": ("basin", "write"),
    "create-stream": ("basin", "write"),
    "delete-stream": ("basin", "write"),
    "issue-access-token": ("basin", "write"),
    "revoke-access-token": ("basin", "write"),
    "get-stream-config": ("stream", "read"),
    "check-tail": ("stream", "read"),
    "read": ("stream", "read"),
    "stream-metrics": ("stream", "read"),
    "reconfigure-stream": ("stream", "write"),
    "append": ("stream", "write"),
    "trim": ("stream", "write"),
    "fence": ("stream", "write"),
}
OPS = tuple(OP_GROUPS)
TOKEN_OPS = ("issue-access-token", "revoke-access-token", "list-access-tokens")
MAX_ID_BYTES = 96
TOKEN_PREFIX = "s2at_"  # tokens this node issues start with it (so a revoked one is recognised)


def hash_token(token: str) -> str:
    """Tokens are stored as their SHA-256 (the token itself is 256 random bits)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def validate_id(value) -> str:
    if not isinstance(value, str) or not value or len(value.encode("utf-8")) > MAX_ID_BYTES or "\0" in value:
        raise invalid("access token id must be 1..96 bytes without NUL")
    return value


def _resource_set(value, what):
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) != 1:
        raise bad("bad_json", "%s must be {\"exact\": name} or {\"prefix\": prefix}" % what)
    (kind, name), = value.items()
    if kind not in ("exact", "prefix") or not isinstance(name, str):
        raise bad("bad_json", "%s must be {\"exact\": name} or {\"prefix\": prefix}" % what)
    return {kind: name}


def parse_scope(value) -> dict:
    """Validated, normalised scope; 422 if it permits no operation."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise bad("bad_json", "scope must be an object")
    scope = {}
    for key in ("basins", "streams", "access_tokens"):
        rs = _resource_set(value.get(key), key)
        if rs is not None:
            scope[key] = rs
    groups = value.get("op_groups")
    if groups is not None:
        if not isinstance(groups, dict):
            raise bad("bad_json", "op_groups must be an object")
        out = {}
        for level in ("account", "basin", "stream"):
            perm = groups.get(level)
            if perm is None:
                continue
            if not isinstance(perm, dict) or any(not isinstance(perm.get(k, False), bool) for k in ("read", "write")):
                raise bad("bad_json", "op_groups.%s must be {\"read\": bool, \"write\": bool}" % level)
            out[level] = {"read": bool(perm.get("read")), "write": bool(perm.get("write"))}
        scope["op_groups"] = out
    ops = value.get("ops")
    if ops is not None:
        if not isinstance(ops, list) or any(op not in OP_GROUPS for op in ops):
            raise invalid("ops must be a list of S2 operations (%s)" % ", ".join(OPS))
        scope["ops"] = sorted(set(ops), key=OPS.index)
    if not permitted_ops(scope):
        raise invalid("the scope permits no operation")
    return scope


def permitted_ops(scope) -> frozenset:
    allowed = set(scope.get("ops") or ())
    for level, perm in (scope.get("op_groups") or {}).items():
        for kind in ("read", "write"):
            if perm.get(kind):
                allowed.update(op for op, g in OP_GROUPS.items() if g == (level, kind))
    return frozenset(allowed)


def matches(rs, name) -> bool:
    if rs is None or name is None:
        return False
    if "exact" in rs:
        return rs["exact"] != "" and name == rs["exact"]
    return name.startswith(rs["prefix"])


def check(scope, op, basin=None, stream=None, token_id=None):
    """Raise 403 permission_denied unless ``scope`` allows ``op`` on the named resources."""
    if op not in permitted_ops(scope):
        raise S2Error(403, "permission_denied", "the access token does not permit %s" % op)
    for key, name in (("basins", basin), ("streams", stream), ("access_tokens", token_id)):
        if name is not None and not matches(scope.get(key), name):
            raise S2Error(403, "permission_denied",
                          "the access token does not permit %s on %s %r" % (op, key.rstrip("s").replace("_", " "), name))


def _within(inner, outer) -> bool:
    """Every name ``inner`` matches, ``outer`` matches too."""
    if inner is None or inner.get("exact") == "":
        return True
    if outer is None:
        return False
    if "exact" in inner:
        return matches(outer, inner["exact"])
    return "prefix" in outer and inner["prefix"].startswith(outer["prefix"])


def narrower(scope, issuer) -> bool:
    """A scoped token may only issue tokens that can do no more than itself."""
    if not permitted_ops(scope) <= permitted_ops(issuer):
        return False
    return all(_within(scope.get(k), issuer.get(k)) for k in ("basins", "streams", "access_tokens"))


def auto_prefix(scope):
    """The stream-name prefix an ``auto_prefix_streams`` token adds; 422 without a prefix scope."""
    rs = scope.get("streams")
    if rs is None or "prefix" not in rs:
        raise invalid("auto_prefix_streams needs a streams scope that is a prefix")
    return rs["prefix"]
