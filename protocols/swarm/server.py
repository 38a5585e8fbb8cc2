"""Swarm stream! server (the upstream peer): a provider over the store (CONTRACT §6).

Stateless except for what one connection has open: at most one batch per stream (a second
GetRange on it gets StreamState 4), and the offers waiting for WantedHashes, which expire. Every
GetRange is answered: OfferedHashes / ChunkDelivery frames / BatchDone, or a StreamState code.

Providers (CONTRACT §6):
- ``["CHUNKS", ""]``: every chunk of the chunk store; index = arrival order from 1; hash = address.
- ``["LOG", "<decimal stream id>"]``: the record batches of a stream this node holds; index = base
  offset + 1; hash = SHA-256 of the stored batch bytes.
"""

import hashlib
from collections import OrderedDict

from twisted.internet import defer, task
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from zope.interface import implementer

from protocols import tcp_internals
from protocols.swarm import codec
from protocols.swarm.codec import (
    ID,
    BatchDone,
    GetRange,
    OfferedHashes,
    StreamDescriptor,
    StreamInfoReq,
    StreamInfoRes,
    StreamState,
    WantedHashes,
)
from storage import errors

OFFER_TIMEOUT = 60.0  # seconds an offer waits for its WantedHashes before it is dropped
FRAME_BYTES = 4 * 1024 * 1024  # aim for ChunkDelivery frames about this big (a single item may exceed it)
FRAME_ITEMS = 256
FETCH_GROUP = 128  # store reads issued at once while delivering
FETCH_BYTES = 16 * 1024 * 1024
HASH_CACHE = 65536  # (stream, base offset) -> (length, sha256) of stored LOG batches
LOG_HASH_WINDOW = 8 * 1024 * 1024  # bytes read at once while hashing LOG batches for an offer


# store errors that mean "no such item (any more)": the peer is told so, nothing is logged
# GetRange refusals by name, the status label of sbpnode_responses_total (node/metrics.py)
_STATE_NAMES = {codec.STATE_BATCH_IN_PROGRESS: "batch_in_progress", codec.STATE_INVALID_RANGE: "invalid_range",
                codec.STATE_NO_SUCH_STREAM: "no_such_stream"}
MISSING = (errors.ChunkNotFound, errors.OffsetOutOfRange, errors.StreamNotFound, errors.RangeNotFound)


class Item:
    """One indexed item of a provider: its index, hash, and where to find its bytes."""

    __slots__ = ("index", "hash", "locator", "length")

    def __init__(self, index, hash, locator, length=None):
        self.index = index
        self.hash = hash
        self.locator = locator
        self.length = length


class ChunksSource:
    """CONTRACT §6 CHUNKS provider: index = the chunk store's arrival sequence."""

    def __init__(self, store):
        self.store = store

    def head(self) -> int:
        return self.store.chunks.last_seq()

    def collect(self, from_, to, limit, need_hash):
        top = to if to is not None else max(self.head(), from_)
        if top < from_:
            return defer.succeed([])
        rows = self.store.chunks.by_seq(from_, top, limit)
        return defer.succeed([Item(seq, addr, addr) for seq, addr in rows])

    def wait(self, from_):
        return self.store.chunks.wait_for_seq(from_)

    @defer.inlineCallbacks
    def fetch(self, items):
        get_many = getattr(self.store.chunks, "get_many", None)
        if get_many is not None:
            # one read transaction and one thread hop for the group, where the store offers it
            # (None: gone since the offer; an exception: its pack entry failed its check)
            datas = yield get_many([item.locator for item in items])
            return [
                (item, None, LookupError("chunk vanished") if data is None else data)
                if data is None or isinstance(data, Exception) else (item, item.hash, data)
                for item, data in zip(items, datas)
            ]
        ds = [self.store.chunks.get(item.locator) for item in items]
        results = yield defer.DeferredList(ds, consumeErrors=True)
        out = []
        for item, (ok, value) in zip(items, results):
            if ok:
                out.append((item, item.hash, value))
            else:
                out.append((item, None, value.value))
        return out


class LogSource:
    """CONTRACT §6 LOG provider over one stream: index = base offset + 1."""

    def __init__(self, store, stream_id, hash_cache):
        self.store = store
        self.sid = stream_id
        self.cache = hash_cache

    def head(self) -> int:
        return last_log_index(self.store, self.sid)

    def _rows(self, from_, to, limit):
        # batches() starts at the batch holding from_-1, which may begin before the range.
        rows = self.store.log.batches(self.sid, from_ - 1, limit + 1)
        out = []
        for base, count, length in rows:
            index = base + 1
            if index < from_:
                continue
            if to is not None and index > to:
                break
            out.append(Item(index, None, base, length))
            if len(out) >= limit:
                break
        return out

    @defer.inlineCallbacks
    def collect(self, from_, to, limit, need_hash):
        items = self._rows(from_, to, limit)
        if need_hash and items:
            yield self._hash(items)
        return items

    @defer.inlineCallbacks
    def _hash(self, items):
        todo = []
        for item in items:
            hit = self.cache.get((self.sid, item.locator))
            if hit is not None and hit[0] == item.length:
                item.hash = hit[1]
                self.cache.move_to_end((self.sid, item.locator))
            else:
                todo.append(item)
        # read runs of uncached batches in windows of about LOG_HASH_WINDOW bytes
        i = 0
        while i < len(todo):
            first = todo[i]
            budget = 0
            j = i
            while j < len(todo) and (j == i or budget + (todo[j].length or 0) <= LOG_HASH_WINDOW):
                budget += todo[j].length or 1
                j += 1
            batches = yield self.store.log.read(self.sid, first.locator, max(budget, 1))
            by_base = {}
            for b in batches:
                by_base[int.from_bytes(b[1:9], "big", signed=True)] = b
            for item in todo[i:j]:
                data = by_base.get(item.locator)
                if data is None:  # not contiguous with the first: read it alone
                    got = yield self.store.log.read(self.sid, item.locator, 1)
                    data = got[0] if got else None
                if data is None:
                    raise LookupError("batch at %d vanished" % item.locator)
                item.hash = hashlib.sha256(data).digest()
                self._remember(item.locator, len(data), item.hash)
            i = j

    def _remember(self, base, length, digest):
        self.cache[(self.sid, base)] = (length, digest)
        if len(self.cache) > HASH_CACHE:
            self.cache.popitem(last=False)

    @defer.inlineCallbacks
    def wait(self, from_):
        meta = self.store.log.stream(self.sid)
        yield self.store.log.wait_for_data(self.sid, max(from_ - 1, meta.next_offset))

    @defer.inlineCallbacks
    def fetch(self, items):
        # one store read for the group from its first batch (its batches usually follow each
        # other); whatever that read did not return is read alone
        budget = sum(item.length or 1 for item in items)
        try:
            got = yield self.store.log.read(self.sid, items[0].locator, max(budget, 1))
        except Exception:
            got = []
        by_base = {int.from_bytes(b[1:9], "big", signed=True): b for b in got}
        out = []
        for item in items:
            data = by_base.get(item.locator)
            if data is None:
                try:
                    alone = yield self.store.log.read(self.sid, item.locator, 1)
                except Exception as e:
                    out.append((item, None, e))
                    continue
                data = alone[0] if alone else None
                if data is None or int.from_bytes(data[1:9], "big", signed=True) != item.locator:
                    out.append((item, None, LookupError("batch at %d vanished" % item.locator)))
                    continue
            digest = item.hash
            if digest is None or len(data) != item.length:
                # no offer (roundtrip off) or not the batch that was offered: hash what is sent
                digest = hashlib.sha256(data).digest()
                self._remember(item.locator, len(data), digest)
            out.append((item, digest, data))
        return out


def last_log_index(store, sid) -> int:
    """CONTRACT §6 cursor of a LOG stream: the highest existing index (last batch's base + 1)."""
    meta = store.log.stream(sid)
    if meta.next_offset <= meta.trim_offset or meta.next_offset <= 0:
        return 0
    rows = store.log.batches(sid, meta.next_offset - 1, 1)
    if rows and rows[-1][0] + rows[-1][1] >= meta.next_offset:
        return rows[-1][0] + 1
    # batches() starting strictly after from_offset: fall back to a short forward scan.
    rows = store.log.batches(sid, meta.trim_offset, 1 << 30)
    return rows[-1][0] + 1 if rows else 0


def _groups(items):
    """Items in fetch groups: at most FETCH_GROUP items or about FETCH_BYTES of known length."""
    group, size = [], 0
    for item in items:
        if group and (len(group) >= FETCH_GROUP or size + (item.length or 0) > FETCH_BYTES):
            yield group
            group, size = [], 0
        group.append(item)
        size += item.length or 0
    if group:
        yield group


def _drop_prefetch(batch):
    if batch.prefetch is not None:
        batch.prefetch[1].addErrback(lambda f: None)
        batch.prefetch = None


class Batch:
    """One open GetRange on a connection."""

    __slots__ = ("req", "source", "items", "last", "waiter", "expiry", "closed", "size", "prefetch")

    def __init__(self, req, source, size):
        self.req = req
        self.source = source
        self.size = size
        self.items = []
        self.last = 0
        self.waiter = None
        self.expiry = None
        self.closed = False
        self.prefetch = None  # (n, Deferred): the first n offered items, read while the offer travels


@implementer(IPushProducer)
class SwarmServerProtocol(Protocol):
    log = Logger()

    def __init__(self, factory):
        self.factory = factory
        self.reader = codec.FrameReader()
        self.open = {}  # ID -> Batch (CONTRACT §6: one batch per stream per connection)
        self.offers = {}  # ruid -> Batch waiting for WantedHashes
        self.paused = False
        self._resume = []
        self.dead = False

    # -- connection -----------------------------------------------------------------------------

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        self.transport.registerProducer(self, True)
        self.factory.connections.add(self)

    def connectionLost(self, reason=None):
        self.dead = True
        self.factory.connections.discard(self)
        for batch in list(self.open.values()):
            self._close(batch)
        self.offers.clear()
        self._wake()

    def dataReceived(self, data):
        try:
            bodies = self.reader.feed(data)
        except codec.FrameTooLarge as e:
            self.log.warn("swarm peer {peer}: {error}; closing", peer=self._peer(), error=str(e))
            self._count("invalid", "frame_too_large")
            self.transport.abortConnection()
            self.dead = True
            return
        for body in bodies:
            if self.dead:
                return
            try:
                msg = codec.decode_body(body)
            except codec.CodecError as e:
                self.log.warn("swarm peer {peer} sent a bad message ({error}); closing", peer=self._peer(), error=str(e))
                self._count("invalid", "bad_message")
                self.transport.loseConnection()
                self.dead = True
                return
            try:
                self._dispatch(msg)
            except Exception:
                self.log.failure("swarm server: handling {msg} from {peer}", msg=type(msg).__name__, peer=self._peer())
                self.transport.abortConnection()
                self.dead = True
                return

    def _peer(self):
        try:
            p = self.transport.getPeer()
            return "%s:%s" % (p.host, p.port)
        except Exception:
            return "?"

    def send(self, msg):
        if not self.dead:
            self.transport.write(codec.encode(msg))

    def send_delivery(self, ruid, last_index, chunks):
        # the frame's pieces go to the transport as they are: its buffer join is their one copy
        if not self.dead:
            self.transport.writeSequence(codec.chunk_delivery_parts(ruid, last_index, chunks))

    # -- IPushProducer (write backpressure for big deliveries) --------------------------------------

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False
        self._wake()

    def stopProducing(self):
        self.dead = True
        self._wake()

    def _wake(self):
        waiting, self._resume = self._resume, []
        for d in waiting:
            d.callback(None)

    def _writable(self):
        if not self.paused or self.dead:
            return defer.succeed(None)
        d = defer.Deferred()
        self._resume.append(d)
        return d

    # -- messages -------------------------------------------------------------------------------

    def _count(self, message, status):
        """One message received, by its type and how it was taken (sbpnode_responses_total)."""
        responses = self.factory.stats["responses"]
        key = message + " " + status
        responses[key] = responses.get(key, 0) + 1

    def _dispatch(self, msg):
        if isinstance(msg, StreamInfoReq):
            self._count("stream_info_req", "ok")
            self.send(StreamInfoRes(self.factory.describe(msg.streams)))
        elif isinstance(msg, GetRange):
            refused = self._get_range(msg)
            self._count("get_range", _STATE_NAMES[refused] if refused else "ok")
        elif isinstance(msg, WantedHashes):
            self._count("wanted_hashes", "ok")
            self._wanted(msg)
        elif isinstance(msg, StreamState):
            self._count("stream_state", "ok")
            # The client ends a stream at its discretion (spec: "the server does not terminate
            # streams"); nothing to undo beyond an open batch, which finishes on its own.
            self.log.info("swarm peer {peer}: stream {stream} state {code} {message}", peer=self._peer(), stream=str(msg.stream), code=msg.code_, message=msg.message)
        else:
            # Server->client messages sent to the server: a confused peer.
            self._count("invalid", "unexpected_message")
            self.log.warn("swarm peer {peer} sent {msg} to a server; closing", peer=self._peer(), msg=type(msg).__name__)
            self.transport.loseConnection()
            self.dead = True

    def _state(self, stream, code):
        self.send(StreamState(stream, code, codec.STATE_MESSAGES[code]))

    def _get_range(self, req: GetRange):
        """Opens the batch; a refusal is answered with its StreamState and its code returned."""
        stream = req.stream
        if stream in self.open or req.ruid in self.offers or any(b.req.ruid == req.ruid for b in self.open.values()):
            self._state(stream, codec.STATE_BATCH_IN_PROGRESS)
            return codec.STATE_BATCH_IN_PROGRESS
        if req.from_ < 1 or (req.to is not None and req.from_ > req.to):
            self._state(stream, codec.STATE_INVALID_RANGE)
            return codec.STATE_INVALID_RANGE
        source = self.factory.source(stream)
        if source is None:
            self._state(stream, codec.STATE_NO_SUCH_STREAM)
            return codec.STATE_NO_SUCH_STREAM
        size = max(1, min(req.batch_size, codec.MAX_BATCH_SIZE))
        batch = Batch(req, source, size)
        self.open[stream] = batch
        d = self._serve(batch)
        d.addErrback(self._failed, batch)

    def _close(self, batch):
        if batch.closed:
            return
        batch.closed = True
        if self.open.get(batch.req.stream) is batch:
            del self.open[batch.req.stream]
        if self.offers.get(batch.req.ruid) is batch:
            del self.offers[batch.req.ruid]
        if batch.expiry is not None and batch.expiry.active():
            batch.expiry.cancel()
        if batch.waiter is not None:
            w, batch.waiter = batch.waiter, None
            w.cancel()
        _drop_prefetch(batch)

    def _failed(self, failure, batch):
        if failure.check(defer.CancelledError) or batch.closed and self.dead:
            self._close(batch)
            return None
        if failure.check(errors.StreamNotFound):
            self._close(batch)
            self._state(batch.req.stream, codec.STATE_NO_SUCH_STREAM)
            return None
        self.log.failure("swarm server: serving {stream} to {peer}", failure, stream=str(batch.req.stream), peer=self._peer())
        self._close(batch)
        # CONTRACT §6: the server always answers; an internal failure ends the batch as bounded.
        self._state(batch.req.stream, codec.STATE_BOUNDED)
        return None

    @defer.inlineCallbacks
    def _serve(self, batch):
        req = batch.req
        while True:
            items = yield batch.source.collect(req.from_, req.to, batch.size, req.roundtrip)
            if batch.closed:
                return
            if items or req.to is not None:
                break
            # CONTRACT §6: an unbounded range waits, with no timeout, until an item exists.
            batch.waiter = batch.source.wait(req.from_)
            try:
                yield batch.waiter
                # one reactor turn, so items stored in the same burst share this batch
                batch.waiter = task.deferLater(self.factory.clock, 0, lambda: None)
                yield batch.waiter
            finally:
                batch.waiter = None
            if batch.closed:
                return
        # CONTRACT §6: BatchDone.last is the highest index the batch covered; a bounded range whose
        # items all fit covers up to `to` (an empty one gets BatchDone {last: to} at once).
        if req.to is not None and len(items) < batch.size:
            batch.last = req.to
        else:
            batch.last = items[-1].index
        batch.items = items
        if not items:
            self._finish(batch)
            return
        if req.roundtrip:
            self.offers[req.ruid] = batch
            batch.expiry = self.factory.clock.callLater(self.factory.offer_timeout, self._expire, batch)
            self.send(OfferedHashes(req.ruid, batch.last, b"".join(i.hash for i in items)))
            # Read the first group while the offer and its answer cross the wire: a peer that
            # is catching up wants all of it, and the first frame then leaves without a store hop.
            # One such read per connection at a time, so offers on many streams hold no more
            # than one group's bytes between them.
            if not any(b.prefetch is not None for b in self.offers.values()):
                first = next(_groups(items))
                batch.prefetch = (len(first), batch.source.fetch(first))
            return
        yield self._deliver(batch, items)

    def _expire(self, batch):
        batch.expiry = None
        if not batch.closed:
            self.log.info("swarm peer {peer}: offer {ruid} on {stream} expired without WantedHashes", peer=self._peer(), ruid=batch.req.ruid, stream=str(batch.req.stream))
            self._close(batch)

    def _wanted(self, msg: WantedHashes):
        batch = self.offers.pop(msg.ruid, None)
        if batch is None or batch.closed:
            # Unknown or expired offer: answer anyway (last 0: nothing covered, ask again).
            self.send(BatchDone(msg.ruid, 0))
            return
        if batch.expiry is not None and batch.expiry.active():
            batch.expiry.cancel()
        batch.expiry = None
        flags = codec.bitvector_decode(msg.bitvector, len(batch.items))
        wanted = [item for item, f in zip(batch.items, flags) if f]
        if not wanted:
            _drop_prefetch(batch)
            self._finish(batch)  # CONTRACT §6: an empty vector is answered by BatchDone at once
            return
        self._deliver(batch, wanted).addErrback(self._failed, batch)

    def _finish(self, batch):
        if batch.closed:
            return
        self._close(batch)
        self.factory.stats["batches"] += 1
        self.send(BatchDone(batch.req.ruid, batch.last))

    @defer.inlineCallbacks
    def _deliver(self, batch, items):
        """ChunkDelivery frames in index order (each under the frame limit), then BatchDone."""
        stats = self.factory.stats
        frame = []
        frame_bytes = 0
        frame_last = 0
        pending = None
        if batch.prefetch is not None:
            n, pending = batch.prefetch
            batch.prefetch = None
            top = batch.items[n - 1].index
            k = 0
            while k < len(items) and items[k].index <= top:
                k += 1
            if k:
                # the wanted items among the prefetched ones are a prefix of `items`
                head = set(items[:k])
                pending.addCallback(lambda fetched: [f for f in fetched if f[0] in head])
                groups = [items[:k]] + list(_groups(items[k:]))
            else:
                pending.addErrback(lambda f: None)
                pending = None
        if pending is None:
            groups = list(_groups(items))
            pending = batch.source.fetch(groups[0])
        # one group read ahead: the store reads the next group while this one is framed and sent
        for n in range(len(groups)):
            fetched = yield pending
            pending = batch.source.fetch(groups[n + 1]) if n + 1 < len(groups) else None
            if batch.closed or self.dead:
                if pending is not None:
                    pending.addErrback(lambda f: None)
                return
            for item, digest, data in fetched:
                if digest is None:
                    # Gone between offer and delivery (trim, retention, sweep) or unreadable: skip
                    # it; the client sees it missing at BatchDone.
                    if isinstance(data, MISSING) or isinstance(data, LookupError):
                        self.log.debug("swarm: item {index} of {stream} vanished", index=item.index, stream=str(batch.req.stream))
                    else:
                        self.log.warn("swarm: item {index} of {stream} unreadable: {error}", index=item.index, stream=str(batch.req.stream), error=repr(data))
                    continue
                size = len(data) + codec.HASH_SIZE + 16
                if frame and (frame_bytes + size > FRAME_BYTES or len(frame) >= FRAME_ITEMS):
                    self.send_delivery(batch.req.ruid, frame_last, frame)
                    frame, frame_bytes = [], 0
                frame.append((digest, data))
                frame_bytes += size
                frame_last = item.index
                stats["items"] += 1
                stats["bytes"] += len(data)
            if frame:
                # a frame per read group, so the peer verifies and stores while we read on
                self.send_delivery(batch.req.ruid, frame_last, frame)
                frame, frame_bytes = [], 0
            yield self._writable()
            if batch.closed or self.dead:
                if pending is not None:
                    pending.addErrback(lambda f: None)
                return
        self._finish(batch)

    # -- shutdown -------------------------------------------------------------------------------

    def shutdown(self):
        """Node stopping: parked unbounded requests are answered (StreamState 1)."""
        for batch in list(self.open.values()):
            if batch.waiter is not None:
                self._close(batch)
                self._state(batch.req.stream, codec.STATE_BOUNDED)


class SwarmServerFactory(Factory):
    log = Logger()
    noisy = False

    def __init__(self, store, clock=None, offer_timeout=OFFER_TIMEOUT, stats=None):
        if clock is None:
            from twisted.internet import reactor as clock
        self.store = store
        self.clock = clock
        self.offer_timeout = offer_timeout
        self.connections = set()
        self.hash_cache = OrderedDict()
        self.stats = stats if stats is not None else {}
        for k in ("batches", "items", "bytes"):
            self.stats.setdefault(k, 0)
        self.stats.setdefault("responses", {})  # "message status" -> count

    def buildProtocol(self, addr):
        p = SwarmServerProtocol(self)
        p.factory = self
        return p

    def source(self, stream: ID):
        """The provider for a stream ID, or None (CONTRACT §6: StreamState 2)."""
        if stream.name == codec.CHUNKS and stream.key == "":
            return ChunksSource(self.store)
        if stream.name == codec.LOG:
            sid = codec.log_stream_id(stream.key)
            if sid is None or not self._has_stream(sid):
                return None
            return LogSource(self.store, sid, self.hash_cache)
        return None

    def _has_stream(self, sid) -> bool:
        try:
            self.store.log.stream(sid)
            return True
        except Exception:
            return False

    def describe(self, ids):
        """CONTRACT §6 StreamInfoRes: one descriptor per known ID; ["LOG", ""] expands to every
        stream held (owned or replicated); unknown IDs are left out; bounded = false."""
        out = []
        seen = set()

        def add(i, cursor):
            if i not in seen:
                seen.add(i)
                out.append(StreamDescriptor(i, cursor, False))

        for i in ids:
            if i.name == codec.CHUNKS and i.key == "":
                add(i, self.store.chunks.last_seq())
            elif i.name == codec.LOG and i.key == "":
                for meta in self.store.log.streams():
                    try:
                        add(codec.log_id(meta.stream_id), last_log_index(self.store, meta.stream_id))
                    except Exception:  # deleted meanwhile
                        continue
            elif i.name == codec.LOG:
                sid = codec.log_stream_id(i.key)
                if sid is not None and self._has_stream(sid):
                    try:
                        add(codec.log_id(sid), last_log_index(self.store, sid))
                    except Exception:
                        continue
        return out

    def shutdown(self):
        for conn in list(self.connections):
            conn.shutdown()


def response_labels(key):
    """(message type, status, ok) of a key of the server's ``responses`` counts (node/metrics.py)."""
    message, status = key.split(" ", 1)
    return message, status, status == "ok"


def build_factory(node) -> SwarmServerFactory:
    stats = node.metrics.setdefault("swarm_server", {})
    factory = SwarmServerFactory(node.store, clock=node.reactor, stats=stats)
    node.on_shutdown(factory.shutdown)
    return factory
