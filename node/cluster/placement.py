"""The placement driver (CONTRACT §9): stream and range metadata in etcd, answered by every node.

Keys under the cluster prefix P:
- ``P streams/<stream_id, 20 digits>``: one JSON record per stream, ranges included::

      {"stream_id", "replica_nums", "ack_count", "retention_period_ms", "epoch", "trim_offset",
       "created_by", "ranges": [{"index", "start", "end" (-1 open), "epoch",
                                 "servers": [{"id", "addr", "primary"}]}]}

  Every change is a transaction comparing the record's mod_revision (compare-and-swap), so two
  nodes changing one stream at once never lose an update; the loser re-reads and retries.
  ``epoch`` is the stream's fencing epoch and each range records the epoch it was opened under:
  the seal on failover (issue 17) bumps it in the same compare-and-swap.
- ``P counters/streams/<node_id>``: the highest n reserved for stream ids ``(node_id << 32) | n``
  by that node (CONTRACT §2), advanced by compare-and-swap a block of STREAM_ID_BLOCK at a time,
  never below the node's local counter.
- ``P counters/allocate_id``: ALLOCATE_ID's counter.

Placement of a new stream: R distinct live members. The primary is the member leading the fewest
open ranges (then holding the fewest), the others the least loaded (open ranges held, then
primaries), ties broken by a rotating start so equal nodes take turns. Fewer than R live members:
NoAvailableRS.

Each node watches ``P streams/`` and keeps every record in ``streams`` (a cache for routing and
placement load; reads that answer clients go to etcd). For each stream whose ranges name it, the
node creates the local stream that holds its replica (same stream id): writable on the open
range's primary, read-only elsewhere (the primary's address as its origin, so a write there gets
PD_NOT_LEADER naming the primary); the primary feeds the others over the replica channel
(node/cluster/replication.py).
"""

import json
import time

from twisted.internet import defer
from twisted.internet.task import deferLater
from twisted.logger import Logger

from node.cluster import etcd
from storage import errors as store_errors

CAS_ATTEMPTS = 20
STREAM_ID_BLOCK = 100


class PlacementError(Exception):
    pass


class NoAvailableRS(PlacementError):
    """CONTRACT §9: fewer live nodes than the stream's replica_nums (status 1502)."""


class StreamGone(PlacementError):
    """No such stream in the cluster (status 1404)."""


class NotHere(PlacementError):
    """The operation belongs on another node (PD_NOT_LEADER, message = that node's SBP address)."""

    def __init__(self, address):
        super().__init__(address)
        self.address = address


class Conflict(PlacementError):
    """A compare-and-swap lost CAS_ATTEMPTS times in a row."""


def ack_count(replica_nums: int) -> int:
    return replica_nums // 2 + 1  # CONTRACT §9: a majority


def open_range(rec):
    for r in reversed(rec.get("ranges", [])):
        if r["end"] < 0:
            return r
    return None


def primary_of(rng):
    for s in rng["servers"]:
        if s.get("primary"):
            return s
    return rng["servers"][0] if rng["servers"] else None


def hosts(rec, node_id) -> bool:
    return any(s["id"] == node_id for r in rec.get("ranges", []) for s in r["servers"])


class PlacementDriver:
    log = Logger()

    def __init__(self, client: etcd.EtcdClient, prefix: str, node_id: int, membership, store,
                 replication_factor: int, reactor=None):
        self.client = client
        self.prefix = prefix
        self.node_id = node_id
        self.membership = membership
        self.store = store
        self.replication_factor = replication_factor
        self.reactor = reactor or client.reactor
        self.streams = {}  # stream_id -> record, as last seen (watch); change through _set/_unset
        self._held = {}  # node_id -> open ranges it holds (from self.streams)
        self._led = {}  # node_id -> open ranges it leads
        self._turn = 0
        self._watch = None
        self._ensuring = {}  # stream_id -> Deferred of a local replica being created
        self._revision = 0
        self._seen = 0  # the newest stream-record revision this cache has taken in
        self._id_lock = defer.DeferredLock()
        self._id_next = self._id_end = 0  # the reserved block of stream-id counters [next, end)
        self.listeners = []  # fn(rec) for every new record seen (the replicator's)
        self.fed_epochs = {}  # stream id -> newest epoch whose primary sent this node batches (replicator)
        self._retention_trims = set()  # stream ids whose retention trim this node is handing on

    def key(self, sid) -> str:
        return self.prefix + "streams/%020d" % sid

    # -- start / stop ---------------------------------------------------------------------------

    @defer.inlineCallbacks
    def start(self):
        yield self._load()
        self._watch = self.client.watch_prefix(self.prefix + "streams/", self._revision + 1, self._events,
                                               on_reset=self._reset)
        self.store.log.retention_handler = self._retention

    def stop(self):
        if self.store.log.retention_handler == self._retention:
            self.store.log.retention_handler = None
        if self._watch is not None:
            self._watch.stop()

    def _retention(self, sid, point):
        """The store's retention found batches of ``sid`` up to ``point`` past their age. A
        replicated stream's retention is decided by one node, its primary (of the open range, else
        of the last range), by the primary's clock, and handed on as a trim through the stream
        record (``trim_stream``), which every replica follows: replicas never trim by their own
        clocks, so they keep the same batches. True: handled here (or left to the primary)."""
        rec = self.streams.get(sid)
        if rec is None:
            return False  # not a cluster stream (made before --cluster): the store's own retention
        rng = open_range(rec) or (rec["ranges"][-1] if rec.get("ranges") else None)
        primary = primary_of(rng) if rng else None
        if primary is None or primary["id"] != self.node_id or sid in self._retention_trims:
            return True
        self._retention_trims.add(sid)
        d = self.trim_stream(sid, point)
        d.addErrback(lambda f: self.log.warn("stream {sid}: retention trim to {point} not handed on: {e}",
                                             sid=sid, point=point, e=f.value))
        d.addBoth(lambda _: self._retention_trims.discard(sid))
        return True

    @defer.inlineCallbacks
    def _load(self):
        kvs, rev = yield self.client.get_prefix(self.prefix + "streams/")
        self._revision = rev
        self._seen = max(self._seen, rev)
        streams = {}
        for kv in kvs:
            rec = _decode(kv)
            if rec is not None:
                streams[rec["stream_id"]] = rec
        gone = [sid for sid in self.streams if sid not in streams]
        self.streams, self._held, self._led = {}, {}, {}
        for rec in streams.values():
            self._set(rec)
        for rec in streams.values():
            self._apply(rec)
        for sid in gone:
            self._apply_delete(sid)

    def _reset(self):
        self._load().addErrback(lambda f: self.log.warn("placement reload failed: {e}", e=f.value))

    def _events(self, events):
        for kind, kv in events:
            if kind == "DELETE":
                try:
                    sid = int(kv.key.rsplit(b"/", 1)[1])
                except ValueError:
                    continue
                self._unset(sid)
                self._apply_delete(sid)
            else:
                rec = _decode(kv)
                if rec is not None:
                    self._remember(rec)

    def _remember(self, rec):
        self._seen = max(self._seen, rec.get("_rev", 0))
        old = self.streams.get(rec["stream_id"])
        if old is not None and old.get("_rev", 0) > rec.get("_rev", 0):
            return  # an older view arriving late
        self._set(rec)
        self._apply(rec)
        for fn in self.listeners:
            try:
                fn(rec)
            except Exception:
                self.log.failure("stream record listener failed")

    def _count(self, rec, sign):
        rng = open_range(rec)
        for s in (rng["servers"] if rng else ()):
            self._held[s["id"]] = self._held.get(s["id"], 0) + sign
            if s.get("primary"):
                self._led[s["id"]] = self._led.get(s["id"], 0) + sign

    def _set(self, rec):
        old = self.streams.get(rec["stream_id"])
        if old is not None:
            self._count(old, -1)
        self.streams[rec["stream_id"]] = rec
        self._count(rec, +1)

    def held(self):
        """node_id -> open ranges it holds (a copy)."""
        return dict(self._held)

    def led(self, node_id):
        return self._led.get(node_id, 0)

    def _unset(self, sid):
        old = self.streams.pop(sid, None)
        if old is not None:
            self._count(old, -1)

    # -- this node's replicas -------------------------------------------------------------------

    def _apply(self, rec):
        """Bring this node's local replica state in line with ``rec`` (errors are logged)."""
        sid = rec["stream_id"]
        if not hosts(rec, self.node_id):
            return
        d = self.ensure_local(rec)
        d.addErrback(lambda f: self.log.warn("local replica of stream {sid} not updated: {error}", sid=sid, error=f.value))

    def ensure_local(self, rec):
        """A Deferred that fires once this node's local stream for ``rec`` exists and has its
        retention and trim point (one at a time per stream)."""
        sid = rec["stream_id"]
        prev = self._ensuring.get(sid)
        d = defer.Deferred()
        self._ensuring[sid] = d

        def run(_):
            return self._ensure_local(rec)

        def done(result):
            if self._ensuring.get(sid) is d:
                del self._ensuring[sid]
            return result

        start = prev.addBoth(lambda _: None) if prev is not None else defer.succeed(None)
        start.addCallback(run).addBoth(done).chainDeferred(d)
        return d

    @defer.inlineCallbacks
    def _ensure_local(self, rec):
        sid = rec["stream_id"]
        log = self.store.log
        rng = open_range(rec)
        primary = primary_of(rng) if rng else None
        origin = None
        if primary is not None and primary["id"] != self.node_id:
            origin = self.membership.sbp_address(primary["id"], primary.get("addr")) or "?"
        try:
            meta = log.stream(sid)
        except store_errors.StreamNotFound:
            meta = None
        if meta is None:
            yield log.create_replica_stream(sid, origin, rec["replica_nums"], rec["retention_period_ms"],
                                            attrs={"cluster": "1"})
            self.log.info("created the local replica of stream {sid} ({role})", sid=sid,
                          role="primary" if origin is None else "replica")
            meta = log.stream(sid)
        elif meta.origin is not None and origin is None:
            # a replica became the primary (failover): its local stream takes appends now
            yield log.create_replica_stream(sid, None, rec["replica_nums"], rec["retention_period_ms"])
            meta = log.stream(sid)
        elif meta.retention_period_ms != rec["retention_period_ms"] or meta.replica_nums != rec["replica_nums"]:
            meta = yield log.update_stream(sid, replica_nums=rec["replica_nums"],
                                           retention_period_ms=rec["retention_period_ms"])
        if rec.get("trim_offset", 0) > meta.trim_offset:
            # the primary's trim already ran in trim_stream (this covers a restart); the other
            # replicas follow the record's trim point
            if meta.origin is None:
                yield log.trim(sid, rec["trim_offset"])
            else:
                yield log.trim_replica(sid, rec["trim_offset"])
        yield self._cut_tail(rec)

    @defer.inlineCallbacks
    def _cut_tail(self, rec):
        """CONTRACT §9 Failover: a node that is not a replica of the open range keeps its copy only
        up to the end of the last (sealed) range it held: anything past it (the dead primary's
        batches that no majority acknowledged, come back with it) is cut, so it never serves them
        and can be taken back as a copy (failover's spares take a node only if its copy ends at
        or below that end)."""
        sid = rec["stream_id"]
        log = self.store.log
        waited = 0.0
        while self._tail_end(sid) is not None and log.durable_end(sid) < log.assigned_end(sid) and waited < 5.0:
            yield deferLater(self.reactor, 0.01, lambda: None)  # batches still in flight here
            waited += 0.01
        # decided on the newest record, in the same reactor turn as the cut: a record that came
        # meanwhile may have made this node a copy again (its batches above the end are then the
        # new range's, acknowledged to its primary)
        end = self._tail_end(sid)
        if end is not None and log.durable_end(sid) == log.assigned_end(sid) and log.assigned_end(sid) > end:
            before = log.assigned_end(sid)
            yield log.truncate_replica(sid, end)
            self.log.warn("stream {sid}: cut this node's copy from {before} to {end}, the end of the last range "
                          "it held (an unacknowledged tail past the seal)", sid=sid, before=before, end=end)

    def _tail_end(self, sid):
        """Where this node's copy of ``sid`` must end, as the newest record says: the end of the
        last range it held if it is not a replica of the open range; else None."""
        rec = self.streams.get(sid)
        rng = open_range(rec) if rec is not None else None
        if rng is None or any(s["id"] == self.node_id for s in rng["servers"]):
            return None
        if self.fed_epochs.get(sid, -1) > rec.get("epoch", 0):
            return None  # a primary of a newer range feeds this copy: the watch is behind
        held = [r for r in rec["ranges"] if r["end"] >= 0 and any(s["id"] == self.node_id for s in r["servers"])]
        if not held:
            return None
        return max(held, key=lambda r: r["index"])["end"]

    def _apply_delete(self, sid):
        try:
            meta = self.store.log.stream(sid)
        except store_errors.StreamNotFound:
            return
        if (meta.attrs or {}).get("cluster") != "1":
            return  # a local stream of this node, not a cluster replica
        d = self.store.log.delete_stream(sid)
        d.addCallback(lambda _: self.log.info("deleted the local replica of stream {sid}", sid=sid))
        d.addErrback(lambda f: self.log.warn("local replica of stream {sid} not deleted: {error}", sid=sid, error=f.value))

    # -- routing (APPEND / FETCH / TRIM) ---------------------------------------------------------

    def route(self, sid, read=False, offset=None, wait=False):
        """Where a data operation on ``sid`` is served: ``None`` here; a ``str`` the SBP address of
        the node to ask; or a Deferred (this node must learn about the stream first) that fires
        with one of those. Appends go to the open range's primary; reads (``read``, from
        ``offset`` when given) are served by any node holding a replica (issue 17: each holds the
        stream up to the confirm offset), except that a replica still catching up (a
        re-replication spare, a lagging copy) sends a read it cannot answer in full to the
        primary (``_catching_up``; ``wait``: a long-poll read)."""
        rec = self.streams.get(sid)
        if rec is None:
            if self._local(sid):
                return None  # a stream of this node outside the cluster's records (made before --cluster)
            return self._lookup(sid, read, offset, wait)
        rng = open_range(rec)
        # a read is served by a replica of the open range (after a failover a node that held
        # an older range only may hold an unacknowledged tail past its seal)
        if read and (any(s["id"] == self.node_id for s in rng["servers"]) if rng else hosts(rec, self.node_id)):
            if self._local(sid):
                if offset is not None and rng is not None:
                    return self._catching_up(sid, rng, offset, wait)
                return None
            return self.ensure_local(rec).addCallback(lambda _: None)
        primary = primary_of(rng) if rng else None
        if primary is None or primary["id"] == self.node_id:
            if self._local(sid) or primary is None:
                return None
            return self.ensure_local(rec).addCallback(lambda _: None)
        live_ids = self.membership.live_ids() if not read else ()
        if not read and primary["id"] not in live_ids:
            live = sum(1 for s in rng["servers"] if s["id"] in live_ids)
            ack = rec.get("ack_count") or ack_count(rec["replica_nums"])
            if live < ack:
                # CONTRACT §9: the range cannot be sealed and re-opened until replicas return
                return defer.fail(NoAvailableRS("stream %d: its primary (node %d) is down and %d live replica(s) "
                                                "are left, ack_count %d" % (sid, primary["id"], live, ack)))
        return self.address(primary)

    def appends_here(self, sid) -> bool:
        """``route(sid) is None`` for an APPEND in its usual case, without side effects: the
        stream's record is known, its open range's primary is this node and the stream is in the
        local store. False covers everything else (``route`` then decides: an address, a lookup
        in etcd, a stream outside the records). The SBP server takes a read's APPENDs into one
        run only for streams this says yes to (protocols/sbp/append.py)."""
        rec = self.streams.get(sid)
        if rec is None:
            return False
        rng = open_range(rec)
        primary = primary_of(rng) if rng else None
        return primary is not None and primary["id"] == self.node_id and self._local(sid)

    def _catching_up(self, sid, rng, offset, wait=False):
        """A read at ``offset`` on this replica of the open range ``rng``: ``None`` (served here)
        unless this copy ends at or below ``offset`` while acknowledged batches go further (the
        range's start, which a majority holds, or the confirm offset this node learned): then
        the primary's address, so the reader gets what is acknowledged rather than this copy's
        end (CONTRACT §9 Reads: "served from any replica of the range holding the offset"). A
        copy the primary has not reached since this node started (no confirm offset yet: it
        cannot know how far it lags) counts as catching up too. A long-poll read (``wait``) on a
        copy the primary feeds live (it has the range's start and a confirm offset) waits here
        instead: the batches are on their way (the usual case: a tail reader on the replica
        that is a few milliseconds behind the majority). With the primary down (a failover
        under way) it is served here as it can be."""
        primary = primary_of(rng)
        if primary is None or primary["id"] == self.node_id:
            return None
        log = self.store.log
        try:
            visible = log.visible_end(sid)
            confirm = log.confirm_offset(sid)
        except store_errors.StreamNotFound:
            return None
        if offset < visible:
            return None
        if confirm is not None and (max(rng["start"], confirm) <= visible or wait and visible >= rng["start"]):
            return None
        if primary["id"] not in self.membership.live_ids():
            return None
        return self.address(primary) or None

    def _local(self, sid):
        try:
            self.store.log.assigned_end(sid)  # (per APPEND and FETCH: no StreamMeta built)
            return True
        except store_errors.StreamNotFound:
            return False

    @defer.inlineCallbacks
    def learn(self, sid):
        """Read the stream's record from etcd (this node's watch may be behind) and, if this
        node holds a replica, make its local stream; fires once done."""
        rec = yield self.get(sid)
        self._remember(rec)
        if hosts(rec, self.node_id):
            yield self.ensure_local(rec)
        return rec

    @defer.inlineCallbacks
    def _lookup(self, sid, read=False, offset=None, wait=False):
        try:
            rec = yield self.get(sid)
        except StreamGone:
            return None  # the local store answers STREAM_NOT_FOUND
        self._remember(rec)
        where = self.route(sid, read, offset, wait)
        if isinstance(where, defer.Deferred):
            where = yield where
        return where

    def address(self, server):
        """A range server's SBP address now (its live record), else the one stored at placement."""
        return self.membership.sbp_address(server["id"], server.get("addr")) or ""

    # -- ids ------------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def _advance(self, key, floor=0, step=1):
        """Compare-and-swap a decimal counter at ``key`` ``step`` up (from at least ``floor``);
        the new value."""
        for _ in range(CAS_ATTEMPTS):
            kv = yield self.client.get(key)
            current = int(kv.value) if kv is not None else 0
            n = max(current, floor) + step
            cmp = etcd.compare_mod_revision(key, kv.mod_revision) if kv is not None else etcd.compare_version(key, 0)
            r = yield self.client.txn([cmp], [etcd.op_put(key, str(n))])
            if r.succeeded:
                return n
        raise Conflict("counter %s kept changing" % key)

    def allocate_id(self):
        return self._advance(self.prefix + "counters/allocate_id")

    @defer.inlineCallbacks
    def _new_stream_id(self):
        # ids are reserved STREAM_ID_BLOCK at a time (one etcd write per block, not per stream,
        # as elastic-stream's allocator does); a restart skips the rest of its block
        yield self._id_lock.acquire()
        try:
            if self._id_next >= self._id_end:
                # never below the local counter: streams this node made before --cluster keep
                # their ids
                floor = self.store.log.last_stream_number()
                end = yield self._advance(self.prefix + "counters/streams/%d" % self.node_id, floor, STREAM_ID_BLOCK)
                self._id_next, self._id_end = end - STREAM_ID_BLOCK + 1, end + 1
            n = self._id_next
            self._id_next += 1
        finally:
            self._id_lock.release()
        if n >= 1 << 32:
            raise PlacementError("stream ids of node %d are exhausted" % self.node_id)
        return (self.node_id << 32) | n

    # -- placement ------------------------------------------------------------------------------

    def choose(self, replica_nums):
        """[(node_id, is_primary)] for a new range: R distinct live members, least loaded first."""
        live = self.membership.live_ids()
        if len(live) < replica_nums:
            raise NoAvailableRS("%d live node(s), stream needs %d" % (len(live), replica_nums))
        held = {nid: self._held.get(nid, 0) for nid in live}
        led = {nid: self._led.get(nid, 0) for nid in live}
        self._turn += 1
        n = len(live)
        order = {nid: (i - self._turn) % n for i, nid in enumerate(live)}
        # the primary first (the node leading the fewest open ranges), then the least loaded others
        primary = min(live, key=lambda nid: (led[nid], held[nid], order[nid]))
        others = sorted((nid for nid in live if nid != primary), key=lambda nid: (held[nid], led[nid], order[nid]))
        return [(primary, True)] + [(nid, False) for nid in others[:replica_nums - 1]]

    def _servers(self, choice):
        out = []
        for nid, is_primary in choice:
            out.append({"id": nid, "addr": self.membership.sbp_address(nid, ""), "primary": is_primary})
        out.sort(key=lambda s: not s["primary"])  # the primary first
        return out

    @defer.inlineCallbacks
    def create_stream(self, replica_nums=0, retention_period_ms=0):
        r = int(replica_nums) or self.replication_factor
        yield self._catch_up()
        choice = self.choose(r)  # 1502 before an id is spent
        sid = yield self._new_stream_id()
        rec = {
            "stream_id": sid, "replica_nums": r, "ack_count": ack_count(r),
            "retention_period_ms": int(retention_period_ms), "epoch": 0, "trim_offset": 0,
            "created_by": self.node_id, "created_ms": int(time.time() * 1000),
            "ranges": [{"index": 0, "start": 0, "end": -1, "epoch": 0, "servers": self._servers(choice)}],
        }
        key = self.key(sid)
        result = yield self.client.txn([etcd.compare_version(key, 0)], [etcd.op_put(key, json.dumps(rec))])
        if not result.succeeded:
            raise Conflict("stream id %d is taken" % sid)
        rec["_rev"] = result.revision
        self._remember(rec)
        return rec

    @defer.inlineCallbacks
    def _catch_up(self, timeout=1.0):
        """Wait (at most ``timeout``) until the watch has delivered every stream record written
        before now, so that placement counts the streams other nodes just created."""
        newest = yield self.client.newest_under(self.prefix + "streams/")
        deadline = self.reactor.seconds() + timeout
        while self._seen < newest and self.reactor.seconds() < deadline:
            yield deferLater(self.reactor, 0.005, lambda: None)

    @defer.inlineCallbacks
    def get(self, sid):
        kv = yield self.client.get(self.key(sid))
        rec = _decode(kv) if kv is not None else None
        if rec is None:
            raise StreamGone("stream %d not found" % sid)
        return rec

    @defer.inlineCallbacks
    def list_streams(self):
        kvs, _ = yield self.client.get_prefix(self.prefix + "streams/")
        return [rec for rec in map(_decode, kvs) if rec is not None]

    @defer.inlineCallbacks
    def _change(self, sid, fn):
        """Apply ``fn(rec) -> rec`` to the stream's record by compare-and-swap; the new record."""
        key = self.key(sid)
        for _ in range(CAS_ATTEMPTS):
            kv = yield self.client.get(key)
            rec = _decode(kv) if kv is not None else None
            if rec is None:
                raise StreamGone("stream %d not found" % sid)
            new = fn(dict(rec))
            new.pop("_rev", None)
            r = yield self.client.txn([etcd.compare_mod_revision(key, kv.mod_revision)], [etcd.op_put(key, json.dumps(new))])
            if r.succeeded:
                new["_rev"] = r.revision
                self._remember(new)
                return new
        raise Conflict("stream %d kept changing" % sid)

    def update_stream(self, sid, replica_nums=None, retention_period_ms=None):
        """replica_nums applies to ranges opened from now on (issue 17 re-places them)."""
        def fn(rec):
            if replica_nums:
                rec["replica_nums"] = int(replica_nums)
                rec["ack_count"] = ack_count(int(replica_nums))
            if retention_period_ms is not None:
                rec["retention_period_ms"] = int(retention_period_ms)
            return rec

        return self._change(sid, fn)

    @defer.inlineCallbacks
    def delete_stream(self, sid):
        key = self.key(sid)
        for _ in range(CAS_ATTEMPTS):
            kv = yield self.client.get(key)
            rec = _decode(kv) if kv is not None else None
            if rec is None:
                raise StreamGone("stream %d not found" % sid)
            r = yield self.client.txn([etcd.compare_mod_revision(key, kv.mod_revision)], [etcd.op_delete(key)])
            if r.succeeded:
                self._unset(sid)
                self._apply_delete(sid)
                return rec
        raise Conflict("stream %d kept changing" % sid)

    @defer.inlineCallbacks
    def trim_stream(self, sid, trim_offset):
        """CONTRACT §3 trim on the primary (it knows next_offset): the local store trims, then the
        record takes the new trim point and drops the ranges wholly below it."""
        rec = self.streams.get(sid) or (yield self.get(sid))
        rng = open_range(rec)
        primary = primary_of(rng) if rng else None
        if primary is not None and primary["id"] != self.node_id:
            raise NotHere(self.address(primary))
        yield self.ensure_local(rec)
        meta = yield self.store.log.trim(sid, trim_offset)
        point = meta.trim_offset

        def fn(rec):
            rec["trim_offset"] = max(rec.get("trim_offset", 0), point)
            ranges = [r for r in rec["ranges"] if r["end"] < 0 or r["end"] > point]
            if ranges:
                ranges[0] = dict(ranges[0], start=max(ranges[0]["start"], point))
            rec["ranges"] = ranges
            return rec

        new = yield self._change(sid, fn)
        return new, meta

    def seal_and_open(self, sid, epoch, end, servers):
        """CONTRACT §9 Failover: seal the open range of ``epoch`` at ``end`` and open the next one
        at ``end`` on ``servers`` ([(node_id, is_primary)]), the stream's epoch incremented, in one
        compare-and-swap; Conflict if the stream moved past ``epoch`` meanwhile."""
        def fn(rec):
            if rec.get("epoch", 0) != epoch:
                raise Conflict("stream %d is at epoch %d, not %d" % (sid, rec.get("epoch", 0), epoch))
            rng = open_range(rec)
            if rng is None:
                raise Conflict("stream %d has no open range" % sid)
            rng["end"] = end
            rec["epoch"] = epoch + 1
            rec["ranges"].append({"index": rng["index"] + 1, "start": end, "end": -1, "epoch": epoch + 1,
                                  "servers": self._servers(servers)})
            return rec

        return self._change(sid, fn)

    def next_offset(self, rec, rng):
        """The range's next offset as this node knows it: the local replica's for an open range
        held here, else its end (sealed) or its start."""
        if rng["end"] >= 0:
            return rng["end"]
        try:
            meta = self.store.log.stream(rec["stream_id"])
        except store_errors.StreamNotFound:
            return rng["start"]
        return max(rng["start"], meta.next_offset)


def _decode(kv):
    try:
        rec = json.loads(kv.value)
        rec["stream_id"] = int(rec["stream_id"])
        rec["_rev"] = kv.mod_revision
        return rec
    except (ValueError, KeyError, TypeError):
        Logger().warn("ignoring an unreadable stream record at {key}", key=kv.key)
        return None
