"""The record log: streams of record batches (CONTRACT §2-§3) in the shared WAL.

Offsets are assigned on the reactor thread at call time, so appends issued in one reactor turn get
consecutive offsets in call order; ``next_offset`` (what readers and ``stream()`` see) advances only
once the batch is durable, in log order.
"""

import functools
import os
import struct
from dataclasses import dataclass, field
from typing import List, Optional

import msgpack
from twisted.internet import defer
from twisted.logger import Logger

from storage import errors, index
from storage import wal as wal_module
from storage.commit import BATCH_BASE_COUNT, AppendBatch, AppendBatches, AppendRun, now_ms
from storage.index import INDEX_KEY, INDEX_VAL, U64
from storage.wal import T_BATCH

_MAX_OFFSET = (1 << 63) - 1
_DIRECT_READ = 16 << 10
CLEAN_BELOW = 0.25  # re-append a segment's live batches when they fill less than this share of it


@dataclass
class RangeMeta:
    range_index: int
    start_offset: int
    next_offset: int
    end_offset: int  # -1 while open
    replicas: list = field(default_factory=list)  # [(server_id, advertise_addr, is_primary)]


@dataclass
class StreamMeta:
    stream_id: int
    replica_nums: int
    retention_period_ms: int
    trim_offset: int
    next_offset: int
    ranges: List[RangeMeta]
    origin: Optional[str]
    attrs: dict
    created_ms: int


class StreamState:
    """Reactor-thread state of one stream."""

    __slots__ = ("sid", "replica_nums", "retention_period_ms", "trim_offset", "ranges", "origin",
                 "attrs", "created_ms", "next_offset", "assigned", "waiters", "durable", "cap", "trim_to",
                 "synced")

    def __init__(self, sid, replica_nums=1, retention_period_ms=0, origin=None, attrs=None, created_ms=0):
        self.sid = sid
        self.replica_nums = replica_nums
        self.retention_period_ms = retention_period_ms
        self.trim_offset = 0
        self.ranges = [[0, 0, -1, []]]  # [index, start, end (-1 open), replicas]
        self.origin = origin
        self.attrs = dict(attrs or {})
        self.created_ms = created_ms
        self.next_offset = 0  # durable and visible
        self.assigned = 0  # handed out to appends (>= next_offset)
        self.waiters = []  # [(offset, Deferred)]
        self.durable = 0  # end of the durable batches (== next_offset unless capped)
        self.cap = None  # cluster replication: readers see no further than this (the confirm offset)
        self.trim_to = 0  # cluster replica: the stream's trim point, reached as the copy grows to it
        # cluster replica: end of the replica runs whose WAL bytes are synced (announced by the
        # commit core before their LMDB commit); may run ahead of ``durable`` for a moment
        self.synced = 0

    def encode(self) -> bytes:
        return msgpack.packb(
            {"r": self.replica_nums, "ret": self.retention_period_ms, "trim": self.trim_offset,
             "ranges": self.ranges, "origin": self.origin, "attrs": self.attrs, "created": self.created_ms},
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, sid, raw):
        d = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=False)
        s = cls(sid, d["r"], d["ret"], d["origin"], d["attrs"], d["created"])
        s.trim_offset = d["trim"]
        s.ranges = [[r[0], r[1], r[2], [tuple(x) for x in r[3]]] for r in d["ranges"]]
        return s

    def range_meta(self, r) -> RangeMeta:
        nxt = self.next_offset if r[2] < 0 else r[2]
        return RangeMeta(r[0], r[1], nxt, r[2], [tuple(x) for x in r[3]])

    def meta(self) -> StreamMeta:
        return StreamMeta(self.sid, self.replica_nums, self.retention_period_ms, self.trim_offset,
                          self.next_offset, [self.range_meta(r) for r in self.ranges], self.origin,
                          dict(self.attrs), self.created_ms)



_COUNT = struct.Struct(">i")  # a record batch's record_count (bytes 9..12)


def _run_synced(s, end, fn):
    """A replica run's ``AppendRun.on_synced`` (reactor thread): its WAL bytes are synced."""
    if end > s.synced:
        s.synced = end
    fn()


def _replica_count(batch, base, assigned):
    """The record count of a replica batch to be stored at ``assigned``, the stream's next offset:
    at ``base`` (a cluster primary's sequenced batch), else at its own base offset (bytes 1..8).
    Raises InvalidRequest or ExpectationFailed as ``append_replica`` answers them."""
    if len(batch) < 29:
        raise errors.InvalidRequest("a record batch is at least 29 bytes")
    at, count = BATCH_BASE_COUNT.unpack_from(batch, 1)
    if base is not None:
        at = base
    if at != assigned:
        raise errors.ExpectationFailed("replica batch base %d != next offset %d" % (at, assigned))
    if count < 1:
        raise errors.InvalidRequest("record_count must be >= 1")
    return count


class RecordLog:
    log = Logger()

    def __init__(self, core, node_id=0):
        self._core = core
        self._node_id = node_id
        self._streams = {}  # reactor thread: stream id -> StreamState
        self._counter = 0
        self._uncleanable = set()  # segments the cleaner could not empty (a hole after a power cut)
        #: Set by whoever decides some streams' retention elsewhere (a cluster's placement driver):
        #: called on the reactor with (stream id, point) for each stream whose batches up to
        #: ``point`` outlived its retention period here; True means it takes that trim over (a
        #: replicated stream's primary hands it on to every replica as a trim; a replica waits for
        #: it), False that this store trims as usual.
        self.retention_handler = None

    def load(self):
        """At open, after recovery: the streams' state from the index (blocking)."""
        core = self._core
        with core.env.begin() as txn:
            raw = txn.get(index.STREAM_COUNTER, db=core.dbs[index.SYS])
            self._counter = U64.unpack(raw)[0] if raw else 0
            idx = txn.cursor(db=core.dbs[index.INDEX])
            for key, value in txn.cursor(db=core.dbs[index.STREAMS]):
                sid = U64.unpack(key)[0]
                s = StreamState.decode(sid, value)
                nxt = s.trim_offset
                # next_offset = the end of the stream's last indexed batch (not stored per append)
                found = idx.prev() if idx.set_range(INDEX_KEY.pack(sid, (1 << 64) - 1)) else idx.last()
                if found:
                    ksid, base = INDEX_KEY.unpack(idx.key())
                    if ksid == sid:
                        count = INDEX_VAL.unpack(idx.value())[2]
                        nxt = max(nxt, base + count)
                for r in s.ranges:
                    if r[2] >= 0:
                        nxt = max(nxt, r[2])
                s.next_offset = s.assigned = s.durable = nxt
                self._streams[sid] = s

    # -- streams --------------------------------------------------------------------------------

    def _get(self, sid) -> "StreamState":
        s = self._streams.get(sid)
        if s is None:
            raise errors.StreamNotFound("stream %d not found" % sid)
        return s

    def stream(self, sid):
        return self._get(sid).meta()

    def streams(self):
        return [s.meta() for s in self._streams.values()]

    def stream_count(self) -> int:
        return len(self._streams)

    def last_stream_number(self) -> int:
        """The n of the last stream id ``(node_id << 32) | n`` this store handed out (deleted
        streams included): cluster mode allocates above it (node/cluster/placement.py)."""
        return self._counter

    def offsets(self):
        """{stream id: (trim offset, next offset)} of every stream: a cheap snapshot (no
        StreamMeta per stream) for the node's metrics and status page, which sample it often."""
        return {sid: (s.trim_offset, s.next_offset) for sid, s in self._streams.items()}

    def _persist(self, s, extra=None, counter=None, nbytes=256):
        """Durably write the stream's metadata; fires with its StreamMeta."""
        sid = s.sid
        blob = s.encode()

        def fn(raw):
            raw.put(index.STREAMS, U64.pack(sid), blob)
            if counter is not None:
                raw.put(index.SYS, index.STREAM_COUNTER, U64.pack(counter))
            if extra is not None:
                extra(raw)

        d = self._core.transact(fn, nbytes)
        d.addCallback(lambda _: s.meta())
        return d

    def create_stream(self, replica_nums=1, retention_period_ms=0, attrs=None):
        try:
            self._core.check_writable()
            _check_attrs(attrs)
        except errors.StoreError:
            return defer.fail()
        self._counter += 1
        if self._counter >= 1 << 32:
            return defer.fail(errors.InvalidRequest("stream ids exhausted"))
        sid = (self._node_id << 32) | self._counter
        s = StreamState(sid, int(replica_nums), int(retention_period_ms), None, attrs, now_ms())
        self._streams[sid] = s
        return self._persist(s, counter=self._counter)

    def create_replica_stream(self, stream_id, origin, replica_nums, retention_period_ms, attrs=None):
        try:
            self._core.check_writable()
            _check_attrs(attrs)
        except errors.StoreError:
            return defer.fail()
        s = self._streams.get(stream_id)
        if s is not None:
            if s.origin is None:
                return defer.fail(errors.InvalidRequest("stream %d is owned by this node" % stream_id))
            s.origin = origin
            s.replica_nums = int(replica_nums)
            s.retention_period_ms = int(retention_period_ms)
            if attrs:
                s.attrs.update(attrs)
        else:
            s = StreamState(stream_id, int(replica_nums), int(retention_period_ms), origin, attrs, now_ms())
            self._streams[stream_id] = s
        return self._persist(s)

    def delete_stream(self, sid):
        try:
            self._core.check_writable()
            s = self._get(sid)
        except errors.StoreError:
            return defer.fail()
        del self._streams[sid]
        meta = s.meta()
        self._fire(s, everything=True)

        def fn(raw):
            raw.delete(index.STREAMS, U64.pack(sid))
            raw.delete_range(index.INDEX, INDEX_KEY.pack(sid, 0), INDEX_KEY.pack(sid, _MAX_OFFSET))

        return self._core.transact(fn).addCallback(lambda _: meta)

    def update_stream(self, sid, replica_nums=None, retention_period_ms=None, attrs=None):
        try:
            self._core.check_writable()
            s = self._get(sid)
            _check_attrs(attrs)
        except errors.StoreError:
            return defer.fail()
        if replica_nums is not None:
            s.replica_nums = int(replica_nums)
        if retention_period_ms is not None:
            s.retention_period_ms = int(retention_period_ms)
        if attrs:
            s.attrs.update(attrs)
        return self._persist(s)

    # -- appends --------------------------------------------------------------------------------

    def _accepted(self, sid, batch, queued=0, expect_offset=None):
        """An append's checks: (the stream's state, ``batch`` as bytes or a view of bytes, its
        record count), or a StoreError (no such stream, a read-only stream, the store full with
        ``queued`` bytes already taken, a short batch, ``expect_offset`` not the next offset, a
        record count below 1)."""
        if type(batch) is not bytes and not (type(batch) is memoryview and type(batch.obj) is bytes):
            batch = bytes(batch)  # the caller's buffer may change once we return (bytes cannot)
        s = self._get(sid)
        if s.origin is not None:
            raise errors.ReadOnlyStream(s.origin)
        self._core.check_writable(queued + len(batch))
        if len(batch) < 29:
            raise errors.InvalidRequest("a record batch is at least 29 bytes")
        if expect_offset is not None and expect_offset != s.assigned:
            raise errors.ExpectationFailed("next offset is %d, not %d" % (s.assigned, expect_offset))
        count = _COUNT.unpack_from(batch, 9)[0]
        if count < 1:
            raise errors.InvalidRequest("record_count must be >= 1")
        return s, batch, count

    def append(self, sid, batch, expect_offset=None, block_crc=None):
        """Assign the next offset now; fire with it once the batch is durable. ``block_crc``: the
        CRC-32 of the batch's records block, if the caller checked it (the WAL reuses it)."""
        try:
            s, batch, count = self._accepted(sid, batch, 0, expect_offset)
        except errors.StoreError:
            return defer.fail()
        base = s.assigned
        s.assigned = base + count
        return self._core.submit(AppendBatch(sid, batch, base, count, block_crc))

    def append_many(self, sids, batches, block_crcs):
        """``append`` of several batches (``sids[k]``, ``batches[k]``, ``block_crcs[k]``) at once, in
        order: each is checked and gets its stream's next offset exactly as ``append`` would give
        them one after another, and the accepted ones are queued as one commit-core operation
        (``AppendBatches``), durable (and acknowledged) together. Returns (a Deferred firing once
        they are durable, None if none was accepted; per batch its base offset, or the
        ``StoreError`` that refused it). Bytes and views of bytes are kept, not copied."""
        accepted = self._accepted
        outcome = []
        keep_sids, keep_batches, keep_bases, keep_counts, keep_crcs = [], [], [], [], []
        queued = 0
        for sid, batch, block_crc in zip(sids, batches, block_crcs):
            try:
                s, batch, count = accepted(sid, batch, queued)
            except errors.StoreError as e:
                outcome.append(e)
                continue
            base = s.assigned
            s.assigned = base + count
            queued += len(batch)
            outcome.append(base)
            keep_sids.append(sid)
            keep_batches.append(batch)
            keep_bases.append(base)
            keep_counts.append(count)
            keep_crcs.append(block_crc)
        if not keep_sids:
            return None, outcome
        return self._core.submit(AppendBatches(keep_sids, keep_batches, keep_bases, keep_counts, keep_crcs, queued)), outcome

    def append_replica(self, sid, batch, base=None, block_crc=None):
        """Swarm follower, cluster replica: store the batch as is; its base_offset must be the
        stream's next offset. With ``base`` (a cluster primary's sequenced batch): the batch is
        stored at ``base``, written into its bytes 1..8 on the way to the WAL. A batch that is bytes
        or a view of bytes (immutable) is not copied. ``block_crc`` as for ``append``."""
        core = self._core
        try:
            s = self._get(sid)
            core.check_writable(len(batch))
            at = s.assigned
            count = _replica_count(batch, base, at)
        except errors.StoreError:
            return defer.fail()
        s.assigned = at + count
        if type(batch) is not bytes and not (type(batch) is memoryview and type(batch.obj) is bytes):
            batch = bytes(batch)  # kept as it is only if it cannot change (bytes, or a view of bytes)
        return core.submit(AppendBatch(sid, batch, base, count, block_crc))

    def append_replica_run(self, sid, batches, block_crcs, on_synced=None):
        """``append_replica`` (without ``base``) of consecutive batches at once: the first must
        start at the stream's next offset and each at the end of the one before; all are stored
        or none (one commit-core operation, ``AppendRun``). Fires with the run's end offset.
        The batches must be bytes or views of bytes (kept, not copied). ``on_synced``: called
        (reactor thread, no arguments) as soon as the run's WAL bytes are synced, before its LMDB
        commit, if its group is synced before that commit (``--fsync always``); ``synced_end``
        covers the run from then on. Never called otherwise: the Deferred is the answer then."""
        core = self._core
        try:
            s = self._get(sid)
            at = start = s.assigned
            nbytes = 0
            for batch in batches:
                at += _replica_count(batch, None, at)
                nbytes += len(batch)
            core.check_writable(nbytes)
        except errors.StoreError:
            return defer.fail()
        s.assigned = at
        hook = None if on_synced is None else functools.partial(_run_synced, s, at, on_synced)
        return core.submit(AppendRun(sid, batches, block_crcs, start, at - start, nbytes, hook))

    def forget_unwritten(self):
        """The commit core's ``on_resume`` hook (reactor thread, nothing queued): the appends refused
        while the disk was full gave back their offsets, so each stream continues at its durable end."""
        for s in self._streams.values():
            s.assigned = s.durable

    def truncate_replica(self, sid, end):
        """Cluster failover (CONTRACT §9): cut the batches at and above ``end`` from this node's
        copy of ``sid``: a former primary's (or a lagging replica's) tail past the seal of the
        last range it held, which was never acknowledged. ``end`` must be where a stored batch
        starts (or the copy's end) and no batch may be in flight. Fires with the StreamMeta; the
        index deletion goes through the WAL like every transaction, so a crash cannot bring the
        tail back."""
        core = self._core
        try:
            core.check_writable()
            s = self._get(sid)
            end = int(end)
            if s.assigned != s.durable:
                raise errors.InvalidRequest("stream %d has batches in flight" % sid)
            if end >= s.assigned:
                return defer.succeed(s.meta())
            if end < s.trim_offset:
                raise errors.InvalidRequest("stream %d is trimmed at %d, above %d" % (sid, s.trim_offset, end))
            cur = self._locate(core.snapshot(), sid, end)
            if cur is not None and INDEX_KEY.unpack(cur.key())[1] != end:
                raise errors.InvalidRequest("offset %d of stream %d is inside a batch" % (end, sid))
        except errors.StoreError:
            return defer.fail()
        s.assigned = s.durable = end
        s.synced = min(s.synced, end)
        s.next_offset = min(s.next_offset, end)
        if s.cap is not None:
            s.cap = min(s.cap, end)

        def fn(raw):
            raw.delete_range(index.INDEX, INDEX_KEY.pack(sid, end), INDEX_KEY.pack(sid, _MAX_OFFSET))

        return core.transact(fn).addCallback(lambda _: s.meta())

    def start_replica_at(self, sid, offset):
        """Cluster re-replication: a new copy of a trimmed stream starts at ``offset`` (where the
        primary's copy begins; it has nothing below to send). What this copy held below is
        trimmed; no batch may be in flight. Fires with the StreamMeta."""
        try:
            self._core.check_writable()
            s = self._get(sid)
            if s.assigned != s.durable:
                raise errors.InvalidRequest("stream %d has batches in flight" % sid)
        except errors.StoreError:
            return defer.fail()
        offset = int(offset)
        if offset <= s.assigned:
            return defer.succeed(s.meta())
        s.assigned = s.durable = s.next_offset = offset
        if s.cap is not None:
            s.cap = max(s.cap, offset)
        d = self._trim(s, offset)
        self._fire(s)
        return d

    def advance(self, sid, base, count):
        """The commit core's ``on_batch_durable`` hook (reactor thread, in log order): the batch at
        ``base`` is durable and readable."""
        s = self._streams.get(sid)
        if s is None:
            return
        if base + count > s.durable:
            s.durable = base + count
        visible = s.durable if s.cap is None else min(s.durable, s.cap)
        if visible > s.next_offset:
            s.next_offset = visible
            if s.trim_to > s.trim_offset:
                self._trim_to(s)
            if s.waiters:
                self._fire(s)

    # -- the confirm offset (cluster replication, CONTRACT §9 Reads) -------------------------------

    def hold_at_confirm(self, sid):
        """From now on readers of ``sid`` see batches only up to the confirm offset given to
        ``confirm`` (what is durable now stays visible): a replicated stream shows nothing that
        a majority of its replicas does not hold yet."""
        s = self._get(sid)
        if s.cap is None:
            s.cap = s.next_offset

    def confirm(self, sid, offset):
        """The stream's confirm offset is at least ``offset``: readers see up to it (once durable
        here)."""
        s = self._streams.get(sid)
        if s is None or s.cap is None or offset <= s.cap:
            return
        s.cap = offset
        self.advance(sid, s.durable, 0)

    def visible_end(self, sid) -> int:
        """Where readers of ``sid`` see the stream end now (its StreamMeta's next_offset)."""
        return self._get(sid).next_offset

    def confirm_offset(self, sid):
        """The confirm offset given to ``confirm`` (None: the stream is not held at one)."""
        return self._get(sid).cap

    def durable_end(self, sid) -> int:
        """The end of the batches durable and indexed here: their WAL bytes durable under the
        store's ``--fsync`` and their LMDB commit done, so readable (above the visible
        next_offset while capped)."""
        return self._get(sid).durable

    def synced_end(self, sid) -> int:
        """What a cluster replica acknowledges (``K``): ``durable_end``, or further while replica
        runs (``append_replica_run(on_synced=...)``) have their WAL bytes synced but their LMDB
        commit is still under way (or failed: the store is then read-only). Every batch below it
        is in the synced WAL, which a restart replays into the index; reads see it only once it
        is below ``durable_end``."""
        s = self._get(sid)
        return s.synced if s.synced > s.durable else s.durable

    def assigned_end(self, sid) -> int:
        """Where the stream's next batch starts (batches handed to the store, durable or not)."""
        return self._get(sid).assigned

    def _fire(self, s, everything=False):
        keep = []
        for offset, d in s.waiters:
            if everything or s.next_offset > offset:
                d.callback(None)
            else:
                keep.append((offset, d))
        s.waiters = keep

    def wait_for_data(self, sid, offset):
        s = self._streams.get(sid)
        if s is None or s.next_offset > offset or self._core.closed:
            return defer.succeed(None)
        entry = [offset, None]

        def cancel(d):
            cur = self._streams.get(sid)
            if cur is not None:
                try:
                    cur.waiters.remove(tuple(entry))
                except ValueError:
                    pass

        d = defer.Deferred(cancel)
        entry[1] = d
        s.waiters.append(tuple(entry))
        return d

    def close_waiters(self):
        """The store closes: every parked reader wakes (and finds no more data)."""
        for s in self._streams.values():
            self._fire(s, everything=True)

    # -- reads ----------------------------------------------------------------------------------

    def _check_read(self, sid, offset):
        s = self._get(sid)
        if offset < s.trim_offset or offset > s.next_offset:
            raise errors.OffsetOutOfRange(
                "offset %d is outside [%d, %d]" % (offset, s.trim_offset, s.next_offset))
        return s

    def read(self, sid, offset, max_bytes):
        try:
            s = self._check_read(sid, offset)
        except errors.StoreError:
            return defer.fail()
        if offset == s.next_offset:
            return defer.succeed([])
        return self._core.in_pool(self._read_blocking, sid, offset, max_bytes, s.next_offset)

    def read_spans(self, sid, offset, max_bytes):
        """``read()`` for a caller that can send file ranges itself (``sendfile``): the same
        batches, but each batch of at least 16 KiB comes as a ``wal.FileSpan`` (where it lies in a
        WAL segment, its head checked in O(1) and its pages brought into the page cache) instead
        of bytes; smaller batches come as bytes, read and CRC-checked as by ``read()``. Only
        batches below the visible ``next_offset`` are named, as by ``read()``."""
        try:
            spans = self.read_spans_now(sid, offset, max_bytes)
        except errors.StoreError:
            return defer.fail()
        if spans is not None:
            return defer.succeed(spans)
        return self._core.in_pool(self._read_blocking, sid, offset, max_bytes, self._streams[sid].next_offset, True)

    def read_spans_now(self, sid, offset, max_bytes):
        """``read_spans`` answered on this thread when it can be without waiting for the disk:
        the list (FileSpans found in the page cache; empty at the stream's end), or None when the
        read pool must do it (``read_spans``). Raises StoreError for a stream or offset it would
        fail. No Deferred: the hot path of a sequential reader (protocols/sbp/fetch.py)."""
        s = self._check_read(sid, offset)
        if offset == s.next_offset:
            return []
        try:
            return self._cached_spans(sid, offset, max_bytes, s.next_offset)
        except Exception:
            return None  # the read pool does it again, and reports what fails

    def read_bounds(self, sid):
        """``(trim_offset, next_offset)`` of ``sid`` (what ``stream()`` says of them, without
        building its StreamMeta); StreamNotFound as ``stream()``."""
        s = self._get(sid)
        return s.trim_offset, s.next_offset

    def prefetch(self, sid, offset, nbytes):
        """Ask the kernel for the ``nbytes`` of the WAL from where the batch holding ``offset``
        lies (other streams' batches in between included), without waiting: the pieces with
        pages missing from the page cache (``Wal.uncached``, a few cachestat calls) are read in by
        the read pool (``Wal.will_need``). For a sequential reader, so its later ``read_spans``
        find the bytes in memory (and stay on the reactor thread) even after memory reclaim
        dropped them. Reactor thread: one index look-up; a no-op past the stream's visible end.
        Returns the number of pieces sent to the read pool."""
        s = self._streams.get(sid)
        if s is None or not s.trim_offset <= offset < s.next_offset:
            return 0
        core = self._core
        cur = self._locate(core.snapshot(), sid, offset)
        if cur is None:
            return 0
        wal = core.wal
        pieces = wal.uncached(INDEX_VAL.unpack(cur.value())[0], nbytes)
        if pieces and wal_module.cachestat is not None:
            # until their reads are done, cached reads of them go to the pool (Wal.fetch_in)
            pieces = wal.mark_fetching(pieces)
            if pieces:
                def failed(f, positions=[p for p, _ in pieces]):
                    wal.unmark_fetching(positions)
                    self.log.failure("WAL prefetch failed", f)

                core.in_pool(wal.fetch_in, pieces).addErrback(failed)
        elif pieces:
            core.in_pool(wal.will_need, pieces).addErrback(
                lambda f: self.log.failure("WAL prefetch failed", f))
        return len(pieces)

    def _cached_spans(self, sid, offset, max_bytes, limit):
        """Reactor thread, no waiting for the disk: the FileSpans of ``read_spans`` when every
        batch is big enough for one and its pages are in the page cache (``wal.cached_spans``), so
        a FETCH of recent or recently read data needs no thread hop; None otherwise."""
        core = self._core
        entries = self._entries(core.snapshot(), sid, offset, max_bytes, limit)
        if not entries or any(length < _DIRECT_READ for _, length, _, _ in entries):
            return None
        return core.wal.cached_spans(sid, entries, {})

    def _entries(self, txn, sid, offset, max_bytes, limit):
        """CONTRACT §3's FETCH rule over the index: ``(pos, length, base, count)`` of whole batches
        from the one holding ``offset``, the first always, then each next while the bytes taken
        are below ``max_bytes``, none at or past ``limit``; None if no stored batch holds
        ``offset``."""
        cur = self._locate(txn, sid, offset)
        if cur is None:
            return None
        entries = []
        total = 0
        unpack_key, unpack_val = INDEX_KEY.unpack, INDEX_VAL.unpack
        for key, value in cur:
            ksid, base = unpack_key(key)
            if ksid != sid or base >= limit:
                break
            pos, length, count, _ = unpack_val(value)
            entries.append((pos, length, base, count))
            total += length - 25
            if total >= max_bytes:
                break
        return entries

    def _locate(self, txn, sid, offset):
        """A cursor on the batch holding ``offset`` (or None)."""
        cur = txn.cursor(db=self._core.dbs[index.INDEX])
        key = INDEX_KEY.pack(sid, offset)
        if cur.set_range(key):
            if cur.key() == key:
                return cur
            if not cur.prev():
                return None
        elif not cur.last():
            return None
        ksid, base = INDEX_KEY.unpack(cur.key())
        if ksid != sid:
            return None
        if base + INDEX_VAL.unpack(cur.value())[2] <= offset:
            return None
        return cur

    def _read_blocking(self, sid, offset, max_bytes, limit, spans=False):
        """Read pool: whole batches from the one holding ``offset``: the first always, then each
        next while the total is below ``max_bytes``. With ``spans``, big batches as FileSpans."""
        core = self._core
        wal = core.wal
        with core.env.begin() as txn:
            entries = self._entries(txn, sid, offset, max_bytes, limit)
        if entries is None:
            raise errors.OffsetOutOfRange("offset %d of stream %d is not stored" % (offset, sid))
        if spans:
            # the whole range asked for at once: the head reads below then wait for the few
            # large reads in flight, not for one disk round trip per batch
            wal.will_need([(pos, length) for pos, length, _, _ in entries])
        out = []
        i = 0
        files = {}
        mapped = []
        while i < len(entries):
            if entries[i][1] >= _DIRECT_READ and spans:
                pos, length, base, count = entries[i]
                span = wal.batch_span(pos, length, sid, base, count, files)
                if span is None:  # the quick check failed: the full CRC check decides
                    out.append(wal.read_batch(pos, length))
                else:
                    out.append(span)
                    mapped.append(span)
                i += 1
                continue
            if entries[i][1] >= _DIRECT_READ:
                # big batch: read the 25-byte frame + prefix and the batch separately, so the batch
                # comes from the kernel straight into the bytes object we return (one copy)
                out.append(wal.read_batch(*entries[i][:2]))
                i += 1
                continue
            # small batches back to back in the WAL: one pread for the run
            j = i + 1
            end = entries[i][0] + entries[i][1]
            while j < len(entries) and entries[j][0] == end and entries[j][1] < _DIRECT_READ and end - entries[i][0] < (8 << 20):
                end += entries[j][1]
                j += 1
            data, seg_base = wal.read_span(entries[i][0], end - entries[i][0])
            if len(data) < end - entries[i][0] and j > i + 1:
                j = i + 1  # the run crossed a segment boundary: read this batch alone
                data, seg_base = wal.read_span(entries[i][0], entries[i][1])
            off = 0
            mv = memoryview(data)
            for pos, length, _, _ in entries[i:j]:
                view = wal.check(mv[off:off + length], seg_base, T_BATCH, pos)
                out.append(bytes(view[16:]))
                off += length
            i = j
        if mapped:
            wal.warm(mapped)
        return out

    def batches(self, sid, from_offset, limit):
        """[(base_offset, record_count, length)] from the batch holding ``from_offset``."""
        self._get(sid)
        out = []
        core = self._core
        txn = core.snapshot()
        cur = self._locate(txn, sid, max(from_offset, 0))
        if cur is None:
            cur = txn.cursor(db=core.dbs[index.INDEX])
            if not cur.set_range(INDEX_KEY.pack(sid, max(from_offset, 0))):
                return out
        for key, value in cur:
            ksid, base = INDEX_KEY.unpack(key)
            if ksid != sid or len(out) >= limit:
                break
            _, length, count, _ = INDEX_VAL.unpack(value)
            out.append((base, count, length - 25))
        return out

    # -- trim, ranges -----------------------------------------------------------------------------

    def trim(self, sid, offset):
        """CONTRACT §3: trim point = max(current, min(offset, next_offset)); ranges wholly below it
        are dropped; the first remaining range starts at the trim point."""
        try:
            self._core.check_writable()
            s = self._get(sid)
            if s.origin is not None:
                raise errors.ReadOnlyStream(s.origin)
        except errors.StoreError:
            return defer.fail()
        return self._trim(s, offset)

    def trim_replica(self, sid, offset):
        """A cluster replica follows its stream's trim point (the record in etcd; the primary
        trimmed with ``trim``). A copy that does not show ``offset`` yet (it lags the primary)
        trims what it shows now and the rest as it gets there (``advance``), so every replica
        ends at the primary's trim point, not at whatever it held when the record came."""
        try:
            self._core.check_writable()
            s = self._get(sid)
        except errors.StoreError:
            return defer.fail()
        s.trim_to = max(s.trim_to, int(offset))
        return self._trim(s, offset)

    def _trim_to(self, s):
        self._trim(s, s.trim_to).addErrback(
            lambda f: self.log.warn("stream {sid}: trim to {offset} failed: {e}", sid=s.sid, offset=s.trim_to, e=f.value))

    def _trim(self, s, offset):
        point = max(s.trim_offset, min(int(offset), s.next_offset))
        s.trim_offset = point
        keep = [r for r in s.ranges if not (r[2] >= 0 and r[2] <= point and r is not s.ranges[-1])]
        if keep:
            keep[0][1] = max(keep[0][1], point)
        s.ranges = keep
        sid = s.sid

        def drop(raw):
            # delete index entries of batches wholly below the trim point; the batch holding it
            # stays (a read at the trim point returns it whole)
            cur = raw.cursor(index.INDEX)
            bound = point
            if cur.set_range(INDEX_KEY.pack(sid, point)):
                if cur.key() != INDEX_KEY.pack(sid, point) and cur.prev():
                    ksid, base = INDEX_KEY.unpack(cur.key())
                    if ksid == sid and base + INDEX_VAL.unpack(cur.value())[2] > point:
                        bound = base
            elif cur.last():
                ksid, base = INDEX_KEY.unpack(cur.key())
                if ksid == sid and base + INDEX_VAL.unpack(cur.value())[2] > point:
                    bound = base
            raw.delete_range(index.INDEX, INDEX_KEY.pack(sid, 0), INDEX_KEY.pack(sid, bound))

        return self._persist(s, extra=drop)

    def seal_range(self, sid, range_index):
        try:
            self._core.check_writable()
            s = self._get(sid)
            if s.origin is not None:
                raise errors.ReadOnlyStream(s.origin)
            r = self._find_range(s, range_index)
            if r[2] >= 0:
                raise errors.RangeAlreadySealed("range %d of stream %d is sealed" % (range_index, sid))
        except errors.StoreError:
            return defer.fail()
        # seal at the assigned end: appends already issued belong to this range, and they are
        # durable before this change is (one ordered queue)
        r[2] = s.assigned
        new = [r[0] + 1, r[2], -1, list(r[3])]
        s.ranges.append(new)
        sealed = RangeMeta(r[0], r[1], r[2], r[2], [tuple(x) for x in r[3]])
        return self._persist(s).addCallback(lambda meta: (sealed, s.range_meta(new)))

    def create_range(self, sid):
        try:
            self._core.check_writable()
            s = self._get(sid)
            if s.origin is not None:
                raise errors.ReadOnlyStream(s.origin)
            if s.ranges and s.ranges[-1][2] < 0:
                raise errors.InvalidRequest("the last range of stream %d is still open" % sid)
        except errors.StoreError:
            return defer.fail()
        last = s.ranges[-1] if s.ranges else None
        new = [last[0] + 1 if last else 0, last[2] if last else s.assigned, -1, list(last[3]) if last else []]
        s.ranges.append(new)
        return self._persist(s).addCallback(lambda meta: s.range_meta(new))

    def set_range_replicas(self, sid, range_index, replicas):
        try:
            self._core.check_writable()
            s = self._get(sid)
            r = self._find_range(s, range_index)
        except errors.StoreError:
            return defer.fail()
        r[3] = [(int(a), b, bool(c)) for a, b, c in replicas]
        return self._persist(s)

    @staticmethod
    def _find_range(s, range_index):
        for r in s.ranges:
            if r[0] == range_index:
                return r
        raise errors.RangeNotFound("stream %d has no range %d" % (s.sid, range_index))

    # -- retention (reactor thread, every retention_check_s) --------------------------------------

    def retention_tick(self):
        """Trim what outlived its stream's retention period, then collect WAL segments."""
        core = self._core
        if core.closed or core.failed or core.full:
            return
        aged = [(s.sid, s.retention_period_ms, s.next_offset) for s in self._streams.values()
                if s.retention_period_ms > 0 and s.next_offset > s.trim_offset]
        if not aged and len(core.wal.bases) <= 1:
            return None
        d = core.in_pool(self._expired, aged, now_ms()) if aged else defer.succeed([])

        def trim_all(points):
            handler = self.retention_handler
            for sid, point in points:
                s = self._streams.get(sid)
                if s is None or point <= s.trim_offset:
                    continue
                if handler is not None and handler(sid, point):
                    continue
                self._trim(s, point)
            return core.transact(self._gc_segments)

        return d.addCallback(trim_all)

    def _expired(self, aged, now):
        """Read pool: per stream, the offset after its last batch older than the retention period."""
        core = self._core
        out = []
        with core.env.begin() as txn:
            cur = txn.cursor(db=core.dbs[index.INDEX])
            for sid, retention, nxt in aged:
                cutoff = now - retention
                point = None
                if not cur.set_range(INDEX_KEY.pack(sid, 0)):
                    continue
                for key, value in cur:
                    ksid, base = INDEX_KEY.unpack(key)
                    if ksid != sid:
                        break
                    _, _, count, append_ms = INDEX_VAL.unpack(value)
                    if append_ms > cutoff:
                        break
                    point = base + count
                if point is not None:
                    out.append((sid, min(point, nxt)))
        return out

    def gc_now(self):
        """Run one segment collection pass now (tests, sbpctl); fires with (deleted, relocated)."""
        return self._core.transact(self._gc_segments)

    def _gc_segments(self, raw):
        """Writer thread: delete every WAL segment whose live batch bytes (table ``seglive``) are 0,
        and clean at most one mostly-dead segment by re-appending its few live batches at the head
        (so one long-lived stream cannot pin old segments full of expired data)."""
        core = self._core
        wal = core.wal
        live = {}
        for key, value in raw.cursor(index.SEGLIVE):
            live[U64.unpack(key)[0]] = U64.unpack(value)[0]
        # never a segment recovery would still replay (past the checkpoint: the kv memtable's
        # unmerged writes live only there, storage/kv.py)
        replay_from = core.replay_from
        old = [b for b in wal.bases if b != wal.active and b + wal.segment_size(b) <= replay_from]
        victims = [b for b in old if live.get(b, 0) <= 0]
        relocated = 0
        candidates = [b for b in old if 0 < live.get(b, 0) <= wal.segment_bytes * CLEAN_BELOW
                      and b not in self._uncleanable]
        if candidates and len(old) >= 2:
            target = min(candidates, key=lambda b: live[b])
            relocated = self._relocate(raw, wal, target)
            left = live[target] + raw.live.delta.get(target, 0)
            if left == 0:
                victims.append(target)
            else:  # an entry the scan could not read is still indexed: keep the segment
                self._uncleanable.add(target)
                self.log.error("segment {base} still holds {left} live bytes after cleaning; kept",
                               base=target, left=left)
        for fd in wal.reap():
            os.close(fd)
        if victims:
            def delete():
                if relocated:
                    wal.sync()  # the moved batches are on disk before their old copies go
                for base in victims:
                    wal.delete(base)
                self.log.info("deleted {n} WAL segments, re-appended {moved} live batches",
                              n=len(victims), moved=relocated)

            raw.after_commit.append(delete)
        return len(victims), relocated

    def _relocate(self, raw, wal, base):
        """Re-append the batches of segment ``base`` the index still points at; the new T_BATCH
        entries replace their index entries (also on replay)."""
        moved = 0
        idx = raw.dbs[index.INDEX]
        for pos, etype, payload in wal.entries(base):
            if etype != T_BATCH:
                continue
            sid = U64.unpack_from(payload, 0)[0]
            boff = int.from_bytes(payload[17:25], "big", signed=True)
            key = INDEX_KEY.pack(sid, boff)
            cur = raw.txn.get(key, db=idx)
            if cur is None or INDEX_VAL.unpack(cur)[0] != pos:
                continue
            _, total, count, append_ms = INDEX_VAL.unpack(cur)
            new = wal.add(T_BATCH, (payload,))
            index.put_batch_index(raw.txn, raw.dbs, key, INDEX_VAL.pack(new, total, count, append_ms),
                                  raw.live, new, total, wal.active)
            moved += 1
        return moved


def _check_attrs(attrs):
    if attrs is not None and not isinstance(attrs, dict):
        raise errors.InvalidRequest("attrs must be a dict")
