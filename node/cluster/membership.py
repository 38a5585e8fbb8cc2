"""Cluster membership (CONTRACT §9): this node's record under an etcd lease, and the live members.

Keys (all under the cluster prefix P):
- ``P version``: the layout version of this prefix, written once by the first node (a node of
  another version refuses to start rather than misread the keys);
- ``P members/<node_id>``: this node's record (JSON), attached to its lease (TTL 3 s, kept alive
  every second). The node is live while the key exists.

A record carries the data dir's ``incarnation`` (a random token persisted in the data dir): a node
restarting on its own data dir after a kill -9, while its old lease still runs, takes its key over
instead of being refused as a duplicate; a node with the same id and another data dir is refused.
"""

import json
import os
import secrets
import time

from twisted.internet import defer, task
from twisted.logger import Logger

from node.cluster import etcd

LAYOUT_VERSION = "1"
LEASE_TTL = 3  # seconds (CONTRACT §9)
KEEPALIVE_EVERY = 1.0
TOKEN_FILE = "cluster.json"


class StartRefused(Exception):
    """The node must not join (a live duplicate id, an incompatible prefix): one-line reason."""


def load_or_create_incarnation(data_dir: str) -> str:
    path = os.path.join(data_dir, TOKEN_FILE)
    try:
        with open(path) as f:
            return json.load(f)["incarnation"]
    except (FileNotFoundError, KeyError, ValueError):
        pass
    token = secrets.token_hex(16)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"incarnation": token}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return token



def member_records(kvs, log=None) -> dict:
    """node_id -> member record from the etcd key-values under ``members/``; an unreadable record
    is skipped (and logged when ``log`` is given)."""
    members = {}
    for kv in kvs:
        try:
            rec = kv.json()
            members[int(rec["node_id"])] = rec
        except (ValueError, KeyError, TypeError):
            if log is not None:
                log.warn("ignoring an unreadable member record at {key}", key=kv.key)
    return members

class Membership:
    log = Logger()

    def __init__(self, client: etcd.EtcdClient, prefix: str, node_id: int, incarnation: str, addresses: dict,
                 reactor=None, ttl=LEASE_TTL):
        self.client = client
        self.prefix = prefix
        self.node_id = node_id
        self.incarnation = incarnation
        self.addresses = addresses  # listener name -> "host:port" or None
        self.reactor = reactor or client.reactor
        self.ttl = ttl
        self.lease = None
        self.members = {}  # node_id -> record dict, live members as last seen
        self._keepalive = None
        self._watch = None
        self._on_change = []
        self._on_new_lease = []
        self._stopping = False
        self.registered_at = None

    @property
    def key(self) -> str:
        return self.prefix + "members/%d" % self.node_id

    def record(self) -> dict:
        rec = {"node_id": self.node_id, "incarnation": self.incarnation, "lease": self.lease,
               "layout": LAYOUT_VERSION, "started_ms": int(time.time() * 1000)}
        rec.update(self.addresses)
        return rec

    def on_change(self, fn):
        self._on_change.append(fn)

    def on_new_lease(self, fn):
        """``fn(lease)`` runs when the node re-registers under a new lease (the old one expired)."""
        self._on_new_lease.append(fn)

    # -- joining --------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def check_layout(self):
        key = self.prefix + "version"
        r = yield self.client.txn([etcd.compare_version(key, 0)], [etcd.op_put(key, LAYOUT_VERSION)], [etcd.op_get(key)])
        if not r.succeeded:
            found = r.kvs(0)[0].value.decode(errors="replace") if r.kvs(0) else "?"
            if found != LAYOUT_VERSION:
                raise StartRefused("cluster prefix %s holds layout version %s; this node speaks version %s"
                                   % (self.prefix, found, LAYOUT_VERSION))

    @defer.inlineCallbacks
    def register(self):
        """Take a lease and put this node's record under it; StartRefused if another live node
        holds this id. Nothing stays behind on failure (the new lease is revoked)."""
        lease = yield self.client.lease_grant(self.ttl)
        try:
            yield self._claim(lease)
        except BaseException:
            self.lease = None
            try:
                yield self.client.lease_revoke(lease, deadline=2.0)
            except Exception:
                pass  # it expires within the TTL anyway
            raise
        self.lease = lease
        self.registered_at = self.reactor.seconds()
        self.log.info("registered as member {node_id} under lease {lease:x}", node_id=self.node_id, lease=lease)
        return lease

    @defer.inlineCallbacks
    def _claim(self, lease):
        key = self.key
        for _ in range(5):
            self.lease = lease
            value = json.dumps(self.record())
            r = yield self.client.txn([etcd.compare_version(key, 0)], [etcd.op_put(key, value, lease)], [etcd.op_get(key)])
            if r.succeeded:
                return
            held = r.kvs(0)
            if not held:
                continue  # it expired in between: try again
            other = held[0]
            try:
                rec = other.json()
            except ValueError:
                rec = {}
            if rec.get("incarnation") != self.incarnation:
                raise StartRefused(
                    "node_id %d is already live in the cluster (sbp %s); stop that node or give this one another --node-id"
                    % (self.node_id, rec.get("sbp") or "?"))
            # CONTRACT §9: our own data dir's previous run (kill -9, lease not yet expired):
            # take the key over and end the old lease (its election key goes with it)
            r = yield self.client.txn([etcd.compare_mod_revision(key, other.mod_revision)], [etcd.op_put(key, value, lease)])
            if r.succeeded:
                if other.lease and other.lease != lease:
                    yield self.client.lease_revoke(other.lease)
                self.log.info("took over member key {key} from this data dir's previous run", key=key)
                return
        raise StartRefused("could not register %s: it kept changing" % key)

    @defer.inlineCallbacks
    def start(self):
        yield self.check_layout()
        yield self.register()
        yield self.refresh()
        self._watch = self.client.watch_prefix(self.prefix + "members/", self._revision + 1, self._events,
                                               on_reset=self._reset)
        self._keepalive = task.LoopingCall(self._keep_alive)
        self._keepalive.clock = self.reactor
        self._keepalive.start(KEEPALIVE_EVERY, now=False)

    @defer.inlineCallbacks
    def refresh(self):
        kvs, rev = yield self.client.get_prefix(self.prefix + "members/")
        members = member_records(kvs, self.log)
        self._revision = rev
        self._set(members)

    def _reset(self):
        self.refresh().addErrback(lambda f: self.log.warn("member refresh failed: {e}", e=f.value))

    def _events(self, events):
        members = dict(self.members)
        for kind, kv in events:
            try:
                nid = int(kv.key.rsplit(b"/", 1)[1])
            except ValueError:
                continue
            if kind == "DELETE":
                members.pop(nid, None)
            else:
                try:
                    members[nid] = kv.json()
                except ValueError:
                    pass
        self._set(members)

    def _set(self, members):
        before = set(self.members)
        self.members = members
        if set(members) != before:
            self.log.info("live members: {members}", members=sorted(members))
        for fn in self._on_change:
            try:
                fn(members)
            except Exception:
                self.log.failure("membership listener failed")

    def live_ids(self):
        return sorted(self.members)

    def sbp_address(self, node_id, default=None):
        rec = self.members.get(node_id)
        return rec.get("sbp") if rec else default

    # -- staying alive --------------------------------------------------------------------------

    @defer.inlineCallbacks
    def _keep_alive(self):
        if self._stopping:
            return
        if self.lease is not None:
            try:
                # a short timeout per attempt: a hung etcd member must not hold the keep-alive
                # past the TTL while another member would answer
                ttl = yield self.client.lease_keepalive(self.lease, deadline=KEEPALIVE_EVERY * 2,
                                                        timeout=KEEPALIVE_EVERY * 0.8)
            except etcd.EtcdError as e:
                # etcd slow or unreachable: keep serving, say so, keep trying (the lease may
                # still run)
                self.log.warn("etcd keep-alive failed: {error}", error=str(e))
                return
            if ttl > 0 or self._stopping:
                return
            # the lease expired (etcd unreachable longer than the TTL): the cluster saw this
            # node leave; join again under a new lease
            self.log.warn("membership lease {lease:x} expired; registering again", lease=self.lease)
            self.lease = None
        try:
            lease = yield self.register()
        except StartRefused as e:
            self.log.error("cannot rejoin: {error}", error=str(e))
            return
        except etcd.EtcdError as e:
            self.log.warn("rejoin failed, will retry: {error}", error=str(e))
            return
        for fn in self._on_new_lease:
            fn(lease)

    @defer.inlineCallbacks
    def stop(self):
        self._stopping = True
        if self._keepalive is not None and self._keepalive.running:
            self._keepalive.stop()
        if self._watch is not None:
            self._watch.stop()
        if self.lease is not None:
            # leaving: the member key (and our election key) go at once, not after the TTL
            try:
                yield self.client.lease_revoke(self.lease, deadline=2.0)
            except Exception as e:
                self.log.warn("could not revoke lease on leaving: {error}", error=str(e))
            self.lease = None
