"""SBP FETCH (CONTRACT §3): reads now or parked at a stream's tail, replies in frames as results
complete, and a read-ahead for sequential readers.

One ``FetchHandler`` per connection holds the FETCHes in progress (``FetchOp``) and the
connection's read-ahead. It reaches the connection only through its public surface (``out``,
``sender``, ``read_batches``, ``read_now``, ``lost``, ``closing``, ``begin``/``end`` of the in-flight budget,
``throttle_time_ms``, ``maybe_idle``).

Zero-copy: with a FileSender (plain TCP/UNIX connections) ``read_batches`` is ``log.read_spans``:
big batches come as FileSpans (where they lie in the WAL files) and go out with ``os.sendfile``;
the payload CRC is derived from the stored batches' own CRCs either way.
"""

import time
from collections import deque

from twisted.internet import defer

from protocols.sbp import codec
from protocols.sbp.append import RESULTS_PER_FRAME
from protocols.sbp.codec import T
from protocols.sbp.status import status_for_error, status_for_failure
from storage import errors, record_batch
from storage.crc import crc32_combine
from storage.wal import FileSpan

# A FETCH reply frame carries at most this much payload so header + payload stay within 16 MiB.
FRAME_PAYLOAD_CAP = codec.MAX_FRAME_LENGTH - 64 * 1024
# Largest FETCH result read ahead for a sequential reader (one per connection).
READ_AHEAD_MAX = 4 * 1024 * 1024
# A sequential reader's stream is kept this far ahead of it in the page cache (``log.prefetch``),
# in steps of PREFETCH_STEP WAL bytes: data written a while ago may have left the page cache
# (memory reclaim), and a read that finds it missing goes to the read pool and waits for the disk.
# 64 MiB: this machine's disk reads evicted data at ~500 MB/s while a pipelined reader takes
# ~900 MB/s from the page cache, so the prefetch must lead by about twice the longest evicted run
# (reclaim works in regions of ~15 MB on average here) to finish before the reader gets there.
PREFETCH_STEP = 4 * 1024 * 1024
PREFETCH_STEPS = 16


class FetchHandler:
    def __init__(self, conn):
        self.conn = conn
        self.ops = set()  # FetchOp in progress
        self.read_ahead = None
        # prefetch: the ends of this connection's latest single-stream replies (a sequential
        # reader asks where one ended), the stream prefetched for and the bytes replied since
        self.reply_ends = deque(maxlen=8)
        self.pf_sid = None
        self.pf_bytes = 0  # reply bytes since the last prefetch

    def handle(self, frame):
        conn = self.conn
        req = codec.request_of(frame, "FetchRequest")
        conn.factory.metrics["fetches"] += 1
        op = FetchOp(self, frame, req)
        if not req.fetch_requests:
            op.finish_empty()
            return
        self.ops.add(op)
        op.start()

    def op_done(self, op):
        self.ops.discard(op)
        self.conn.maybe_idle()

    def shutdown(self):
        """CONTRACT §1: parked FETCHes are answered with NO_NEW_RECORD."""
        for op in list(self.ops):
            op.shutdown()

    def cancel_all(self):
        """The connection is lost: drop every FETCH and the read-ahead."""
        for op in list(self.ops):
            op.cancel()
        self.ops.clear()
        self.read_ahead = None

    def prefetch(self, sid, start, end, nbytes):
        """After a single-stream reply of ``nbytes`` from offset ``start`` to ``end`` of ``sid``:
        for a sequential reader (``start`` is where one of this connection's recent replies ended)
        ask the store, once per PREFETCH_STEP bytes replied, to have the PREFETCH_STEPS steps of
        WAL from ``end`` in the page cache (``log.prefetch``: a few cachestat calls; the read pool
        reads what is missing). Random readers cause no extra reads."""
        sequential = (sid, start) in self.reply_ends
        self.reply_ends.append((sid, end))
        if not sequential:
            return
        if sid != self.pf_sid:
            self.pf_sid, self.pf_bytes = sid, PREFETCH_STEP
        self.pf_bytes += nbytes
        if self.pf_bytes >= PREFETCH_STEP:
            self.pf_bytes = 0
            factory = self.conn.factory
            steps = factory.prefetch_steps
            if steps:
                pieces = self.conn.store.log.prefetch(sid, end, steps * PREFETCH_STEP)
                metrics = factory.metrics
                metrics["prefetch_checks"] += 1
                metrics["prefetch_pieces"] += pieces

    def start_read_ahead(self, sid, offset, max_bytes):
        """After a single-stream FETCH ending at ``offset`` below the stream's tail (and once its
        reply is written), read the next ``max_bytes`` while the reply travels, so a sequential
        reader's next FETCH finds it ready: in the store's read pool, or at once from the page
        cache (``read_spans``) while the reader is still busy with this reply. One per connection
        (the latest), at most READ_AHEAD_MAX bytes."""
        conn = self.conn
        if max_bytes > READ_AHEAD_MAX or conn.lost or conn.closing:
            return
        try:
            trim, nxt = conn.store.log.read_bounds(sid)
        except errors.StoreError:
            return
        if offset >= nxt or offset < trim:
            return
        if conn.read_now is not None:
            # from the page cache at once, on this thread: no Deferred
            try:
                batches = conn.read_now(sid, offset, max_bytes)
            except errors.StoreError:
                batches = None
            if batches is not None:
                self.read_ahead = ReadAhead.ready(sid, offset, max_bytes, nxt, batches)
                return
        self.read_ahead = ReadAhead(self.read, sid, offset, max_bytes, nxt)

    def read(self, sid, offset, max_bytes):
        """``conn.read_batches``, counting the reads not answered at once (fetch_pool_reads: with
        a FileSender, those whose bytes were not all in the page cache)."""
        d = self.conn.read_batches(sid, offset, max_bytes)
        if not d.called:
            self.conn.factory.metrics["fetch_pool_reads"] += 1
        return d

    def read_now(self, sid, offset, max_bytes):
        """What ``read_ahead_or_read`` would deliver, when it can be had at once on this thread
        (the read-ahead, done and still valid, or ``conn.read_now``: the page cache): the batches;
        None when the caller must take the Deferred path. StoreError as the read would fail."""
        ra = self.read_ahead
        if ra is not None and ra.key == (sid, offset, max_bytes):
            if not ra.done:
                return None  # its read is in the pool: the Deferred path waits for it
            self.read_ahead = None
            if ra.failure is None and (ra.nbytes >= max_bytes or self.conn.store.log.read_bounds(sid)[1] == ra.next_at_read):
                self.conn.factory.metrics["read_ahead_hits"] += 1
                return ra.batches
        read_now = self.conn.read_now
        return None if read_now is None else read_now(sid, offset, max_bytes)

    def read_ahead_or_read(self, sid, offset, max_bytes):
        """``store.log.read(sid, offset, max_bytes)`` (``read_spans`` with a FileSender), served from
        the read-ahead when it matches.
        Stored batches never change, so a read-ahead result is what a read now would return,
        unless it stopped at the tail (under max_bytes) and the stream has grown since."""
        conn = self.conn
        read = self.read
        ra, self.read_ahead = self.read_ahead, None
        if ra is None or ra.key != (sid, offset, max_bytes):
            return read(sid, offset, max_bytes)
        out = defer.Deferred()

        def deliver(_):
            if out.called:  # cancelled (the connection went away)
                return
            try:
                grown = conn.store.log.read_bounds(sid)[1] != ra.next_at_read
            except errors.StoreError as exc:
                out.errback(exc)
                return
            if ra.failure is None and (ra.nbytes >= max_bytes or not grown):
                conn.factory.metrics["read_ahead_hits"] += 1
                out.callback(ra.batches)
            else:
                read(sid, offset, max_bytes).addBoth(lambda r: None if out.called else out.callback(r))

        ra.when_done(deliver)
        return out


class ReadAhead:
    __slots__ = ("key", "next_at_read", "batches", "nbytes", "failure", "done", "_waiters")

    def __init__(self, read, sid, offset, max_bytes, next_at_read):
        self.key = (sid, offset, max_bytes)
        self.next_at_read = next_at_read
        self.batches = None
        self.nbytes = 0
        self.failure = None
        self.done = False
        self._waiters = []
        try:
            d = read(sid, offset, max_bytes)
        except Exception as e:  # pragma: no cover (the store returns failed Deferreds)
            d = defer.fail(e)
        d.addCallbacks(self._got, self._failed)

    @classmethod
    def ready(cls, sid, offset, max_bytes, next_at_read, batches):
        """A read-ahead answered at once (from the page cache)."""
        ra = cls.__new__(cls)
        ra.key = (sid, offset, max_bytes)
        ra.next_at_read = next_at_read
        ra.batches = batches
        ra.nbytes = _nbytes(batches)
        ra.failure = None
        ra.done = True
        ra._waiters = []
        return ra

    def _got(self, batches):
        self.batches = batches
        self.nbytes = sum(len(b) for b in batches)
        self._finish()

    def _failed(self, f):
        self.failure = f
        self._finish()

    def _finish(self):
        self.done = True
        waiters, self._waiters = self._waiters, []
        for fn in waiters:
            fn(None)

    def when_done(self, fn):
        if self.done:
            fn(None)
        else:
            self._waiters.append(fn)


class _FetchEntry:
    __slots__ = ("info", "batches", "status", "nbytes", "wait", "done", "parked")

    def __init__(self, info):
        self.info = info
        self.parked = False
        self.batches = []
        self.status = None
        self.nbytes = 0
        self.wait = None  # the outstanding wait_for_data / read Deferred
        self.done = False


class FetchOp:
    """One FETCH frame: each FetchInfo is read now, or parked at the tail until data (at least
    max(min_bytes, 1) bytes) arrives or max_wait_ms passes. Ready results are flushed in frames with
    flags 0x01 as they complete; the last frame has 0x03 (CONTRACT §3)."""

    def __init__(self, fetcher, frame, req):
        self.fetcher = fetcher
        self.conn = fetcher.conn
        self.frame = frame
        self.req = req
        self.log = self.conn.store.log
        self.reactor = self.conn.reactor
        self.min_bytes = max(req.min_bytes, 1)
        self.entries = [_FetchEntry(info) for info in req.fetch_requests]
        self.remaining = len(self.entries)
        self.ready = []
        self.timer = None
        self.flush_call = None
        self.reserved = 0
        self.finished = False
        self.t0 = time.perf_counter()  # sbpnode_request_duration_seconds (node/metrics.py)

    def start(self):
        parked = False
        for e in self.entries:
            if not self._begin(e):
                parked = True
        if parked and not self.finished and self.timer is None:
            self.timer = self.reactor.callLater(max(self.req.max_wait_ms, 0) / 1000.0, self._timeout)
        self._flush()

    def _begin(self, e):
        """Start entry e; returns False if it is parked at the tail."""
        info = e.info
        try:
            trim, nxt = self.log.read_bounds(info.stream_id)
        except errors.StoreError as exc:
            return self._complete(e, status_for_error(exc))
        off = info.fetch_offset
        if off < trim or off > nxt:
            return self._complete(e, codec.status(codec.OFFSET_OUT_OF_RANGE, "offset %d outside [%d, %d]" % (off, trim, nxt)))
        if off < nxt:
            self._read(e)
            return True
        if self.req.max_wait_ms <= 0 or self.conn.closing:
            return self._complete(e, codec.status(codec.NO_NEW_RECORD, "no new record"))
        self._park(e, off)
        return False

    def _park(self, e, offset):
        d = self.log.wait_for_data(e.info.stream_id, offset)
        e.wait = d
        e.parked = True
        d.addCallbacks(self._woken, self._wait_failed, callbackArgs=(e,), errbackArgs=(e,))

    def _woken(self, _, e):
        e.wait = None
        e.parked = False
        if e.done or self.finished:
            return
        try:
            meta = self.log.stream(e.info.stream_id)
        except errors.StoreError as exc:
            self._complete(e, status_for_error(exc))
            self._flush()
            return
        off = e.info.fetch_offset
        if meta.next_offset <= off:  # woken by a close or delete without data
            self._complete(e, codec.status(codec.NO_NEW_RECORD, "no new record"))
            self._flush()
            return
        # CONTRACT §3: wait for at least max(min_bytes, 1) bytes
        if self.min_bytes > 1:
            avail = 0
            try:
                for _base, _count, length in self.log.batches(e.info.stream_id, off, 4096):
                    avail += length
                    if avail >= self.min_bytes:
                        break
            except errors.StoreError:
                avail = self.min_bytes
            if avail < self.min_bytes:
                self._park(e, meta.next_offset)
                return
        self._read(e)

    def _wait_failed(self, f, e):
        e.wait = None
        e.parked = False
        if f.check(defer.CancelledError) or e.done or self.finished:
            return
        self._complete(e, status_for_failure(f, self.conn.log, "FETCH wait"))
        self._flush()

    def _read(self, e):
        info = e.info
        conn = self.conn
        max_bytes = min(max(info.batch_max_bytes, 1), FRAME_PAYLOAD_CAP)
        self.reserved += max_bytes
        conn.begin(max_bytes)
        try:
            now = self.fetcher.read_now(info.stream_id, info.fetch_offset, max_bytes)
        except errors.StoreError:
            now = None  # the Deferred path reports it
        if now is not None:
            # answered at once (the read-ahead or the page cache): no Deferred on the hot path
            self._got_now(e, info, max_bytes, now)
            return
        d = self.fetcher.read_ahead_or_read(info.stream_id, info.fetch_offset, max_bytes)
        e.wait = d
        ahead = []

        def got(batches):
            e.wait = None
            # a batch is never split; keep under one frame's payload
            taken = []
            total = 0
            for b in batches:
                if taken and (total >= info.batch_max_bytes or total + len(b) > FRAME_PAYLOAD_CAP):
                    break
                taken.append(b)
                total += len(b)
            e.batches = taken
            e.nbytes = total
            self._complete(e, codec.status() if taken else codec.status(codec.NO_NEW_RECORD, "no new record"))
            if taken and len(self.entries) == 1:
                # a sequential reader will ask for what follows: read it ahead (once this reply
                # is written: from the page cache that is done at once, on this thread)
                last = record_batch.read_header(_head(taken[-1]))
                ahead.append(last.base_offset + last.record_count)
                self.fetcher.prefetch(info.stream_id, info.fetch_offset, ahead[0], total)

        def failed(f):
            e.wait = None
            if f.check(defer.CancelledError):
                return
            self._complete(e, status_for_failure(f, conn.log, "FETCH read"))

        def release(_):
            # write first: a full send buffer pauses reading before the budget is released
            self.reserved -= max_bytes
            self._flush()
            if ahead:
                self.fetcher.start_read_ahead(info.stream_id, ahead[0], max_bytes)
            conn.end(max_bytes)

        d.addCallbacks(got, failed)
        d.addBoth(release)

    def _got_now(self, e, info, max_bytes, batches):
        """``_read``'s got and release for batches had at once."""
        taken = []
        total = 0
        limit = info.batch_max_bytes
        for b in batches:
            n = b.length if type(b) is FileSpan else len(b)
            if taken and (total >= limit or total + n > FRAME_PAYLOAD_CAP):
                break
            taken.append(b)
            total += n
        e.batches = taken
        e.nbytes = total
        self._complete(e, codec.status() if taken else codec.status(codec.NO_NEW_RECORD, "no new record"))
        ahead = None
        if taken and len(self.entries) == 1:
            last = record_batch.read_header(_head(taken[-1]))
            ahead = last.base_offset + last.record_count
            self.fetcher.prefetch(info.stream_id, info.fetch_offset, ahead, total)
        self.reserved -= max_bytes
        self._flush()
        if ahead is not None:
            self.fetcher.start_read_ahead(info.stream_id, ahead, max_bytes)
        self.conn.end(max_bytes)

    def _complete(self, e, st):
        if e.done:
            return True
        e.done = True
        e.status = st
        self.conn.count_reply(codec.FETCH, st.code)
        self.remaining -= 1
        self.ready.append(e)
        return True

    def _timeout(self):
        self.timer = None
        # max_wait_ms passed: parked entries return what exists (status 0) or NO_NEW_RECORD
        for e in self.entries:
            if e.done or not e.parked:
                continue
            w, e.wait, e.parked = e.wait, None, False
            w.cancel()
            try:
                meta = self.log.stream(e.info.stream_id)
                has_data = meta.next_offset > e.info.fetch_offset
            except errors.StoreError as exc:
                self._complete(e, status_for_error(exc))
                continue
            if has_data:
                self._read(e)
            else:
                self._complete(e, codec.status(codec.NO_NEW_RECORD, "no new record"))
        self._flush()

    def shutdown(self):
        """CONTRACT §1: parked FETCHes are answered with NO_NEW_RECORD."""
        for e in self.entries:
            if not e.done and e.parked:
                w, e.wait, e.parked = e.wait, None, False
                w.cancel()
                self._complete(e, codec.status(codec.NO_NEW_RECORD, "server shutting down"))
        self._flush()

    def cancel(self):
        """Connection lost: drop everything."""
        self.finished = True
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None
        for e in self.entries:
            if e.wait is not None:
                w, e.wait = e.wait, None
                w.cancel()

    def finish_empty(self):
        self.conn.count_reply(codec.FETCH, codec.OK)
        self.conn.out.write(codec.encode_frame(
            codec.FETCH, codec.RESPONSE_LAST, self.frame.stream_id,
            codec.encode_table("FetchResponse", T.FetchResponse(self.conn.throttle_time_ms(), codec.status(), []))))

    def _flush(self):
        if self.finished or not self.ready:
            return
        conn = self.conn
        ready, self.ready = self.ready, []
        last = self.remaining == 0
        if last:
            self.finished = True
            if self.timer is not None and self.timer.active():
                self.timer.cancel()
            self.timer = None
        if conn.lost:
            self.fetcher.op_done(self)
            return
        # split so no frame exceeds 16 MiB; a result's batches stay together
        groups = []
        cur = []
        cur_bytes = 0
        for e in ready:
            if cur and (cur_bytes + e.nbytes > FRAME_PAYLOAD_CAP or len(cur) >= RESULTS_PER_FRAME):
                groups.append(cur)
                cur, cur_bytes = [], 0
            cur.append(e)
            cur_bytes += e.nbytes
        groups.append(cur)
        metrics = conn.factory.metrics
        for gi, group in enumerate(groups):
            flags = codec.RESPONSE_LAST if (last and gi == len(groups) - 1) else codec.FLAG_RESPONSE
            if len(group) == 1 and group[0].status.code == codec.OK:
                e = group[0]
                header = codec.encode_fetch_response_one(conn.throttle_time_ms(), e.info.stream_id, e.info.request_index, e.nbytes)
            else:
                results = [T.FetchResult(e.info.stream_id, e.info.request_index, e.nbytes, e.status) for e in group]
                header = codec.encode_table("FetchResponse", T.FetchResponse(conn.throttle_time_ms(), codec.status(), results))
            parts = [b for e in group for b in e.batches]
            metrics["fetch_bytes"] += sum(e.nbytes for e in group)
            # the payload CRC from the stored batches' own CRCs (the store checked each batch's
            # head, and bytes batches whole, when reading it): no pass over the payload here
            crc = 0
            spans = 0
            for b in parts:
                if type(b) is FileSpan:
                    if b.crc is not None:  # worked out by the store's head check
                        crc = crc32_combine(crc, b.crc, b.length)
                    else:
                        crc = codec.batch_crc_from_header(b.header, b.length, crc)
                    spans += b.length
                else:
                    try:
                        crc = codec.batches_crc(b, 0, len(b), crc)
                    except ValueError:
                        crc = codec.crc32(b, crc)
            frame_parts = codec.encode_frame_parts(codec.FETCH, flags, self.frame.stream_id, header, parts, payload_crc=crc,
                                                   payload_len=sum(e.nbytes for e in group))
            if spans:
                metrics["fetch_sendfile_bytes"] += spans
                conn.sender.send(frame_parts)
            else:
                conn.out.writeSequence(frame_parts)
            for e in group:
                e.batches = []
        if last:
            conn.factory.observe_latency("sbp.fetch", time.perf_counter() - self.t0)
            self.fetcher.op_done(self)


def _nbytes(batches):
    """The bytes of a read's batches (FileSpans and bytes)."""
    return sum([b.length if type(b) is FileSpan else len(b) for b in batches])


def _head(batch):
    """A batch's first bytes (its record batch header): bytes, or a FileSpan's copy of them."""
    return batch.header if type(batch) is FileSpan else batch
