"""The S2 API's control plane in a cluster (CONTRACT §9 "Every interface, every node"; docs/cluster.md
"S2 across the cluster"): basins, stream names, stream configs, fencing tokens and access tokens
in etcd, so every node's ``--http`` listener serves the same account.

Keys under the cluster prefix P (JSON values):

- ``P s2/basins/<basin>``: ``{"created_ms", "config"}`` (the basin config as protocols/s2/codec.py
  keeps it);
- ``P s2/streams/<basin>/<stream name>``: ``{"stream_id", "config", "fence", "cipher",
  "created_ms"}``; ``stream_id`` is a replicated stream of the placement driver (R =
  ``--replication-factor``), created before the name is claimed;
- ``P s2/tokens/<token id>``: an issued access token as protocols/s2/tokens.py stores it (its
  SHA-256, never the token);
- ``P s2/root-tokens/<node_id>``: the SHA-256 of that node's ``--http-token`` (absent without one).

Every write is an etcd transaction (create-if-absent or compare-and-swap on the key's mod
revision). Each node watches ``P s2/`` and answers lookups from that cache; a miss (the watch is
a few milliseconds behind a write on another node) reads etcd before saying "not found".

The S2 protocol (protocols/s2/cluster.py) reaches all of this through this object only
(``node.cluster.s2_catalog``); it knows nothing of etcd or of the placement driver's records.
Where the data of a stream is served also comes from here: ``append_target`` (this node, or the
address of the open range's primary's S2 forwarding port) and ``read_here`` (whether this node
holds a replica of the open range).

The S2 forwarding port (member record ``s2_peer``) is a node-to-node listener like the replica
channel and the kv peer port (``tls.listen``): mutual TLS with the cluster CA when the node has
the cluster TLS options, so only a peer presenting a CA-signed certificate gets a forwarded
request served; the API's forwarder connects to it with ``forward_tls()``.
"""

import json
import time

from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger

from node.cluster import etcd, placement
from storage import errors as store_errors

CAS_ATTEMPTS = 20
FAILOVER_WAIT_S = 20.0  # CONTRACT §9: appends resume within 20 s of a primary's death
POLL_S = 0.1


class NoPrimary(placement.PlacementError):
    """No live primary for the stream's open range within FAILOVER_WAIT_S."""


class S2Catalog:
    log = Logger()

    def __init__(self, cluster):
        self.cluster = cluster  # node.cluster.service.ClusterNode (pd and membership once started)
        self.client = cluster.client
        self.base = cluster.prefix + "s2/"
        self.basins = {}  # name -> record
        self.streams = {}  # (basin, name) -> record
        self.by_sid = {}  # stream id -> (basin, name)
        self.tokens = {}  # token id -> record
        self.token_hashes = {}  # SHA-256 -> (token id, record): what tokens.py authenticates with
        self.roots = {}  # node id -> SHA-256 of its --http-token
        self._watch = None
        self.forwarded_site = None  # the S2 API's site for forwarded requests (serve_forwarded)
        self.port = None  # its node-to-node listener

    @property
    def pd(self):
        return self.cluster.pd

    @property
    def membership(self):
        return self.cluster.membership

    @property
    def node_id(self):
        return self.cluster.node_id

    # -- keys -------------------------------------------------------------------------------------

    def _basin_key(self, name):
        return self.base + "basins/" + name

    def _stream_key(self, basin, name):
        return self.base + "streams/%s/%s" % (basin, name)

    def _token_key(self, token_id):
        return self.base + "tokens/" + token_id

    # -- start / stop / the cache ----------------------------------------------------------------

    @defer.inlineCallbacks
    def start(self, root_token_hash=None):
        key = self.base + "root-tokens/%d" % self.node_id
        if root_token_hash:
            yield self.client.put(key, root_token_hash)
        else:
            yield self.client.delete(key)
        rev = yield self._load()
        self._watch = self.client.watch_prefix(self.base, rev + 1, self._events, on_reset=self._reset)

    def stop(self):
        if self._watch is not None:
            self._watch.stop()
        if self.port is not None:
            port, self.port = self.port, None
            return port.stopListening()
        return None

    # -- the S2 forwarding port (node to node) -----------------------------------------------------

    def serve_forwarded(self, site):
        """The S2 API (protocols/s2/server.py) hands over the site that serves the requests other
        nodes forward to this one; the node opens its port in ``listen``."""
        self.forwarded_site = site

    def listen(self, interface):
        """Open the S2 forwarding port beside the SBP listener (mutual TLS with the cluster's
        options); its port number, or None when this node serves no S2 API."""
        if self.forwarded_site is None:
            return None
        from node.cluster.tls import listen

        self.port = listen(self.cluster.node.reactor, self.forwarded_site, interface, self.cluster.tls)
        return self.port.getHost().port

    def forward_tls(self):
        """None (plain HTTP between nodes, no cluster TLS options), or ``host -> `` the Twisted
        client TLS options the forwarder connects to that host with: this node's certificate, the
        cluster CA as the only trust root, the host checked against the peer's certificate."""
        if not self.cluster.tls:
            return None
        from node.cluster.tls import client_options_for

        return client_options_for(*self.cluster.tls)

    @defer.inlineCallbacks
    def _load(self):
        kvs, rev = yield self.client.get_prefix(self.base)
        self.basins, self.streams, self.by_sid, self.tokens, self.token_hashes, self.roots = {}, {}, {}, {}, {}, {}
        for kv in kvs:
            self._put(kv)
        return rev

    def _reset(self):
        self._load().addErrback(lambda f: self.log.warn("S2 catalog reload failed: {e}", e=f.value))

    def _events(self, events):
        for kind, kv in events:
            if kind == "DELETE":
                self._drop(kv.key.decode("utf-8", "replace"))
            else:
                self._put(kv)

    def _split(self, key):
        rest = key[len(self.base):]
        kind, _, name = rest.partition("/")
        return kind, name

    def _put(self, kv):
        key = kv.key.decode("utf-8", "replace")
        kind, name = self._split(key)
        if kind == "root-tokens":
            try:
                self.roots[int(name)] = kv.value.decode()
            except ValueError:
                pass
            return
        try:
            rec = json.loads(kv.value)
        except ValueError:
            self.log.warn("ignoring an unreadable S2 catalog entry at {key}", key=key)
            return
        if kind == "basins":
            self.basins[name] = rec
        elif kind == "streams":
            basin, _, stream = name.partition("/")
            self._remember_stream(basin, stream, rec)
        elif kind == "tokens":
            old = self.tokens.get(name)
            if old is not None:
                self.token_hashes.pop(old.get("hash"), None)
            self.tokens[name] = rec
            self.token_hashes[rec["hash"]] = (name, rec)

    def _drop(self, key):
        kind, name = self._split(key)
        if kind == "root-tokens":
            try:
                self.roots.pop(int(name), None)
            except ValueError:
                pass
        elif kind == "basins":
            self.basins.pop(name, None)
        elif kind == "streams":
            basin, _, stream = name.partition("/")
            self._forget_stream(basin, stream)
        elif kind == "tokens":
            rec = self.tokens.pop(name, None)
            if rec is not None:
                self.token_hashes.pop(rec.get("hash"), None)

    def _remember_stream(self, basin, name, rec):
        old = self.streams.get((basin, name))
        if old is not None and old["stream_id"] != rec["stream_id"]:
            self.by_sid.pop(old["stream_id"], None)
        self.streams[(basin, name)] = rec
        self.by_sid[rec["stream_id"]] = (basin, name)

    def _forget_stream(self, basin, name):
        rec = self.streams.pop((basin, name), None)
        if rec is not None and self.by_sid.get(rec["stream_id"]) == (basin, name):
            del self.by_sid[rec["stream_id"]]

    # -- compare-and-swap on one key --------------------------------------------------------------

    @defer.inlineCallbacks
    def _change(self, key, fn):
        """``fn(record or None) -> (result, new record or None: no write)`` by compare-and-swap;
        returns ``(result, the record now)``."""
        for _ in range(CAS_ATTEMPTS):
            kv = yield self.client.get(key)
            rec = json.loads(kv.value) if kv is not None else None
            result, new = fn(rec)
            if new is None:
                return result, rec
            cmp = etcd.compare_mod_revision(key, kv.mod_revision) if kv is not None else etcd.compare_version(key, 0)
            r = yield self.client.txn([cmp], [etcd.op_put(key, json.dumps(new))])
            if r.succeeded:
                self._put(etcd.KV({"key": etcd.b64(key), "value": etcd.b64(json.dumps(new))}))
                return result, new
        raise placement.Conflict("%s kept changing" % key)

    @defer.inlineCallbacks
    def _create(self, key, rec):
        r = yield self.client.txn([etcd.compare_version(key, 0)], [etcd.op_put(key, json.dumps(rec))])
        if r.succeeded:
            self._put(etcd.KV({"key": etcd.b64(key), "value": etcd.b64(json.dumps(rec))}))
        return r.succeeded

    @defer.inlineCallbacks
    def _delete(self, key):
        """The record deleted, or None if there was none."""
        r = yield self.client.txn([], [etcd.op_get(key), etcd.op_delete(key)])
        kvs = r.kvs(0)
        self._drop(key)
        return json.loads(kvs[0].value) if kvs else None

    # -- basins -----------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def basin(self, name, fresh=False):
        """The basin's record, or None. From the watch cache, which trails other nodes' writes
        by milliseconds; ``fresh`` (a control-plane GET) reads etcd, so a basin deleted through
        another node a moment ago is not found here."""
        rec = None if fresh else self.basins.get(name)
        if rec is None:
            kv = yield self.client.get(self._basin_key(name))
            if kv is not None:
                self._put(kv)
                rec = json.loads(kv.value)
        return rec

    @defer.inlineCallbacks
    def list_basins(self, prefix=""):
        kvs, _ = yield self.client.get_prefix(self.base + "basins/" + prefix)
        out = {}
        for kv in kvs:
            self._put(kv)
            name = self._split(kv.key.decode("utf-8", "replace"))[1]
            if name in self.basins:
                out[name] = self.basins[name]
        return out

    def create_basin(self, name, rec):
        return self._create(self._basin_key(name), rec)

    def change_basin(self, name, fn):
        return self._change(self._basin_key(name), fn)

    @defer.inlineCallbacks
    def delete_basin(self, name):
        """Delete every stream of the basin (names and placement-driver streams), then the basin."""
        for stream, _rec in (yield self.list_streams(name)):
            yield self.delete_stream(name, stream)
        yield self._delete(self._basin_key(name))

    # -- streams ----------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def stream(self, basin, name, fresh=False):
        """The stream's record, or None (``fresh``: as for ``basin``)."""
        rec = None if fresh else self.streams.get((basin, name))
        if rec is None:
            kv = yield self.client.get(self._stream_key(basin, name))
            if kv is not None:
                self._put(kv)
                rec = json.loads(kv.value)
        return rec

    def name_of(self, sid):
        """(basin, name) of a stream id the S2 API created, or None."""
        return self.by_sid.get(sid)

    def entry_of(self, sid):
        key = self.by_sid.get(sid)
        return self.streams.get(key) if key is not None else None

    @defer.inlineCallbacks
    def list_streams(self, basin, prefix=""):
        kvs, _ = yield self.client.get_prefix(self.base + "streams/%s/%s" % (basin, prefix))
        out = []
        for kv in kvs:
            self._put(kv)
            name = self._split(kv.key.decode("utf-8", "replace"))[1].partition("/")[2]
            rec = self.streams.get((basin, name))
            if rec is not None:
                out.append((name, rec))
        return out

    @defer.inlineCallbacks
    def create_stream(self, basin, name, config, cipher, retention_period_ms):
        """Create the replicated stream through the placement driver, then claim the name; None
        if the name is taken (the stream just made is deleted again)."""
        key = self._stream_key(basin, name)
        if (yield self.stream(basin, name)) is not None:
            return None
        prec = yield self.pd.create_stream(0, retention_period_ms)
        sid = prec["stream_id"]
        rec = {"stream_id": sid, "config": config, "fence": "", "cipher": cipher or None,
               "created_ms": int(time.time() * 1000)}
        if (yield self._create(key, rec)):
            return rec
        try:
            yield self.pd.delete_stream(sid)
        except placement.StreamGone:
            pass
        return None

    def change_stream(self, basin, name, fn):
        return self._change(self._stream_key(basin, name), fn)

    @defer.inlineCallbacks
    def set_config(self, basin, name, config, retention_period_ms):
        def fn(rec):
            if rec is None:
                raise placement.StreamGone("stream %s not found" % name)
            return None, dict(rec, config=config)

        _, rec = yield self.change_stream(basin, name, fn)
        yield self.pd.update_stream(rec["stream_id"], retention_period_ms=retention_period_ms)
        return rec

    def set_fence(self, basin, name, fence):
        def fn(rec):
            if rec is None or rec.get("fence") == fence:
                return None, None
            return None, dict(rec, fence=fence)

        return self.change_stream(basin, name, fn)

    @defer.inlineCallbacks
    def delete_stream(self, basin, name):
        rec = yield self._delete(self._stream_key(basin, name))
        if rec is not None:
            try:
                yield self.pd.delete_stream(rec["stream_id"])
            except placement.StreamGone:
                pass
        return rec

    @defer.inlineCallbacks
    def sbp_stream(self, sid):
        """The placement driver's record of a stream made through SBP (S2 shows it in the default
        basin under its decimal id), or None."""
        rec = self.pd.streams.get(sid)
        if rec is None:
            try:
                rec = yield self.pd.get(sid)
            except placement.StreamGone:
                return None
        return rec

    @defer.inlineCallbacks
    def sbp_streams(self, prefix=""):
        """[(decimal id, placement-driver record)] of the streams made through SBP whose decimal
        id starts with ``prefix`` (S2 lists them in the default basin, as on one node): every
        stream of the placement driver that no S2 name claims, both read from etcd (the stream
        records first: an S2 create makes the stream, then claims its name, so a stream is
        listed here only until its name is claimed)."""
        recs = yield self.pd.list_streams()
        kvs, _ = yield self.client.get_prefix(self.base + "streams/")
        named = set()
        for kv in kvs:
            try:
                named.add(json.loads(kv.value)["stream_id"])
            except (ValueError, KeyError, TypeError):
                pass
        return [(str(rec["stream_id"]), rec) for rec in recs
                if rec["stream_id"] not in named and str(rec["stream_id"]).startswith(prefix)]

    def append(self, sid, batch, expect_offset=None):
        """An S2 append on this node as the primary: sequenced and replicated (Deferred[base])."""
        return self.cluster.replicator.append(sid, batch, expect_offset)

    def trim(self, sid, point):
        """A trim command record: on the primary, through the placement driver (replicas follow)."""
        return self.pd.trim_stream(sid, point)

    # -- access tokens ------------------------------------------------------------------------------

    def root_hashes(self):
        return set(self.roots.values())

    @defer.inlineCallbacks
    def refresh_tokens(self):
        """Read every token from etcd (a token issued on another node this node has not heard of
        through its watch yet)."""
        kvs, _ = yield self.client.get_prefix(self.base + "tokens/")
        for kv in kvs:
            self._put(kv)

    def issue_token(self, token_id, rec):
        return self._create(self._token_key(token_id), rec)

    @defer.inlineCallbacks
    def list_tokens(self, prefix=""):
        kvs, _ = yield self.client.get_prefix(self.base + "tokens/" + prefix)
        out = []
        for kv in kvs:
            self._put(kv)
            token_id = self._split(kv.key.decode("utf-8", "replace"))[1]
            if token_id in self.tokens:
                out.append((token_id, self.tokens[token_id]))
        return out

    def revoke_token(self, token_id):
        return self._delete(self._token_key(token_id))

    # -- where a stream's data is served -----------------------------------------------------------

    def _forwarding_port_of(self, node_id):
        rec = self.membership.members.get(node_id)
        return rec.get("s2_peer") if rec else None

    @defer.inlineCallbacks
    def _record(self, sid):
        rec = self.pd.streams.get(sid)
        if rec is None:
            rec = yield self.pd.learn(sid)
        return rec

    @defer.inlineCallbacks
    def append_target(self, sid, avoid=None, wait_s=FAILOVER_WAIT_S):
        """Where appends to ``sid`` go: None (this node is the open range's primary; its local
        stream exists) or the ``host:port`` of the primary's S2 forwarding port. A primary that
        is not live, or is ``avoid`` (it refused a connection or failed while serving), is waited
        out (failover) for ``wait_s``; then NoPrimary."""
        deadline = time.monotonic() + wait_s
        while True:
            rec = yield self._record(sid)
            rng = placement.open_range(rec)
            primary = placement.primary_of(rng) if rng else None
            if primary is not None:
                if primary["id"] == self.node_id:
                    if not self._local(sid):
                        yield self.pd.ensure_local(rec)
                    return None
                address = self._forwarding_port_of(primary["id"])
                if address is not None and address != avoid:
                    return address
            if time.monotonic() > deadline:
                raise NoPrimary("stream %d has no live primary (failover pending)" % sid)
            yield deferLater(self.cluster.node.reactor, POLL_S, lambda: None)  # the watch brings the new record

    @defer.inlineCallbacks
    def read_here(self, sid):
        """True if this node holds a replica of the stream's open range (reads are served from it,
        up to the confirm offset); else False (forward to ``append_target``)."""
        rec = yield self._record(sid)
        rng = placement.open_range(rec)
        if rng is None or not any(s["id"] == self.node_id for s in rng["servers"]):
            return False
        if not self._local(sid):
            yield self.pd.ensure_local(rec)
        return True

    def open_range(self, sid):
        """(epoch, start seq_num) of the stream's open range as this node knows it, or None. A
        failover seals the old range at the largest end its survivors hold and opens the next
        one there (CONTRACT §9 Failover): a forwarding node compares that start with the end of
        the acknowledgements it relayed to learn whether a broken append was kept."""
        rec = self.pd.streams.get(sid)
        rng = placement.open_range(rec) if rec else None
        return (rec.get("epoch", 0), rng["start"]) if rng else None

    def is_primary(self, sid):
        rec = self.pd.streams.get(sid)
        rng = placement.open_range(rec) if rec else None
        primary = placement.primary_of(rng) if rng else None
        return primary is not None and primary["id"] == self.node_id

    def epoch(self, sid):
        rec = self.pd.streams.get(sid)
        return rec.get("epoch", 0) if rec else 0

    def _local(self, sid):
        try:
            self.cluster.node.store.log.stream(sid)
            return True
        except store_errors.StreamNotFound:
            return False

    def classify(self, e):
        """(kind, message) of a cluster error for the S2 protocol, or None (ClusterNode.classify's
        kinds, plus no_primary)."""
        if isinstance(e, NoPrimary):
            return "no_primary", str(e)
        return self.cluster.classify(e)
