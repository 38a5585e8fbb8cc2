"""Swarm stream! client (the downstream peer): one syncer per ``--peer`` (CONTRACT §1, §6).

A ClientService with backoff keeps a connection to the peer. On every connection the syncer asks
for the peer's streams (StreamInfoReq with ``["CHUNKS", ""]`` and ``["LOG", ""]``, repeated every
``info_interval`` so new streams are found and a dead peer is noticed), then per stream runs one
GetRange at a time (CONTRACT §6: a second one would get StreamState 4): bounded ranges over the
gaps of its synced intervals up to the peer's cursor, then an unbounded one at the head, which the
server parks until data arrives. Roundtrip is on: the peer offers hashes, only the wanted ones
cross the wire.

Every delivered item is checked before anything is stored: its address must be one this syncer
asked for in the current batch and still waits for, and SHA-256 of its bytes must equal the
address; otherwise the peer is dropped and the data discarded. Chunks are stored pinned; LOG
batches are appended to a read-only replica stream (same id, ``origin`` = the peer's host:port) in
offset order. A stream id minted by this node, or a stream this node owns, is never replicated
back (CONTRACT §2: a stream keeps its id everywhere).

Synced intervals persist per (peer, stream) in ``store.meta`` (table ``swarm_iv``) once the items
they cover are durable, and a new connection resumes from them.
"""

import hashlib
import json
import os
import struct
import weakref

from twisted.application import internet, service
from twisted.internet import defer, endpoints, task
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from protocols import tcp_internals
from protocols.swarm import codec
from protocols.swarm.codec import (
    ID,
    BatchDone,
    ChunkDelivery,
    GetRange,
    OfferedHashes,
    StreamInfoReq,
    StreamInfoRes,
    StreamState,
    WantedHashes,
)
from protocols.swarm.intervals import Intervals

INTERVAL_TABLE = "swarm_iv"
CHUNK_BATCH = 1024  # CONTRACT §6 maximum
LOG_BATCH = 256
SILENCE_TIMEOUT = 10.0  # seconds without a byte while an answer is due: the peer is dropped
INFO_INTERVAL = 1.0  # StreamInfoReq period (new streams, cursors, liveness)
RETRY_DELAY = 0.5  # after StreamState 4 / an expired offer
PENDING_LIMIT = 64 * 1024 * 1024  # bytes of accepted-but-not-yet-durable items before reading pauses
RECENT_LOG_HASHES = 8192
RECV_BYTES = 1 << 20  # read deliveries in pieces this big (Twisted's default is 64 KiB)
STOP_PERSIST_WAIT = 5.0  # seconds a clean stop waits for queued interval saves

_BATCH_HEAD = struct.Struct(">qi")  # base_offset, record_count at bytes 1..13 of a record batch


class PeerMisbehaved(Exception):
    """The peer broke the protocol (bad hash, unsolicited item, bad batch): drop it."""


def endpoint_address(endpoint_string: str) -> str:
    """``host:port`` from a client endpoint string like ``tcp:host=127.0.0.1:port=7704``."""
    host = port = None
    parts = endpoint_string.split(":")
    for p in parts[1:]:
        if p.startswith("host="):
            host = p[5:]
        elif p.startswith("port="):
            port = p[5:]
    if host is None and len(parts) >= 3 and "=" not in parts[1]:
        host, port = parts[1], parts[2]
    if host is None:
        return endpoint_string
    return "%s:%s" % (host, port)


# ---------------------------------------------------------------------------------------------
# the local side: one per node, shared by every peer syncer (two peers may offer the same data)

_SINKS = weakref.WeakKeyDictionary()


def local_sink(node):
    sink = _SINKS.get(node)
    if sink is None:
        sink = _SINKS[node] = LocalSink(node.store, node.node_id)
    return sink


class LocalSink:
    """Writes verified items into the store: chunks (pinned, de-duplicated while in flight) and
    replica LOG batches (serialised per stream, in offset order, skipping what is already held)."""

    log = Logger()

    def __init__(self, store, node_id):
        self.store = store
        self.node_id = node_id
        self.pending_chunks = {}  # addr -> Deferred of the put in progress
        self.log_tail = {}  # sid -> next offset once queued appends land
        self.recent = {}  # sid -> dict of recently appended batch hashes (ordered)
        self.pending_bytes = 0
        self._drained = []

    # chunks
    def has_chunks(self, addrs):
        held = self.store.chunks.has_many(addrs)
        return [h or a in self.pending_chunks for a, h in zip(addrs, held)]

    def put_chunks(self, addrs, datas):
        """Store verified chunks (pinned) in one store transaction; fires once they, and any of
        them another syncer is already writing, are durable."""
        pending = self.pending_chunks
        fresh_addrs, fresh_datas, others = [], [], []
        for addr, data in zip(addrs, datas):
            d = pending.get(addr)
            if d is None:
                fresh_addrs.append(addr)
                fresh_datas.append(data)
            elif d not in others:
                others.append(d)
        waits = [_chain(d) for d in others]
        if fresh_addrs:
            n = sum(map(len, fresh_datas))
            self.pending_bytes += n
            d = self.store.chunks.put_many(fresh_datas, pin=True, addrs=fresh_addrs)

            def done(result, d=d):
                for addr in fresh_addrs:
                    if pending.get(addr) is d:
                        del pending[addr]
                self._release(n)
                return result

            d.addBoth(done)
            for addr in fresh_addrs:
                pending[addr] = d
            waits.append(d)  # only this syncer's batch waits on it; others get a _chain
        if len(waits) == 1:
            return waits[0]
        return defer.gatherResults(waits, consumeErrors=True)

    # logs
    def replicable(self, sid) -> bool:
        """CONTRACT §2: never replicate a stream this node minted or owns."""
        if (sid >> 32) == self.node_id:
            return False
        meta = self._meta(sid)
        return meta is None or meta.origin is not None

    def _meta(self, sid):
        try:
            return self.store.log.stream(sid)
        except Exception:
            return None

    def log_next(self, sid) -> int:
        meta = self._meta(sid)
        held = meta.next_offset if meta is not None else 0
        return max(held, self.log_tail.get(sid, 0))

    def knows_batch(self, sid, digest) -> bool:
        return digest in self.recent.get(sid, ())

    def append(self, sid, base, count, digest, data, origin):
        """Append a verified batch now (the store checks and advances the stream's assigned
        offset synchronously, so appends issued in order share group commits); fires True once
        durable, False when the batch was already held."""
        recent = self.recent.setdefault(sid, {})
        recent[digest] = True
        if len(recent) > RECENT_LOG_HASHES:
            recent.pop(next(iter(recent)))
        meta = self._meta(sid)
        if meta is not None and meta.origin is None:
            return defer.succeed(False)
        tail = self.log_next(sid)
        if base < tail:
            return defer.succeed(False)  # already held (another peer delivered it first)
        if base > tail:
            return defer.fail(LookupError("stream %d: batch at %d leaves a gap after %d" % (sid, base, tail)))
        created = None
        if meta is None:
            # the stream exists in the store from this call on; its record is written in order
            created = self.store.log.create_replica_stream(sid, origin, 1, 0, {})
            self.log.info("replicating stream {sid} from {origin}", sid=sid, origin=origin)
        self.log_tail[sid] = base + count
        self.pending_bytes += len(data)
        d = self.store.log.append_replica(sid, data)
        if created is not None:
            d = defer.gatherResults([created, d], consumeErrors=True)

        def done(result):
            self._release(len(data))
            if isinstance(result, Failure):
                self.log_tail.pop(sid, None)  # re-derive the tail from the store
                return result
            return True

        d.addBoth(done)
        return d

    # backpressure
    def _release(self, n):
        self.pending_bytes -= n
        if self.pending_bytes <= PENDING_LIMIT // 2 and self._drained:
            waiting, self._drained = self._drained, []
            for fn in waiting:
                fn()

    def over_limit(self) -> bool:
        return self.pending_bytes > PENDING_LIMIT

    def when_drained(self, fn):
        self._drained.append(fn)


def _chain(d):
    """A new Deferred firing with ``d``'s result, leaving ``d``'s own result untouched."""
    out = defer.Deferred()

    def relay(result):
        if isinstance(result, Failure):
            out.errback(result)
        else:
            out.callback(result)
        return result

    d.addBoth(relay)
    return out


# ---------------------------------------------------------------------------------------------
# per-stream sync state on one connection


class StreamSync:
    """Drives one stream of one peer: GetRange, offer/want, deliveries, BatchDone, intervals."""

    def __init__(self, conn, stream: ID, cursor: int):
        self.conn = conn
        self.stream = stream
        self.cursor = cursor
        self.is_log = stream.name == codec.LOG
        self.sid = codec.log_stream_id(stream.key) if self.is_log else None
        self.intervals = Intervals(conn.svc.load_intervals(stream))
        self.req = None  # the open GetRange
        self.offered = None  # list of hashes of the open offer (None: no offer yet)
        self.wanted = set()  # hashes asked for and not yet delivered
        self.want_sent = False
        self.writes = []  # Deferreds of this batch's stores
        self.log_buffer = {}  # base -> (count, digest, data) waiting for their turn
        self.applied_top = 0  # highest LOG index handed to the sink in this batch
        self.persist = defer.succeed(None)
        self.retry = None
        self.stopped = False
        self.failed = False
        self.items = 0
        self.bytes = 0

    # -- which range next -------------------------------------------------------------------------

    def synced_top(self) -> int:
        top = self.intervals.top()
        if self.is_log:
            top = max(top, self.conn.sink.log_next(self.sid))
        return top

    def lag(self) -> int:
        return max(0, self.cursor - self.synced_top())

    def expecting(self) -> bool:
        """True while the peer owes an answer (a bounded request, or deliveries for a want)."""
        return self.req is not None and (self.req.to is not None or self.want_sent)

    def next(self):
        if self.stopped or self.req is not None or self.conn.dead:
            return
        start = 1
        if self.is_log:
            start = self.conn.sink.log_next(self.sid) + 1
        first, last = self.intervals.next_gap(start)
        if first <= self.cursor:
            to = self.cursor if last is None else min(last, self.cursor)
        else:
            to = None  # at the head: the server parks the request until data arrives
        size = LOG_BATCH if self.is_log else CHUNK_BATCH
        self.req = GetRange(self.conn.new_ruid(), self.stream, first, to, size, self.conn.svc.roundtrip)
        self.offered = None
        self.wanted = set()
        self.want_sent = False
        self.writes = []
        self.log_buffer = {}
        self.applied_top = 0
        self.conn.by_ruid[self.req.ruid] = self
        self.conn.send(self.req)

    def update_cursor(self, cursor):
        if not self.is_log and cursor < self.intervals.top():
            # The peer's chunk index went backwards: its store was reset; our intervals for it
            # describe another history (bee's epoch lesson).
            self.conn.log.warn("peer {peer}: {stream} cursor {c} below synced {t}; resetting intervals", peer=self.conn.svc.address, stream=str(self.stream), c=cursor, t=self.intervals.top())
            self.intervals = Intervals()
            d = self.conn.svc.save_intervals(self.stream, self.intervals)
            if d is not None:
                d.addErrback(self._write_failed)
        self.cursor = cursor
        self.next()

    def stop(self):
        self.stopped = True
        if self.retry is not None and self.retry.active():
            self.retry.cancel()

    def later(self):
        self._end_request()
        if self.stopped:
            return
        self.retry = self.conn.svc.clock.callLater(RETRY_DELAY, self.next)

    def _end_request(self):
        if self.req is not None:
            self.conn.by_ruid.pop(self.req.ruid, None)
        self.req = None

    # -- messages ---------------------------------------------------------------------------------

    def on_offer(self, msg: OfferedHashes):
        if self.offered is not None or not self.req.roundtrip:
            raise PeerMisbehaved("a second OfferedHashes for ruid %d" % msg.ruid)
        hashes = msg.hash_list()
        self.offered = hashes
        sink = self.conn.sink
        if self.is_log:
            flags = [not sink.knows_batch(self.sid, h) for h in hashes]
        else:
            held = sink.has_chunks(hashes)
            flags = [not h for h in held]
        seen = set()
        for i, h in enumerate(hashes):
            if flags[i] and h in seen:
                flags[i] = False
            seen.add(h)
        self.wanted = {h for h, f in zip(hashes, flags) if f}
        self.want_sent = True
        self.conn.send(WantedHashes(msg.ruid, codec.bitvector_encode(flags)))

    def on_delivery(self, msg: ChunkDelivery):
        roundtrip = self.req.roundtrip
        if roundtrip and not self.want_sent:
            raise PeerMisbehaved("ChunkDelivery before WantedHashes")
        chunks = msg.chunks
        if not chunks:
            return
        # the whole frame is checked before any of it is stored
        wanted = self.wanted
        sha256 = hashlib.sha256
        for addr, data in chunks:
            if roundtrip:
                if addr not in wanted:
                    raise PeerMisbehaved("unsolicited item %s" % addr.hex())
                wanted.discard(addr)
            if sha256(data).digest() != addr:
                raise PeerMisbehaved("item %s does not match its SHA-256" % addr.hex())
        if self.is_log:
            for addr, data in chunks:
                self._take_log(addr, data)
        else:
            addrs, datas = zip(*chunks)
            self.writes.append(self.conn.sink.put_chunks(addrs, datas))
        nbytes = sum(len(data) for _, data in chunks)
        self.items += len(chunks)
        self.bytes += nbytes
        self.conn.svc.count(len(chunks), nbytes)

    def _take_log(self, digest, data):
        from storage import record_batch

        try:
            header = record_batch.validate(data, check_records=False)
        except Exception as e:
            raise PeerMisbehaved("delivered LOG batch is not a record batch: %s" % e)
        base, count = header.base_offset, header.record_count
        if base + 1 < self.req.from_ or (self.req.to is not None and base + 1 > self.req.to):
            raise PeerMisbehaved("LOG batch at offset %d outside the requested range" % base)
        self.log_buffer[base] = (count, digest, data)
        self._flush_log()

    def _flush_log(self):
        sink = self.conn.sink
        while True:
            nxt = sink.log_next(self.sid)
            # drop buffered batches another peer already delivered
            for b in [b for b in self.log_buffer if b + self.log_buffer[b][0] <= nxt]:
                del self.log_buffer[b]
            item = self.log_buffer.pop(nxt, None)
            if item is None:
                return
            count, digest, data = item
            self.writes.append(sink.append(self.sid, nxt, count, digest, data, self.conn.svc.address))
            self.applied_top = max(self.applied_top, nxt + 1)

    def on_done(self, msg: BatchDone):
        req = self.req
        self._end_request()
        if msg.last < req.from_:
            # offer expired or unknown on the server: nothing covered; ask again shortly
            self.retry = self.conn.svc.clock.callLater(RETRY_DELAY, self.next)
            return
        if req.to is not None and msg.last > req.to:
            raise PeerMisbehaved("BatchDone.last %d beyond the requested %d" % (msg.last, req.to))
        last = msg.last
        if self.is_log:
            self._flush_log()
            if self.log_buffer or (self.wanted and req.roundtrip):
                # something is missing (vanished on the peer): cover only what was applied
                last = self.applied_top if self.applied_top >= req.from_ else 0
                if not self.applied_top and self.log_buffer:
                    # the peer's first batch starts past our replica's end (trimmed on its
                    # owner): a replica cannot start there. Park the stream until reconnect.
                    self.conn.log.warn(
                        "peer {peer}: {stream} continues at offset {base}, our copy ends at {end}; not syncing it",
                        peer=self.conn.svc.address, stream=str(self.stream), base=min(self.log_buffer), end=self.conn.sink.log_next(self.sid),
                    )
                    self.stopped = True
            self.log_buffer = {}
        self.wanted = set()
        if last >= req.from_:
            self.intervals.add(req.from_, last)
            snapshot = Intervals(self.intervals.to_list())
            writes = self.writes
            self.writes = []
            # CONTRACT §6: the interval is recorded only once what it covers is durable
            self.persist.addCallback(lambda _: defer.gatherResults(writes, consumeErrors=True))
            self.persist.addCallback(lambda _: None if self.failed else self.conn.svc.save_intervals(self.stream, snapshot))
            self.persist.addErrback(self._write_failed)
        self.conn.svc.publish()
        if last >= req.from_:
            self.next()
        else:
            self.retry = self.conn.svc.clock.callLater(RETRY_DELAY, self.next)

    def _write_failed(self, failure):
        # later snapshots include this batch's range: never save them
        self.failed = True
        self.conn.write_failed(failure)

    def on_state(self, msg: StreamState):
        req = self.req
        self._end_request()
        code = msg.code_
        if code == codec.STATE_NO_SUCH_STREAM:
            self.stopped = True  # the next StreamInfoRes brings it back if it reappears
            self.conn.streams.pop(self.stream, None)
        elif code == codec.STATE_INVALID_RANGE:
            self.conn.log.warn("peer {peer} says {stream} range {r} is invalid", peer=self.conn.svc.address, stream=str(self.stream), r=(req.from_, req.to) if req else None)
            self.stopped = True
            self.conn.streams.pop(self.stream, None)
        else:
            # 1 (bounded: the peer is stopping) or 4 (batch in progress): try again later
            self.later()


# ---------------------------------------------------------------------------------------------
# the connection


class SyncProtocol(Protocol):
    log = Logger()

    def __init__(self, svc):
        self.svc = svc
        self.sink = svc.sink
        self.reader = codec.FrameReader()
        self.streams = {}  # ID -> StreamSync
        self.by_ruid = {}
        self.ruid = 0
        self.awaiting_info = False
        self.dead = False
        self.last_rx = 0.0
        self.ticker = None
        self.paused = False

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        # fewer, bigger reads: one dataReceived per MiB of a delivery rather than per 64 KiB
        tcp_internals.set_read_size(self.transport, RECV_BYTES)
        self.last_rx = self.svc.clock.seconds()
        self.svc.connected(self)
        self.ticker = task.LoopingCall(self.tick)
        self.ticker.clock = self.svc.clock
        self.ticker.start(self.svc.info_interval, now=True)

    def connectionLost(self, reason=None):
        self.dead = True
        if self.ticker is not None and self.ticker.running:
            self.ticker.stop()
        for s in self.streams.values():
            s.stop()
        self.svc.disconnected(self)

    def new_ruid(self):
        self.ruid = (self.ruid + 1) & 0xFFFFFFFF or 1
        return self.ruid

    def send(self, msg):
        if not self.dead:
            self.transport.write(codec.encode(msg))

    def drop(self, why):
        if self.dead:
            return
        self.log.warn("dropping peer {peer}: {why}", peer=self.svc.address, why=why)
        self.svc.stats["last_error"] = why
        self.dead = True
        self.transport.abortConnection()

    def write_failed(self, failure):
        self.log.failure("peer {peer}: storing synced items failed", failure, peer=self.svc.address)
        self.drop("store write failed: %s" % failure.getErrorMessage())

    def tick(self):
        now = self.svc.clock.seconds()
        if self.paused:
            self.last_rx = now  # we stopped reading (the store is behind), not the peer
        expecting = self.awaiting_info or any(s.expecting() for s in self.streams.values())
        if expecting and now - self.last_rx > self.svc.timeout:
            self.drop("silent for %.1fs" % (now - self.last_rx))
            return
        if not self.awaiting_info:
            self.awaiting_info = True
            if not expecting:
                self.last_rx = max(self.last_rx, now)  # the silence clock starts with the question
            self.send(StreamInfoReq([codec.CHUNKS_ID, codec.ALL_LOGS_ID]))
        self.svc.publish()

    def dataReceived(self, data):
        self.last_rx = self.svc.clock.seconds()
        try:
            bodies = self.reader.feed(data)
            for body in bodies:
                if self.dead:
                    return
                self.handle(codec.decode_body(body))
        except (codec.CodecError, PeerMisbehaved) as e:
            self.drop(str(e))
        except Exception as e:
            self.log.failure("peer {peer}: handling a message", peer=self.svc.address)
            self.drop("internal error: %r" % e)
        if not self.dead and not self.paused and self.sink.over_limit():
            self.paused = True
            self.transport.pauseProducing()
            self.sink.when_drained(self._resume)

    def _resume(self):
        if self.paused and not self.dead:
            self.paused = False
            self.transport.resumeProducing()

    def handle(self, msg):
        if isinstance(msg, StreamInfoRes):
            self.awaiting_info = False
            for d in msg.streams:
                self.on_descriptor(d)
        elif isinstance(msg, (OfferedHashes, ChunkDelivery, BatchDone)):
            s = self.by_ruid.get(msg.ruid)
            if s is None:
                if isinstance(msg, BatchDone):
                    return  # a stale answer to a request we gave up on
                raise PeerMisbehaved("%s for unknown ruid %d" % (type(msg).__name__, msg.ruid))
            if isinstance(msg, OfferedHashes):
                s.on_offer(msg)
            elif isinstance(msg, ChunkDelivery):
                s.on_delivery(msg)
            else:
                s.on_done(msg)
        elif isinstance(msg, StreamState):
            s = self.streams.get(msg.stream)
            if s is not None:
                s.on_state(msg)
        else:
            raise PeerMisbehaved("client-side message %s sent by the server" % type(msg).__name__)

    def on_descriptor(self, d):
        stream = d.stream
        if stream.name == codec.LOG:
            sid = codec.log_stream_id(stream.key)
            if sid is None or not self.sink.replicable(sid):
                return
        elif stream != codec.CHUNKS_ID:
            return
        s = self.streams.get(stream)
        if s is None:
            s = self.streams[stream] = StreamSync(self, stream, d.cursor)
            s.next()
        else:
            s.update_cursor(d.cursor)


class SyncFactory(Factory):
    noisy = False  # ClientService reconnects often; its own retry log line is enough

    def __init__(self, svc):
        self.svc = svc

    def buildProtocol(self, addr):
        p = SyncProtocol(self.svc)
        p.factory = self
        return p


# ---------------------------------------------------------------------------------------------
# the service


class PeerSyncService(service.MultiService):
    """One ``--peer``: the connection (reconnecting with backoff), its stats and intervals."""

    log = Logger()

    def __init__(self, node, endpoint_string, clock=None, timeout=SILENCE_TIMEOUT, info_interval=INFO_INTERVAL, roundtrip=True, endpoint=None):
        super().__init__()
        self.node = node
        self.endpoint_string = endpoint_string
        self.address = endpoint_address(endpoint_string)
        self.clock = clock if clock is not None else node.reactor
        self.timeout = timeout
        self.info_interval = info_interval
        self.roundtrip = roundtrip
        self.conn = None
        self.stopping = False
        peers = node.metrics.setdefault("peers", {})
        self.stats = peers.setdefault(
            self.address,
            {"endpoint": endpoint_string, "connected": False, "connects": 0, "items": 0, "bytes": 0,
             "rate_items_s": 0.0, "rate_bytes_s": 0.0, "streams": {}, "last_error": None},
        )
        self._rate_mark = (self.clock.seconds(), 0, 0)
        if endpoint is None:
            endpoint = endpoints.clientFromString(node.reactor, endpoint_string)
        self.client = internet.ClientService(
            _RecordingEndpoint(endpoint, self.stats), SyncFactory(self), retryPolicy=internet.backoffPolicy(initialDelay=0.2, maxDelay=5.0), clock=self.clock
        )
        self.client.setServiceParent(self)

    @property
    def sink(self):
        return local_sink(self.node)

    # intervals (CONTRACT §6: per (peer, stream), in the node's metadata store)
    def _key(self, stream: ID) -> bytes:
        return ("%s|%s|%s" % (self.address, stream.name, stream.key)).encode()

    def load_intervals(self, stream: ID):
        key = self._key(stream)
        try:
            pairs = self.node.store.meta.read(lambda txn: txn.get(INTERVAL_TABLE, key))
        except Exception:
            self.log.failure("peer {peer}: reading synced intervals", peer=self.address)
            pairs = None
        return [tuple(p) for p in pairs or ()]

    def save_intervals(self, stream: ID, intervals: Intervals):
        if self.stopping:
            return None  # the store is closing; the roundtrip makes a lost record cheap
        key = self._key(stream)
        value = intervals.to_list()
        return self.node.store.meta.transact(lambda txn: txn.put(INTERVAL_TABLE, key, value))

    # stats
    def connected(self, conn):
        self.conn = conn
        self.stats["connected"] = True
        self.stats["connects"] += 1
        try:
            p = conn.transport.getPeer()
            self.stats["address"] = "%s:%d" % (p.host, p.port)
        except Exception:
            pass
        self.log.info("connected to peer {peer}", peer=self.address)

    def disconnected(self, conn):
        if self.conn is conn:
            self.conn = None
            self.stats["connected"] = False
        self.publish()

    def count(self, items, nbytes):
        self.stats["items"] += items
        self.stats["bytes"] += nbytes

    def startService(self):
        # the snapshot file describes this run from its start: a previous run's (say "connected",
        # with its item counts) must not be read as this one's
        write_snapshot(self.node, force=True)
        super().startService()

    def publish(self, force=False):
        """Refresh node.metrics["peers"][address] (streams, lag, rates) and the snapshot file."""
        now = self.clock.seconds()
        t0, i0, b0 = self._rate_mark
        if now - t0 >= 1.0:
            dt = now - t0
            self.stats["rate_items_s"] = round((self.stats["items"] - i0) / dt, 1)
            self.stats["rate_bytes_s"] = round((self.stats["bytes"] - b0) / dt, 1)
            self._rate_mark = (now, self.stats["items"], self.stats["bytes"])
        conn = self.conn
        if conn is not None:
            self.stats["streams"] = {
                str(s.stream): {"cursor": s.cursor, "synced": s.synced_top(), "lag": s.lag()}
                for s in conn.streams.values()
            }
        self.stats["lag"] = sum(v["lag"] for v in self.stats["streams"].values())
        write_snapshot(self.node, force=force)

    @defer.inlineCallbacks
    def stopService(self):
        # CONTRACT §6: intervals whose items are durable are still recorded on a clean stop, so
        # the restart resumes from them and refetches nothing. Their saves queue behind the
        # items' commits and can trail the data by seconds on a busy machine; wait for the ones
        # already queued (bounded: a stuck store must not hold the shutdown).
        conn = self.conn
        if conn is not None:
            queued = defer.DeferredList([_chain(s.persist) for s in conn.streams.values()], consumeErrors=True)
            queued.addTimeout(STOP_PERSIST_WAIT, self.clock)
            try:
                yield queued
            except defer.TimeoutError:
                self.log.warn("peer {peer}: synced intervals still being saved after {t}s; a restart may refetch", peer=self.address, t=STOP_PERSIST_WAIT)
        self.stopping = True
        yield super().stopService()
        self.stats["connected"] = False
        write_snapshot(self.node, force=True)


class _RecordingEndpoint:
    """Passes connects through, keeping the last connection failure in the peer's stats."""

    def __init__(self, endpoint, stats):
        self.endpoint = endpoint
        self.stats = stats

    def connect(self, factory):
        def failed(failure):
            self.stats["last_error"] = "connect: %s" % failure.getErrorMessage()
            return failure

        return self.endpoint.connect(factory).addErrback(failed)


_LAST_SNAPSHOT = weakref.WeakKeyDictionary()

SNAPSHOT_NAME = "swarm-peers.json"


def write_snapshot(node, force=False):
    """``<data dir>/swarm-peers.json``: node.metrics["peers"] for ``sbpctl peer`` (at most 1/s,
    unless ``force``: at start and stop)."""
    data_dir = getattr(node.config, "data_dir", None)
    if not data_dir:
        return
    clock = node.reactor
    now = clock.seconds()
    last = _LAST_SNAPSHOT.get(node)
    if not force and last is not None and now - last < 1.0:
        return
    _LAST_SNAPSHOT[node] = now
    path = os.path.join(data_dir, SNAPSHOT_NAME)
    try:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"node_id": node.node_id, "time": now, "peers": node.metrics.get("peers", {})}, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def build_peer_service(node, endpoint_string) -> service.IService:
    return PeerSyncService(node, endpoint_string)
