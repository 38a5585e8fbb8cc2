"""The placement-driver leader (CONTRACT §9): etcd's own election under ``P election/``.

Every node campaigns with its membership lease (etcd's ``/v3/election/campaign`` waits until this
node's key is the oldest under the election name). The leader is the key with the lowest create
revision; every node learns it by watching the prefix, so DESCRIBE_PD_CLUSTER on every node names
the same one. A dead leader's lease expires (TTL 3 s), its key goes, and the next oldest candidate
leads: re-election takes at most the lease TTL plus a keep-alive tick.
"""

from twisted.internet import defer
from twisted.logger import Logger

from node.cluster import etcd


class Election:
    log = Logger()

    def __init__(self, client: etcd.EtcdClient, prefix: str, node_id: int):
        self.client = client
        self.name = prefix + "election"
        self.node_id = node_id
        self.leader_id = None  # the current leader's node id, as last seen
        self.is_leader = False
        self._keys = {}  # election key -> (create_revision, node_id)
        self._watch = None
        self._campaign = None
        self._lease = None
        self._stopping = False
        self._listeners = []

    def on_leader(self, fn):
        self._listeners.append(fn)

    @defer.inlineCallbacks
    def start(self, lease):
        yield self.refresh()
        self._watch = self.client.watch_prefix(self.name + "/", self._revision + 1, self._events, on_reset=self._reset)
        self.campaign(lease)

    def campaign(self, lease):
        """Stand with ``lease`` (again, after the membership lease changed)."""
        self._lease = lease
        if self._campaign is not None:
            self._campaign.cancel()
        d = self.client.campaign(self.name, lease, str(self.node_id))
        self._campaign = d

        def won(key):
            if self._campaign is d:
                self._campaign = None
            self.log.info("node {node_id} campaign won ({key})", node_id=self.node_id, key=key)

        def failed(f):
            if self._campaign is d:
                self._campaign = None
            if self._stopping or f.check(defer.CancelledError):
                return None
            # etcd restarted or the connection broke while waiting: stand again (same lease,
            # so etcd finds our key and keeps its place in line)
            self.log.warn("campaign interrupted ({error}); standing again", error=str(f.value))
            self.client.reactor.callLater(0.5, lambda: self._stopping or self._lease != lease or self.campaign(lease))
            return None

        d.addCallbacks(won, failed)

    @defer.inlineCallbacks
    def refresh(self):
        kvs, rev = yield self.client.get_prefix(self.name + "/")
        self._revision = rev
        self._keys = {}
        for kv in kvs:
            self._keys[kv.key] = (kv.create_revision, _node_id(kv.value))
        self._update()

    def _reset(self):
        self.refresh().addErrback(lambda f: self.log.warn("election refresh failed: {e}", e=f.value))

    def _events(self, events):
        for kind, kv in events:
            if kind == "DELETE":
                self._keys.pop(kv.key, None)
            else:
                self._keys[kv.key] = (kv.create_revision, _node_id(kv.value))
        self._update()

    def _update(self):
        leader = min(self._keys.values())[1] if self._keys else None
        if leader != self.leader_id:
            self.log.info("placement-driver leader: {leader}", leader=leader)
            self.leader_id = leader
            self.is_leader = leader == self.node_id
            for fn in self._listeners:
                try:
                    fn(leader)
                except Exception:
                    self.log.failure("leader listener failed")

    @defer.inlineCallbacks
    def current_leader(self):
        """The leader as etcd says now (one linearizable read)."""
        kvs, _ = yield self.client.get_prefix(self.name + "/")
        if not kvs:
            return None
        return min((kv.create_revision, _node_id(kv.value)) for kv in kvs)[1]

    def stop(self):
        self._stopping = True
        if self._watch is not None:
            self._watch.stop()
        if self._campaign is not None:
            self._campaign.cancel()


def _node_id(value: bytes):
    try:
        return int(value)
    except ValueError:
        return None
