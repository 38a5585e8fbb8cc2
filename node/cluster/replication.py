"""Primary-sequenced replication of a stream's open range (CONTRACT §9 Appends and Reads).

The open range's primary is its only sequencer. An APPEND on it (``Replicator.append``, what the
SBP append handler calls in cluster mode) gets the next offset at once, is written to the local
store (``log.append_replica``: the batch with its base offset set) and sent to every other replica
of the range over the replica channel (protocols/replica/), without waiting for anything: appends
are pipelined and each store still group-commits. Every replica answers ``K`` with its durable end
as its batches become durable under its own ``--fsync``. The confirm offset is the ack_count-th
largest durable end among the range's replicas, the primary included (elastic-stream's confirm
offset, research note §3.6); an APPEND is answered once the confirm offset covers it and the
primary's own copy holds it (so the primary's FETCH sees it), hence only after every earlier
offset is acknowledged too.

Reads: each replica's local stream is held at its confirm offset (``log.hold_at_confirm``): FETCH
and long-poll FETCH see nothing above it. The primary tells the replicas each new confirm offset
(``C``, at most one per stream per reactor turn).

A replica that was down or fell behind is brought up to date on reconnect: it answers ``S`` with
where it is, and the primary sends what it misses, from its own store up to the confirm offset
and from the in-memory window above it (batches not yet confirmed).

Sealing (CONTRACT §9 Failover): ``seal`` asks a replica, ``seal_here`` is a replica's side (it
fences the epoch: 1460 for that epoch's appends); node/cluster/failover.py decides when and what.
Re-replication (failover.py) re-opens a range with a spare; the spare's copy is this catch-up
(``T`` starts a new copy of a trimmed stream at the primary's first kept batch). Below ack_count
live replicas appends get 1502 (``members_changed``). Trim reaches the replicas through the stream
record's watch only.
"""

import collections
import json
import struct

from twisted.internet import defer, protocol, reactor as default_reactor
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from node.cluster import placement
from protocols.replica import codec as rcodec
from protocols.replica.channel import ReplicaChannel, ReplicaChannelFactory
from storage import errors as store_errors
from storage import record_batch
from storage.crc import crc32_held

SEALED = 1460  # CONTRACT §3 status: the range is sealed, or the append comes from a stale epoch
SEAL_TIMEOUT_S = 3.0  # a replica that does not answer a seal within this counts as not answering
SEAL_DRAIN_S = 5.0  # longest a replica waits for its received batches to be durable before answering a seal
CATCH_UP_READ = 1 << 20  # bytes read from the store at once while catching a replica up
RETRY_S = 0.5  # seconds between attempts to reach a replica
# A new confirm offset goes to the replicas with the stream's next B message (the closed loop of
# a writer sends its next APPENDs as its answers come), else on its own after this long: one
# send by the primary and one wake-up of each replica instead of one more for every confirm
CONFIRM_DELAY_S = 0.002



_SEALED = object()  # _primary: this node sealed the stream's current epoch and awaits the next record


def checked_records_crc(batch):
    """A received batch's records-block CRC-32 if it is the one its header holds (and its
    records_len its length), else None. The store reuses it for the WAL entry's CRC, so checking
    costs a replica no extra pass over the bytes."""
    n = len(batch)
    if n < record_batch.HEADER_SIZE:
        return None
    crc, records_len = _CRC_LEN.unpack_from(batch, 21)
    if records_len != n - record_batch.HEADER_SIZE:
        return None
    got = crc32_held(memoryview(batch)[record_batch.HEADER_SIZE:])
    return got if got == crc else None


_CRC_LEN = struct.Struct(">Ii")  # a record batch header's crc and records_len (bytes 21..28)


class PeerStream:
    """What the primary knows of one replica of one stream."""

    __slots__ = ("acked", "sent", "pumping")

    def __init__(self):
        self.acked = 0  # the replica's durable end, as it last said
        self.sent = None  # where the next batch sent to it starts; None: not in sync (asked with S)
        self.pumping = False


class PrimaryStream:
    """The primary's state of one replicated stream (its open range)."""

    def __init__(self, sid, rec, assigned, durable):
        self.sid = sid
        self.epoch = rec.get("epoch", 0)
        self.ack_count = rec.get("ack_count") or placement.ack_count(rec["replica_nums"])
        rng = placement.open_range(rec)
        self.peers = {s["id"]: PeerStream() for s in rng["servers"]} if rng else {}
        self.assigned = assigned
        self.local = durable  # this node's durable end
        self.confirm = durable
        self.pending = collections.OrderedDict()  # end -> (base, Deferred), in offset order
        self.window = collections.OrderedDict()  # base -> (end, batch as the client sent it) of batches above the confirm offset
        self.confirm_call = None  # the pending CONFIRM to the replicas (see Replicator._advance)
        self.sealed = False  # a replica refused this epoch's appends (1460): the range was sealed
        # the placement driver's record this state was last checked against, and its number of
        # ranges then (a record changed in place grows it): the same record needs no new check
        self.rec = None
        self.nranges = 0
        self.live_of = None  # (the membership's member map, live replicas in it): see Replicator._live


class Link:
    """The primary's connection to one replica node (reconnecting)."""

    def __init__(self, replicator, node_id):
        self.replicator = replicator
        self.node_id = node_id
        self.channel = None
        self.connecting = False
        self.stopped = False


class Replicator:
    log = Logger()

    def __init__(self, node, tls=None, reactor=None):
        self.node = node
        self.pd = None  # set by ClusterNode.start once the placement driver runs
        self.membership = None
        self.tls = tls  # (cert, key, ca) or None
        self.reactor = reactor or default_reactor
        self.primaries = {}  # stream id -> PrimaryStream (streams this node sequences)
        self.links = {}  # node id -> Link
        self.port = None
        self._inbound = {}  # stream id -> [messages waiting for the local replica to exist]
        self.refused_epochs = {}  # stream id -> epoch below which appends are refused (sealed here)
        self._seals = {}  # (node id, stream id, epoch) -> [Deferred of the replica's end]
        # (stream id, base offset, batch) -> None, for each batch this replica stores (queued, in
        # log order): the key-value partitions apply confirmed batches from these bytes
        self.batch_listeners = []
        # primary streams with local appends not yet durable: looked at once per group the store
        # delivers (``_delivered``), not once per batch
        self._local_waiting = set()
        self._hooked_core = None
        # replica channels given batches while the store holds its writer's wake-up (one read of
        # APPENDs): sent when the hold ends, right after the local writer is woken (``_send_early``)
        self._to_flush = set()

    @property
    def node_id(self):
        return self.node.node_id

    @property
    def store(self):
        return self.node.store

    # -- the listener (replica side) -------------------------------------------------------------

    def listen(self, interface):
        from node.cluster.tls import listen

        self.port = listen(self.reactor, ReplicaChannelFactory(_ReplicaSide(self)), interface, self.tls)
        return self.port.getHost().port

    def stop(self):
        for link in self.links.values():
            link.stopped = True
            if link.channel is not None:
                link.channel.transport.loseConnection()
        if self.port is not None:
            return self.port.stopListening()

    # -- the primary's append ---------------------------------------------------------------------

    def append(self, sid, batch, expect_offset=None, block_crc=None):
        """SBP APPEND in cluster mode: sequenced and replicated for a replicated stream this node
        leads; the local store's append for anything else. ``block_crc``: as for ``log.append``."""
        log = self.store.log
        st = self._primary(sid)
        if st is None:
            return log.append(sid, batch, expect_offset, block_crc)
        refused = self._sealed(sid, st)
        if refused is not None:
            return defer.fail(refused)
        try:
            if expect_offset is not None and expect_offset != st.assigned:
                raise store_errors.ExpectationFailed("next offset is %d, not %d" % (st.assigned, expect_offset))
            if len(batch) < record_batch.HEADER_SIZE:
                raise store_errors.InvalidRequest("a record batch is at least 29 bytes")
            count = int.from_bytes(batch[9:13], "big", signed=True)
            if count < 1:
                raise store_errors.InvalidRequest("record_count must be >= 1")
            refused = self._degraded(sid, st)
            if refused is not None:
                raise refused
        except store_errors.StoreError:
            return defer.fail()
        base = st.assigned
        if type(batch) is not bytes and not (type(batch) is memoryview and type(batch.obj) is bytes):
            batch = bytes(batch)  # the caller's buffer may change once this returns (bytes cannot)
        # the batch as the client sent it: the store writes ``base`` into its bytes 1..8 on the
        # way to the WAL, the replica messages carry it beside the batch (no copy of the batch)
        d_local = log.append_replica(sid, batch, base, block_crc)
        if d_local.called and isinstance(d_local.result, Failure):
            return d_local  # refused by the store (busy, failed): nothing was assigned
        end = base + count
        st.assigned = end
        done = defer.Deferred()
        st.pending[end] = (base, done)
        st.window[base] = (end, batch)
        d_local.addErrback(self._local_failed, st, end)
        self._local_waiting.add(st)
        self._hook(self.store.core)
        if st.confirm_call is not None:
            self._send_confirm(st)  # (before the batch: both leave in this turn's one send)
        parts = None
        for nid, ps in st.peers.items():
            if nid == self.node_id:
                continue
            link = self._link(nid)
            if ps.sent == base and link.channel is not None:
                if parts is None:
                    parts = rcodec.batch_parts(batch, base)
                link.channel.queue_parts(sid, st.epoch, parts)
                self._to_flush.add(link.channel)
                ps.sent = end
        return done

    def append_many(self, sids, batches, block_crcs):
        """The APPENDs of one socket read (an SBP connection's run, protocols/sbp/append.py) as
        one unit: ``append`` of each batch (``sids[k]``, ``batches[k]``, ``block_crcs[k]``), in
        order, with the same checks and offsets, but each stream this node sequences is checked
        once, every accepted batch goes to the local store in one operation
        (``log.append_many``), a replica gets the run's batches of a stream with one queueing,
        and the run waits for one acknowledgement per stream (its last offset confirmed and
        held here, so every earlier offset is too). Returns (a Deferred firing once every
        accepted batch is acknowledged, None if none was; per batch its base offset or the
        ``StoreError`` that refused it), as ``log.append_many`` does."""
        core = self.store.core
        # the batches queued to the replicas leave when the outermost hold ends (``_send_early``,
        # an after_wake hook): the SBP server's read holds it; a caller outside one (a frame that
        # waited on etcd) gets this hold's end, so the channels need no timer of their own
        core.hold_wakeups()
        try:
            return self._append_many(core, sids, batches, block_crcs)
        finally:
            core.release_wakeups()

    def _append_many(self, core, sids, batches, block_crcs):
        log = self.store.log
        n = len(sids)
        outcome = [None] * n
        states = {}  # stream id -> PrimaryStream, None (not replicated here) or the error refusing it
        for sid in dict.fromkeys(sids):
            st = self._primary(sid)
            if st is None:
                states[sid] = None
                continue
            try:
                refused = self._sealed(sid, st)
                if refused is None:
                    refused = self._degraded(sid, st)
                if refused is not None:
                    raise refused
                if log.assigned_end(sid) != st.assigned:  # (a bug: the store and the sequencer disagree)
                    raise store_errors.ExpectationFailed("stream %d: next offset %d, sequenced %d"
                                                         % (sid, log.assigned_end(sid), st.assigned))
            except store_errors.StoreError as e:
                states[sid] = e
                continue
            states[sid] = st
        keep = []
        for k in range(n):
            st = states[sids[k]]
            if isinstance(st, Exception):
                outcome[k] = st
            else:
                keep.append(k)
        if not keep:
            return None, outcome
        if len(keep) < n:
            d_local, out = log.append_many([sids[k] for k in keep], [batches[k] for k in keep], [block_crcs[k] for k in keep])
        else:
            d_local, out = log.append_many(sids, batches, block_crcs)
        if d_local is not None and d_local.called and isinstance(d_local.result, Failure):
            return d_local, outcome  # refused by the store (failed): nothing sequenced, nothing sent
        # the replicated streams' accepted batches, in order: stream id -> [PrimaryStream, first
        # base, [(base, batch)]]
        runs = {}
        plain = False  # batches of streams not replicated here among the accepted
        for k, x in zip(keep, out):
            outcome[k] = x
            if type(x) is not int:
                continue
            sid = sids[k]
            st = states[sid]
            if st is None:
                plain = True
                continue
            batch = batches[k]
            if type(batch) is not bytes and not (type(batch) is memoryview and type(batch.obj) is bytes):
                batch = bytes(batch)  # (as log.append_many keeps it)
            end = x + int.from_bytes(batch[9:13], "big", signed=True)
            st.assigned = end
            st.window[x] = (end, batch)
            r = runs.get(sid)
            if r is None:
                runs[sid] = [st, x, [(x, batch)]]
            else:
                r[2].append((x, batch))
        if d_local is None:
            return None, outcome
        if not runs:
            return d_local, outcome
        self._hook(core)
        waits = []
        ends = []
        me = self.node_id
        for sid, (st, first, items) in runs.items():
            done = defer.Deferred()
            st.pending[st.assigned] = (first, done)
            ends.append((st, st.assigned))
            waits.append(done)
            self._local_waiting.add(st)
            if st.confirm_call is not None:
                self._send_confirm(st, True)  # (before the batches: both leave in the same send)
            parts = None
            for nid, ps in st.peers.items():
                if nid == me:
                    continue
                link = self._link(nid)
                if ps.sent == first and link.channel is not None:
                    if parts is None:
                        parts = [rcodec.batch_parts(batch, base) for base, batch in items]
                        size = sum(len(h) + len(b) for h, b in parts)
                    link.channel.queue_run(sid, st.epoch, parts, size, flushed=True)
                    self._to_flush.add(link.channel)
                    ps.sent = st.assigned
        d_local.addErrback(self._run_local_failed, ends, plain)
        if not plain and len(waits) == 1:
            return waits[0], outcome  # (the usual run: one replicated stream, nothing else)
        if plain:
            waits.append(d_local)  # (batches of streams not replicated here: their local commit)
        d = defer.gatherResults(waits, consumeErrors=True)
        return d.addErrback(lambda f: f.value.subFailure if isinstance(f.value, defer.FirstError) else f), outcome

    @staticmethod
    def _sealed(sid, st):
        """The error refusing an APPEND to a stream whose range is sealed here, or None."""
        if st is _SEALED:
            return store_errors.RangeAlreadySealed("stream %d: its range is sealed; retry on the new range" % sid)
        if st.sealed:
            return store_errors.RangeAlreadySealed("stream %d: range of epoch %d is sealed" % (sid, st.epoch))
        return None

    def _degraded(self, sid, st):
        """CONTRACT §9: below ack_count live replicas nothing can be acknowledged (degraded): the
        error refusing an APPEND then, or None."""
        live = self._live(st)
        if live < st.ack_count:
            return store_errors.NoAvailableReplicas("stream %d: %d live replica(s), ack_count %d" % (sid, live, st.ack_count))
        return None

    def _hook(self, core):
        """Learn the local durable end once per delivered group and send queued batches when the
        store's writer is woken (the node's store, hooked once)."""
        if self._hooked_core is not core:
            self._hooked_core = core
            core.after_deliver.append(self._delivered)
            core.after_wake.append(self._send_early)

    def _run_local_failed(self, f, ends, waited):
        """The local store failed a run: each stream's acknowledgement of it fails with that
        (``waited``: the run's answer waits on the local Deferred itself as well)."""
        for st, end in ends:
            self._local_failed(f, st, end)
        return f if waited else None

    def _send_early(self):
        """A read of APPENDs is done and the store's writer woken: the read's batches go to the
        replicas now, not at the end of the reactor turn (which may serve other connections
        first), so the replicas' group commits start sooner; the first replica's ``K`` is as much
        of an answer's wait as the local commit (docs/benchmarks.md, issue 17 part 6)."""
        if self._to_flush:
            channels, self._to_flush = self._to_flush, set()
            for channel in channels:
                channel.flush()

    def _primary(self, sid):
        st = self.primaries.get(sid)
        rec = self.pd.streams.get(sid)
        if rec is None:
            return st
        if st is not None and st.rec is rec and st.nranges == len(rec.get("ranges", ())):
            return st  # (per APPEND: checked already against this very record)
        rng = placement.open_range(rec)
        primary = placement.primary_of(rng) if rng else None
        if primary is None or primary["id"] != self.node_id:
            return None
        if st is not None and st.epoch == rec.get("epoch", 0):
            st.rec, st.nranges = rec, len(rec.get("ranges", ()))
            return st
        if rec.get("epoch", 0) < self.refused_epochs.get(sid, 0):
            # this node sealed that epoch (a seal of its own range: SEAL_RANGES, re-replication)
            # and the next record has not reached it yet: nothing may be sequenced meanwhile
            return _SEALED
        try:
            self.store.log.hold_at_confirm(sid)
            assigned = self.store.log.assigned_end(sid)
            durable = self.store.log.durable_end(sid)
        except store_errors.StreamNotFound:
            return None
        self._drop(sid, "a new range")
        st = PrimaryStream(sid, rec, assigned, durable)
        st.peers.pop(self.node_id, None)
        # everything below the open range's start was sealed (a majority has it, CONTRACT §9
        # Failover); above it only acknowledgements count
        st.confirm = rng["start"]
        self.store.log.confirm(sid, st.confirm)
        self.primaries[sid] = st
        st.rec, st.nranges = rec, len(rec.get("ranges", ()))
        for nid in st.peers:
            link = self._link(nid)
            if link.channel is not None:
                link.channel.send(rcodec.SYNC, sid)
        self._advance(st)
        return st

    def _drop(self, sid, why):
        """This node no longer sequences ``sid`` under the state it had: its unanswered appends
        fail with 1460 (the client retries on the new range)."""
        st = self.primaries.pop(sid, None)
        if st is None:
            return
        self._local_waiting.discard(st)
        st.sealed = True
        pending, st.pending = st.pending, collections.OrderedDict()
        for _end, (_base, d) in pending.items():
            d.errback(store_errors.RangeAlreadySealed("stream %d: range sealed (%s); retry on the new range" % (sid, why)))

    def _live(self, st):
        """Live replicas of the range ``st`` sequences, this node included."""
        live = self.membership.members if self.membership is not None else ()  # (per append: no copy)
        cached = st.live_of
        if cached is not None and cached[0] is live:
            return cached[1]  # (the membership replaces its map on every change)
        n = 1 + sum(1 for nid in st.peers if nid in live)
        st.live_of = (live, n)
        return n

    def members_changed(self, _members):
        """Membership changed: a range left with fewer than ack_count live replicas fails the
        appends waiting for acknowledgements with 1502 instead of holding them until a replica
        returns (CONTRACT §9). Their batches stay in the primary's store and window: like a
        timed-out append, one answered 1502 may still be acknowledged later, at its offset, when
        a replica returns and catches up."""
        for st in list(self.primaries.values()):
            live = self._live(st)
            if live >= st.ack_count or not st.pending:
                continue
            pending, st.pending = st.pending, collections.OrderedDict()
            self.log.warn("stream {sid}: {live} live replica(s), ack_count {ack}: {n} append(s) answered 1502",
                          sid=st.sid, live=live, ack=st.ack_count, n=len(pending))
            for _end, (_base, d) in pending.items():
                d.errback(store_errors.NoAvailableReplicas(
                    "stream %d: %d live replica(s), ack_count %d" % (st.sid, live, st.ack_count)))

    def record_changed(self, rec):
        """The placement driver saw a new record of a stream (its watch), or this node starts
        with it: a range this node no longer sequences is dropped, and one it sequences now is
        taken up at once (``_primary``), not at its first append. Taking it up sends SYNC to the
        range's other replicas, which starts their catch-up: a re-replication spare (or a copy
        that lags) gets the stream even if no client appends to the new range (seed 25 of
        bench/replication_campaign.py: a spare left at the old seal while the range took no
        appends, its reads short of acknowledged batches)."""
        sid = rec["stream_id"]
        st = self.primaries.get(sid)
        rng = placement.open_range(rec)
        primary = placement.primary_of(rng) if rng else None
        if st is not None and (rec.get("epoch", 0) != st.epoch or primary is None or primary["id"] != self.node_id):
            self._drop(sid, "epoch %d" % rec.get("epoch", 0))
        if primary is not None and primary["id"] == self.node_id and self.pd is not None \
                and self.pd.streams.get(sid) is rec:
            self._primary(sid)

    def _delivered(self):
        """The store delivered a group (after its operations' Deferreds): the primary streams
        with local appends in flight learn their durable end, and answer what it covers (once
        per group and stream, not once per batch)."""
        waiting = self._local_waiting
        if not waiting:
            return
        log = self.store.log
        for st in list(waiting):
            try:
                local = log.durable_end(st.sid)
            except store_errors.StreamNotFound:
                waiting.discard(st)
                continue
            if local >= st.assigned:
                waiting.discard(st)
            if local > st.local:
                st.local = local
                self._advance(st)

    def _local_failed(self, f, st, end):
        entry = st.pending.pop(end, None)
        if entry is not None:
            entry[1].errback(f)

    def _advance(self, st):
        """Recompute the confirm offset; answer the appends it covers, in offset order."""
        ends = sorted([st.local] + [ps.acked for ps in st.peers.values()], reverse=True)
        confirm = ends[st.ack_count - 1] if len(ends) >= st.ack_count else st.confirm
        if confirm > st.confirm:
            st.confirm = confirm
            self.store.log.confirm(st.sid, confirm)
            if st.confirm_call is None:
                # the replicas learn it with the stream's next B message (one send, one wake-up
                # of each replica), or on their own after CONFIRM_DELAY_S if no append comes
                st.confirm_call = self.reactor.callLater(CONFIRM_DELAY_S, self._send_confirm, st)
        # below it, the primary's own log serves reads and a lagging replica is sent batches from
        # the store; an APPEND is answered only once it is readable here too (two other replicas
        # can make the confirm offset before the primary's own write lands; answering then would
        # let the writer's next FETCH on the primary miss its own acknowledged batch)
        readable = min(st.confirm, st.local)
        while st.pending:
            end, (base, d) = next(iter(st.pending.items()))
            if end > readable:
                break
            del st.pending[end]
            d.callback(base)
        while st.window:
            base, (end, _) = next(iter(st.window.items()))
            if end > readable:
                break
            del st.window[base]

    def _send_confirm(self, st, flushed=False):
        """The stream's confirm offset to its replicas (``flushed``: the caller has them sent
        before the reactor turn ends, through ``_to_flush``)."""
        call, st.confirm_call = st.confirm_call, None
        if call is not None and call.active():
            call.cancel()
        payload = None
        for nid in st.peers:
            link = self.links.get(nid)
            if link is not None and link.channel is not None:
                if payload is None:
                    payload = rcodec.encode(rcodec.CONFIRM, st.sid, st.confirm)  # (once for every replica)
                link.channel.send_encoded(payload, flushed)
                if flushed:
                    self._to_flush.add(link.channel)

    # -- links to the replicas ----------------------------------------------------------------------

    def _link(self, nid):
        link = self.links.get(nid)
        if link is None:
            link = self.links[nid] = Link(self, nid)
        if link.channel is None and not link.connecting and not link.stopped:
            self._connect(link)
        return link

    def _connect(self, link):
        rec = self.membership.members.get(link.node_id)
        addr = rec.get("replica") if rec else None
        if not addr:
            link.connecting = True
            self.reactor.callLater(RETRY_S, self._retry, link)
            return
        host, port = addr.rsplit(":", 1)
        host = host.strip("[]")
        link.connecting = True
        cc = protocol.ClientCreator(self.reactor, ReplicaChannel, _PrimarySide(self, link))
        if self.tls:
            from node.cluster.tls import client_options

            d = cc.connectSSL(host, int(port), client_options(host, *self.tls), timeout=3)
        else:
            d = cc.connectTCP(host, int(port), timeout=3)

        def failed(f):
            self.log.debug("replica link to node {nid} failed: {e}", nid=link.node_id, e=f.value)
            self.reactor.callLater(RETRY_S, self._retry, link)

        d.addErrback(failed)

    def _retry(self, link):
        link.connecting = False
        if link.stopped or link.channel is not None:
            return
        if any(link.node_id in st.peers for st in self.primaries.values()) or \
                any(k[0] == link.node_id for k in self._seals):
            self._connect(link)

    def linked(self, link, channel):
        link.channel = channel
        link.connecting = False
        for (nid, sid, epoch) in list(self._seals):
            if nid == link.node_id:
                channel.send(rcodec.SEAL, sid, epoch)
        for st in self.primaries.values():
            if link.node_id in st.peers:
                st.peers[link.node_id].sent = None
                channel.send(rcodec.SYNC, st.sid)

    def unlinked(self, link, channel):
        if link.channel is channel:
            link.channel = None
            for st in self.primaries.values():
                ps = st.peers.get(link.node_id)
                if ps is not None:
                    ps.sent = None
            if not link.stopped:
                link.connecting = True
                self.reactor.callLater(RETRY_S, self._retry, link)

    def from_replica(self, link, msg):
        kind, sid = msg[0], msg[1]
        if kind == rcodec.SEALED:
            for d in self._seals.pop((link.node_id, sid, msg[2]), []):
                if not d.called:
                    d.callback(msg[3])
            return
        st = self.primaries.get(sid)
        ps = st.peers.get(link.node_id) if st is not None else None
        if ps is None:
            return
        if kind == rcodec.ACK:
            durable, assigned = msg[2], msg[3]
            if durable > ps.acked:
                ps.acked = durable
                self._advance(st)
            if ps.sent is None:
                # its answer to SYNC, after (re)connecting: the confirm offset it may not have
                # heard, then what it misses
                link.channel.send(rcodec.CONFIRM, sid, st.confirm)
                ps.sent = assigned
                self._pump(st, ps, link)
        elif kind == rcodec.GAP:
            if ps.sent is not None and msg[2] < ps.sent:
                ps.sent = msg[2]
                self._pump(st, ps, link)
        elif kind == rcodec.ERROR:
            if msg[2] == SEALED and self.primaries.get(sid) is st:
                # fenced: the range was sealed behind this node's back (it was paused or cut
                # off); it acknowledges nothing more of this epoch
                self._drop(sid, "fenced by node %d" % link.node_id)
            self.log.warn("replica {nid} refuses stream {sid}: {code} {message}", nid=link.node_id, sid=sid,
                          code=msg[2], message=msg[3])

    @defer.inlineCallbacks
    def _pump(self, st, ps, link):
        """Send the replica what it misses, from ``ps.sent`` to the stream's assigned end."""
        if ps.pumping:
            return
        ps.pumping = True
        try:
            while ps.sent is not None and ps.sent < st.assigned and link.channel is not None \
                    and self.primaries.get(st.sid) is st:
                entry = st.window.get(ps.sent)
                if entry is not None:
                    link.channel.queue_batch(st.sid, st.epoch, entry[1], ps.sent)
                    ps.sent = entry[0]
                    continue
                start = ps.sent
                try:
                    first, batches = yield self._catch_up_read(st.sid, start)
                except store_errors.StoreError as e:
                    self.log.warn("cannot catch replica {nid} up on stream {sid} from {offset}: {e}",
                                  nid=link.node_id, sid=st.sid, offset=start, e=e)
                    return
                if ps.sent != start or link.channel is None or self.primaries.get(st.sid) is not st:
                    continue  # (a state replaced while reading must not send: its epoch is stale)
                if first > start:
                    # a new copy of a trimmed stream: it starts where this copy begins
                    link.channel.send(rcodec.START, st.sid, first)
                    ps.sent = first
                if not batches:
                    return
                for b in batches:
                    b = bytes(b)
                    link.channel.queue_batch(st.sid, st.epoch, b)
                    ps.sent = int.from_bytes(b[1:9], "big", signed=True) + int.from_bytes(b[9:13], "big", signed=True)
        finally:
            ps.pumping = False

    @defer.inlineCallbacks
    def _catch_up_read(self, sid, start):
        """(first, batches): this node's batches from ``start``; below its trim point, from the
        first batch it keeps (``first`` > ``start``: the replica must start its copy there)."""
        log = self.store.log
        try:
            batches = yield log.read(sid, start, CATCH_UP_READ)
            return start, batches
        except store_errors.OffsetOutOfRange:
            trim = log.stream(sid).trim_offset
            if start >= trim:
                raise
        batches = yield log.read(sid, trim, CATCH_UP_READ)
        first = int.from_bytes(batches[0][1:9], "big", signed=True) if batches else trim
        return max(first, start), batches

    # -- the replica side ---------------------------------------------------------------------------

    def to_replica(self, channel, msg):
        sid = msg[1]
        if self.pd is None:
            # still starting (the listener opens before the placement driver has the records):
            # without the records no epoch can be checked; the primary reconnects and asks again
            channel.transport.loseConnection()
            return
        waiting = self._inbound.get(sid)
        if waiting is not None:
            waiting.append((channel, msg))
            return
        try:
            self.store.log.assigned_end(sid)  # (cheaper than stream(): no StreamMeta built)
        except store_errors.StreamNotFound:
            # the stream's record has not reached this node's watch yet: learn it first, keep order
            self._inbound[sid] = [(channel, msg)]
            self.pd.learn(sid).addBoth(self._learned, sid)
            return
        self._serve(channel, msg)

    def _learned(self, result, sid):
        waiting = self._inbound.pop(sid, [])
        if isinstance(result, Failure):
            self.log.warn("replica of stream {sid} unavailable: {e}", sid=sid, e=result.value)
        for channel, msg in waiting:
            self._serve(channel, msg)

    def _serve(self, channel, msg):
        kind, sid = msg[0], msg[1]
        log = self.store.log
        try:
            log.hold_at_confirm(sid)
        except store_errors.StreamNotFound:
            channel.send(rcodec.ERROR, sid, 1404, "no replica of stream %d here" % sid)
            return
        if kind == rcodec.CONFIRM:
            log.confirm(sid, msg[2])
            return
        if kind == rcodec.SYNC:
            self._ack(channel, sid)
            return
        if kind == rcodec.START:
            if log.assigned_end(sid) < msg[2]:
                log.start_replica_at(sid, msg[2]).addErrback(
                    lambda f: self.log.warn("replica of stream {sid} not started at {offset}: {e}", sid=sid,
                                            offset=msg[2], e=f.value))
            return
        if kind == rcodec.SEAL:
            epoch = msg[2]
            self.seal_here(sid, epoch).addCallbacks(
                lambda end: channel.send(rcodec.SEALED, sid, epoch, end),
                lambda f: self.log.warn("seal of stream {sid} failed: {e}", sid=sid, e=f.value))
            return
        # APPEND (one batch) or BATCHES (consecutive batches, one answer)
        epoch = msg[2]
        batches = (msg[3],) if kind == rcodec.APPEND else msg[3]
        mine = self.primaries.get(sid)
        if mine is not None and mine.epoch >= epoch:
            channel.send(rcodec.ERROR, sid, SEALED, "this node sequences stream %d at epoch %d" % (sid, mine.epoch))
            return
        rec = self.pd.streams.get(sid) if self.pd is not None else None
        if epoch < max(self.refused_epochs.get(sid, 0), rec.get("epoch", 0) if rec else 0):
            channel.send(rcodec.ERROR, sid, SEALED, "epoch %d is stale" % epoch)
            return
        # the batches it lacks, in order, stored as one run (one store operation, one answer)
        run, crcs = [], []
        assigned = log.assigned_end(sid)
        for batch in batches:
            base = int.from_bytes(batch[1:9], "big", signed=True)
            if base < assigned:
                continue  # a copy of a batch it holds (resent after a reconnect): answered below
            if base > assigned:
                channel.send(rcodec.GAP, sid, assigned)  # it misses batches: where to resend from
                if not run:
                    return
                break
            block_crc = checked_records_crc(batch)
            if block_crc is None:
                # corrupted on the way (or a primary's bug): nothing of it is stored; the primary
                # reconnects, asks where this copy is and sends it again
                self.log.warn("replica batch of stream {sid} at {base} fails its CRC; closing the channel",
                              sid=sid, base=base)
                channel.transport.loseConnection()
                break
            count = int.from_bytes(batch[9:13], "big", signed=True)
            if count < 1:
                break  # (the store refuses it: the run ends before it)
            run.append(batch)
            crcs.append(block_crc)
            assigned = base + count
        if not run:
            self._ack(channel, sid)
            return
        # this node is a copy in the range of ``epoch`` even if its watch has not said so yet: the
        # placement driver must not cut its copy to an older range's end meanwhile
        fed = self.pd.fed_epochs
        if fed.get(sid, -1) < epoch:
            fed[sid] = epoch
        # K as soon as the run's WAL bytes are synced (--fsync always), before its LMDB commit
        # (the store keeps a synced run through a failed commit: docs/cluster.md "Replication");
        # otherwise (another policy) once the run is stored
        acked = _RunAck(self, channel, sid)
        d = log.append_replica_run(sid, run, crcs, acked.synced)
        if d.called and isinstance(d.result, Failure):
            d.addErrback(lambda f: self.log.warn("replica append to stream {sid} failed: {e}", sid=sid, e=f.value))
            self._ack(channel, sid)  # (where it is: the primary resends from there)
            return
        if self.batch_listeners:
            for batch in run:
                base = int.from_bytes(batch[1:9], "big", signed=True)
                for listener in self.batch_listeners:
                    listener(sid, base, batch)
        # the store commits in log order: the run durable means every earlier batch is
        d.addCallbacks(acked.stored,
                       lambda f: self.log.warn("replica append to stream {sid} failed: {e}", sid=sid, e=f.value))

    # -- sealing (CONTRACT §9 Failover) ---------------------------------------------------------------

    @defer.inlineCallbacks
    def seal_here(self, sid, epoch):
        """Seal this node's replica of ``sid``'s range of ``epoch``: appends of that epoch or
        older are refused from now on (1460); fires with its end once every batch received is
        durable (so nothing can be acknowledged above the answer). The end is the one its ``K``
        named (``log.synced_end``: every batch it acknowledged is below it). A store that went
        read-only with acknowledged batches its index does not name yet (an LMDB commit failed
        after their WAL sync) does not answer: it could not serve them before a restart replays
        them, and the seal needs R - ack_count + 1 answers, any set of which holds every
        acknowledged batch, so the others decide (or the seal waits for this node's restart)."""
        self.refused_epochs[sid] = max(self.refused_epochs.get(sid, 0), epoch + 1)
        st = self.primaries.get(sid)
        if st is not None and st.epoch <= epoch:
            self._drop(sid, "sealed")
        log = self.store.log
        core = self.store.core
        waited = 0.0
        while log.durable_end(sid) < log.assigned_end(sid) and waited < SEAL_DRAIN_S and core.failed is None:
            yield deferLater(self.reactor, 0.005, lambda: None)
            waited += 0.005
        end = log.synced_end(sid)
        if core.failed is not None and end > log.durable_end(sid):
            raise store_errors.StoreReadOnly("stream %d: acknowledged batches up to %d wait for a restart to be "
                                             "indexed (the store is read-only: %s)" % (sid, end, core.failed))
        return end

    def seal(self, nid, sid, epoch):
        """Ask node ``nid`` to seal its replica of ``sid`` (epoch ``epoch``); a Deferred of its
        durable end, failing after SEAL_TIMEOUT_S without an answer."""
        if nid == self.node_id:
            return self.seal_here(sid, epoch)
        d = defer.Deferred()
        key = (nid, sid, epoch)
        first = key not in self._seals
        self._seals.setdefault(key, []).append(d)
        link = self._link(nid)
        if first and link.channel is not None:
            link.channel.send(rcodec.SEAL, sid, epoch)

        def timeout():
            waiting = self._seals.get(key, [])
            if d in waiting:
                waiting.remove(d)
                if not waiting:
                    del self._seals[key]
            if not d.called:
                d.errback(defer.TimeoutError("node %d did not answer the seal of stream %d" % (nid, sid)))

        call = self.reactor.callLater(SEAL_TIMEOUT_S, timeout)
        d.addBoth(lambda r: (call.active() and call.cancel(), r)[1])
        return d

    def _ack(self, channel, sid):
        """``K``: the end below which this replica holds every batch durably (``log.synced_end``:
        synced in its WAL under its ``--fsync``, indexed or about to be, see ``_RunAck``) and
        where its next batch must start."""
        try:
            log = self.store.log
            channel.send_latest(rcodec.ACK, sid, log.synced_end(sid), log.assigned_end(sid))
        except store_errors.StreamNotFound:
            pass

    # -- what DESCRIBE_RANGES and the status show ---------------------------------------------------

    def progress(self, sid):
        """{"confirm_offset", "replica_ends": {node id: durable end}} as this node knows them."""
        st = self.primaries.get(sid)
        if st is not None:
            ends = {str(nid): ps.acked for nid, ps in st.peers.items()}
            ends[str(self.node_id)] = st.local
            return {"confirm_offset": st.confirm, "replica_ends": ends, "sequencer": self.node_id}
        try:
            meta = self.store.log.stream(sid)
            return {"confirm_offset": meta.next_offset,
                    "replica_ends": {str(self.node_id): self.store.log.synced_end(sid)}}
        except store_errors.StreamNotFound:
            return {"confirm_offset": None, "replica_ends": {}}

    def progress_json(self, sid) -> bytes:
        return json.dumps(self.progress(sid), sort_keys=True).encode()


class _RunAck:
    """The ``K`` for one stored run of a replica (the batches of one ``B`` message): sent when
    the store announces the run's WAL bytes synced (``synced``, under ``--fsync always``: before
    its LMDB commit), else when the run is stored (``stored``: every other policy, where the
    run's durability is its commit). Safe to send at the WAL sync: once announced, a failed LMDB
    commit leaves the run in the WAL and the store read-only (storage/commit.py), and a restart
    (after kill -9 or a power cut too) replays it into the index."""

    __slots__ = ("replicator", "channel", "sid", "sent")

    def __init__(self, replicator, channel, sid):
        self.replicator = replicator
        self.channel = channel
        self.sid = sid
        self.sent = False

    def synced(self):
        self.sent = True
        self.replicator._ack(self.channel, self.sid)

    def stored(self, _):
        if not self.sent:
            self.replicator._ack(self.channel, self.sid)


class _ReplicaSide:
    """Channel handler of an accepted connection (this node is a replica)."""

    def __init__(self, replicator):
        self.replicator = replicator

    def connected(self, channel):
        pass

    def disconnected(self, channel):
        pass

    def around_read(self, starting):
        # the batches of one read go to the store's writer together (one group, one wake-up of
        # the writer thread, not one per batch)
        core = getattr(self.replicator.store, "core", None)
        if core is not None:
            if starting:
                core.hold_wakeups()
            else:
                core.release_wakeups()

    def message(self, channel, msg):
        if msg[0] in (rcodec.SYNC, rcodec.BATCHES, rcodec.APPEND, rcodec.CONFIRM, rcodec.SEAL, rcodec.START):
            self.replicator.to_replica(channel, msg)


class _PrimarySide:
    """Channel handler of a connection this node opened to a replica."""

    def __init__(self, replicator, link):
        self.replicator = replicator
        self.link = link

    def connected(self, channel):
        self.replicator.linked(self.link, channel)

    def disconnected(self, channel):
        self.replicator.unlinked(self.link, channel)

    def message(self, channel, msg):
        if msg[0] in (rcodec.ACK, rcodec.GAP, rcodec.ERROR, rcodec.SEALED):
            self.replicator.from_replica(self.link, msg)
