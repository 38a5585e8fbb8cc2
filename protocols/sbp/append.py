"""SBP APPEND (CONTRACT §3): check the frame's payload CRC and each batch, append to the store's log,
reply once the entries are durable.

One ``AppendHandler`` per connection. It reaches the connection only through its public surface
(``out``, ``lost``, ``begin``/``end`` of the in-flight budget, ``warn``, ``throttle_time_ms``).
"""

import struct
import time

from twisted.internet import defer
from twisted.python.failure import Failure

from protocols.sbp import codec
from protocols.sbp.codec import T
from protocols.sbp.status import status_for_error, status_for_failure
from storage import record_batch
from storage.crc import crc32, crc32_held

_BATCH_HEADER_SIZE = record_batch.HEADER_SIZE
_PREFIX, _PREFIX_SIZE = codec.PREFIX, codec.PREFIX_SIZE
_CRC = struct.Struct(">I")  # a frame's payload CRC, after the payload
# Results per reply frame: keeps a reply's header well inside the 64 KiB left beside the payload
# cap (a result with its status is under 128 bytes unless its message is long).
RESULTS_PER_FRAME = 256
_APPEND_OK = codec.APPEND << 16 | codec.OK  # a key of the server's responses counts


def _observed(result, observe, t0):
    """A Deferred callback: the APPEND's time since ``t0`` to the node's latency hook."""
    observe("sbp.append", time.perf_counter() - t0)
    return result


class AppendHandler:
    """APPENDs of one connection.

    A run (issue 24): the one-batch APPENDs of one socket read that pass their checks are not
    handed to the store one by one but kept (``_run``) until the read's frames are done (the server
    calls ``flush``), or until anything else must be answered first: then they go to the store
    as one operation (``RecordLog.append_many``: offsets assigned in frame order, one Deferred),
    and once durable their acks are rendered together and written at once. Each APPEND keeps its
    own reply and status: one the store refuses is answered at the flush (as ``log.append``'s
    failed Deferred answers it at once), one that fails a check is answered after the run before
    it has been flushed, so replies that leave at once leave in frame order, as before. In a
    cluster the run goes to the replicator (``Replicator.append_many``: sequenced, stored and
    replicated as one unit) and holds only APPENDs to one stream the router says this node serves
    now; any other frame flushes the run and takes the per-frame path (``ClusterRouter.route``),
    an APPEND to another such stream starts the next run."""

    def __init__(self, conn):
        self.conn = conn
        self.log = conn.log
        self.metrics = conn.factory.metrics
        self.core = getattr(conn.store, "core", None)  # the store's commit core (None: a test double)
        # runs go to the store's own log, or in a cluster to the replicator (``append_many``: the
        # run sequenced and replicated as one unit); there only APPENDs to streams the router
        # says this node serves now are taken into a run, the others take the per-frame path
        factory = conn.factory
        self._appender = getattr(factory, "appender", None)
        self._router = getattr(factory, "router", None)
        if self._router is None and self._appender is None:
            self.runs = self.core is not None
        else:
            self.runs = (self.core is not None and self._router is not None
                         and hasattr(self._appender, "append_many") and hasattr(self._router, "appends_here"))
        self._here_sid = None  # a stream the router said this node serves, during this run
        # the run being gathered: per APPEND (the frame's stream_id, the entry's stream_id and
        # request_index, the batch, its records-block CRC, record count, append time ms, t0), and
        # its payload bytes
        self._run = []
        self._run_bytes = 0

    def handle(self, frame):
        t0 = time.perf_counter()  # sbpnode_request_duration_seconds (node/metrics.py)
        conn = self.conn
        req = codec.request_of(frame, "AppendRequest")
        infos = req.append_requests
        batches = codec.split_payload(frame.payload, [i.batch_length for i in infos])
        if batches is None:
            self.flush()
            # CONTRACT §3: lengths that do not add up to the payload: system error INVALID_REQUEST
            conn.warn("APPEND batch lengths do not add up: {error}", "%d entries" % len(infos))
            conn.count_reply(codec.APPEND, codec.INVALID_REQUEST)
            conn.out.write(codec.system_error_frame(codec.APPEND, frame.stream_id, codec.INVALID_REQUEST,
                                                    "batch lengths do not add up to the payload"))
            return
        # CONTRACT §3: the frame's payload CRC, from each entry's header bytes and its records
        # block CRC (which validation needs anyway) combined: one pass over the payload, not two.
        block_crcs = []
        frame_crc = 0
        # While the store's writer is at work the reactor keeps the GIL through the CRC
        # (storage/crc.py: giving it up there meant waiting behind the writer); while the writer
        # waits for a group nobody takes the GIL meanwhile, and the one-call CRC costs half as
        # much (issue 24: 4-6 against 8-14 us per 64 KiB on this machine).
        core = self.core
        crc, combine = (crc32_held if core is None or core.writer_busy else crc32), codec.crc32_combine
        for batch in batches:
            n = len(batch)
            if n >= _BATCH_HEADER_SIZE:
                view = memoryview(batch)
                bcrc = crc(view[_BATCH_HEADER_SIZE:])
                frame_crc = combine(crc32(view[:_BATCH_HEADER_SIZE], frame_crc), bcrc, n - _BATCH_HEADER_SIZE)
            else:
                bcrc = None
                frame_crc = crc32(batch, frame_crc)
            block_crcs.append(bcrc)
        if frame.crc is not None and frame_crc != frame.crc:
            self.flush()
            conn.warn("bad frame: {error}", "APPEND payload crc 0x%08x != 0x%08x" % (frame.crc, frame_crc))
            conn.count_reply(codec.APPEND, codec.INVALID_REQUEST)
            conn.out.write(codec.system_error_frame(codec.APPEND, frame.stream_id, codec.INVALID_REQUEST,
                                                    "payload crc mismatch"))
            return
        nbytes = len(frame.payload)
        metrics = self.metrics
        max_batch = conn.factory.max_batch_bytes
        # CONTRACT §9: in a cluster the replicator sequences and replicates (node/cluster/replication.py)
        log = getattr(conn.factory, "appender", None) or conn.store.log
        now_ms = int(time.time() * 1000)
        if len(infos) == 1 and nbytes <= max_batch:
            # the common frame, one batch: no per-entry bookkeeping
            info = infos[0]
            try:
                count = record_batch.validate_count(frame.payload, block_crcs[0])
            except record_batch.InvalidBatch:
                pass  # answered by the general path below
            else:
                if self.runs:
                    self._queue(frame.stream_id, info.stream_id, info.request_index, frame.payload, block_crcs[0],
                                count, now_ms, t0)
                    return
                try:
                    d = log.append(info.stream_id, frame.payload, block_crc=block_crcs[0])
                except Exception as e:
                    d = defer.fail(e)
                metrics["appends"] += 1
                metrics["append_records"] += count
                metrics["append_bytes"] += nbytes
                conn.begin(nbytes)
                d.addCallbacks(self._appended_one, self._append_one_failed,
                               callbackArgs=(frame, info, now_ms, nbytes, t0), errbackArgs=(frame, info, now_ms, nbytes, t0))
                return
        self.flush()  # offsets in frame order; replies sent at once in frame order
        results = [None] * len(infos)
        pending = []
        for k, (info, batch) in enumerate(zip(infos, batches)):
            sid = info.stream_id
            if len(batch) > max_batch:
                results[k] = T.AppendResult(sid, info.request_index, 0, now_ms,
                                            codec.status(codec.PAYLOAD_TOO_LARGE, "batch of %d bytes > %d" % (len(batch), max_batch)))
                continue
            try:
                count = record_batch.validate_count(batch, block_crcs[k])
            except record_batch.InvalidBatch as e:
                results[k] = T.AppendResult(sid, info.request_index, 0, now_ms, codec.status(codec.CORRUPT_BATCH, str(e)))
                continue
            try:
                d = log.append(sid, batch, block_crc=block_crcs[k])
            except Exception as e:
                results[k] = T.AppendResult(sid, info.request_index, 0, now_ms, status_for_error(e))
                continue
            metrics["append_records"] += count
            metrics["append_bytes"] += len(batch)
            pending.append((k, d))
        metrics["appends"] += 1
        if not pending:
            self._send(frame.stream_id, results)
            return
        conn.begin(nbytes)

        def ok(base, k):
            info = infos[k]
            results[k] = T.AppendResult(info.stream_id, info.request_index, base, now_ms, codec.status())

        def err(f, k):
            info = infos[k]
            results[k] = T.AppendResult(info.stream_id, info.request_index, 0, now_ms, status_for_failure(f, self.log, "APPEND"))

        ds = []
        for k, d in pending:
            d.addCallbacks(ok, err, callbackArgs=(k,), errbackArgs=(k,))
            ds.append(d)
        # CONTRACT §3: the reply is sent once the entries are durable (each store Deferred fires
        # after the group commit that covers it).
        all_done = ds[0] if len(ds) == 1 else defer.DeferredList(ds)

        def send(_):
            self._send(frame.stream_id, results)
            conn.end(nbytes)

        all_done.addCallback(send)
        all_done.addErrback(lambda f: self.log.failure("APPEND reply failed", f))
        all_done.addBoth(_observed, conn.factory.observe_latency, t0)

    def take(self, buf, start, end):
        """The frame ``buf[start:end]`` (bytes, a whole frame as the framer gives it) queued in the
        run if it is an APPEND of one batch that passes every check ``handle`` makes (the frame's
        prefix, its header, the lengths, the payload CRC, the batch): True. False for anything
        else, with nothing done: the server then parses it and ``handle`` (or the error path)
        answers it as always. No Frame, no decoded header table: one run entry."""
        length, magic, opcode, flags, frame_sid, fmt_hlen = _PREFIX.unpack_from(buf, start)
        hlen = fmt_hlen & 0xFFFFFF
        if (magic != codec.MAGIC or opcode != codec.APPEND or flags & codec.FLAG_RESPONSE
                or fmt_hlen >> 24 != codec.HEADER_FORMAT_FLATBUFFERS or hlen > length - 16 or type(buf) is not bytes):
            return False
        t0 = time.perf_counter()  # sbpnode_request_duration_seconds (node/metrics.py)
        pstart = start + _PREFIX_SIZE + hlen
        pend = end - 4
        one = codec.append_one(buf[start + _PREFIX_SIZE:pstart])
        if one is None:
            return False
        sid, request_index, nbytes = one
        if nbytes != pend - pstart or nbytes < _BATCH_HEADER_SIZE or nbytes > self.conn.factory.max_batch_bytes:
            return False
        router = self._router
        if router is not None and (self.conn.cluster_gate is not None
                                   or (sid != self._here_sid and not router.appends_here(sid))):
            # cluster mode: another node's stream, one not known here yet, or frames waiting on
            # etcd before it: the per-frame path (ClusterRouter.route) answers it, after the run
            # before it has gone to the replicator (offsets in frame order)
            self.flush()
            return False
        core = self.core
        crc = crc32_held if core.writer_busy else crc32  # see handle
        payload = memoryview(buf)[pstart:pend]
        block_crc = crc(payload[_BATCH_HEADER_SIZE:])
        if codec.crc32_combine(crc32(payload[:_BATCH_HEADER_SIZE]), block_crc, nbytes - _BATCH_HEADER_SIZE) != \
                _CRC.unpack_from(buf, pend)[0]:
            return False
        try:
            count = record_batch.validate_count(payload, block_crc)
        except record_batch.InvalidBatch:
            return False
        self._queue(frame_sid, sid, request_index, payload, block_crc, count, int(time.time() * 1000), t0)
        self._here_sid = sid  # (after: a flush in _queue forgets it)
        return True

    def _queue(self, frame_sid, sid, request_index, payload, block_crc, count, now_ms, t0):
        if self._router is not None and self._run and self._run[-1][1] != sid:
            # cluster mode: one stream per run. A run is answered as one (its Deferred), and two
            # streams' APPENDs can end differently (one range sealed, the other acknowledged):
            # each APPEND keeps its own status
            self.flush()
        self._run.append((frame_sid, sid, request_index, payload, block_crc, count, now_ms, t0))
        self._run_bytes += len(payload)
        # as one begin() per APPEND would: past the in-flight budget, stop reading here
        if self.conn.over_budget(self._run_bytes):
            self.flush()

    def flush(self):
        """Hand the run gathered so far to the store (see the class)."""
        self._here_sid = None  # (routing is checked again in the next run)
        run = self._run
        if not run:
            return
        nbytes = self._run_bytes
        self._run = []
        self._run_bytes = 0
        conn = self.conn
        metrics = self.metrics
        appender = self._appender if self._appender is not None else conn.store.log
        try:
            d, outcome = appender.append_many([e[1] for e in run], [e[3] for e in run], [e[4] for e in run])
        except Exception as e:  # a bug: every APPEND of the run is answered with it
            d, outcome = None, [e] * len(run)
        metrics["appends"] += len(run)
        metrics["append_records"] += sum(e[5] for e in run)
        metrics["append_bytes"] += nbytes
        if d is not None and len(outcome) == len(run) and all(type(x) is int for x in outcome):
            acked = [entry + (x,) for entry, x in zip(run, outcome)]
        else:
            acked = []
            for entry, x in zip(run, outcome):
                if type(x) is int:
                    acked.append(entry + (x,))
                    continue
                # refused by the store at once: answered now, as log.append's failed Deferred is
                nbytes -= len(entry[3])
                frame_sid, sid, request_index, _, _, _, now_ms, t0 = entry
                st = status_for_failure(Failure(x), self.log, "APPEND")
                self._send(frame_sid, [T.AppendResult(sid, request_index, 0, now_ms, st)])
                conn.factory.observe_latency("sbp.append", time.perf_counter() - t0)
            if d is None:
                return
        conn.begin(nbytes)
        d.addCallbacks(self._run_appended, self._run_failed, callbackArgs=(acked, nbytes), errbackArgs=(acked, nbytes))

    def _run_appended(self, _, run, nbytes):
        conn = self.conn
        responses = conn.factory.responses
        responses[_APPEND_OK] = responses.get(_APPEND_OK, 0) + len(run)
        if not conn.lost:
            # each ack's throttle_time_ms as it would be with the acks before it answered (and
            # their bytes given back) one at a time
            left = conn.inflight_bytes
            acks = []
            for frame_sid, sid, request_index, payload, _, _, now_ms, _, base in run:
                acks.append((frame_sid, conn.throttle_time_ms(left), sid, request_index, base, now_ms))
                left -= len(payload)
            acks = codec.append_ack_frames(acks)
            if conn.sender is not None:
                # straight to the socket when nothing is queued before them (FileSender.send), not
                # at the reactor's next writability pass: the client sends the next window sooner
                conn.sender.send([acks])
            else:
                conn.out.write(acks)
        self._run_ended(run, nbytes)

    def _run_failed(self, failure, run, nbytes):
        st = status_for_failure(failure, self.log, "APPEND")
        for frame_sid, sid, request_index, _, _, _, now_ms, _, _ in run:
            self._send(frame_sid, [T.AppendResult(sid, request_index, 0, now_ms, st)])
        self._run_ended(run, nbytes)

    def _run_ended(self, run, nbytes):
        """A run answered: its bytes back to the in-flight budget, one latency observation per APPEND."""
        conn = self.conn
        conn.end(nbytes)
        observe = conn.factory.observe_latency
        t1 = time.perf_counter()
        for entry in run:
            observe("sbp.append", t1 - entry[7])

    def _appended_one(self, base, frame, info, now_ms, nbytes, t0):
        conn = self.conn
        responses = conn.factory.responses
        responses[_APPEND_OK] = responses.get(_APPEND_OK, 0) + 1
        if not conn.lost:
            conn.out.write(codec.append_ack_frame(frame.stream_id, conn.throttle_time_ms(), info.stream_id,
                                                  info.request_index, base, now_ms))
        conn.end(nbytes)
        conn.factory.observe_latency("sbp.append", time.perf_counter() - t0)

    def _append_one_failed(self, failure, frame, info, now_ms, nbytes, t0):
        st = status_for_failure(failure, self.log, "APPEND")
        self._send(frame.stream_id, [T.AppendResult(info.stream_id, info.request_index, 0, now_ms, st)])
        self.conn.end(nbytes)
        self.conn.factory.observe_latency("sbp.append", time.perf_counter() - t0)

    def _send(self, frame_sid, results):
        conn = self.conn
        for r in results:
            conn.count_reply(codec.APPEND, r.status.code)
        if conn.lost:
            return
        if len(results) == 1 and results[0].status.code == codec.OK:
            r = results[0]
            conn.out.write(codec.append_ack_frame(frame_sid, conn.throttle_time_ms(), r.stream_id, r.request_index,
                                                  r.base_offset, r.stream_append_time_ms))
            return
        # a frame of many tiny entries could need a reply header over 16 MiB: split the results
        # over several frames (0x01 each, the last 0x03), as FETCH does
        chunks = [results[i:i + RESULTS_PER_FRAME] for i in range(0, len(results), RESULTS_PER_FRAME)] or [[]]
        for i, chunk in enumerate(chunks):
            flags = codec.RESPONSE_LAST if i == len(chunks) - 1 else codec.FLAG_RESPONSE
            header = codec.encode_table("AppendResponse", T.AppendResponse(conn.throttle_time_ms(), codec.status(), chunk))
            conn.out.write(codec.encode_frame(codec.APPEND, flags, frame_sid, header))
