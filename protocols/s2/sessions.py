"""S2 sessions (docs/protocols/s2.md): SSE and S2S read sessions that catch up and then follow the
tail with heartbeats, and S2S append sessions that answer one AppendAck per AppendInput, in order.
Both work on a responder (protocols/s2/http.py) and the request handlers in protocols/s2/api.py."""

import random
import time
from collections import deque

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from protocols.s2 import codec
from protocols.s2.codec import S2Error

HEARTBEAT_MIN, HEARTBEAT_MAX = 5.0, 15.0  # S2: a heartbeat every 5-15 s while idle (SDK gives up at 20 s)
READ_CHUNK_BYTES = 1024 * 1024
SESSION_HIGH_WATER = 4 * 1024 * 1024  # read session: stop reading the store while this much waits to be sent
MAX_FRAME_RECORDS = 1000
SESSION_MAX_INFLIGHT_BYTES = 32 * 1024 * 1024  # append session: stop reading the socket above this


def now_ms() -> int:
    return int(time.time() * 1000)


class ReadSession:
    """An SSE or S2S read session: catch up, then follow the tail with heartbeats."""

    log = Logger()

    def __init__(self, api, responder, kind, sid, p, fmt, start, min_ts, wait, seen_count, seen_bytes):
        self.api = api
        self.responder = responder
        self.kind = kind
        self.sid = sid
        self.p = p
        self.fmt = fmt
        self.pos = start
        self.min_ts = min_ts
        self.wait = wait  # seconds idle at the tail before ending; None = forever
        self.count = p.count
        self.nbytes = p.bytes
        self.seen_count = seen_count
        self.seen_bytes = seen_bytes
        self.stopped = False
        self.draining = False
        self.waiting = None
        self.basin = None
        self.cipher = None  # protocols.s2.crypto.RecordCipher of an encrypted stream
        responder.on_close.append(self.stop)

    def stop(self, draining=False):
        """Client gone, or (draining) the node is shutting down: end the session."""
        self.stopped = True
        # (a connection closing after the node's shutdown began does not take the drain back)
        self.draining = self.draining or draining
        if self.waiting is not None and not self.waiting.called:
            self.waiting.callback(False)
        fn = self.responder.on_drain
        if fn is not None:
            self.responder.on_drain = None
            fn()

    def _drained(self):
        d = defer.Deferred()
        self.responder.when_drained(lambda: d.called or d.callback(None))
        return d

    async def run(self):
        api = self.api
        r = self.responder
        following = False
        idle_since = time.monotonic()
        try:
            while not self.stopped and not r.closed:
                if r.pending() >= SESSION_HIGH_WATER:
                    await self._drained()
                    continue
                meta = api.store.log.stream(self.sid)
                if self.count is not None and self.count <= 0 or self.nbytes is not None and self.nbytes <= 0:
                    break
                if self.pos < meta.next_offset:
                    got, self.pos, self.min_ts = await api.read_records(self.sid, self.pos, READ_CHUNK_BYTES, self.min_ts,
                                                                         self.cipher)
                    got, used, hit = api._limit_records(got, self.count, self.nbytes, self.p.until)
                    if got:
                        # A batch that reaches the tail carries it: the SDKs count a session
                        # as caught up only from such a batch (or a heartbeat).
                        tail = None
                        if got[-1][0] + 1 >= api.store.log.stream(self.sid).next_offset:
                            tail = await api._tail(api.store.log.stream(self.sid))
                            if got[-1][0] + 1 != tail[0]:
                                tail = None
                        self._emit(got, used, tail)
                        idle_since = time.monotonic()
                        following = False
                    if hit:
                        break
                    continue
                if self.wait is not None and self.wait <= 0:
                    break
                if not following:
                    following = True
                    await self._heartbeat(meta)
                    continue
                timeout = random.uniform(HEARTBEAT_MIN, HEARTBEAT_MAX)
                if self.wait is not None:
                    left = self.wait - (time.monotonic() - idle_since)
                    if left <= 0:
                        break
                    timeout = min(timeout, left)
                self.waiting = api._wait_data(self.sid, self.pos, timeout, r)
                if not await self.waiting:
                    if self.stopped or r.closed:
                        break
                    if self.wait is not None and time.monotonic() - idle_since >= self.wait:
                        break
                    await self._heartbeat(api.store.log.stream(self.sid))
        except Exception as e:
            if not r.closed:
                self._error(api.to_s2(Failure(e)))
            return
        if self.draining:
            self._error(S2Error(503, "server_draining", "the node is shutting down"))
        elif not r.closed:
            self._end()

    def _emit(self, records, used, tail=None):
        n = len(records)
        if self.count is not None:
            self.count -= n
        if used is None:
            used = sum(codec.metered_size(h, b) for _, _, h, b in records)
        self.api.counters.read(self.basin, n, used)
        if self.kind == "s2s":
            if self.nbytes is not None:
                self.nbytes -= used
            write = self.responder.write
            for i in range(0, n, MAX_FRAME_RECORDS):
                last = i + MAX_FRAME_RECORDS >= n
                write(codec.s2s_frame(codec.encode_read_batch_proto(records[i:i + MAX_FRAME_RECORDS],
                                                                    tail if last else None)))
            return
        for i in range(0, n, MAX_FRAME_RECORDS):
            part = records[i:i + MAX_FRAME_RECORDS]
            last = i + MAX_FRAME_RECORDS >= n
            size = sum(codec.metered_size(h, b) for _, _, h, b in part)
            if self.nbytes is not None:
                self.nbytes -= size
            self.seen_count += len(part)
            self.seen_bytes += size
            event_id = "%d,%d,%d" % (part[-1][0], self.seen_count, self.seen_bytes)
            self.responder.write(codec.sse_event("batch", codec.dumps(codec.read_batch_json(part, self.fmt, tail if last else None)), event_id))

    async def _heartbeat(self, meta):
        tail = await self.api._tail(meta)
        if self.kind == "s2s":
            self.responder.write(codec.s2s_frame(codec.encode_read_batch_proto((), tail)))
        else:
            self.responder.write(codec.sse_event("ping", codec.dumps({"timestamp": now_ms(), "tail": codec.position(tail)})))

    def _end(self):
        if self.kind == "sse":
            self.responder.write(codec.SSE_DONE)
        self.responder.finish()

    def _error(self, err):
        if self.kind == "s2s":
            self.responder.write(codec.s2s_terminal(err))
        else:
            self.responder.write(codec.sse_event("error", err.json_bytes()))
        self.responder.finish()


class AppendSession:
    """An S2S append session: AppendInput frames in, one AppendAck frame per input, in order."""

    log = Logger()

    def __init__(self, api, responder, sid, auth=None, cipher=None):
        self.api = api
        self.responder = responder
        self.sid = sid
        self.auth = auth
        self.cipher = cipher
        self.reader = codec.S2SReader()
        self.pending = deque()  # [Deferred result slot]
        self.failed = False
        self.ended = False
        self.inflight = 0
        self.paused = False
        responder.on_close.append(self._closed)

    def _closed(self):
        self.failed = True
        self.pending.clear()
        self._resume()

    def _resume(self):
        if self.paused:
            self.paused = False
            self.responder.resume_input()

    def data(self, data: bytes):
        if self.failed:
            return
        try:
            payloads = self.reader.inputs(data)
        except S2Error as e:
            self.fail(e)
            return
        self.take(payloads)

    def take(self, payloads):
        """AppendInput payloads, deframed (by ``data``, or by a forwarded session this node
        takes over once it became the stream's primary: protocols/s2/forward.py)."""
        if self.failed:
            return
        try:
            for payload in payloads:
                inp = codec.decode_append_input_proto(payload)
                slot = [False, None, len(payload)]
                self.inflight += len(payload)
                self.pending.append(slot)
                d = defer.ensureDeferred(self.api.append(self.sid, inp, self.auth, self.cipher))
                d.addBoth(self._done, slot)
                if self.failed:
                    return
        except S2Error as e:
            self.fail(e)
            return
        if self.inflight > SESSION_MAX_INFLIGHT_BYTES and not self.paused:
            # Backpressure: a client that does not wait for acks stops being read.
            self.paused = True
            self.responder.pause_input()

    def _done(self, result, slot):
        slot[0] = True
        slot[1] = result
        self.inflight -= slot[2]
        self._flush()
        if self.paused and self.inflight <= SESSION_MAX_INFLIGHT_BYTES // 2:
            self._resume()

    def _flush(self):
        out = []
        while self.pending and self.pending[0][0]:
            result = self.pending.popleft()[1]
            if hasattr(result, "value"):  # Failure
                if out:
                    self.responder.write(b"".join(out))
                self.fail(self.api.to_s2(result))
                return
            start, end, tail = result
            out.append(codec.s2s_frame(codec.encode_append_ack_proto(start, end, tail)))
        if out:
            self.responder.write(b"".join(out))
        if self.ended and not self.pending and not self.failed:
            self.responder.finish()

    def end(self):
        self.ended = True
        if not self.failed:
            if self.reader.buffered:
                self.fail(codec.bad("bad_frame", "request body ended inside an S2S frame"))
                return
            self._flush()

    def fail(self, err):
        if self.failed:
            return
        self.failed = True
        for slot in self.pending:
            if slot[0] and hasattr(slot[1], "value"):
                slot[1].trap(Exception)
        self.pending.clear()
        self._resume()
        self.responder.write(codec.s2s_terminal(err))
        self.responder.finish()
