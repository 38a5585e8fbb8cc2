"""SBP APPEND (CONTRACT §3): check the frame's payload CRC and each batch, append to the store's log,
reply once the entries are durable.

One ``AppendHandler`` per connection. It reaches the connection only through its public surface
(``out``, ``lost``, ``begin``/``end`` of the in-flight budget, ``warn``, ``throttle_time_ms``).
"""

import time

from twisted.internet import defer

from protocols.sbp import codec
from protocols.sbp.codec import T
from protocols.sbp.status import status_for_error, status_for_failure
from storage import record_batch
from storage.crc import crc32, crc32_held

_BATCH_HEADER_SIZE = record_batch.HEADER_SIZE
# Results per reply frame: keeps a reply's header well inside the 64 KiB left beside the payload
# cap (a result with its status is under 128 bytes unless its message is long).
RESULTS_PER_FRAME = 256
_APPEND_OK = codec.APPEND << 16 | codec.OK  # a key of the server's responses counts


def _observed(result, observe, t0):
    """A Deferred callback: the APPEND's time since ``t0`` to the node's latency hook."""
    observe("sbp.append", time.perf_counter() - t0)
    return result


class AppendHandler:
    def __init__(self, conn):
        self.conn = conn
        self.log = conn.log
        self.metrics = conn.factory.metrics
        self.core = getattr(conn.store, "core", None)  # the store's commit core (None: a test double)

    def handle(self, frame):
        t0 = time.perf_counter()  # sbpnode_request_duration_seconds (node/metrics.py)
        conn = self.conn
        req = codec.request_of(frame, "AppendRequest")
        infos = req.append_requests
        batches = codec.split_payload(frame.payload, [i.batch_length for i in infos])
        if batches is None:
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
            self._send(frame, results)
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
            self._send(frame, results)
            conn.end(nbytes)

        all_done.addCallback(send)
        all_done.addErrback(lambda f: self.log.failure("APPEND reply failed", f))
        all_done.addBoth(_observed, conn.factory.observe_latency, t0)

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
        self._send(frame, [T.AppendResult(info.stream_id, info.request_index, 0, now_ms, st)])
        self.conn.end(nbytes)
        self.conn.factory.observe_latency("sbp.append", time.perf_counter() - t0)

    def _send(self, frame, results):
        conn = self.conn
        for r in results:
            conn.count_reply(codec.APPEND, r.status.code)
        if conn.lost:
            return
        if len(results) == 1 and results[0].status.code == codec.OK:
            r = results[0]
            conn.out.write(codec.append_ack_frame(frame.stream_id, conn.throttle_time_ms(), r.stream_id, r.request_index,
                                                  r.base_offset, r.stream_append_time_ms))
            return
        # a frame of many tiny entries could need a reply header over 16 MiB: split the results
        # over several frames (0x01 each, the last 0x03), as FETCH does
        chunks = [results[i:i + RESULTS_PER_FRAME] for i in range(0, len(results), RESULTS_PER_FRAME)] or [[]]
        for i, chunk in enumerate(chunks):
            flags = codec.RESPONSE_LAST if i == len(chunks) - 1 else codec.FLAG_RESPONSE
            header = codec.encode_table("AppendResponse", T.AppendResponse(conn.throttle_time_ms(), codec.status(), chunk))
            conn.out.write(codec.encode_frame(codec.APPEND, flags, frame.stream_id, header))
