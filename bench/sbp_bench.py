"""SBP benchmark, side by side with Redis Streams (issue 4; results in docs/benchmarks.md "SBP").

    python bench/sbp_bench.py [--always-records 200000] [--records 1000000] [--latency-seconds 10]

Starts one sbpnode (twistd, SBP listener only) per fsync policy and one Debian redis-server with
``appendonly yes`` on free loopback ports, in a temp dir. Each measurement runs one load-generating
process per side that sends pre-encoded requests over a raw socket (so the client costs little on
either side), one side at a time:

1. append 1 KiB records in 64-record batches, pipelined: ``--fsync always`` vs ``appendfsync always``
   and ``--fsync interval:1000`` vs ``appendfsync everysec`` (records/s and the ratio);
2. sequential read of the ``--records`` records appended in (1): FETCH (1 MiB per request: 16
   batches, 1024 records) vs ``XRANGE key (last + COUNT 1024``, one request at a time;
3. append latency p50/p99/p99.9 at a steady 20 MB/s (64 KiB batches paced open-loop), both fsync
   pairs.

``--metrics-ab N`` instead measures what the node's metrics cost (issue 22): N alternating pairs
of the append run, ``--fsync interval:1000``, one node started with ``--metrics on`` and one with
``--metrics off`` (the order flips every pair), with the node's CPU seconds per million records.
"""

import argparse
import multiprocessing
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protocols.sbp import codec  # noqa: E402
from protocols.sbp.client import BlockingSbpClient  # noqa: E402
from storage import record_batch  # noqa: E402
from storage.crc import crc32  # noqa: E402

RECORD_SIZE = 1024
BATCH_RECORDS = 64
FETCH_BYTES = 1 << 20
# Records per read request on both sides: a 1 MiB FETCH returns whole batches until it has 1 MiB,
# i.e. 16 batches of 64 (~66 KB each), so XRANGE asks for the same 1024.
XRANGE_COUNT = 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- servers ------------------------------------------------------------------------------------


class Node:
    def __init__(self, base, fsync, metrics="on"):
        from tests.nodeproc import NodeProcess

        opts = {name: "none" for name in ("kv", "meta", "chunks", "swarm", "http")}
        self.proc = NodeProcess(base, name="sbp-" + fsync.replace(":", "-"), fsync=fsync, log_level="warn",
                                metrics=metrics, **opts)

    def __enter__(self):
        self.proc.start()
        self.port = self.proc.ports["sbp"]
        # A node loads its compiled APPEND check on a thread after it starts (about 1 s; the first
        # time on a machine, a few seconds of compiling): measure the node as it then runs.
        c = BlockingSbpClient("127.0.0.1", self.port)
        deadline = time.monotonic() + 60
        while c.status().get("append_check") == "loading" and time.monotonic() < deadline:
            time.sleep(0.1)
        c.close()
        return self

    def __exit__(self, *exc):
        self.proc.terminate()


class Redis:
    def __init__(self, base, appendfsync):
        self.dir = os.path.join(base, "redis-" + appendfsync)
        os.makedirs(self.dir, exist_ok=True)
        self.port = free_port()
        self.appendfsync = appendfsync

    def __enter__(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "", "--daemonize", "no",
             "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- load generators (run in their own process) -------------------------------------------------


def record_value(i=0):
    return (b"%08d" % i + b"x" * RECORD_SIZE)[:RECORD_SIZE]


def sbp_append_frames(sid, n_distinct=16):
    """Pre-encoded APPEND frames, each one batch of 64 x 1 KiB records."""
    frames = []
    for k in range(n_distinct):
        b = record_batch.encode([(1700000000000 + i, [], record_value(k * BATCH_RECORDS + i)) for i in range(BATCH_RECORDS)])
        header = codec.encode_table("AppendRequest", codec.T.AppendRequest(0, [codec.T.AppendInfo(sid, 0, len(b))]))
        frames.append(codec.encode_frame(codec.APPEND, 0, k + 1, header, b))
    return frames


def _connect(port):
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def sbp_append_load(port, sid, batches, window, q):
    frames = sbp_append_frames(sid)
    s = _connect(port)
    fb = codec.FrameBuffer()
    sent = acked = errors = 0
    t0 = time.perf_counter()
    while acked < batches:
        if sent < batches and sent - acked < window:
            n = min(window - (sent - acked), batches - sent)
            s.sendall(b"".join(frames[(sent + j) % len(frames)] for j in range(n)))
            sent += n
        fb.feed(s.recv(1 << 20))
        while (f := fb.next()) is not None:
            acked += 1
            if f.flags != 0x03 or codec.decode_header(f).append_responses[0].status.code:
                errors += 1
    el = time.perf_counter() - t0
    s.close()
    q.put({"seconds": el, "records": batches * BATCH_RECORDS, "errors": errors})


def redis_cmd(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def redis_append_load(port, batches, window, q):
    """XADD of 64 records per pipelined group (the same records SBP appends as one batch)."""
    groups = [b"".join(redis_cmd(b"XADD", b"s", b"*", b"f", record_value(k * BATCH_RECORDS + i)) for i in range(BATCH_RECORDS)) for k in range(16)]
    s = _connect(port)
    sent = 0
    newlines = 0
    errors = 0
    need = 2 * BATCH_RECORDS  # "$15\r\n<id>\r\n" per reply
    t0 = time.perf_counter()
    total = batches * need
    while newlines < total:
        acked = newlines // need
        if sent < batches and sent - acked < window:
            n = min(window - (sent - acked), batches - sent)
            s.sendall(b"".join(groups[(sent + j) % len(groups)] for j in range(n)))
            sent += n
        data = s.recv(1 << 20)
        if data.startswith(b"-") or b"\n-" in data:
            errors += 1
        newlines += data.count(b"\n")
    el = time.perf_counter() - t0
    s.close()
    q.put({"seconds": el, "records": batches * BATCH_RECORDS, "errors": errors})


def _recv_exact_into(s, view):
    got = 0
    n = len(view)
    while got < n:
        k = s.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("closed")
        got += k


def sbp_read_load(port, sid, total, q):
    """Sequential FETCHes, one at a time. Each reply is received straight into one buffer (no
    re-buffering) and checked as it arrives, as the Redis reader counts its reply's marks as they
    arrive: every batch's records CRC is computed and checked once the batch is in, the frame CRC
    combined from them and checked at the end, and the batch headers walked for the next offset."""
    s = _connect(port)
    buf = bytearray(codec.MAX_FRAME_LENGTH + 4)
    view = memoryview(buf)
    offset = 0
    got = 0
    rid = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while got < total:
        rid += 1
        header = codec.encode_table("FetchRequest", codec.T.FetchRequest(0, 1, [codec.T.FetchInfo(sid, 0, offset, FETCH_BYTES)]))
        s.sendall(codec.encode_frame(codec.FETCH, 0, rid, header))
        n = 0
        end = None  # frame end (4 + frame_length), once the prefix is in
        pos = pend = None
        crc = 0
        records = 0
        while end is None or n < end:
            k = s.recv_into(view[n:] if end is None else view[n:end])
            if not k:
                raise ConnectionError("closed")
            n += k
            if end is None:
                if n < codec.PREFIX_SIZE:
                    continue
                length, _magic, _opcode, flags, _stream_id, fmt_hlen = codec.PREFIX.unpack_from(buf, 0)
                end = 4 + length
                pos = codec.PREFIX_SIZE + (fmt_hlen & 0xFFFFFF)
                pend = length  # the frame's CRC follows the payload
            # check every batch that is complete
            while pos + record_batch.HEADER_SIZE <= min(n, pend):
                h = record_batch.read_header(buf, pos)
                bend = pos + record_batch.HEADER_SIZE + h.records_len
                if bend > n:
                    break
                crc = codec.batches_crc(buf, pos, bend, crc, verify=True)  # ValueError if corrupt
                records += h.record_count
                offset = h.base_offset + h.record_count
                pos = bend
        if pend == codec.PREFIX_SIZE + (fmt_hlen & 0xFFFFFF):
            break  # empty reply
        (frame_crc,) = struct.unpack_from(">I", buf, pend)
        if flags != 0x03 or pos != pend or crc != frame_crc:
            raise AssertionError("bad FETCH reply")
        got += records
    el = time.perf_counter() - t0
    s.close()
    q.put({"seconds": el, "records": got, "requests": rid, "client_cpu": time.process_time() - c0})


_XR_MARK = b"*2\r\n$"  # twice per XRANGE entry: the entry array and its field-value array
_XR_VALUE_HEAD = b"*2\r\n$1\r\nf\r\n$%d\r\n" % RECORD_SIZE


def redis_read_load(port, total, q):
    """Sequential XRANGE ... COUNT 1024, one at a time. A reply is complete once it holds 2 x count
    entry marks and the last value's bytes (values never contain the marks); only the last entry
    is parsed, for the next start ID. bytes.count/rfind run in C, so the client stays cheap."""
    s = _connect(port)
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    last = b"-"
    got = 0
    requests = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while got < total:
        requests += 1
        start = last if last == b"-" else b"(" + last
        s.sendall(redis_cmd(b"XRANGE", b"s", start, b"+", b"COUNT", b"%d" % XRANGE_COUNT))
        n = 0
        count = None
        marks = 0
        while True:
            old = n
            k = s.recv_into(view[n:])
            if not k:
                raise ConnectionError("closed")
            n += k
            if count is None:
                i = buf.find(b"\r\n", 0, n)
                if i < 0:
                    continue
                count = int(buf[1:i])
                if count == 0:
                    break
            marks += buf.count(_XR_MARK, max(0, old - len(_XR_MARK) + 1), n)
            if marks >= 2 * count:
                v = buf.rfind(_XR_VALUE_HEAD, 0, n)
                if n >= v + len(_XR_VALUE_HEAD) + RECORD_SIZE + 2:
                    break
        if not count:
            break
        e = buf.rfind(_XR_MARK, 0, buf.rfind(_XR_VALUE_HEAD, 0, n))
        i = buf.find(b"\r\n", e + len(_XR_MARK))
        j = buf.find(b"\r\n", i + 2)
        got += count
        last = bytes(buf[i + 2:j])
    el = time.perf_counter() - t0
    s.close()
    q.put({"seconds": el, "records": got, "requests": requests, "client_cpu": time.process_time() - c0})


def sbp_latency_load(port, sid, rate_bps, seconds, q):
    frames = sbp_append_frames(sid, 4)
    interval = len(frames[0]) / rate_bps
    s = _connect(port)
    s.setblocking(False)
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ)
    fb = codec.FrameBuffer()
    sent_at = {}
    lat = []
    t0 = time.perf_counter()
    end = t0 + seconds
    next_send = t0
    k = 0
    while True:
        now = time.perf_counter()
        if now >= next_send and now < end:
            k += 1
            f = bytearray(frames[k % len(frames)])
            struct.pack_into(">I", f, 8, k)
            sent_at[k] = time.perf_counter()
            s.setblocking(True)
            s.sendall(bytes(f))
            s.setblocking(False)
            next_send += interval
            continue
        if now >= end and not sent_at:
            break
        timeout = max(0.0, min(next_send, end) - now) if now < end else 0.5
        for _key, _ in sel.select(timeout):
            try:
                data = s.recv(1 << 20)
            except BlockingIOError:
                continue
            fb.feed(data)
            while (fr := fb.next()) is not None:
                t = sent_at.pop(fr.stream_id, None)
                if t is not None:
                    lat.append(time.perf_counter() - t)
        if now > end + 10:
            break
    s.close()
    q.put({"latencies": lat, "sent": k, "seconds": seconds})


def redis_latency_load(port, rate_bps, seconds, q):
    group = b"".join(redis_cmd(b"XADD", b"lat", b"*", b"f", record_value(i)) for i in range(BATCH_RECORDS))
    interval = BATCH_RECORDS * RECORD_SIZE / rate_bps
    s = _connect(port)
    s.setblocking(False)
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ)
    pending = []  # send times of groups in order
    lat = []
    newlines = 0
    need = 2 * BATCH_RECORDS
    t0 = time.perf_counter()
    end = t0 + seconds
    next_send = t0
    k = 0
    while True:
        now = time.perf_counter()
        if now >= next_send and now < end:
            k += 1
            pending.append(time.perf_counter())
            s.setblocking(True)
            s.sendall(group)
            s.setblocking(False)
            next_send += interval
            continue
        if now >= end and not pending:
            break
        timeout = max(0.0, min(next_send, end) - now) if now < end else 0.5
        for _key, _ in sel.select(timeout):
            try:
                data = s.recv(1 << 20)
            except BlockingIOError:
                continue
            newlines += data.count(b"\n")
            while newlines >= need and pending:
                newlines -= need
                lat.append(time.perf_counter() - pending.pop(0))
        if now > end + 10:
            break
    s.close()
    q.put({"latencies": lat, "sent": k, "seconds": seconds})


# -- the pipelined method (issue 24) -----------------------------------------------------------
#
# Both sides pipeline: APPENDs / 64-XADD groups with PIPE_APPEND_WINDOW in flight, and reads with
# PIPE_READ_WINDOW requests in flight. A pipelined reader must know where each request starts
# before the previous reply is in: SBP offsets are record counts (request k starts at k x 1024),
# and the Redis side appends with explicit IDs ``1-<n>`` (n = record index + 1) so XRANGE k asks
# for ``1-(k x 1024 + 1)`` on. Every reply is still checked: SBP batches' CRCs, the frame CRC and
# the first batch's base offset; Redis replies' byte length, entry marks and first ID.

PIPE_APPEND_WINDOW = 16
PIPE_READ_WINDOW = 4


def _top_up(sock, request, sent, answered, total, window, sent_at, clock):
    """Send requests ``sent``.. (``request(i)`` -> its bytes, pre-encoded) until ``window`` are
    unanswered or all ``total`` are sent, stamping each one's send time in ``sent_at``; returns
    the new ``sent``. The pipelined loads of both sides share it."""
    if sent >= total or sent - answered >= window:
        return sent
    n = min(window - (sent - answered), total - sent)
    data = b"".join(request(sent + j) for j in range(n))
    sent_at[sent:sent + n] = [clock()] * n
    sock.sendall(data)
    return sent + n


def _pipe_latencies(sent_at, done_at):
    return [done_at[i] - sent_at[i] for i in range(len(done_at))]


def sbp_pipe_append_load(port, sid, batches, window, q):
    """``window`` APPEND frames in flight; the time of each from send to its ack."""
    frames = sbp_append_frames(sid)
    s = _connect(port)
    fb = codec.FrameBuffer()
    sent_at = [0.0] * batches
    done_at = []
    sent = acked = errors = 0
    clock = time.perf_counter
    t0 = clock()
    c0 = time.process_time()
    while acked < batches:
        sent = _top_up(s, lambda i: frames[i % len(frames)], sent, acked, batches, window, sent_at, clock)
        fb.feed(s.recv(1 << 20))
        now = clock()
        while (f := fb.next()) is not None:
            acked += 1
            done_at.append(now)
            if f.flags != 0x03 or codec.decode_header(f).append_responses[0].status.code:
                errors += 1
    el = clock() - t0
    s.close()
    q.put({"seconds": el, "records": batches * BATCH_RECORDS, "errors": errors, "requests": batches,
           "latencies": _pipe_latencies(sent_at, done_at), "client_cpu": time.process_time() - c0})


def redis_id(n):
    return b"1-%d" % n


def redis_pipe_groups(key, first_group, n):
    """``n`` pipelined groups of 64 XADDs with explicit IDs, from group ``first_group`` on."""
    out = []
    for k in range(first_group, first_group + n):
        base = k * BATCH_RECORDS
        out.append(b"".join(redis_cmd(b"XADD", key, redis_id(base + i + 1), b"f", record_value(base + i))
                            for i in range(BATCH_RECORDS)))
    return out


def redis_pipe_append_load(port, key, batches, window, q):
    """``window`` groups of 64 XADDs in flight (IDs ``1-1``, ``1-2``, ... so the pipelined reader
    knows where each XRANGE starts); the time of each group from send to its 64th reply. Every
    group is encoded before the clock starts, as SBP's frames are (~1.1 GB per 1M records in this
    process)."""
    groups = redis_pipe_groups(key, 0, batches)
    s = _connect(port)
    sent_at = [0.0] * batches
    done_at = []
    sent = newlines = errors = 0
    need = 2 * BATCH_RECORDS  # "$<n>\r\n<id>\r\n" per reply
    total = batches * need
    clock = time.perf_counter
    t0 = clock()
    c0 = time.process_time()
    while newlines < total:
        acked = newlines // need
        sent = _top_up(s, groups.__getitem__, sent, acked, batches, window, sent_at, clock)
        data = s.recv(1 << 20)
        now = clock()
        if data.startswith(b"-") or b"\n-" in data:
            errors += 1
        newlines += data.count(b"\n")
        while len(done_at) < newlines // need:
            done_at.append(now)
    el = clock() - t0
    s.close()
    q.put({"seconds": el, "records": batches * BATCH_RECORDS, "errors": errors, "requests": batches,
           "latencies": _pipe_latencies(sent_at, done_at), "client_cpu": time.process_time() - c0})


class _Inbox:
    """One receive buffer for a stream of pipelined replies: ``fill`` receives into it, ``drop``
    forgets what was consumed (the tail moves to the front when the room runs short)."""

    def __init__(self, sock, size=32 << 20):
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0  # first unconsumed byte
        self.n = 0  # bytes received

    def fill(self):
        if len(self.buf) - self.n < (2 << 20):
            tail = self.n - self.start
            self.buf[:tail] = self.buf[self.start:self.n]
            self.start, self.n = 0, tail
        k = self.sock.recv_into(self.view[self.n:])
        if not k:
            raise ConnectionError("closed")
        self.n += k
        return k


def sbp_pipe_read_load(port, sid, total, window, q):
    """FETCH (1 MiB) with ``window`` in flight; request k at offset k x 1024. Each reply is checked
    as it arrives: the frame CRC over its payload bytes (one pass, each received piece while it is
    fresh), and each batch header once it is in (magic, record_count >= 1, records_len >= 0, the
    batches exactly filling the payload, each batch's base offset following the previous one's
    records, the first one at the request's offset). The node derives a frame CRC from the stored
    batches' records CRCs (docs/protocols/sbp.md), so a records block that differs from its stored
    CRC fails the frame CRC: this is the check of every block against its CRC, in one pass."""
    s = _connect(port)
    inbox = _Inbox(s)
    buf = inbox.buf
    view = inbox.view
    per = XRANGE_COUNT  # records per 1 MiB reply (16 batches of 64)
    nreq = (total + per - 1) // per
    reqs = []
    for k in range(nreq):
        header = codec.encode_table("FetchRequest", codec.T.FetchRequest(0, 1, [codec.T.FetchInfo(sid, 0, k * per, FETCH_BYTES)]))
        reqs.append(codec.encode_frame(codec.FETCH, 0, k + 1, header))
    unpack_header = record_batch.HEADER.unpack_from
    hsize, magic_ok = record_batch.HEADER_SIZE, record_batch.MAGIC
    sent_at = [0.0] * nreq
    done_at = [0.0] * nreq
    sent = done = got = reordered = 0
    fpos = 0  # the current frame's start in buf
    end = pos = pend = crc_at = None
    crc = records = 0
    first = nxt = None
    clock = time.perf_counter
    t0 = clock()
    c0 = time.process_time()
    while done < nreq:
        sent = _top_up(s, reqs.__getitem__, sent, done, nreq, window, sent_at, clock)
        moved = inbox.start
        inbox.fill()
        if moved != inbox.start:  # the buffer was compacted: positions shift
            shift = moved - inbox.start
            fpos -= shift
            if end is not None:
                end, pos, pend, crc_at = end - shift, pos - shift, pend - shift, crc_at - shift
        n = inbox.n
        now = clock()
        while True:
            if end is None:
                if n - fpos < codec.PREFIX_SIZE:
                    break
                length, _magic, _opcode, flags, stream_id, fmt_hlen = codec.PREFIX.unpack_from(buf, fpos)
                end = fpos + 4 + length
                pos = crc_at = fpos + codec.PREFIX_SIZE + (fmt_hlen & 0xFFFFFF)
                pend = fpos + length
                crc = records = 0
                first = nxt = None
            upto = min(n, pend)
            if upto > crc_at:
                crc = crc32(view[crc_at:upto], crc)
                crc_at = upto
            while pos + hsize <= upto:
                magic, base, count, _ts, _records_crc, records_len = unpack_header(buf, pos)
                if magic != magic_ok or count < 1 or records_len < 0 or (nxt is not None and base != nxt):
                    raise AssertionError("bad batch header at %d of FETCH reply %d" % (pos - fpos, stream_id - 1))
                if first is None:
                    first = base
                nxt = base + count
                records += count
                pos += hsize + records_len
            if n < end:
                break
            (frame_crc,) = struct.unpack_from(">I", buf, pend)
            k = stream_id - 1
            # replies may pass each other (CONTRACT §3: matched by stream_id): one served by the
            # store's read pool, the next one from the page cache
            if flags != 0x03 or pos != pend or crc != frame_crc or first != k * per or not 0 <= k < sent or done_at[k]:
                raise AssertionError("bad FETCH reply %d: flags 0x%02x, %d/%d bytes, crc %08x/%08x, first offset %s" % (
                    k, flags, pos - fpos, pend - fpos, crc, frame_crc, first))
            got += records
            done += 1
            done_at[k] = now
            if k != done - 1:
                reordered += 1
            fpos = end
            inbox.start = fpos
            end = None
    el = clock() - t0
    s.close()
    q.put({"seconds": el, "records": got, "requests": nreq, "latencies": _pipe_latencies(sent_at, done_at),
           "client_cpu": time.process_time() - c0, "reordered": reordered})


def _xrange_entry(n):
    ident = redis_id(n)
    return b"*2\r\n$%d\r\n%s\r\n*2\r\n$1\r\nf\r\n$%d\r\n" % (len(ident), ident, RECORD_SIZE)


def redis_pipe_read_load(port, key, total, window, q):
    """``XRANGE key 1-<first> + COUNT 1024`` with ``window`` in flight. A reply's length is known
    (fixed-size values, IDs of known digits); each is checked once in: its array head, its entry
    marks counted with ``bytes.count`` (2 per entry) and its first entry's ID."""
    s = _connect(port)
    inbox = _Inbox(s)
    buf = inbox.buf
    per = XRANGE_COUNT
    nreq = (total + per - 1) // per
    reqs, sizes, heads = [], [], []
    for k in range(nreq):
        lo = k * per + 1
        cnt = min(per, total - k * per)
        reqs.append(redis_cmd(b"XRANGE", key, redis_id(lo), b"+", b"COUNT", b"%d" % per))
        head = b"*%d\r\n" % cnt
        sizes.append(len(head) + sum(len(_xrange_entry(lo + i)) + RECORD_SIZE + 2 for i in range(cnt)))
        heads.append((head + _xrange_entry(lo), cnt))
    sent_at = [0.0] * nreq
    done_at = []
    sent = done = got = 0
    clock = time.perf_counter
    t0 = clock()
    c0 = time.process_time()
    while done < nreq:
        sent = _top_up(s, reqs.__getitem__, sent, done, nreq, window, sent_at, clock)
        inbox.fill()
        now = clock()
        while done < nreq and inbox.n - inbox.start >= sizes[done]:
            a = inbox.start
            b = a + sizes[done]
            head, cnt = heads[done]
            if buf[a:a + len(head)] != head or buf.count(_XR_MARK, a, b) != 2 * cnt:
                raise AssertionError("bad XRANGE reply %d" % done)
            got += cnt
            done += 1
            done_at.append(now)
            inbox.start = b
    el = clock() - t0
    s.close()
    q.put({"seconds": el, "records": got, "requests": nreq, "latencies": _pipe_latencies(sent_at, done_at),
           "client_cpu": time.process_time() - c0})


def proc_cpu(pid, tid=None):
    """CPU seconds (user + system) a process (or its thread ``tid``) has used so far."""
    with open("/proc/%d/stat" % pid if tid is None else "/proc/%d/task/%d/stat" % (pid, tid)) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_sched(pid, tid):
    """(seconds on a CPU, seconds runnable but waiting for one) of a thread so far
    (/proc/PID/task/TID/schedstat)."""
    try:
        with open("/proc/%d/task/%d/schedstat" % (pid, tid)) as f:
            run, wait = f.read().split()[:2]
        return int(run) / 1e9, int(wait) / 1e9
    except OSError:
        return 0.0, 0.0


def proc_read_bytes(pid):
    """Bytes a process has had read from the disk so far (/proc/PID/io read_bytes: its reads and
    read-ahead that missed the page cache, the read pool's WILLNEED prefetch included)."""
    try:
        with open("/proc/%d/io" % pid) as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def proc_switches(pid):
    """Context switches (voluntary + involuntary) of all of a process's threads so far: each
    hand-off between the node's reactor and writer, each wake-up, is one; less load-sensitive
    than times."""
    total = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, tid)) as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        total += int(line.split()[-1])
        except OSError:
            pass
    return total


def measured(pid, fn, *args, profile=None):
    """Run a load generator; add the server's CPU seconds over the run to its result. ``profile``:
    a path prefix; py-spy records the server (``<prefix>.server.txt``) and the load generator
    (``<prefix>.client.txt``), collapsed stacks per thread of the samples on CPU, over the run (Redis is not
    Python: only its load generator is recorded)."""
    c0 = proc_cpu(pid)
    m0 = proc_cpu(pid, pid)  # the main thread: the node's reactor
    spies = []

    def started(child):
        if profile:
            for who, p in ((("server", pid),) if fn.__name__.startswith("sbp") else ()) + (("client", child),):
                spies.append(subprocess.Popen(
                    ["py-spy", "record", "--nonblocking", "--threads", "-r", "250", "-f", "raw",
                     "-p", str(p), "-o", "%s.%s.txt" % (profile, who)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)  # py-spy attaches before the load starts

    x0 = proc_switches(pid)
    d0 = proc_read_bytes(pid)
    s0 = thread_sched(pid, pid)
    result = run_in_process(fn, *args, started=started)
    result["server_disk_read"] = proc_read_bytes(pid) - d0
    result["main_thread_cpu_wait"] = thread_sched(pid, pid)[1] - s0[1]
    result["server_cpu"] = proc_cpu(pid) - c0
    result["main_thread_cpu"] = proc_cpu(pid, pid) - m0
    result["server_switches"] = proc_switches(pid) - x0
    for spy in spies:
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    return result


def run_in_process(fn, *args, started=None):
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    go = ctx.Event()
    p = ctx.Process(target=_after, args=(go, fn) + args + (q,))
    p.start()
    if started is not None:
        started(p.pid)
    go.set()
    import queue

    deadline = time.monotonic() + 3600
    while True:
        try:
            result = q.get(timeout=1.0)
            break
        except queue.Empty:
            if not p.is_alive() or time.monotonic() > deadline:
                p.join(1)
                raise RuntimeError("load generator %s ended without a result (exit code %s)" % (fn.__name__, p.exitcode))
    p.join()
    return result


def _after(go, fn, *args):
    go.wait()
    fn(*args)


# -- driver -------------------------------------------------------------------------------------


def disk_floor(base, n=300):
    """p50/p99 of one 64 KiB append + fdatasync in the bench's directory: the floor for any
    fsync-always ack latency on this disk."""
    path = os.path.join(base, "fsync-probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    data = b"x" * (BATCH_RECORDS * RECORD_SIZE)
    lat = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            os.write(fd, data)
            os.fdatasync(fd)
            lat.append((time.perf_counter() - t) * 1000)
    finally:
        os.close(fd)
        os.remove(path)
    return pct(lat, 50), pct(lat, 99)


def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(p / 100.0 * len(v)))]


def fmt_rate(r):
    return "%.0f rec/s (%.1f MiB/s)" % (r, r * RECORD_SIZE / 1048576)


def metrics_ab(base, runs, records, window):
    """Append throughput and the node's CPU per record, --metrics on vs off, alternating."""
    batches = records // BATCH_RECORDS
    results = {"on": [], "off": []}
    print("metrics A/B: %d pairs of %d-record append runs, --fsync interval:1000, window %d" % (runs, batches * BATCH_RECORDS, window))
    # one discarded run first: the first node of a bench ran slow in every A/B (cold caches)
    with Node(base, "interval:1000", metrics="off") as node:
        c = BlockingSbpClient("127.0.0.1", node.port)
        sid = c.create_stream()["stream_id"]
        c.close()
        measured(node.proc.proc.pid, sbp_append_load, node.port, sid, batches, window)
    shutil.rmtree(node.proc.data_dir, ignore_errors=True)
    for i in range(runs):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            load = os.getloadavg()[0]
            with Node(base, "interval:1000", metrics=mode) as node:
                c = BlockingSbpClient("127.0.0.1", node.port)
                sid = c.create_stream()["stream_id"]
                c.close()
                r = measured(node.proc.proc.pid, sbp_append_load, node.port, sid, batches, window)
            shutil.rmtree(node.proc.data_dir, ignore_errors=True)
            rate = r["records"] / r["seconds"]
            cpu = r["server_cpu"] / r["records"] * 1e6
            results[mode].append((rate, cpu))
            print("  pair %d metrics %-3s: %9.0f rec/s  node CPU %.2f s per 1M records  errors=%d  load %.2f" % (
                i + 1, mode, rate, cpu, r["errors"], load))
    med = {m: (pct([x[0] for x in v], 50), pct([x[1] for x in v], 50)) for m, v in results.items()}
    wins = sum(1 for a, b in zip(results["on"], results["off"]) if a[0] >= b[0])
    print("median: on %.0f rec/s (%.2f CPU s/1M), off %.0f rec/s (%.2f CPU s/1M): throughput on/off %.3f, "
          "CPU on/off %.3f; metrics-on faster in %d of %d pairs" % (
              med["on"][0], med["on"][1], med["off"][0], med["off"][1], med["on"][0] / med["off"][0],
              med["on"][1] / med["off"][1], wins, runs))


def settle_writeback(limit_mb=64, timeout=15.0):
    """Wait (at most ``timeout`` s) until the kernel's dirty and under-writeback pages are below
    ``limit_mb``: the phase before (either side's appends, 1 GB under interval / everysec) leaves
    its write-back running for seconds, and the next phase, whichever side it is, should not pay
    for it. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with open("/proc/meminfo") as f:
            kb = sum(int(line.split()[1]) for line in f if line.startswith(("Dirty:", "Writeback:")))
        if kb < limit_mb * 1024:
            break
        time.sleep(0.1)
    return time.monotonic() - t0


def redis_info(port, section):
    """``INFO section`` of the Redis on ``port``, as a dict of strings."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(redis_cmd(b"INFO", section))
        data = b""
        while b"\r\n" not in data:
            data += s.recv(1 << 16)
        head, _, body = data.partition(b"\r\n")
        n = int(head[1:])  # a bulk string: $<length>
        while len(body) < n:
            data = s.recv(1 << 16)
            if not data:
                break
            body += data
    return dict(line.split(":", 1) for line in body[:n].decode().split("\r\n") if ":" in line)


def settle_redis_rewrite(port, timeout=120.0):
    """Wait (at most ``timeout`` s) until Redis has no AOF rewrite running or scheduled; returns the
    seconds waited. With its default ``auto-aof-rewrite-percentage 100`` Redis rewrites its AOF
    in a forked child each time the file doubles (64 MiB, 128 MiB, ... with 1 GB appended per
    round), and the last rewrite of a round's appends, a child writing the whole data set, ran on
    into the phase after, whichever side that was: the same reason the write-back is settled."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        info = redis_info(port, b"persistence")
        if info.get("aof_rewrite_in_progress") == "0" and info.get("aof_rewrite_scheduled") == "0":
            break
        time.sleep(0.05)
    return time.monotonic() - t0


def pipelined(base, args):
    """Issue 24's method: one node (``--fsync interval:1000``) and one Redis (``everysec``) side by
    side; ``--rounds`` rounds, each appending ``--records`` records to a fresh stream / key on each
    side, then reading them back; the side that goes first alternates by round, and every phase
    starts once the kernel's write-back of the phase before is done. Medians at the end."""
    records = args.records // XRANGE_COUNT * XRANGE_COUNT
    batches = records // BATCH_RECORDS
    aw, rw = args.append_window, args.read_window
    print("pipelined method (issue 24): %d records of %d B per round, %d rounds; appends %d x 64 records "
          "in flight; reads FETCH 1 MiB vs XRANGE COUNT %d, %d in flight; --fsync interval:1000 vs appendfsync everysec"
          % (records, RECORD_SIZE, args.rounds, aw, XRANGE_COUNT, rw))
    rows = {k: [] for k in ("sbp_append", "redis_append", "sbp_read", "redis_read")}
    with Node(base, "interval:1000") as node, Redis(base, "everysec") as redis:
        npid, rpid = node.proc.proc.pid, redis.proc.pid
        c = BlockingSbpClient("127.0.0.1", node.port)
        appended_at = time.monotonic()
        for i in range(args.rounds):
            sid = c.create_stream()["stream_id"]
            key = b"p%d" % i
            runs = {
                "sbp_append": (npid, sbp_pipe_append_load, node.port, sid, batches, aw),
                "redis_append": (rpid, redis_pipe_append_load, redis.port, key, batches, aw),
                "sbp_read": (npid, sbp_pipe_read_load, node.port, sid, records, rw),
                "redis_read": (rpid, redis_pipe_read_load, redis.port, key, records, rw),
            }
            order = ("sbp", "redis") if i % 2 == 0 else ("redis", "sbp")
            order = [side for side in order if side in args.sides.split(",")]
            for what in ("append", "read"):
                for side in order:
                    name = side + "_" + what
                    # both sides start with Redis's AOF rewrite and the disk's deferred work done
                    rewrite_wait = settle_redis_rewrite(redis.port)
                    settle_writeback()
                    load = os.getloadavg()[0]
                    prof = os.path.join(args.py_spy, "round%d.%s" % (i + 1, name)) if args.py_spy else None
                    before = c.status()["metrics"].get("sbp", {}) if name == "sbp_read" else None
                    if name == "sbp_read":
                        # how long ago the stream was written: pages older than about a minute may
                        # have been reclaimed (this VM's DAMON pageout; the prefetch reads them again)
                        r_age = time.monotonic() - appended_at
                    r = measured(*runs[name], profile=prof)
                    if name == "sbp_append":
                        appended_at = time.monotonic()
                    if before is not None:  # reads the node could not answer from the page cache
                        after = c.status()["metrics"].get("sbp", {})
                        r["pool_reads"] = after.get("fetch_pool_reads", 0) - before.get("fetch_pool_reads", 0)
                        r["age"] = r_age
                        r["node_counts"] = {k: after.get(k, 0) - before.get(k, 0) for k in (
                            "fetch_sendfile_calls", "fetch_sendfile_short", "fetch_send_stalls", "fetch_send_wall_s",
                            "prefetch_checks", "prefetch_pieces")}
                    r["load"] = load
                    r["rewrite_wait"] = rewrite_wait
                    r["rate"] = r["records"] / r["seconds"]
                    rows[name].append(r)
                    lat = [x * 1000 for x in r["latencies"]]
                    print("  round %d %-12s %10.0f rec/s  p50 %.2f p99 %.2f p99.9 %.2f ms  server CPU %.2f s/1M rec "
                          "(%.0f us/request, %.1f context switches/request)  client CPU %.2f s  errors %d  load %.2f" % (
                              i + 1, name, r["rate"], pct(lat, 50), pct(lat, 99), pct(lat, 99.9),
                              r["server_cpu"] / r["records"] * 1e6, r["server_cpu"] / r["requests"] * 1e6,
                              r["server_switches"] / r["requests"],
                              r["client_cpu"], r.get("errors", 0), load)
                          + ("  (server main thread runnable, waiting for a CPU: %.0f us/request)" % (
                              r["main_thread_cpu_wait"] / r["requests"] * 1e6))
                          + ("  (%d replies before an earlier one)" % r["reordered"] if r.get("reordered") else "")
                          + ("  (%d reads from the read pool)" % r["pool_reads"] if "pool_reads" in r else "")
                          + ("  (started after %.1f s waiting for Redis's AOF rewrite)" % r["rewrite_wait"]
                             if r["rewrite_wait"] >= 0.1 else ""))
                    if "node_counts" in r:
                        # what the node did per FETCH this round (issue 24: what makes a round slow)
                        k, n = r["node_counts"], r["requests"]
                        print("      data written %.0f s before, %.0f MiB read back from disk; node per FETCH: reactor thread CPU %.0f us "
                              "(and %.0f us runnable, waiting for a CPU), %.1f sendfile "
                              "calls (%.2f short: socket full), %.0f us wall in them, %d sends over 5 ms; %.3f prefetch "
                              "checks naming %d pieces to read back from disk (4 MiB of WAL with pages missing from the page "
                              "cache, up to %d MiB; a piece found short again after its read counts again); load generator CPU %.0f us per FETCH; node/load generator CPU %.2f" % (
                                  r["age"], r["server_disk_read"] / 2 ** 20, r["main_thread_cpu"] / n * 1e6,
                                  r["main_thread_cpu_wait"] / n * 1e6, k["fetch_sendfile_calls"] / n,
                                  k["fetch_sendfile_short"] / n, k["fetch_send_wall_s"] / n * 1e6, k["fetch_send_stalls"],
                                  k["prefetch_checks"] / n, k["prefetch_pieces"], k["prefetch_pieces"] * 4,
                                  r["client_cpu"] / n * 1e6, r["server_cpu"] / r["client_cpu"]))
            c.delete_stream(sid)
            with socket.create_connection(("127.0.0.1", redis.port)) as rs:
                rs.sendall(redis_cmd(b"DEL", key))
                rs.recv(64)
        c.close()
    print()
    print("| pipelined, median of %d (%d records) | SBP | Redis | SBP/Redis |" % (args.rounds, records))
    print("|---|---|---|---|")
    for what in ("append", "read"):
        a, b = rows["sbp_" + what], rows["redis_" + what]
        if not a or not b:
            continue
        ra, rb = pct([r["rate"] for r in a], 50), pct([r["rate"] for r in b], 50)
        ratios = ", ".join("%.2fx" % (x["rate"] / y["rate"]) for x, y in zip(a, b))
        print("| %s rec/s | %.0f | %.0f | %.2fx (rounds: %s) |" % (what, ra, rb, ra / rb, ratios))
        for p in (50, 99, 99.9):
            la = pct([pct([x * 1000 for x in r["latencies"]], p) for r in a], 50)
            lb = pct([pct([x * 1000 for x in r["latencies"]], p) for r in b], 50)
            print("| %s latency p%s per request | %.2f ms | %.2f ms | - |" % (what, p, la, lb))
        ca = pct([r["server_cpu"] / r["records"] * 1e6 for r in a], 50)
        cb = pct([r["server_cpu"] / r["records"] * 1e6 for r in b], 50)
        print("| %s server CPU per 1M records | %.2f s | %.2f s | %.2fx |" % (what, ca, cb, ca / cb))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--always-records", type=int, default=200_000, help="records appended in the fsync-always pair")
    ap.add_argument("--records", type=int, default=1_000_000, help="records appended in the interval/everysec pair, then read")
    ap.add_argument("--window", type=int, default=32, help="pipelined batches in flight")
    ap.add_argument("--latency-seconds", type=float, default=10.0)
    ap.add_argument("--rate-mb", type=float, default=20.0, help="MB/s for the latency runs")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--metrics-ab", type=int, default=0, metavar="N",
                    help="only measure the metrics' cost: N alternating pairs of append runs (--records each), metrics on/off")
    ap.add_argument("--pipelined", action="store_true",
                    help="only the pipelined method (issue 24): --rounds alternating rounds of interval appends and reads, "
                         "--append-window / --read-window requests in flight")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sides", default="sbp,redis", help="with --pipelined: sbp, redis or both (A/B runs of the node alone)")
    ap.add_argument("--py-spy", metavar="DIR", help="with --pipelined: py-spy the server and the load generator "
                    "of each measurement into DIR (collapsed stacks per thread)")
    ap.add_argument("--append-window", type=int, default=PIPE_APPEND_WINDOW)
    ap.add_argument("--read-window", type=int, default=PIPE_READ_WINDOW)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="sbp-bench-")
    rows = []
    if args.pipelined:
        try:
            pipelined(base, args)
        finally:
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
        return
    if args.metrics_ab:
        try:
            metrics_ab(base, args.metrics_ab, args.records, args.window)
        finally:
            if not args.keep:
                shutil.rmtree(base, ignore_errors=True)
        return
    try:
        print("records: %d B body, %d per batch; window %d batches; one load process per side" % (RECORD_SIZE, BATCH_RECORDS, args.window))
        f50, f99 = disk_floor(base)
        print("disk: 64 KiB write + fdatasync p50=%.2f ms p99=%.2f ms (the floor for fsync-always acks)" % (f50, f99))
        for fsync, appendfsync, n in (("always", "always", args.always_records), ("interval:1000", "everysec", args.records)):
            batches = n // BATCH_RECORDS
            load = os.getloadavg()[0]
            with Node(base, fsync) as node:
                c = BlockingSbpClient("127.0.0.1", node.port)
                sid = c.create_stream()["stream_id"]
                lat_sid = c.create_stream()["stream_id"]
                c.close()
                pid = node.proc.proc.pid
                sbp = measured(pid, sbp_append_load, node.port, sid, batches, args.window)
                sbp_rate = sbp["records"] / sbp["seconds"]
                if fsync != "always":
                    sbp_read = measured(pid, sbp_read_load, node.port, sid, batches * BATCH_RECORDS)
                sbp_lat = run_in_process(sbp_latency_load, node.port, lat_sid, args.rate_mb * 1e6, args.latency_seconds)
            with Redis(base, appendfsync) as redis:
                rpid = redis.proc.pid
                red = measured(rpid, redis_append_load, redis.port, batches, args.window)
                red_rate = red["records"] / red["seconds"]
                if fsync != "always":
                    red_read = measured(rpid, redis_read_load, redis.port, batches * BATCH_RECORDS)
                red_lat = run_in_process(redis_latency_load, redis.port, args.rate_mb * 1e6, args.latency_seconds)
            print()
            print("append, SBP --fsync %s vs Redis appendfsync %s (%d records; machine load %.1f at start):" % (
                fsync, appendfsync, batches * BATCH_RECORDS, load))
            print("  SBP   %s  errors=%d  server CPU %.2f s" % (fmt_rate(sbp_rate), sbp["errors"], sbp["server_cpu"]))
            print("  Redis %s  errors=%d  server CPU %.2f s" % (fmt_rate(red_rate), red["errors"], red["server_cpu"]))
            print("  ratio SBP/Redis = %.2fx" % (sbp_rate / red_rate))
            rows.append(("append 1 KiB x64, fsync %s / %s" % (fsync, appendfsync), "%.0f rec/s" % sbp_rate, "%.0f rec/s" % red_rate, sbp_rate / red_rate))
            if fsync != "always":
                r1 = sbp_read["records"] / sbp_read["seconds"]
                r2 = red_read["records"] / red_read["seconds"]
                print("sequential read of %d records (FETCH 1 MiB vs XRANGE COUNT %d):" % (sbp_read["records"], XRANGE_COUNT))
                print("  SBP   %s  (%d requests; server CPU %.2f s, client CPU %.2f s)" % (
                    fmt_rate(r1), sbp_read["requests"], sbp_read["server_cpu"], sbp_read["client_cpu"]))
                print("  Redis %s  (%d requests; server CPU %.2f s, client CPU %.2f s)" % (
                    fmt_rate(r2), red_read["requests"], red_read["server_cpu"], red_read["client_cpu"]))
                print("  ratio SBP/Redis = %.2fx" % (r1 / r2))
                rows.append(("sequential read %d records" % sbp_read["records"], "%.0f rec/s" % r1, "%.0f rec/s" % r2, r1 / r2))
            for name, res in (("SBP  ", sbp_lat), ("Redis", red_lat)):
                lat = [x * 1000 for x in res["latencies"]]
                print("append latency at %.0f MB/s (64 x 1 KiB per request), %s %s: n=%d p50=%.2f ms p99=%.2f ms p99.9=%.2f ms max=%.2f ms" % (
                    args.rate_mb, name, fsync if name.startswith("SBP") else appendfsync, len(lat), pct(lat, 50), pct(lat, 99), pct(lat, 99.9), max(lat) if lat else float("nan")))
            sl = [x * 1000 for x in sbp_lat["latencies"]]
            rl = [x * 1000 for x in red_lat["latencies"]]
            rows.append(("append latency p50/p99 at %.0f MB/s, %s / %s" % (args.rate_mb, fsync, appendfsync),
                         "%.2f / %.2f ms" % (pct(sl, 50), pct(sl, 99)), "%.2f / %.2f ms" % (pct(rl, 50), pct(rl, 99)), None))
        print()
        print("| measurement | SBP | Redis | SBP/Redis |")
        print("|---|---|---|---|")
        for name, a, b, ratio in rows:
            print("| %s | %s | %s | %s |" % (name, a, b, "%.2fx" % ratio if ratio else "-"))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
