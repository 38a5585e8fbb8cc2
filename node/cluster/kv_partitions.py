"""Key-value partitions placed and replicated across the cluster (CONTRACT §2, §4, §9; issue 20).

Placement: each of the 8 partitions (first key byte >> 5) is one replicated stream of the
placement driver (node/cluster/placement.py): its open range's R servers hold the partition and
the range's primary is the partition's *leader*. ``P kv/partitions`` in etcd maps partition ->
stream id (JSON ``{"streams": [8 ids], "replica_nums": R}``); the first node that serves a key
creates the 8 streams and the map (one etcd compare-and-swap; a loser deletes its streams and
takes the winner's). So placement, failover (sealing, epoch fencing) and catch-up are the
streams' own (node/cluster/failover.py, replication.py).

Writes: the leader turns each write run into one record (node/cluster/kv_log.py) appended through
the stream's sequencer (``Replicator.append``), which answers once ack_count replicas hold it;
the write is acknowledged once this node has also *applied* it. REMOVE's answer (did the key
exist) is decided when the run is sequenced, from the applied store and the runs sequenced but
not yet applied (``Partition.overlay``).

Applying: on every node holding a replica, an applier reads the stream's confirmed prefix from
the local log (held at the confirm offset, so nothing unacknowledged) and writes it into the local
key-value store, in offset order; a node outside the open range applies up to the end of the last
sealed range it held, never an unsealed tail. The applied offset of each stream is kept in
``kv_partitions.json`` in the data directory (written after the store has the writes; replaying
from an older offset is harmless: the last write of each key wins either way).

Trimming (issue 20): every node publishes, under ``P kv/applied/<node id>``, the applied offset of
each stream as its state file last recorded it (the store had the writes, durable per its fsync
policy, before). Every TRIM_S the leader of each partition trims its stream below the smallest
offset that every replica of the open range published (``pd.trim_stream``; the replicas follow the
record's trim point), so a stream keeps only what some replica has not applied yet. A replica whose
applied offset is below its local copy's trim point (a new copy started at the trim point by
re-replication or a rebalancing move, a node back after its copy was trimmed) first takes a
*snapshot*: it clears the partition's key range, copies the partition's pages from a node that has
applied at least that far (any node: the kv peer port's snapshot cursor, ``snapshot_page``), then
applies the stream from its trim point (replaying over newer copied values is harmless: the last
write of each key wins). Its applied offset (file and published) moves only once the copy is in its
store, so a kill -9 during the copy starts it over.

Leadership: a node that becomes the primary of a partition's open range (a new stream, or a
failover) serves it only once it has applied everything its log holds (its assigned end, which
covers every acknowledged write: the seal picked the replica with the largest end as primary).

Routing: every node serves every key. A request for a partition led elsewhere goes to the leader's
*kv peer* port (a listener of its own in cluster mode, the member record's ``kv_peer``; mutual TLS
with the cluster TLS options) over the §4 framing, pipelined on one connection per peer node with
client_id as the correlation id. The peer port serves only partitions its node leads and answers
ERR 1 (PARTITION_DIED) for the others, having done nothing: the sender looks the leader up again
and retries, for at most ROUTE_WAIT_S (covering a failover). Reads are served by the leader
(linearizable), unless the node runs with ``--kv-reads replica``: then a GET of a partition held
here is answered from the local applied copy (an acknowledged value, possibly stale). Scans are one
partition at a time (``scan``), cursors on the client's node.

Dropped copies (issue 20): a node no longer a replica of a partition's open range clears the
partition's keys from its store once the open range's replicas hold everything below the trim
point (``_maybe_drop``, ``_drop``); the placement-driver leader deletes the published applied
offsets of nodes that left the cluster for good (``_forget_departed``).
"""

import json
import os
import struct
import time

from twisted.internet import defer, protocol, task, threads
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.python.failure import Failure

from node.cluster import etcd, kv_log, placement
from protocols.partition import codec
from protocols.partition.client import KvClientProtocol, KvError, KvProtocolError
from protocols.partition.server import BEGIN, END, SCAN_REPLY_BUDGET, scan_page
from storage import errors as store_errors
from storage import record_batch

PARTITIONS = 8
MAP_KEY = "kv/partitions"
STATE_FILE = "kv_partitions.json"
ROUTE_WAIT_S = 20.0  # longest a request waits for its partition to have a live, ready leader
RETRY_S = 0.05  # between two looks at the partition's leader while it has none
RECORD_BYTES = 4 << 20  # a write run is split into records of about this size
SETTLE_S = 5.0  # how long a leader whose appends failed waits to learn from the seal what became of them
REPLICA_APPLY_DELAY_S = 0.02  # a replica's applier, woken by new data, first waits this long
APPLY_READ = 4 << 20  # bytes read from the log at once by an applier
RECEIVED_BYTES = 16 << 20  # most bytes of received batches a replica keeps per partition for its applier
APPLY_WRITE = 8 << 20  # bytes of operations per write_many while applying
PERSIST_S = 1.0  # applied offsets are written to STATE_FILE at most this often
CHECK_S = 0.5  # leadership and appliers are re-checked this often (besides the record watch)
PEER_CONNECT_S = 3.0
# a peer connection with requests pending and no reply for this long is dropped (a hung leader:
# SIGSTOP, a network partition); its reads are retried on the partition's leader as it is then,
# its writes answered ERR 0 (outcome unknown). A peer that leaves the member list is dropped at once.
FORWARD_TIMEOUT_S = 10.0
PEER_CURSOR = b"c"
REBALANCE_S = 1.0  # at most one rebalancing move this often (the placement-driver leader's)
REBALANCE_RETRY_S = 5.0  # a partition whose move did not take is left alone this long
APPLIED_KEY = "kv/applied/"  # + node id: {"applied": {stream id: offset}}, the published applied offsets
TRIM_S = 2.0  # each leader trims its partitions' streams this often (below what every replica applied)
# a trim (an etcd compare-and-swap, then a store transaction on every replica) only once this many
# records can go, or the whole stream can (every replica applied all of it)
TRIM_MIN_RECORDS = 512
PUBLISH_S = 2.0  # applied offsets are published at most this often
# ... and at least this often even if unchanged (a key the placement-driver leader removed while this
# node was out of the member list comes back)
REPUBLISH_S = 30.0
SNAPSHOT_CURSOR = b"\x00snap"  # + u8 partition + u64 offset: a snapshot cursor on the kv peer port
_SNAP = struct.Struct(">BQ")
SNAPSHOT_PAGE = 1024  # keys per snapshot page (and per local write while clearing the range)
SNAPSHOT_RETRY_S = 0.5  # between two attempts when no node could serve a snapshot


def _write_state(path, state, durable):
    """STATE_FILE, replaced whole (in a thread); ``durable``: fsynced before and after the rename."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class NotLeader(Exception):
    """This node does not lead the partition; nothing was done (ERR 1, the sender re-routes)."""


class Unavailable(Exception):
    """The partition has no live, ready leader within ROUTE_WAIT_S (ERR 1)."""


_NOT_HERE = object()  # KvPartitions.get_here: not answered here at once
_RUN = object()  # a pending entry's kind: one operation of a forwarded write run (PeerProtocol.write_run)
_RELAY = object()  # a pending entry's kind: a GET relayed for a client connection (PeerProtocol.relay_get)


class PeerProtocol(KvClientProtocol):
    """A forwarding connection to a kv peer port that notes when it last made progress; GETs
    relayed for client connections go without a Deferred or a decoded reply (``relay_get``)."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock
        self.progress = clock.seconds()

    def _request(self, cmd, encode):
        if not self._pending:
            self.progress = self.clock.seconds()
        return super()._request(cmd, encode)

    def relay_get(self, key, client_id, done, ctx):
        """Forward a GET whose reply goes back to a client as it came: ``done(reply, status,
        ctx)`` with the reply frame's bytes, the client's ``client_id`` (8 bytes) put in place of
        this connection's, and its status (OK, DATA_NOT_FOUND or ERR); ``done(None, None, ctx)``
        if the peer no longer leads the partition (ERR 1) or the connection is lost (then the
        caller routes the GET again). No Deferred and no decoded reply per GET."""
        if not self._pending:
            self.progress = self.clock.seconds()
        cid = next(self._ids)
        self._pending.append((cid, _RELAY, (client_id, done, ctx)))
        # (Twisted's buffer: the requests of one pass leave together on the next poll. Holding
        # them for one send on the next pass instead was measured to split what the peer reads
        # into smaller runs, so into more replicated records per SET: 0.20-0.22 against 0.17-0.19)
        self.transport.write(codec.encode_get(cid, key))

    def write_run(self, ops):
        """Forward a write run ([(key, value or None to remove)]) in one write: fires once every
        operation is answered with one bool per operation (True for a SET; whether the key
        existed for a REMOVE), or fails with the first failed operation's error in run order
        (KvError; ConnectionError if the connection is lost first). One Deferred per run."""
        if self._lost is not None:
            return defer.fail(ConnectionError("connection to the kv server lost"))
        if not self._pending:
            self.progress = self.clock.seconds()
        d = defer.Deferred()
        run = [d, len(ops), [None] * len(ops), {}]  # the Deferred, unanswered, results, errors by index
        parts, pending, ids = [], self._pending, self._ids
        encode_set, encode_remove = codec.encode_set, codec.encode_remove
        for i, (key, value) in enumerate(ops):
            cid = next(ids)
            pending.append((cid, _RUN, (run, i, value is None)))
            parts.append(encode_remove(cid, key) if value is None else encode_set(cid, key, value))
        self.transport.write(b"".join(parts))
        return d

    @staticmethod
    def _run_answered(run, i, result, error):
        if error is not None:
            run[3][i] = error
        else:
            run[2][i] = result
        run[1] -= 1
        if run[1] == 0:
            d = run[0]
            if run[3]:
                d.errback(run[3][min(run[3])])
            else:
                d.callback(run[2])

    peer = "kv peer"

    def dataReceived(self, data):
        self.progress = self.clock.seconds()
        super().dataReceived(data)

    def _answer(self, buf, pos, end, cid, cmd, d):
        if cmd is not _RUN and cmd is not _RELAY:
            return super()._answer(buf, pos, end, cid, cmd, d)
        if int.from_bytes(buf[pos + 8:pos + 16], "big") != cid:
            raise KvProtocolError("reply for client_id %d, expected %d" % (int.from_bytes(buf[pos + 8:pos + 16], "big"), cid))
        status = int.from_bytes(buf[pos + 24:pos + 26], "big")
        if cmd is _RUN:
            run, i, remove = d
            if status == codec.OK or (remove and status == codec.DATA_NOT_FOUND):
                self._run_answered(run, i, status == codec.OK, None)
            elif status == codec.ERR:
                code = int.from_bytes(buf[pos + 26:pos + 28], "big") if end - pos >= codec.ERR_LEN else None
                self._run_answered(run, i, None, KvError(code))
            elif status == codec.INVALID_COMMAND:
                self._run_answered(run, i, None, KvError(None, status))
            else:
                raise KvProtocolError("unexpected %s reply to a write" % codec.COMMAND_NAMES.get(status, status))
            return
        client_id, done, ctx = d
        if status == codec.ERR and end - pos >= codec.ERR_LEN and \
                int.from_bytes(buf[pos + 26:pos + 28], "big") == codec.E_PARTITION_DIED:
            done(None, None, ctx)
        else:
            done(b"".join((buf[pos:pos + 8], client_id, buf[pos + 16:end])), status, ctx)

    def connectionLost(self, reason=None):
        relayed = [entry for entry in self._pending if entry[1] is _RELAY]
        runs = [entry for entry in self._pending if entry[1] is _RUN]
        self._pending = type(self._pending)(entry for entry in self._pending if entry[1] is not _RELAY
                                            and entry[1] is not _RUN)
        super().connectionLost(reason)
        for _cid, _cmd, (run, i, _remove) in runs:
            self._run_answered(run, i, None, ConnectionError("connection to the kv server lost"))
        for _cid, _cmd, (_client_id, done, ctx) in relayed:
            done(None, None, ctx)

    def stalled(self, now, limit):
        """True if requests have waited ``limit`` seconds with no reply at all."""
        return bool(self._pending) and now - self.progress > limit


def plan_move(ranges, live, skip=()):
    """The next rebalancing move, or None: ``ranges`` {partition: (leader id, [replica ids])} of
    healthy open ranges, ``live`` the live node ids. Replicas first: while one live node holds
    two or more replicas more than another, ``("replica", p, from_id, to_id)`` (a partition the
    fuller node holds and the emptier does not, preferring one it does not lead); then leaders:
    while one leads two or more partitions more than another, ``("leader", p, to_id)`` (a
    partition the busier one leads that the idler one holds)."""
    live = sorted(live)
    if len(live) < 2:
        return None
    held = {nid: 0 for nid in live}
    led = {nid: 0 for nid in live}
    for leader, servers in ranges.values():
        for nid in servers:
            if nid in held:
                held[nid] += 1
        if leader in led:
            led[leader] += 1
    parts = sorted(p for p in ranges if p not in skip)
    lo = min(live, key=lambda n: (held[n], n))
    for hi in sorted(live, key=lambda n: (-held[n], n)):
        if held[hi] - held[lo] < 2:
            break
        options = [p for p in parts if hi in ranges[p][1] and lo not in ranges[p][1]]
        options.sort(key=lambda p: (ranges[p][0] == hi, p))
        if options:
            return ("replica", options[0], hi, lo)
    for hi in sorted(live, key=lambda n: (-led[n], n)):
        for to in sorted(live, key=lambda n: (led[n], n)):
            if led[hi] - led[to] < 2:
                break
            options = [p for p in parts if ranges[p][0] == hi and to in ranges[p][1]]
            if options:
                return ("leader", options[0], to)
    return None


def bounds(p):
    """(smallest key, largest key) of partition ``p`` (keys are 1..65535 bytes)."""
    return bytes([p << 5]), bytes([(p << 5) | 31]) + b"\xff" * (codec.MAX_KEY - 1)


class Partition:
    def __init__(self, p, sid, applied=0):
        self.p = p
        self.sid = sid
        self.applied = applied  # the local store holds the stream's operations below this offset
        self.applying = False
        self.parked = False  # an applier waits for data (log.wait_for_data)
        self.waiters = []  # (offset, Deferred) fired once applied >= offset
        self.lead_epoch = None  # the stream epoch this node leads at, None if not the leader
        self.ready = False  # leader and caught up: serves
        self.target = 0  # a new leader serves once applied >= target
        self.ready_waiters = []
        self.overlay = {}  # key -> (value or None, end offset): sequenced here, not yet applied
        self.sequenced = {}  # base offset -> (end, ops) of records sequenced here, not yet applied
        # a replica's copies of the batches it received (base offset -> (end, batch bytes)), in
        # log order: its applier applies confirmed ones from here instead of reading the log back
        self.received = {}
        self.received_bytes = 0
        self.seen_epoch = None  # the stream epoch ``received`` belongs to
        self.snapshotting = False  # the partition's key range is being cleared and copied here
        self.snapshots = 0  # snapshots this node took of the partition since it started
        self.trimming = False  # a trim of the stream (leader) is under way
        # this node is no longer a replica of the partition and its key range is (being) cleared
        # from the local store: ``applied`` is 0 and the applier stays off until it is a replica
        # again (then a snapshot, or the log from 0). Kept in STATE_FILE.
        self.dropped = False
        self.cleared = False  # the key range was cleared by this process (``dropped`` and done)
        self.clearing = False  # the key range is being cleared
        self.held_in = None  # (stream record, this node a replica of its open range, its trim point)
        self.drop_check_at = 0.0  # reactor time of the next check whether the dropped copy may go

    def when_applied(self, offset):
        if self.applied >= offset:
            return defer.succeed(None)
        d = defer.Deferred()
        self.waiters.append((offset, d))
        return d


class KvPartitions:
    log = Logger()

    def __init__(self, node, cluster):
        self.node = node
        self.cluster = cluster
        self.prefix = cluster.prefix
        self.map = None  # [stream id] by partition, once known
        self.parts = {}  # p -> Partition
        self._by_sid = {}  # stream id -> Partition
        self.peers = {}  # node id -> Deferred of a connected KvClientProtocol
        self.port = None
        self.stopped = False
        self._map_waiters = []  # ensure_map callers while the map is being read or made
        self._saved = {}  # sid -> applied offset (the state file, as loaded / last written)
        self._saved_dropped = set()  # sids whose partition this node dropped (the state file, as loaded)
        self._dirty = False
        self._published = None  # the applied offsets last published to etcd
        self._next_publish = 0.0
        self._last_publish = 0.0
        self._trim_loop = None
        self._loop = None
        self._watch = None
        self._persist_loop = None
        self._moving = False
        self._next_move = 0.0
        self._move_skip = {}  # partition -> reactor time until which the rebalancer leaves it alone
        self.moves = 0  # rebalancing moves this node made (as placement-driver leader)
        # --kv-reads replica: GETs of partitions held here are answered from the local applied copy
        self.replica_reads = getattr(node.config, "kv_reads", "leader") == "replica"
        self.replica_gets = 0  # GETs answered that way
        self.forgotten = 0  # departed nodes' published offsets this node removed (as placement-driver leader)
        self._save_lock = defer.DeferredLock()
        self._leaders = [None] * PARTITIONS  # p -> (stream record, its open range's primary id)
        self._due = [{}, {}]  # partitions whose appliers are kicked on the next pass / after the delay
        self._due_calls = [None, None]
        self.reactor = node.reactor
        self.path = os.path.join(node.config.data_dir, STATE_FILE)

    @property
    def node_id(self):
        return self.node.node_id

    @property
    def pd(self):
        return self.cluster.pd

    @property
    def kv(self):
        return self.node.store.kv

    @property
    def core(self):
        """The store's commit core (the kv listeners hold its writer wake-ups over a read)."""
        return getattr(self.node.store, "core", None)

    # -- start / stop -----------------------------------------------------------------------------

    def listen(self, interface, factory):
        """Open the kv peer port beside the SBP listener (TLS with the cluster's options)."""
        from node.cluster.tls import listen

        self.port = listen(self.reactor, factory, interface, self.cluster.tls)
        return self.port.getHost().port

    @defer.inlineCallbacks
    def start(self):
        try:
            with open(self.path) as f:
                state = json.load(f)
            self._saved = {int(k): int(v) for k, v in state.get("applied", {}).items()}
            self._saved_dropped = {int(s) for s in state.get("dropped", [])}
        except FileNotFoundError:
            pass
        except (ValueError, AttributeError, TypeError) as e:
            self.log.warn("ignoring unreadable {path} ({e}): applying partitions from their start", path=self.path, e=e)
        kvs, revision = yield self.cluster.client.get_prefix(self.prefix + MAP_KEY)
        for kv in kvs:
            self._take_map(kv.value)
        if self.map is None:  # made later by whichever node serves a key first
            self._watch = self.cluster.client.watch_prefix(self.prefix + MAP_KEY, revision + 1, self._map_events)
        self.pd.listeners.append(self._record_changed)
        self.cluster.replicator.batch_listeners.append(self._replica_batch)
        self._loop = task.LoopingCall(self.check)
        self._loop.clock = self.reactor
        self._loop.start(CHECK_S, now=True)
        self._persist_loop = task.LoopingCall(self._persist)
        self._persist_loop.clock = self.reactor
        self._persist_loop.start(PERSIST_S, now=False)
        self._trim_loop = task.LoopingCall(self._trim)
        self._trim_loop.clock = self.reactor
        self._trim_loop.start(TRIM_S, now=False)

    @defer.inlineCallbacks
    def stop(self):
        self.stopped = True
        if self._watch is not None:
            self._watch.stop()
        for lp in (self._loop, self._persist_loop, self._trim_loop):
            if lp is not None and lp.running:
                lp.stop()
        for call in self._due_calls:
            if call is not None and call.active():
                call.cancel()
        for peer in list(self.peers.values()):
            if isinstance(peer, KvClientProtocol) and peer._lost is None:
                peer.transport.loseConnection()
        if self.port is not None:
            yield self.port.stopListening()
        for part in self.parts.values():
            self._not_leader(part, "node stopping")
        yield self._persist()

    def _map_events(self, events):
        for kind, kv in events:
            if kind != "DELETE" and self.map is None:
                self._take_map(kv.value)
                self.check()
        if self.map is not None and self._watch is not None:
            watch, self._watch = self._watch, None
            self.reactor.callLater(0, watch.stop)  # not from inside its own callback

    def _take_map(self, raw):
        try:
            streams = [int(s) for s in json.loads(raw)["streams"]]
            if len(streams) != PARTITIONS:
                raise ValueError("%d streams" % len(streams))
        except (ValueError, KeyError, TypeError) as e:
            self.log.error("unreadable key-value partition map in etcd: {e}", e=e)
            return
        self.map = streams
        for p, sid in enumerate(streams):
            if p not in self.parts:
                part = self.parts[p] = Partition(p, sid, self._saved.get(sid, 0))
                part.dropped = sid in self._saved_dropped
                self._by_sid[sid] = part

    def ensure_map(self):
        """Fires once the partition map is known (made here if no node made it yet)."""
        if self.map is not None:
            return defer.succeed(None)
        d = defer.Deferred()
        self._map_waiters.append(d)
        if len(self._map_waiters) == 1:
            self._make_map().addBoth(self._mapped)
        return d

    def _mapped(self, result):
        waiters, self._map_waiters = self._map_waiters, []
        if isinstance(result, Failure) and not result.check(Unavailable):
            # e.g. fewer live nodes than R (NoAvailableRS): the partitions are unavailable (ERR 1)
            result = Failure(Unavailable("the key-value partitions cannot be placed: %s" % result.value))
        for d in waiters:
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(None)

    @defer.inlineCallbacks
    def _make_map(self):
        key = self.prefix + MAP_KEY
        kv = yield self.cluster.client.get(key)
        if kv is None:
            created = []
            try:
                for _ in range(PARTITIONS):
                    rec = yield self.pd.create_stream()
                    created.append(rec["stream_id"])
                r = yield self.cluster.client.txn(
                    [etcd.compare_version(key, 0)],
                    [etcd.op_put(key, json.dumps({"streams": created, "replica_nums": rec["replica_nums"]}))])
                won = r.succeeded
            except Exception:
                won = False
                if not created:
                    raise
            if won:
                self.log.info("key-value partitions placed on streams {streams}", streams=created)
            else:
                for sid in created:
                    try:
                        yield self.pd.delete_stream(sid)
                    except Exception as e:
                        self.log.warn("stream {sid} of a lost partition map not deleted: {e}", sid=sid, e=e)
            kv = yield self.cluster.client.get(key)
            if kv is None:
                raise Unavailable("the key-value partitions could not be placed")
        if self.map is None:
            self._take_map(kv.value)
        self.check()

    # -- leadership and appliers -----------------------------------------------------------------

    def _record_changed(self, rec):
        if self.map is None or rec["stream_id"] not in self.map:
            return
        self._check(self.parts[self.map.index(rec["stream_id"])], rec)

    def check(self):
        if self.stopped:
            return
        self._check_peers()
        if self.map is None:
            return
        self._rebalance()
        for part in self.parts.values():
            rec = self.pd.streams.get(part.sid)
            if rec is not None:
                self._check(part, rec)

    def _check_peers(self):
        """Drop the forwarding connections to nodes that left the cluster or stopped answering:
        what waits on them fails (ConnectionError) and ``_routed`` decides what happens next."""
        now = self.reactor.seconds()
        members = self.cluster.membership.members
        for nid, peer in list(self.peers.items()):
            if not isinstance(peer, KvClientProtocol) or peer._lost is not None:
                continue
            if nid not in members:
                why = "it left the cluster"
            elif peer.stalled(now, FORWARD_TIMEOUT_S):
                why = "no answer for %ss" % FORWARD_TIMEOUT_S
            else:
                continue
            if peer._pending:
                self.log.warn("dropping the kv peer connection to node {nid} ({why}): {n} forwarded request(s) "
                              "fail over", nid=nid, why=why, n=len(peer._pending))
            del self.peers[nid]
            peer.transport.abortConnection()

    # -- rebalancing (the placement-driver leader) -----------------------------------------------

    def _rebalance(self):
        """One move at a time toward partitions spread evenly over the live nodes (``plan_move``),
        only while every partition's open range is whole (R live replicas, no failover running):
        a dead node's partitions are the failover's and re-replication's first."""
        cluster = self.cluster
        election, failover = cluster.election, cluster.failover
        now = self.reactor.seconds()
        if self._moving or now < self._next_move or failover is None or not (election and election.is_leader):
            return
        live = set(cluster.membership.live_ids())
        ranges = {}
        for p, sid in enumerate(self.map):
            rec = self.pd.streams.get(sid)
            rng = placement.open_range(rec) if rec is not None else None
            primary = placement.primary_of(rng) if rng else None
            if primary is None or sid in failover.busy:
                return
            ids = [s["id"] for s in rng["servers"]]
            if len(ids) < rec["replica_nums"] or not live.issuperset(ids):
                return
            ranges[p] = (primary["id"], ids)
        skip = {p for p, until in self._move_skip.items() if until > now}
        move = plan_move(ranges, live, skip)
        if move is None:
            return
        self._moving = True
        sid = self.map[move[1]]
        failover.busy.add(sid)
        d = self._move(move, sid)

        def done(result):
            failover.busy.discard(sid)
            self._moving = False
            self._next_move = self.reactor.seconds() + REBALANCE_S
            if isinstance(result, Failure):
                self._move_skip[move[1]] = self.reactor.seconds() + REBALANCE_RETRY_S
                self.log.warn("key-value rebalancing move {move} not done: {e}", move=move, e=result.value)

        d.addBoth(done)

    @defer.inlineCallbacks
    def _move(self, move, sid):
        """Seal the partition's open range and open the next one moved (failover.reopen): the new
        replica copies the stream through the replica channel's catch-up before it applies and
        may lead; a leader moves only to a replica holding everything (else it stays)."""
        failover = self.cluster.failover
        rec = yield self.pd.get(sid)
        rng = placement.open_range(rec)
        if rng is None:
            return
        if move[0] == "replica":
            _, p, source, target = move
            live = set(self.cluster.membership.live_ids())
            # the failover's spare rule: a node never gets a copy past a tail it may hold unacknowledged
            spares = yield failover._spares(rec, rng, rec.get("epoch", 0), live, live - {target}, 1)
            if not spares:
                raise placement.NoAvailableRS("no node can take a copy of stream %d" % sid)
            why = "key-value rebalancing: partition %d's replica on node %d moves to node %d" % (p, source, spares[0])
            yield failover.reopen(rec, why, spares=spares, drop=(source,))
        else:
            _, p, target = move
            why = "key-value rebalancing: partition %d's leader moves to node %d" % (p, target)
            new = yield failover.reopen(rec, why, spares=[], prefer=target)
            if placement.primary_of(placement.open_range(new))["id"] != target:
                raise placement.Conflict("node %d has not caught up with partition %d yet" % (target, p))
        self.moves += 1

    def _replica_batch(self, sid, base, batch):
        """The replicator stored (queued) ``batch`` at ``base`` in this node's copy of ``sid``."""
        part = self._by_sid.get(sid)
        if part is None or part.lead_epoch is not None or part.received_bytes >= RECEIVED_BYTES:
            return  # (too far behind: the applier reads the log back, as after a restart)
        if batch.__class__ is not bytes:
            batch = bytes(batch)
        old = part.received.get(base)
        if old is not None:
            part.received_bytes -= len(old[1])
        part.received[base] = (base + int.from_bytes(batch[9:13], "big", signed=True), batch)
        part.received_bytes += len(batch)

    def _check(self, part, rec):
        if self.stopped:
            return
        if part.seen_epoch != rec.get("epoch", 0):
            # a seal may have cut batches received in the old epoch: read the log from here on
            part.seen_epoch = rec.get("epoch", 0)
            part.received.clear()
            part.received_bytes = 0
        rng = placement.open_range(rec)
        primary = placement.primary_of(rng) if rng else None
        if primary is not None and primary["id"] == self.node_id:
            if part.lead_epoch != rec.get("epoch", 0):
                self._not_leader(part, "epoch %d" % rec.get("epoch", 0))
                part.lead_epoch = rec.get("epoch", 0)
                self.pd.ensure_local(rec).addCallbacks(self._take_lead, self._lead_failed,
                                                       callbackArgs=(part, part.lead_epoch), errbackArgs=(part,))
        elif part.lead_epoch is not None:
            self._not_leader(part, "node %s leads" % (primary["id"] if primary else None))
        if rng is not None and not any(s["id"] == self.node_id for s in rng["servers"]):
            if part.lead_epoch is None and not (part.cleared or part.clearing or part.applying):
                self._maybe_drop(part, rec)
        self._kick(part)

    def _take_lead(self, _, part, epoch):
        if part.lead_epoch != epoch or self.stopped:
            return
        log = self.node.store.log
        # the replicator's sequencer state for the range (confirm offset = the range's start)
        if self.cluster.replicator._primary(part.sid) is None:
            part.lead_epoch = None
            return
        part.target = log.assigned_end(part.sid)
        self.log.info("leading key-value partition {p} (stream {sid}, epoch {epoch}) once applied to {target}",
                      p=part.p, sid=part.sid, epoch=epoch, target=part.target)
        part.when_applied(part.target).addCallback(self._ready, part, epoch)
        self._kick(part)

    def _lead_failed(self, f, part):
        self.log.warn("cannot lead key-value partition {p}: {e}", p=part.p, e=f.value)
        part.lead_epoch = None

    def _ready(self, _, part, epoch):
        if part.lead_epoch != epoch:
            return
        part.ready = True
        waiters, part.ready_waiters = part.ready_waiters, []
        for d in waiters:
            d.callback(None)

    def _not_leader(self, part, why):
        if part.lead_epoch is None and not part.ready:
            return
        part.lead_epoch = None
        part.ready = False
        part.overlay.clear()
        part.sequenced.clear()
        waiters, part.ready_waiters = part.ready_waiters, []
        for d in waiters:
            d.errback(NotLeader("no longer leads partition %d (%s)" % (part.p, why)))

    def _limit(self, part):
        """The offset an applier may apply up to: None (the confirmed prefix) on a replica of the
        open range; else the end of the last sealed range this node held."""
        rec = self.pd.streams.get(part.sid)
        if rec is None:
            return 0
        rng = placement.open_range(rec)
        if rng is not None and any(s["id"] == self.node_id for s in rng["servers"]):
            return None
        ends = [r["end"] for r in rec["ranges"] if r["end"] >= 0 and any(s["id"] == self.node_id for s in r["servers"])]
        return max(ends) if ends else 0

    def _kick(self, part):
        if not part.applying and not self.stopped:
            self._apply(part).addErrback(lambda f: self.log.failure("key-value applier of partition {p} failed", f, p=part.p))

    @defer.inlineCallbacks
    def _apply(self, part):
        part.applying = True
        log = self.node.store.log
        try:
            while not self.stopped:
                try:
                    log.hold_at_confirm(part.sid)  # only what a majority holds is applied
                except store_errors.StreamNotFound:
                    return
                limit = self._limit(part)
                if limit is not None and (part.dropped or part.applied >= limit):
                    return  # (a dropped copy applies nothing until it is a replica again)
                if limit is None and part.dropped:
                    # a replica again (re-replication, a move back): from applied 0, so a snapshot
                    # if the local copy is trimmed, else the whole log; never the cleared copy
                    part.dropped = part.cleared = False
                    self._dirty = True
                if part.sequenced or part.received:
                    visible = log.stream(part.sid).next_offset
                    if limit is not None:
                        visible = min(visible, limit)
                    ops, end = self._take_in_memory(part, visible)
                    if end > part.applied:
                        yield self._land(part, ops, end)
                        continue
                trim = log.stream(part.sid).trim_offset
                if part.applied < trim:
                    if limit is not None:
                        return  # a copy outside the open range, trimmed past it: never served
                    # this copy starts past what the store has applied: the partition's state
                    # comes from a snapshot first, then the stream from its trim point
                    yield self._snapshot(part, trim)
                    continue
                try:
                    batches = yield log.read(part.sid, part.applied, APPLY_READ)
                except store_errors.OffsetOutOfRange as e:
                    if log.stream(part.sid).trim_offset > part.applied:
                        continue  # trimmed meanwhile: a snapshot (above)
                    self.log.error("key-value partition {p}: cannot apply from {offset}: {e}", p=part.p,
                                   offset=part.applied, e=e)
                    return
                ops, end = [], part.applied
                for b in batches:
                    header, records = record_batch.decode(bytes(b))
                    if header.next_offset <= end:
                        continue  # the batch holding a trim point starts below it
                    if header.base_offset > end or (limit is not None and header.next_offset > limit):
                        break
                    for r in records[end - header.base_offset:]:
                        ops.extend(kv_log.decode_ops(r.body))
                    end = header.next_offset
                if end == part.applied:
                    if not part.parked:
                        part.parked = True
                        log.wait_for_data(part.sid, part.applied).addBoth(self._unpark, part)
                    return
                yield self._land(part, ops, end)
        finally:
            part.applying = False

    @staticmethod
    def _take_in_memory(part, visible):
        """``(ops, end)`` of the confirmed records from ``part.applied`` up to ``visible`` still in
        memory, taken out of it: the leader's own records (``sequenced``: their operations as
        sequenced), else a replica's batches as the replica channel handed them (``received``);
        ``end == part.applied`` when neither continues there."""
        ops, end = [], part.applied
        sequenced = part.sequenced
        while end in sequenced and sequenced[end][0] <= visible:
            nxt, chunk = sequenced.pop(end)
            ops.extend(chunk)
            end = nxt
        if end > part.applied:
            return ops, end
        received = part.received
        entry = received.get(end)
        while entry is not None and entry[0] <= visible:
            del received[end]
            part.received_bytes -= len(entry[1])
            for r in record_batch.decode(entry[1])[1]:
                ops.extend(kv_log.decode_ops(r.body))
            end = entry[0]
            entry = received.get(end)
        return ops, end

    @defer.inlineCallbacks
    def _land(self, part, ops, end):
        """Write ``ops`` into the local store, then count ``end`` as applied (and published)."""
        yield self._write_local(ops)
        part.applied = end
        self._dirty = True
        self._applied(part)

    @defer.inlineCallbacks
    def _snapshot(self, part, start):
        """Make the local store hold partition ``part``'s state as of at least offset ``start``
        (the local copy's trim point): clear its key range here, then copy its pages from a node
        that has applied ``start`` (the leader first, then the other members; ``snapshot_page``
        on their kv peer port). Pages are read while that node goes on applying, so the copy is no
        single point in time; but every key written only below ``start`` has its final value in
        every page, and the stream from ``start`` (applied next) rewrites every key written later.
        ``part.applied`` becomes ``start`` only once the copy is in the store."""
        part.snapshotting = True
        p = part.p
        lo, hi = bounds(p)
        self.log.info("key-value partition {p}: applied {applied} is below the stream's trim point {start} here: "
                      "taking a snapshot", p=p, applied=part.applied, start=start)
        try:
            yield self._clear_range(p)
            name = SNAPSHOT_CURSOR + _SNAP.pack(p, start)
            copied = None
            while copied is None and not self.stopped:
                for nid in self._snapshot_sources(p):
                    try:
                        copied = yield self._copy_from(nid, name, lo)
                        break
                    except Exception as e:  # that node cannot serve it (not applied that far, gone)
                        self.log.info("key-value partition {p}: no snapshot from node {nid}: {e}", p=p, nid=nid, e=e)
                        # pages already copied from it are rewritten by the next copy or the stream
                if copied is None:
                    yield deferLater(self.reactor, SNAPSHOT_RETRY_S, lambda: None)
            if self.stopped:
                return
            part.applied = start
            part.snapshots += 1
            self._dirty = True
            self._applied(part)
            self.log.info("key-value partition {p}: snapshot of {n} keys from node {nid} in, applying the stream "
                          "from {start}", p=p, n=copied[1], nid=copied[0], start=start)
        finally:
            part.snapshotting = False

    @defer.inlineCallbacks
    def _clear_range(self, p):
        """Remove every key of partition ``p`` from the local store; fires with how many."""
        lo, hi = bounds(p)
        position, n = lo, 0
        while not self.stopped:
            keys = [k for k in self.kv.scan_keys(position, SNAPSHOT_PAGE) if k <= hi]
            if not keys:
                break
            yield self._write_retrying([(k, None) for k in keys])
            n += len(keys)
            position = keys[-1] + b"\x00"
        return n

    # -- a copy this node no longer holds ------------------------------------------------------------

    def _maybe_drop(self, part, rec):
        """This node is not a replica of ``part``'s open range (a rebalancing move or
        re-replication dropped it): clear the partition's keys from the local store (``_drop``)
        once the copy is not needed, i.e. once every replica of the open range published an applied
        offset at least the stream's trim point (so they hold everything below it, and any later
        snapshot has a source other than this node; nothing below it exists anywhere else). A
        stream never trimmed needs no check: a new copy applies its whole log. Checked at most
        every TRIM_S."""
        if part.dropped and part.applied == 0:
            self._drop(part)  # (dropped before a restart; the clear may not have finished)
            return
        now = self.reactor.seconds()
        if now < part.drop_check_at:
            return
        part.drop_check_at = now + TRIM_S
        self._drop_safe(part).addCallbacks(
            lambda ok: ok and self._drop(part),
            lambda f: self.log.info("key-value partition {p}: dropped copy kept for now: {e}", p=part.p, e=f.value))

    @defer.inlineCallbacks
    def _drop_safe(self, part):
        rec = self.pd.streams.get(part.sid)
        trim = rec.get("trim_offset", 0) if rec is not None else None
        published = {}
        if trim:
            published = yield self._read_published()
            rec = self.pd.streams.get(part.sid)  # (the newest, after the read)
        rng = placement.open_range(rec) if rec is not None else None
        if rng is None or any(s["id"] == self.node_id for s in rng["servers"]):
            return False
        if part.lead_epoch is not None or part.cleared or part.clearing or part.applying or self.stopped:
            return False
        trim = rec.get("trim_offset", 0)
        return all(published.get(s["id"], {}).get(part.sid, -1) >= trim for s in rng["servers"]) if trim else True

    @defer.inlineCallbacks
    def _drop(self, part):
        """Clear partition ``part``'s keys from the local store, its applied offset 0 first (in
        the state file, durably, and published), so that a crash part-way never leaves a store
        missing keys below its recorded applied offset; if this node becomes a replica again it
        starts from a snapshot (or the whole log), never from this copy."""
        part.clearing = part.applying = True
        try:
            if not part.dropped or part.applied:
                part.dropped = True
                part.applied = 0
                part.received.clear()
                part.received_bytes = 0
                self._dirty = True
                saved = yield self._save(durable=True)
                if not saved:
                    return
                state = self._state()
                yield self.cluster.client.put(self.prefix + APPLIED_KEY + str(self.node_id), json.dumps(state))
                self._published = state
                self._last_publish = self.reactor.seconds()
            n = yield self._clear_range(part.p)
            if not self.stopped:
                part.cleared = True
                self.log.info("key-value partition {p}: not a replica here any more: {n} keys cleared from the "
                              "local store", p=part.p, n=n)
        except Exception as e:
            self.log.warn("key-value partition {p}: dropped copy not cleared yet: {e}", p=part.p, e=e)
        finally:
            part.clearing = part.applying = False
        self._kick(part)  # (a replica again meanwhile: its applier starts over from 0)

    @defer.inlineCallbacks
    def _read_published(self):
        """node id -> {stream id: applied offset}, as every node last published it."""
        kvs, _rev = yield self.cluster.client.get_prefix(self.prefix + APPLIED_KEY)
        return self._parse_published(kvs)

    def _parse_published(self, kvs):
        published = {}
        for kv in kvs:
            try:
                nid = int(kv.key.decode()[len(self.prefix + APPLIED_KEY):])
                published[nid] = {int(k): int(v) for k, v in json.loads(kv.value)["applied"].items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        return published

    def _snapshot_sources(self, p):
        """Nodes to ask for a snapshot of ``p``: its leader first, then every other live member."""
        leader = self._known_leader(p)
        others = sorted(nid for nid in self.cluster.membership.members if nid not in (self.node_id, leader))
        return ([leader] if leader is not None and leader != self.node_id else []) + others

    @defer.inlineCallbacks
    def _copy_from(self, nid, name, start):
        peer = yield self._peer(nid)
        yield peer.create_cursor(name)
        n, position = 0, start
        try:
            while True:
                page = yield peer.scan(codec.GET_FF, name, SNAPSHOT_PAGE, position)
                if page.items:
                    yield self._write_retrying(page.items)
                    n += len(page.items)
                if not page.next_key:
                    return nid, n
                position = page.next_key
        finally:
            if peer._lost is None:
                peer.delete_cursor(name).addErrback(lambda f: None)

    def snapshot_page(self, name, position, count):
        """The kv peer port's side of a snapshot (``_snapshot``): one GET_FF page of the partition
        the cursor ``name`` names, from ``position``, if this node has applied its stream at least
        to the cursor's offset (and is not taking a snapshot of it itself); else NotLeader (ERR 1,
        the taker asks another node)."""
        p, start = _SNAP.unpack_from(name, len(SNAPSHOT_CURSOR))
        part = self.parts.get(p) if p < PARTITIONS else None
        if part is None or part.snapshotting or part.applied < start:
            raise NotLeader("partition %d: not applied to %d here" % (p, start))
        if position is BEGIN:
            position = bounds(p)[0]
        if position is END or codec.partition_of(position) != p:
            return [], END
        return self._scan_now(p, codec.GET_FF, position, count, b"")

    def _unpark(self, _, part):
        part.parked = False
        if not self.stopped:
            # a replica's applier is off every answer's path: it waits a little so that it reads
            # and applies many records at once (one log read and one store write, not one each)
            self._kick_later(part, part.lead_epoch is None)

    def _kick_later(self, part, delayed):
        """Kick ``part``'s applier on the reactor's next pass (``delayed``: after
        REPLICA_APPLY_DELAY_S) together with every other partition due then, the store writer's
        wake-ups held over them: the partitions' writes go to the writer as one group (one
        wake-up, one commit), not one group per partition."""
        i = 1 if delayed else 0
        due = self._due[i]
        due[part.p] = part
        if self._due_calls[i] is None:
            self._due_calls[i] = self.reactor.callLater(REPLICA_APPLY_DELAY_S if delayed else 0, self._kick_due, i)

    def _kick_due(self, i):
        self._due_calls[i] = None
        due, self._due[i] = self._due[i], {}
        core = self.core
        if core is not None:
            core.hold_wakeups()
        try:
            for part in due.values():
                self._kick(part)
        finally:
            if core is not None:
                core.release_wakeups()

    @defer.inlineCallbacks
    def _write_local(self, ops):
        chunk, size = [], 0
        for key, value in ops:
            chunk.append((key, value))
            size += kv_log.op_size(key, value)
            if size >= APPLY_WRITE:
                yield self._write_retrying(chunk)
                chunk, size = [], 0
        if chunk:
            yield self._write_retrying(chunk)

    @defer.inlineCallbacks
    def _write_retrying(self, ops):
        while True:
            try:
                yield self.kv.write_many(ops)
                return
            except store_errors.StoreBusy:
                yield deferLater(self.reactor, 0.05, lambda: None)  # the memtable flush catches up

    def _applied(self, part):
        keep = []
        for offset, d in part.waiters:
            if part.applied >= offset:
                d.callback(None)
            else:
                keep.append((offset, d))
        part.waiters = keep
        if part.sequenced and min(part.sequenced) < part.applied:  # applied from the log instead
            for base in [b for b in part.sequenced if b < part.applied]:
                del part.sequenced[base]
        received = part.received
        while received:
            base = next(iter(received))
            if base >= part.applied:
                break
            part.received_bytes -= len(received.pop(base)[1])
        if part.overlay:
            applied = part.applied
            for key in [k for k, (_v, end) in part.overlay.items() if end <= applied]:
                del part.overlay[key]

    def _state(self):
        return {"applied": {str(part.sid): part.applied for part in self.parts.values()},
                "dropped": sorted(part.sid for part in self.parts.values() if part.dropped)}

    @defer.inlineCallbacks
    def _save(self, durable=False):
        """Write the applied offsets (and dropped copies) to the state file if they changed (always
        with ``durable``: fsynced, file and directory); True once the file holds them."""
        yield self._save_lock.acquire()
        try:
            if not self._dirty and not durable:
                return True
            self._dirty = False
            try:
                yield threads.deferToThread(_write_state, self.path, self._state(), durable)
            except OSError as e:
                self.log.warn("cannot write {path}: {e}", path=self.path, e=e)
                self._dirty = True
                return False
            return True
        finally:
            self._save_lock.release()

    @defer.inlineCallbacks
    def _persist(self):
        """Write the applied offsets to the state file (the store has those writes), then publish
        them (``APPLIED_KEY``): a stream is trimmed only below what every replica published."""
        if self.map is None:
            return
        saved = yield self._save()
        if not saved:
            return
        state = self._state()
        now = self.reactor.seconds()
        due = state != self._published or now >= self._last_publish + REPUBLISH_S
        if due and not self.stopped and now >= self._next_publish:
            self._next_publish = now + PUBLISH_S
            try:
                yield self.cluster.client.put(self.prefix + APPLIED_KEY + str(self.node_id), json.dumps(state))
                self._published = state
                self._last_publish = now
            except Exception as e:
                self.log.warn("cannot publish the applied offsets of the key-value partitions: {e}", e=e)

    @defer.inlineCallbacks
    def _trim(self):
        """Trim the streams of the partitions led here below what every replica of their open
        range published as applied (and this node applied); as placement-driver leader, remove
        the published offsets of nodes that left the cluster (``_forget_departed``)."""
        if self.map is None or self.stopped:
            return
        led = [part for part in self.parts.values() if part.ready and not part.trimming]
        pd_leader = bool(self.cluster.election and self.cluster.election.is_leader)
        if not led and not pd_leader:
            return
        try:
            kvs, _rev = yield self.cluster.client.get_prefix(self.prefix + APPLIED_KEY)
        except Exception as e:
            self.log.warn("cannot read the published applied offsets: {e}", e=e)
            return
        published = self._parse_published(kvs)
        if pd_leader:
            self._forget_departed(kvs)
        for part in led:
            rec = self.pd.streams.get(part.sid)
            rng = placement.open_range(rec) if rec is not None else None
            if rng is None or not part.ready:
                continue
            offsets = [published.get(s["id"], {}).get(part.sid) for s in rng["servers"]]
            if any(o is None for o in offsets):
                continue  # a replica that never applied this stream (a new copy): it needs the stream
            point = min(offsets + [part.applied])
            trim = rec.get("trim_offset", 0)
            if point <= trim or (point - trim < TRIM_MIN_RECORDS and point < self.node.store.log.assigned_end(part.sid)):
                continue
            part.trimming = True
            self.pd.trim_stream(part.sid, point).addCallbacks(
                self._trimmed, self._trim_failed, callbackArgs=(part, point), errbackArgs=(part,))

    def _forget_departed(self, kvs):
        """Delete ``P kv/applied/<node>`` of every node that left the cluster for good: not a live
        member and a replica of no partition's open range (failover or re-replication dropped it
        from all 8). Such a node holds no trim back anyway (only the open ranges' replicas count);
        this keeps etcd from growing with departed nodes. Each delete is a transaction that holds
        only while the node's member key is absent and the published value unchanged, so a node
        back meanwhile keeps its key; a node that returns later publishes again."""
        if self.map is None:
            return
        members = self.cluster.membership.members
        holders = set()
        for sid in self.map:
            rec = self.pd.streams.get(sid)
            rng = placement.open_range(rec) if rec is not None else None
            if rng is None or sid in getattr(self.cluster.failover, "busy", ()):
                return  # placement in flux: decide on a later pass
            holders.update(s["id"] for s in rng["servers"])
        for kv in kvs:
            try:
                nid = int(kv.key.decode()[len(self.prefix + APPLIED_KEY):])
            except ValueError:
                continue
            if nid in members or nid in holders or nid == self.node_id:
                continue
            key = self.prefix + APPLIED_KEY + str(nid)
            d = self.cluster.client.txn(
                [etcd.compare_version(self.prefix + "members/%d" % nid, 0), etcd.compare_mod_revision(key, kv.mod_revision)],
                [etcd.op_delete(key)])
            d.addCallbacks(self._forgot, lambda f, nid=nid: self.log.info(
                "published applied offsets of node {nid} not removed: {e}", nid=nid, e=f.value), callbackArgs=(nid,))

    def _forgot(self, result, nid):
        if result.succeeded:
            self.forgotten += 1
            self.log.info("node {nid} left the cluster and holds no key-value partition: its published applied "
                          "offsets are removed", nid=nid)

    def _trimmed(self, _, part, point):
        part.trimming = False
        self.log.debug("key-value partition {p}: stream {sid} trimmed below {point}", p=part.p, sid=part.sid,
                       point=point)

    def _trim_failed(self, f, part):
        part.trimming = False
        self.log.info("key-value partition {p}: stream {sid} not trimmed: {e}", p=part.p, sid=part.sid, e=f.value)

    # -- serving partitions led here ---------------------------------------------------------------

    def _led(self, p):
        """The Partition if this node leads ``p`` (a Deferred once it is ready), else NotLeader."""
        part = self.parts.get(p)
        if part is None or part.lead_epoch is None:
            raise NotLeader("partition %d is not led here" % p)
        if part.ready:
            return part
        d = defer.Deferred()
        part.ready_waiters.append(d)
        timeout = self.reactor.callLater(ROUTE_WAIT_S, lambda: d.called or d.errback(Unavailable(
            "partition %d: this node has not caught up within %ss" % (p, ROUTE_WAIT_S))))
        d.addBoth(lambda r: (timeout.active() and timeout.cancel(), r)[1])
        return d.addCallback(lambda _: part)

    def get_local(self, key):
        try:
            part = self._led(codec.partition_of(key))
        except NotLeader:
            return defer.fail()
        if isinstance(part, defer.Deferred):
            return part.addCallback(lambda _: self.kv.get(key))
        return defer.succeed(self.kv.get(key))

    @defer.inlineCallbacks
    def write_local(self, p, ops):
        """Sequence ``ops`` ([(key, value or None)], all in partition ``p``) through the stream and
        apply them; fires with one bool per op (True for a SET; whether the key existed for a
        REMOVE) once acknowledged and applied here."""
        part = self._led(p)
        if isinstance(part, defer.Deferred):
            part = yield part
        epoch = part.lead_epoch
        overlay = part.overlay
        results = []
        run = {}  # key -> value or None: this run's own earlier operations
        for key, value in ops:
            if value is None:
                if key in run:
                    existed = run[key] is not None
                else:
                    entry = overlay.get(key)
                    existed = (entry[0] if entry is not None else self.kv.get(key)) is not None
                results.append(existed)
            else:
                results.append(True)
            run[key] = value
        replicator = self.cluster.replicator
        log = self.node.store.log
        ds, end, bases = [], None, []
        chunk, size = [], 0
        now = int(time.time() * 1000)

        def append(chunk):
            batch = record_batch.encode([(now, [], kv_log.encode_ops(chunk))])
            d = replicator.append(part.sid, batch)
            if d.called and hasattr(d.result, "value"):
                return d  # refused at once: nothing sequenced
            e = log.assigned_end(part.sid)
            bases.append(e - 1)
            part.sequenced[e - 1] = (e, chunk)  # one record per batch: base = end - 1
            for k, v in chunk:
                overlay[k] = (v, e)
            ds.append(d)
            return e

        for key, value in ops:
            chunk.append((key, value))
            size += kv_log.op_size(key, value)
            if size >= RECORD_BYTES:
                end = append(chunk)
                if isinstance(end, defer.Deferred):
                    yield self._refused_at_once(part, end, bases)
                chunk, size = [], 0
        if chunk:
            end = append(chunk)
            if isinstance(end, defer.Deferred):
                yield self._refused_at_once(part, end, bases)
        base = bases[0] if bases else end
        try:
            yield defer.gatherResults(ds, consumeErrors=True)
        except defer.FirstError as e:
            if part.lead_epoch == epoch:
                # the range was sealed under it (a failover, a rebalancing move) or replicas failed:
                # start the lead over, then learn from the seal what became of these records
                self._not_leader(part, "append failed: %s" % e.subFailure.value)
                rec = self.pd.streams.get(part.sid)
                if rec is not None:
                    self._check(part, rec)
            kept = yield self._sealed_outcome(part, epoch, base, end)
            if kept is None:
                e.subFailure.raiseException()  # not known in time: ERR 0, outcome unknown
            if not kept:
                # the seal ended the range below them: nothing of the run exists anywhere, so it is
                # sent to the new leader (ERR 1 to a forwarding node, a retry here)
                raise NotLeader("partition %d: the run was cut by the seal of epoch %d" % (part.p, epoch))
            try:
                yield self._applied_within(part, end, SETTLE_S)  # kept: acknowledged once applied here
            except Unavailable:
                e.subFailure.raiseException()  # kept but not applied here in time: ERR 0
            return results
        yield part.when_applied(end)
        return results

    @staticmethod
    def _refused_at_once(part, failed, bases):
        """An append refused before anything was sequenced: a range sealed under this leader
        (its record not handled here yet) means nothing was done: NotLeader (re-routed)."""
        def refused(f):
            if not bases and f.check(store_errors.RangeAlreadySealed):
                raise NotLeader("partition %d: %s" % (part.p, f.value))
            return f

        return failed.addErrback(refused)

    @defer.inlineCallbacks
    def _sealed_outcome(self, part, epoch, base, end):
        """What the seal of ``epoch``'s range did to the records [base, end) this node appended in
        it: True (all kept: the seal's end is at or past them), False (none: it ends at or below
        base; replicas cut the tail past a seal), None (part of them, or no seal within
        SETTLE_S, e.g. replicas down without a failover)."""
        deadline = self.reactor.seconds() + SETTLE_S
        while not self.stopped:
            rec = self.pd.streams.get(part.sid)
            for rng in (rec or {}).get("ranges", []):
                if rng.get("epoch") == epoch and rng["end"] >= 0:
                    if rng["end"] >= end:
                        return True
                    return False if rng["end"] <= base else None
            if self.reactor.seconds() > deadline:
                return None
            yield deferLater(self.reactor, RETRY_S, lambda: None)
        return None

    def _applied_within(self, part, offset, seconds):
        d = part.when_applied(offset)
        timeout = self.reactor.callLater(seconds, lambda: d.called or d.errback(Unavailable(
            "partition %d: offset %d not applied here within %ss" % (part.p, offset, seconds))))
        return d.addBoth(lambda r: (timeout.active() and timeout.cancel(), r)[1])

    def scan_local(self, cmd, position, count, prefix=b""):
        """One page of one partition led here, from ``position`` (BEGIN, END or a key; the
        partition is the key's, partition 0 from BEGIN, 7 from END): forward for GET_FF /
        GET_KEYS / GET_KEYS_PREFIX, down for GET_FB (ascending in the page). Fires with
        ``(items, new_position)``: [(key, value or None)] and the position after the page, BEGIN /
        END when the partition ran out (CONTRACT §4 paging: ``server.scan_page``)."""
        if cmd == codec.GET_FB:
            if position is BEGIN:
                return defer.succeed(([], BEGIN))
            start = bounds(PARTITIONS - 1)[1] if position is END else position
        else:
            if position is END:
                return defer.succeed(([], END))
            start = b"\x00" if position is BEGIN else position
            if cmd == codec.GET_KEYS_PREFIX and prefix and start < prefix:
                start = prefix  # CONTRACT §4: forward from max(position, prefix)
        p = codec.partition_of(start)
        part = self._led(p)
        if isinstance(part, defer.Deferred):
            return part.addCallback(lambda _: self._scan_now(p, cmd, start, count, prefix))
        return defer.succeed(self._scan_now(p, cmd, start, count, prefix))

    def scan_peer(self, cmd, name, position, count, prefix=b""):
        """A scan on the kv peer port: a snapshot page for a snapshot cursor, else ``scan_local``."""
        if cmd == codec.GET_FF and name.startswith(SNAPSHOT_CURSOR) and len(name) == len(SNAPSHOT_CURSOR) + _SNAP.size:
            return defer.succeed(self.snapshot_page(name, position, count))
        return self.scan_local(cmd, position, count, prefix)

    def _scan_now(self, p, cmd, start, count, prefix):
        lo, hi = bounds(p)
        kv = self.kv

        def backward(s, limit):
            return [e for e in kv.scan_backward(s, limit) if e[0] >= lo]

        def forward(s, limit):
            return [e for e in kv.scan_forward(s, limit) if e[0] <= hi]

        def keys(s, limit):
            return [k for k in kv.scan_keys(s, limit) if k <= hi]

        return scan_page(cmd, start, count, prefix, forward, backward, keys)

    # -- routing (any node) ------------------------------------------------------------------------

    @defer.inlineCallbacks
    def leader(self, p, deadline=None):
        """The node id leading partition ``p`` (this node's own id included), waiting while it
        has no live leader; Unavailable after ROUTE_WAIT_S."""
        yield self.ensure_map()
        deadline = deadline or self.reactor.seconds() + ROUTE_WAIT_S
        sid = self.map[p]
        while True:
            rec = self.pd.streams.get(sid)
            if rec is None:
                try:
                    rec = yield self.pd.learn(sid)
                except placement.StreamGone:
                    raise Unavailable("the stream of partition %d is gone" % p)
            rng = placement.open_range(rec)
            primary = placement.primary_of(rng) if rng else None
            if primary is not None and primary["id"] in self.cluster.membership.members:
                if primary["id"] == self.node_id:
                    self._check(self.parts[p], rec)
                return primary["id"]
            if self.reactor.seconds() > deadline:
                raise Unavailable("partition %d has no live leader" % p)
            yield deferLater(self.reactor, RETRY_S, lambda: None)

    def _peer(self, nid):
        """A Deferred of the pipelined §4 connection to node ``nid``'s kv peer port."""
        peer = self.peers.get(nid)
        if isinstance(peer, KvClientProtocol):
            if peer._lost is None:
                return defer.succeed(peer)
            peer = None
        d = defer.Deferred()
        if peer is not None:  # connecting: wait with the others
            peer.append(d)
            return d
        rec = self.cluster.membership.members.get(nid) or {}
        addr = rec.get("kv_peer")
        if not addr:
            return defer.fail(Unavailable("node %d has no kv peer address" % nid))
        waiters = self.peers[nid] = [d]
        host, port = addr.rsplit(":", 1)
        host = host.strip("[]")
        cc = protocol.ClientCreator(self.reactor, PeerProtocol, self.reactor)
        tls = self.cluster.tls
        if tls:
            from node.cluster.tls import client_options

            connecting = cc.connectSSL(host, int(port), client_options(host, *tls), timeout=PEER_CONNECT_S)
        else:
            connecting = cc.connectTCP(host, int(port), timeout=PEER_CONNECT_S)

        def done(result):
            if self.peers.get(nid) is waiters:
                if isinstance(result, Failure):
                    del self.peers[nid]
                else:
                    self.peers[nid] = result
                    # the one cursor forwarded scans name (each gives its start as NextKey)
                    result.create_cursor(PEER_CURSOR).addErrback(lambda f: None)
            for w in waiters:
                if isinstance(result, Failure):
                    w.errback(result)
                else:
                    w.callback(result)

        connecting.addBoth(done)
        return d

    @defer.inlineCallbacks
    def _routed(self, p, local, remote, retry_lost=True):
        """Run ``local()`` if this node leads ``p``, else ``remote(peer)`` on the leader's peer
        connection; look the leader up again and retry while it is not the leader (ERR 1, a
        refused connection, or, with ``retry_lost``, a connection lost on the way)."""
        deadline = self.reactor.seconds() + ROUTE_WAIT_S
        while True:
            nid = yield self.leader(p, deadline)
            try:
                if nid == self.node_id:
                    r = yield local()
                else:
                    try:
                        peer = yield self._peer(nid)
                    except Exception as e:  # not reachable (yet): its lease decides
                        raise NotLeader(str(e))
                    r = yield remote(peer)
                return r
            except NotLeader:
                pass
            except KvError as e:
                if e.code != codec.E_PARTITION_DIED:
                    raise
            except ConnectionError:
                if not retry_lost:
                    raise
            if self.reactor.seconds() > deadline:
                raise Unavailable("partition %d: no leader answered within %ss" % (p, ROUTE_WAIT_S))
            yield deferLater(self.reactor, RETRY_S, lambda: None)

    def _known_leader(self, p):
        """The live leader of ``p`` as this node knows it now, or None (then the slow path)."""
        if self.map is None:
            return None
        rec = self.pd.streams.get(self.map[p])
        cached = self._leaders[p]
        if cached is not None and cached[0] is rec:  # (a record changes by replacement)
            nid = cached[1]
        else:
            rng = placement.open_range(rec) if rec is not None else None
            primary = placement.primary_of(rng) if rng else None
            nid = primary["id"] if primary is not None else None
            self._leaders[p] = (rec, nid)
        if nid is None or nid not in self.cluster.membership.members:
            return None
        return nid

    def _fast(self, p, local, remote):
        """``local()`` / ``remote(peer)`` at once when the leader is known and ready here or its
        peer connection is up; None otherwise (the caller takes the routed path)."""
        nid = self._known_leader(p)
        if nid is None:
            return None
        if nid == self.node_id:
            part = self.parts.get(p)
            if part is None or not part.ready:
                return None
            return local()
        peer = self.peers.get(nid)
        if not isinstance(peer, KvClientProtocol) or peer._lost is not None:
            return None
        return remote(peer)

    def _replica_read(self, p):
        """True if ``--kv-reads replica`` lets this node answer a GET of partition ``p`` from its
        own applied copy: it is a replica of the open range whose copy is a prefix of the
        stream's acknowledged history (not dropped, not clearing or taking a snapshot: mid-copy,
        the key range is no single state)."""
        part = self.parts.get(p)
        if part is None or part.dropped or part.clearing or part.snapshotting:
            return False
        rec = self.pd.streams.get(part.sid)
        cached = part.held_in
        if cached is None or cached[0] is not rec:  # (a record changes by replacement)
            rng = placement.open_range(rec) if rec is not None else None
            cached = part.held_in = (rec, rng is not None and any(s["id"] == self.node_id for s in rng["servers"]),
                                     rec.get("trim_offset", 0) if rec is not None else 0)
        # applied at least to the record's trim point, so at least to this copy's own (a copy
        # follows the record's, or starts below it): not a new copy still to take its snapshot
        return cached[1] and part.applied >= cached[2]

    NOT_HERE = _NOT_HERE

    def get_here(self, key, peer=False):
        """The value of ``key`` (None if absent) when this node answers it at once, without a
        Deferred: it leads the key's partition and serves it (``peer``: the kv peer port's rule,
        ``get_local``'s), or ``--kv-reads replica`` answers from the copy here; else NOT_HERE."""
        p = codec.partition_of(key)
        part = self.parts.get(p)
        if part is not None and part.ready and (peer or self._known_leader(p) == self.node_id):
            return self.kv.get(key)
        if not peer and self.replica_reads and self.map is not None and self._replica_read(p):
            self.replica_gets += 1
            return self.kv.get(key)
        return _NOT_HERE

    def relay_get(self, key, client_id, done, ctx):
        """The forwarding fast path of a GET (``PeerProtocol.relay_get``) when ``key``'s
        partition is led by another node whose peer connection is up and ``--kv-reads replica``
        does not answer it here: True once sent; False (nothing done) otherwise, and then the
        caller takes ``get``."""
        p = codec.partition_of(key)
        nid = self._known_leader(p)
        if nid is None or nid == self.node_id:
            return False
        if self.replica_reads and self._replica_read(p):
            return False
        peer = self.peers.get(nid)
        if peer.__class__ is not PeerProtocol or peer._lost is not None:
            return False
        peer.relay_get(key, client_id, done, ctx)
        return True

    def get(self, key):
        p = codec.partition_of(key)
        if self.replica_reads and self.map is not None and self._replica_read(p):
            self.replica_gets += 1
            return defer.succeed(self.kv.get(key))
        local = lambda: self.get_local(key)  # noqa: E731
        remote = lambda peer: peer.get(key)  # noqa: E731
        d = self._fast(p, lambda: defer.succeed(self.kv.get(key)), remote)
        if d is None:
            return self._routed(p, local, remote)
        # a leader that changed meanwhile answers ERR 1 (nothing done): the routed path retries
        return d.addErrback(self._retry_routed, p, local, remote)

    def _retry_routed(self, f, p, local, remote, retry_lost=True):
        f.trap(KvError, ConnectionError, NotLeader)
        if f.check(KvError) and f.value.code != codec.E_PARTITION_DIED:
            return f
        if f.check(ConnectionError) and not retry_lost:
            return f
        return self._routed(p, local, remote, retry_lost)

    def write(self, p, ops):
        """Fires with one bool per op (as write_local); an op refused with ERR 1 by a peer that no
        longer leads is sent again to the new leader."""

        @defer.inlineCallbacks
        def remote_each(peer):
            ds = [peer.remove(k) if v is None else peer.set(k, v) for k, v in ops]
            results = yield defer.DeferredList(ds, consumeErrors=True)
            out = []
            for (ok, r), (_k, v) in zip(results, ops):
                if not ok:
                    # ERR 1: that peer no longer leads (it did nothing); the run goes to the new
                    # leader again (SETs are idempotent; a REMOVE may then answer DATA_NOT_FOUND)
                    r.raiseException()
                out.append(r if v is None else True)
            return out

        def remote(peer):
            # (one Deferred for the run; ERR 1 from a peer that no longer leads fails it with that
            # KvError, and the run goes to the new leader as above)
            return peer.write_run(ops) if peer.__class__ is PeerProtocol else remote_each(peer)

        # a peer that is not the leader refuses every op with ERR 1 (it does nothing); one that
        # fails part-way answers ERR 0 for what it could not do
        local = lambda: self.write_local(p, ops)  # noqa: E731
        d = self._fast(p, local, remote)
        if d is None:
            return self._routed(p, local, remote, retry_lost=False)
        return d.addErrback(self._retry_routed, p, local, remote, False)

    def scan_partition(self, p, cmd, start, count, prefix=b""):
        """One page of partition ``p`` from the key ``start`` on its leader: ``(items, next)``,
        next the position after the page, None when the partition ran out."""
        def remote(peer):
            return peer.scan(cmd, PEER_CURSOR, count, start, prefix).addCallback(
                lambda page: (page.items, page.next_key or None))

        def local():
            return self.scan_local(cmd, start, count, prefix).addCallback(
                lambda page: (page[0], page[1] if isinstance(page[1], bytes) else None))

        return self._routed(p, local, remote)

    @defer.inlineCallbacks
    def scan(self, cmd, position, count, prefix=b""):
        """One cursor page across partitions (CONTRACT §4): ``position`` BEGIN, END or a key.
        Fires with ``(items, new_position, jumped)``."""
        budget = SCAN_REPLY_BUDGET
        values = cmd in codec.VALUE_SCANS
        items, parts, nbytes = [], set(), 0

        def size(k, v):
            return len(k) + 2 + (len(v) + 4 if values else 0)

        if cmd == codec.GET_FB:
            if position is BEGIN:
                return [], BEGIN, False
            start = bounds(PARTITIONS - 1)[1] if position is END else position
            p = codec.partition_of(start)
            while p >= 0:
                want = count - len(items)
                got, nxt = yield self.scan_partition(p, cmd, start, max(want, 1))
                if want == 0:
                    # the page is full and ended with a partition: the position is the largest key
                    # below it, in the next partition down that has one
                    if got:
                        return items, got[-1][0], len(parts) > 1
                else:
                    kept = []
                    for k, v in reversed(got):  # downwards, within the byte budget
                        if (items or kept) and nbytes + size(k, v) > budget:
                            nxt = k  # the largest key not returned
                            break
                        kept.append((k, v))
                        nbytes += size(k, v)
                    if kept:
                        parts.add(p)
                    kept.reverse()
                    items = kept + items
                    if nxt is not None:
                        return items, nxt, len(parts) > 1
                p -= 1
                if p >= 0:
                    start = bounds(p)[1]
            return items, BEGIN, len(parts) > 1
        if position is END:
            return [], END, False
        start = b"\x00" if position is BEGIN else position
        if cmd == codec.GET_KEYS_PREFIX and prefix and start < prefix:
            start = prefix
        p = codec.partition_of(start)
        while p < PARTITIONS:
            want = count - len(items)
            got, nxt = yield self.scan_partition(p, cmd, start, max(want, 1), prefix)
            if want == 0:
                # the page is full and ended with a partition: the position is the first key
                # after it (for GET_KEYS_PREFIX, the first key at all: with or without the prefix)
                if got:
                    return items, got[0][0], len(parts) > 1
                if nxt is not None:
                    return items, nxt, len(parts) > 1
            else:
                for i, (k, v) in enumerate(got):
                    if items and nbytes + size(k, v) > budget:
                        got, nxt = got[:i], k
                        break
                    items.append((k, v))
                    nbytes += size(k, v)
                if got:
                    parts.add(p)
                if nxt is not None:
                    return items, nxt, len(parts) > 1
            p += 1
            if p < PARTITIONS:
                start = bounds(p)[0]
        return items, END, len(parts) > 1

    # -- what `sbpctl cluster` and the status show ---------------------------------------------------

    def status(self):
        if self.map is None:
            return {"placed": False}
        out = []
        for p in range(PARTITIONS):
            part = self.parts[p]
            rec = self.pd.streams.get(part.sid)
            rng = placement.open_range(rec) if rec else None
            primary = placement.primary_of(rng) if rng else None
            out.append({"partition": p, "stream_id": part.sid, "leader": primary["id"] if primary else None,
                        "replicas": [s["id"] for s in rng["servers"]] if rng else [],
                        "applied": part.applied, "serving_here": part.ready,
                        "trim_offset": rec.get("trim_offset", 0) if rec else 0,
                        "snapshotting": part.snapshotting, "snapshots": part.snapshots,
                        "dropped": part.dropped, "cleared": part.cleared})
        return {"placed": True, "partitions": out, "rebalancing_moves": self.moves, "forgotten_nodes": self.forgotten,
                "reads": "replica" if self.replica_reads else "leader", "replica_gets": self.replica_gets,
                "peer_port": self.port.getHost().port if self.port is not None else None}
