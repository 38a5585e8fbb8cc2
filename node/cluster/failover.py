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

The new primary, on seeing the record, treats everything below the end as confirmed and brings
the other replicas up to it (the replicator's catch-up), then takes appends. Clients that get
1460 or PD_NOT_LEADER retry on the new range's primary (LIST_RANGES).
"""

import time

from twisted.internet import defer, task
from twisted.logger import Logger

from node.cluster import placement

CHECK_EVERY_S = 0.25


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
        for sid, rec in list(self.pd.streams.items()):
            rng = placement.open_range(rec)
            p = placement.primary_of(rng) if rng else None
            if p is None or p["id"] in live or sid in self.busy:
                continue
            self.busy.add(sid)
            d = self.fail_over(sid)
            d.addErrback(self._not_yet, sid)
            d.addBoth(lambda _, sid=sid: self.busy.discard(sid))

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
        t0 = time.monotonic()
        rec = yield self.pd.get(sid)  # the record as etcd has it now
        rng = placement.open_range(rec)
        p = placement.primary_of(rng) if rng else None
        live = set(self.membership.live_ids())
        if p is None or p["id"] in live:
            return
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
        primary = min((nid for nid in ends if ends[nid] == end))
        copies = sorted(nid for nid in ends if nid != primary)
        copies += (yield self._spares(rec, rng, epoch, live, set(ends), r - 1 - len(copies)))
        choice = [(primary, True)] + [(nid, False) for nid in copies]
        yield self.pd.seal_and_open(sid, epoch, end, choice)
        seconds = time.monotonic() - t0
        self.count += 1
        self._said.pop(sid, None)
        self.last = {"stream_id": sid, "range": rng["index"], "end": end, "primary": primary, "seconds": seconds}
        self.log.info("failover of stream {sid}: range {index} of dead node {dead} sealed at {end} "
                      "({answers} of {r} replicas answered), range {next} opened on {servers}, primary {primary}",
                      sid=sid, index=rng["index"], dead=p["id"], end=end, answers=len(ends), r=r,
                      next=rng["index"] + 1, servers=[nid for nid, _ in choice], primary=primary)
