"""Failover of a dead primary's range (CONTRACT §9 Failover), run by the placement-driver leader.

Every CHECK_EVERY_S the leader looks for streams whose open range's primary is not a live member
(its lease expired) and, one stream at a time, elastic-stream's way (research note §3.6):

1. asks every live replica of the range to seal it under the stream's epoch
   (``Replicator.seal``): each refuses that epoch's appends from then on (1460) and answers its
   durable end once everything it received is durable;
2. waits for at least R - ack_count + 1 answers: every acknowledged batch is on ack_count
   replicas, so on at least one of them; fewer answers: it tries again on the next check;
3. the range's end is the largest end among the answers; the replica holding it becomes the new
   range's primary (it has every batch below the end), the other answering replicas its copies,
   and live members that held no copy fill it up to R if there are any;
4. records the seal and opens range index+1 at the end in one etcd compare-and-swap, the
   stream's epoch incremented (``PlacementDriver.seal_and_open``).

The same check re-replicates (CONTRACT §9): a range whose primary is live but which is short of R
live replicas (opened degraded, or a server gone REREPLICATE_AFTER_S) is sealed the same way and
re-opened with spares (``rereplicate``); SEAL_RANGES from a client goes through ``seal_range``.

The new primary, on seeing the record, treats everything below the end as confirmed and brings
the other replicas up to it (the replicator's catch-up), then takes appends. Clients that get
1460 or PD_NOT_LEADER retry on the new range's primary (LIST_RANGES).
"""

import time

from twisted.internet import defer, task
from twisted.logger import Logger

from node.cluster import placement
from storage import errors as store_errors

CHECK_EVERY_S = 0.25
REREPLICATE_AFTER_S = 10.0  # a replica gone this long is replaced (CONTRACT §9: copied within 45 s)


class Failover:
    log = Logger()

    def __init__(self, pd, membership, election, replicator, reactor):
        self.pd = pd
        self.membership = membership
        self.election = election
        self.replicator = replicator
        self.reactor = reactor
        self.busy = set()  # stream ids being failed over
        self.count = 0  # failovers done by this node
        self.last = None  # {"stream_id", "range", "end", "primary", "seconds"} of the latest
        self._loop = None
        self._said = {}  # stream id -> the last reason it could not be failed over (logged once)
        self._gone_since = {}  # node id -> reactor time the leader first saw it not live

    def start(self):
        self._loop = task.LoopingCall(self.check)
        self._loop.clock = self.reactor
        self._loop.start(CHECK_EVERY_S, now=False).addErrback(lambda f: self.log.failure("failover check stopped", f))

    def stop(self):
        if self._loop is not None and self._loop.running:
            self._loop.stop()

    def check(self):
        if not (self.election and self.election.is_leader):
            return
        live = set(self.membership.live_ids())
        now = self.reactor.seconds()
        for nid in list(self._gone_since):
            if nid in live:
                del self._gone_since[nid]
        for sid, rec in list(self.pd.streams.items()):
            rng = placement.open_range(rec)
            p = placement.primary_of(rng) if rng else None
            if p is None or sid in self.busy:
                continue
            if p["id"] not in live:
                d = self.fail_over(sid)
            elif self._short(rec, rng, live, now):
                d = self.rereplicate(sid)
            else:
                continue
            self.busy.add(sid)
            d.addErrback(self._not_yet, sid)
            d.addBoth(lambda _, sid=sid: self.busy.discard(sid))

    def _short(self, rec, rng, live, now):
        """True if the open range wants re-replication now: fewer servers than the stream's R
        (opened degraded), or a server gone for REREPLICATE_AFTER_S (a restart within it just
        catches up), and a live node outside the range to take a copy."""
        ids = [s["id"] for s in rng["servers"]]
        if not any(nid not in ids for nid in live):
            return False
        if len(ids) < rec["replica_nums"]:
            return True
        for nid in ids:
            if nid not in live and now - self._gone_since.setdefault(nid, now) >= REREPLICATE_AFTER_S:
                return True
        return False

    @defer.inlineCallbacks
    def _spares(self, rec, rng, epoch, live, taken, wanted):
        """Up to ``wanted`` live nodes to fill the next range: nodes that never held the stream,
        and nodes that held an older range whose copy ends at or below that range's end (a node
        that held it longer, e.g. the dead primary come back, may keep an unacknowledged tail
        past the seal: it is not extended)."""
        out = []
        held = self.pd.held()
        in_open = {s["id"] for s in rng["servers"]}
        for nid in sorted((n for n in live if n not in taken and n not in in_open), key=lambda n: (held.get(n, 0), n)):
            if len(out) >= wanted:
                break
            if not placement.hosts(rec, nid):
                out.append(nid)
                continue
            last_end = max(r["end"] for r in rec["ranges"] if r["end"] >= 0 and any(s["id"] == nid for s in r["servers"]))
            try:
                end = yield self.replicator.seal(nid, rec["stream_id"], epoch)  # also fences it
            except Exception:
                continue
            if end <= last_end:
                out.append(nid)
        return out

    def _not_yet(self, f, sid):
        # checked again every CHECK_EVERY_S: say it once per reason, not four times a second
        reason = str(f.value)
        if self._said.get(sid) != reason:
            self._said[sid] = reason
            self.log.warn("failover of stream {sid} not done yet: {e}", sid=sid, e=reason)

    @defer.inlineCallbacks
    def fail_over(self, sid):
        """The open range's primary is dead: seal the range at its survivors' largest end and open
        the next one on them (and spares)."""
        rec = yield self.pd.get(sid)  # the record as etcd has it now
        rng = placement.open_range(rec)
        p = placement.primary_of(rng) if rng else None
        if p is None or p["id"] in set(self.membership.live_ids()):
            return
        yield self.reopen(rec, "dead primary %d" % p["id"])

    @defer.inlineCallbacks
    def rereplicate(self, sid):
        """Re-replication (CONTRACT §9): the open range has fewer than R live replicas and a live
        node outside it can take a copy: seal it and open the next range on its live replicas
        plus spares (the primary stays: it holds the largest end). The spares get the whole
        stream from the new primary's store through the replica channel's catch-up."""
        rec = yield self.pd.get(sid)
        rng = placement.open_range(rec)
        live = set(self.membership.live_ids())
        if rng is None or not self._short(rec, rng, live, self.reactor.seconds()):
            return
        wanted = rec["replica_nums"] - sum(1 for s in rng["servers"] if s["id"] in live)
        spares = yield self._spares(rec, rng, rec.get("epoch", 0), live, set(), wanted)
        if not spares:
            raise placement.NoAvailableRS("stream %d: no live node can take a copy yet" % sid)
        yield self.reopen(rec, "re-replication to node(s) %s" % ",".join(map(str, spares)), spares=spares)

    @defer.inlineCallbacks
    def seal_range(self, sid, index):
        """SBP SEAL_RANGES in cluster mode (CONTRACT §3 Ranges, §9): seal the stream's open range
        ``index`` the failover way (its replicas fenced, the largest end taken) and open range
        index+1 on the same live replicas; the new record. 1460 for a sealed range, 1462 for an
        unknown index."""
        rec = yield self.pd.get(sid)
        rng = placement.open_range(rec)
        if rng is None or rng["index"] != index:
            if any(r["index"] == index for r in rec["ranges"]):
                raise store_errors.RangeAlreadySealed("range %d of stream %d is sealed" % (index, sid))
            raise store_errors.RangeNotFound("stream %d has no range %d" % (sid, index))
        if sid in self.busy:
            raise placement.Conflict("stream %d is being sealed already" % sid)
        self.busy.add(sid)
        try:
            new = yield self.reopen(rec, "SEAL_RANGES", spares=[])
        finally:
            self.busy.discard(sid)
        return new

    @defer.inlineCallbacks
    def reopen(self, rec, why, spares=None, prefer=None, drop=()):
        """Seal ``rec``'s open range (CONTRACT §9 Failover) and open range index+1; ``spares``:
        the nodes to add (None: failover's choice, up to R); ``prefer``: the primary wanted if
        it holds the largest end; ``drop``: replicas left out of the new range (sealed all the
        same) unless one alone holds the largest end (the key-value rebalancer's moves)."""
        t0 = time.monotonic()
        sid = rec["stream_id"]
        rng = placement.open_range(rec)
        p = placement.primary_of(rng)
        live = set(self.membership.live_ids())
        r = len(rng["servers"])
        ack = rec.get("ack_count") or placement.ack_count(rec["replica_nums"])
        need = max(1, r - ack + 1)
        epoch = rec.get("epoch", 0)
        survivors = [s["id"] for s in rng["servers"] if s["id"] in live]
        if len(survivors) < need:
            raise placement.NoAvailableRS("%d live replica(s) of stream %d, a seal needs %d" % (len(survivors), sid, need))
        results = yield defer.DeferredList([self.replicator.seal(nid, sid, epoch) for nid in survivors], consumeErrors=True)
        ends = {nid: end for nid, (ok, end) in zip(survivors, results) if ok}
        if len(ends) < need:
            raise placement.NoAvailableRS("%d of %d replicas of stream %d answered the seal, %d needed"
                                          % (len(ends), len(survivors), sid, need))
        end = max(ends.values())
        if end < rng["start"]:
            # the survivors have not caught up to the range's start (a range opened moments ago
            # whose primary died before they got its first batches): sealing here would leave a
            # hole; nothing of this range was acknowledged, but wait for the primary or a copy
            raise placement.NoAvailableRS("the replicas of stream %d that answered end at %d, below range %d's start %d"
                                          % (sid, end, rng["index"], rng["start"]))
        # the primary stays if it holds the largest end (a seal of a live primary's range)
        holders = [nid for nid in ends if ends[nid] == end]
        holders = [nid for nid in holders if nid not in drop] or holders
        primary = prefer if prefer in holders else p["id"] if p["id"] in holders else min(holders)
        copies = sorted(nid for nid in ends if nid != primary and nid not in drop)
        if spares is None:
            spares = yield self._spares(rec, rng, epoch, live, set(ends), rec["replica_nums"] - 1 - len(copies))
        copies += [nid for nid in spares if nid not in ends]
        choice = [(primary, True)] + [(nid, False) for nid in copies]
        new = yield self.pd.seal_and_open(sid, epoch, end, choice)
        seconds = time.monotonic() - t0
        self.count += 1
        self._said.pop(sid, None)
        self.last = {"stream_id": sid, "range": rng["index"], "end": end, "primary": primary, "seconds": seconds,
                     "why": why}
        self.log.info("stream {sid} ({why}): range {index} sealed at {end} ({answers} of {r} replicas answered), "
                      "range {next} opened on {servers}, primary {primary}",
                      sid=sid, why=why, index=rng["index"], end=end, answers=len(ends), r=r,
                      next=rng["index"] + 1, servers=[nid for nid, _ in choice], primary=primary)
        return new
