"""The Toasty file protocol over plain sockets: ``BlockingToastyClient`` and its
``BlockingConnection`` (for sbpctl, scripts, Spark and benchmarks); the planning is in ``planning``.

Replies are read by ``recv`` of up to 1 MiB and taken from that read where they lie (a chunk's
data is a view of it, not a copy); a reply cut by the end of a read is finished with an exact
``recv(n, MSG_WAITALL)`` and joined, so no framer is needed and only cut replies are copied.
"""

import os
import socket
import time
from collections import deque

from protocols import client_socket
from protocols.toasty import codec
from protocols.toasty.codec import HEADER, HEADER_LEN
from protocols.toasty.errors import ErrorCode
from protocols.toasty.planning import (
    DEFAULT_CHUNK_SIZE,
    LANES_PER_JOB,
    MAX_ATTEMPTS,
    MAX_PIECE_CHUNKS,
    UPLOADS_IN_FLIGHT,
    HashBatcher,
    ToastyError,
    backoff,
    error_of,
    file_state_steps,
    path_bytes,
    plan_uploads,
    raise_for,
    record_upload,
    run_steps,
    server_address,
    sha256,
    should_retry,
    verify_chunk,
    write_message,
)
from storage import sha256 as multi_sha256

READ_SIZE = 1024 * 1024  # bytes asked of one recv: up to 16 pipelined 64 KiB chunk replies
HASH_THREADS = 4  # at most this many helper threads hash chunks
# A chunk goes to a read's sink in pieces of at most this much. A file sink then writes 512 KiB
# at a time: on this project's machine (Linux 6.18, ext4) a buffered write of a whole aligned
# 1 MiB costs 0.8-1.0 CPU-s per GB of fresh page cache, of 64-512 KiB pieces 0.27-0.43
# (docs/benchmarks.md, issue 18).
SINK_PIECE = 512 * 1024


def hash_threads():
    return max(1, min(HASH_THREADS, os.cpu_count() or 1))


class BlockingConnection:
    """One socket to either listener; ``send`` then ``recv`` replies in request order."""

    def __init__(self, host, port, timeout=30.0, tls_ca=None):
        self.sock = client_socket.connect(host, port, timeout, tls_ca)
        self.tls = client_socket.is_tls(self.sock)  # no sendmsg, no MSG_WAITALL
        self.pending = deque()
        self.address = (host, port)
        self._rbuf, self._rview, self._rpos = b"", memoryview(b""), 0  # received, not yet taken

    def close(self):
        self._rbuf, self._rview, self._rpos = b"", memoryview(b""), 0
        try:
            self.sock.close()
        except OSError:
            pass

    def send(self, msg):
        if self.sock.fileno() < 0:
            raise ConnectionError("toasty connection to %s:%d is closed" % self.address)
        parts = codec.encode_parts(msg)
        self.pending.append(msg.TYPE)
        if len(parts) > 8 or self.tls:  # many small fields: one buffer (sendmsg takes at most IOV_MAX)
            self.sock.sendall(b"".join(parts))
            return
        total = sum(len(p) for p in parts)
        sent = self.sock.sendmsg(parts)
        if sent < total:  # a partial send: finish from where it stopped
            rest = memoryview(b"".join(parts))[sent:]
            self.sock.sendall(rest)

    def send_many(self, msgs):
        """Send several messages with as few calls as possible (big data is not copied)."""
        if self.sock.fileno() < 0:
            raise ConnectionError("toasty connection to %s:%d is closed" % self.address)
        parts = []
        for msg in msgs:
            parts.extend(codec.encode_parts(msg))
        self.pending.extend(msg.TYPE for msg in msgs)
        total = sum(len(p) for p in parts)
        if total < 65536 or self.tls:
            self.sock.sendall(b"".join(parts))
            return
        views = [memoryview(p) for p in parts]
        i = 0
        while i < len(views):
            sent = self.sock.sendmsg(views[i : i + 512])  # IOV_MAX is 1024
            while sent:
                n = len(views[i])
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    def _exact(self, n):
        """The next ``n`` bytes of the stream (bytes, or a view of a read holding them). Replies
        are taken from what one ``recv`` of up to READ_SIZE brought in, with no copy, so pipelined
        replies cost one system call per read rather than two each; a reply cut by the end of a
        read is finished with MSG_WAITALL and joined (one copy of that reply only)."""
        buf, pos = self._rbuf, self._rpos
        avail = len(buf) - pos
        if avail >= n:
            self._rpos = pos + n
            return self._rview[pos : pos + n]
        if avail:
            head = self._rview[pos:]
            self._rbuf, self._rview, self._rpos = b"", memoryview(b""), 0
            return b"".join((head, self._rest(n - avail)))  # one copy of the reply, not two
        if self.tls:
            return self._rest(n)
        data = self.sock.recv(max(n, READ_SIZE))  # what is there (waiting for at least a byte)
        if not data:
            raise ConnectionError("toasty server %s:%d closed the connection" % self.address)
        if len(data) >= n:
            self._rbuf, self._rview, self._rpos = data, memoryview(data), n
            return self._rview[:n]
        return b"".join((data, self._rest(n - len(data))))

    def _rest(self, n):
        # MSG_WAITALL: one call, one allocation, no zero-fill.
        data = self.sock.recv(n) if self.tls else self.sock.recv(n, socket.MSG_WAITALL)
        if len(data) == n:
            return data
        if not data:
            raise ConnectionError("toasty server %s:%d closed the connection" % self.address)
        return b"".join((data, self._rest(n - len(data))))

    def recv(self):
        try:
            return self._recv()
        except BaseException:
            # A reply we could not read leaves the stream out of step: never reuse it.
            self.close()
            raise

    def _recv(self):
        if self.sock.fileno() < 0:
            raise ConnectionError("toasty connection to %s:%d is closed" % self.address)
        req_type = self.pending.popleft()
        version, mtype, length = HEADER.unpack(self._exact(HEADER_LEN))
        try:
            codec.check_header(version, mtype, length, codec.REPLIES[req_type])
            body = self._exact(length - HEADER_LEN)
            if mtype == codec.DOWNLOAD_CHUNK_SUCCESS and len(body) >= 4 and int.from_bytes(body[:4], "little") == len(body) - 4:
                return codec.DownloadChunkSuccess(memoryview(body)[4:])  # no copy of the data
            return codec.decode_reply(mtype, bytes(body))
        except codec.CodecError as e:
            self.close()
            raise ConnectionError("bad reply from toasty server %s:%d: %s" % (self.address + (e,)))

    def call(self, msg):
        self.send(msg)
        return self.recv()

    def pipeline(self, msgs, window=64):
        """Send ``msgs`` keeping up to ``window`` outstanding; yield replies in order."""
        outstanding = 0
        for msg in msgs:
            self.send(msg)
            outstanding += 1
            if outstanding >= window:
                yield self.recv()
                outstanding -= 1
        for _ in range(outstanding):
            yield self.recv()


class BlockingToastyClient:
    """The file protocol over plain sockets (for sbpctl, scripts and benchmarks)."""

    tls_ca = None  # PEM CA file when the listeners are TLS (protocols.client_socket)

    def __init__(self, host, port, timeout=30.0, parallel=UPLOADS_IN_FLIGHT, tls_ca=None):
        self.tls_ca = tls_ca  # chunk servers are reached the same way as the metadata server
        self.meta = BlockingConnection(host, port, timeout, tls_ca)
        self._pool = None
        self.timeout = timeout
        self.parallel = parallel
        self._chunk_conns = {}
        multi_sha256.start_loading()  # on a thread; chunks are hashed by hashlib until it is ready

    def close(self):
        self.meta.close()
        for c in self._chunk_conns.values():
            c.close()
        self._chunk_conns.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _hasher(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            # Hashing runs beside this thread's sends and receives, on one helper per core (up
            # to HASH_THREADS): SHA-256 releases the GIL, and without the CPU's SHA extensions
            # it is most of a transfer's CPU, more than one core can hash at line rate.
            self._pool = ThreadPoolExecutor(max_workers=hash_threads(), thread_name_prefix="toasty-verify")
        if multi_sha256.enabled():
            # The multi-buffer SHA-256 hashes a job's chunks side by side: jobs of up to 16 chunks,
            # but at most half the requests in flight, so one job hashes while the next fills.
            lanes = max(multi_sha256.MIN_LANES, min(LANES_PER_JOB, self.parallel // 2))
            return HashBatcher(self._pool, per_job=lanes, job_bytes=lanes << 20)
        return HashBatcher(self._pool)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def chunk_conn(self, address):
        c = self._chunk_conns.get(address)
        if c is None or c.sock.fileno() < 0:
            c = self._chunk_conns[address] = BlockingConnection(address[0], address[1], self.timeout, self.tls_ca)
        return c

    # -- metadata operations --

    def create(self, path, is_dir=False, chunk_size=DEFAULT_CHUNK_SIZE):
        return raise_for(self.meta.call(codec.Create(path_bytes(path), is_dir, 0 if is_dir else chunk_size))).gen

    def mkdir(self, path):
        return self.create(path, True)

    def delete(self, path, expect_gen=0):
        raise_for(self.meta.call(codec.Delete(expect_gen, path_bytes(path))))

    def list(self, path, expect_gen=0):
        base = path_bytes(path)
        items, after = [], None
        while True:
            wire = base if after is None else base.rstrip(b"/") + b"/\x00" + after
            reply = raise_for(self.meta.call(codec.List_(expect_gen, wire)))
            items.extend(reply.items)
            if not reply.truncated or not reply.items:
                return reply.gen, items
            after = reply.items[-1].name

    def read_raw(self, path, offset, length, expect_gen=0):
        return raise_for(self.meta.call(codec.Read(expect_gen, path_bytes(path), offset, length)))

    def stat(self, path):
        """-> dict(gen, chunk_size, size) for a file; dict(gen, is_dir=True) for a directory."""
        path = path_bytes(path)
        reply = self.meta.call(codec.Read(0, path, 0, 0))
        if isinstance(reply, codec.ReadError):
            if ErrorCode.of(reply.message) is ErrorCode.IS_A_DIRECTORY:
                gen, items = self.list(path)
                return {"is_dir": True, "gen": gen, "entries": len(items)}
            raise error_of(reply)
        gen, cs = reply.gen, reply.chunk_size
        size, span = 0, MAX_PIECE_CHUNKS * cs
        while True:
            rs = self.read_raw(path, size, span, expect_gen=gen)
            size += rs.file_length
            if rs.file_length < span:
                return {"is_dir": False, "gen": gen, "chunk_size": cs, "size": size}

    # -- file data --

    def write(self, path, data, offset=0, truncate=False, create=True, chunk_size=None, progress=None):
        """Write ``data`` (bytes, or a file object with ``size``) at ``offset`` -> new generation."""
        path = path_bytes(path)
        return self.write_stream(path, _BytesSource(data), len(data), offset, truncate, create, chunk_size, progress)

    def write_stream(self, path, source, size, offset=0, truncate=False, create=True, chunk_size=None, progress=None):
        """``source.read(n)`` supplies ``size`` bytes, written piece by piece (<= 1024 chunks each)
        and read chunk by chunk as the uploads go (memory stays bounded). A retried piece is read
        again after ``source.seek``."""
        path = path_bytes(path)
        if size == 0:
            return self._write_piece(path, None, offset, 0, truncate, create, chunk_size)
        probe = self.meta.call(codec.Read(0, path, offset, 0))
        if isinstance(probe, codec.ReadSuccess):
            cs, probe = probe.chunk_size, None
        elif ErrorCode.of(probe.message) is ErrorCode.NOT_FOUND:
            cs = chunk_size or DEFAULT_CHUNK_SIZE  # the probe doubles as the first piece's READ
        else:
            raise error_of(probe)
        base = source.tell() if hasattr(source, "tell") else 0
        pos, gen, first_piece = 0, None, True
        while pos < size:
            piece_len = min(size - pos, MAX_PIECE_CHUNKS * cs - (offset + pos) % cs)
            last = pos + piece_len == size
            # TRUNCATE_AFTER on the first piece drops old bytes past it; later pieces extend.
            reported = [0]

            def report(n, reported=reported, piece_len=piece_len):
                n = min(n, piece_len - reported[0])  # a retried piece is not counted twice
                if n > 0 and progress is not None:
                    reported[0] += n
                    progress(n)

            gen = self._write_piece(path, _SourceReader(source, base + pos, offset + pos, piece_len), offset + pos, piece_len,
                                    truncate and (first_piece or last), create, chunk_size, cs, probe, report)
            report(piece_len)
            first_piece, probe = False, None
            pos += piece_len
        return gen

    def _state(self, path, offset, length, create, chunk_size, cs_hint=None, probe=None):
        return run_steps(file_state_steps(path, offset, length, create, chunk_size, cs_hint, probe), self.meta.call)

    def _write_piece(self, path, reader, offset, length, truncate, create, chunk_size, cs_hint=None, probe=None, report=None):
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                time.sleep(backoff(attempt))
            state = self._state(path, offset, length, create, chunk_size, cs_hint, probe if not attempt else None)
            if state is None:
                continue
            flags = (codec.TRUNCATE_AFTER if truncate else 0) | (codec.CREATE_IF_MISSING if not state.exists else 0)
            uploads = []
            if length:
                reader.rewind()
                try:
                    self._upload_all(plan_uploads(state, offset, length, reader.read, truncate, self._hasher().submit), uploads, report if not attempt else None)
                except OSError:
                    # a write location is down: it leaves the member list (and the locations
                    # READ offers) within the cluster's lease TTL, so start again from the READ
                    continue
            reply = self.meta.call(write_message(state, path, offset, length, flags, uploads))
            if isinstance(reply, codec.WriteSuccess):
                return reply.gen
            if not should_retry(reply):
                raise error_of(reply)
        raise ToastyError("WRITE of %r kept conflicting after %d attempts" % (path, MAX_ATTEMPTS))

    def _run_pipelined(self, jobs, on_reply):
        """``jobs``: iterable of (address, msg or (type, raw bytes), context). Keeps up to
        ``parallel`` outstanding across connections; replies are handled in send order."""
        try:
            self._pipelined(jobs, on_reply)
        except BaseException:
            # Replies still on the wire would be read as answers to later requests: start afresh.
            for c in self._chunk_conns.values():
                c.close()
            self._chunk_conns.clear()
            raise

    def _pipelined(self, jobs, on_reply):
        # Requests go out a quarter window at a time, several per send call.
        window = self.parallel
        refill = max(1, window // 4)
        outstanding = deque()
        jobs = iter(jobs)
        more = True
        while True:
            if more and len(outstanding) <= window - refill:
                sends = {}
                while len(outstanding) < window:
                    job = next(jobs, None)
                    if job is None:
                        more = False
                        break
                    address, msg, ctx = job
                    conn = self.chunk_conn(address)
                    sends.setdefault(conn, []).append(msg)
                    outstanding.append((conn, ctx))
                for conn, msgs in sends.items():
                    conn.send_many(msgs)
            if not outstanding:
                return
            conn0, ctx0 = outstanding.popleft()
            on_reply(ctx0, conn0.recv())

    def _upload_all(self, planned, uploads, report=None):
        def jobs():
            for up in planned:
                uploads.append(up)
                for target in up.targets:
                    yield target, up.msg, (up, target)

        def done(ctx, reply):
            up = ctx[0]
            record_upload(up, ctx[1], reply)
            if report is not None and up.msg is not None:
                report(len(up.msg.data))
            up.msg = None  # the data may go

        self._run_pipelined(jobs(), done)

    def read(self, path, offset=0, length=None, verify=True):
        out = []
        self.read_into(path, out.append, offset, length, verify)
        return b"".join(out)

    def read_into(self, path, sink, offset=0, length=None, verify=True, progress=None):
        """Stream [offset, offset+length) into ``sink(bytes)`` -> bytes read. Pieces after the
        first are pinned to the first READ's generation (a concurrent write fails the read)."""
        path = path_bytes(path)
        first = self.read_raw(path, offset, 0)
        gen, cs = first.gen, first.chunk_size
        end = offset + length if length is not None else None
        pos = offset
        while end is None or pos < end:
            want = MAX_PIECE_CHUNKS * cs - pos % cs
            if end is not None:
                want = min(want, end - pos)
            rs = self.read_raw(path, pos, want, expect_gen=gen)
            if rs.file_length == 0:
                break
            self._download_piece(rs, pos, sink, verify, progress)
            pos += rs.file_length
            if rs.file_length < want:
                break
        return pos - offset

    def _download_piece(self, rs, offset, sink, verify, progress=None):
        cs = rs.chunk_size
        out = [None] * len(rs.chunks)
        spans = []
        jobs = []
        unreachable = set()
        holder_lists = {}  # the decoder shares AddrList objects: resolve each distinct list once
        for i, c in enumerate(rs.chunks):
            index = offset // cs + i
            start = index * cs
            lo = max(offset, start) - start
            hi = min(offset + rs.file_length, start + cs) - start
            spans.append((lo, hi))
            if c.hash == codec.ZERO_HASH:
                out[i] = bytes(hi - lo)
                continue
            key = tuple(map(id, c.holders))
            holders = holder_lists.get(key)
            if holders is None:
                holders = holder_lists[key] = [a for a in (server_address(h) for h in c.holders) if a]
            if not holders:
                raise ToastyError("no chunk server holds chunk %s" % c.hash.hex())
            # CONTRACT §9: holders are tried in order; one that refuses connections is skipped
            k = self._reachable(c.hash, holders, unreachable)
            jobs.append((holders[k], codec.DownloadChunk(c.hash, True), (i, c.hash, lo, hi, holders[k:])))

        hasher = self._hasher() if verify else None
        checks = {}  # index -> (hash, Digest) of a chunk being hashed
        emitted = [0]  # out[:emitted] went to the sink

        def drain(wait):
            # Chunks go to the sink in order as soon as they are verified, so writing the output
            # overlaps with receiving and hashing the chunks after them.
            n = emitted[0]
            while n < len(out) and out[n] is not None:
                check = checks.get(n)
                if check is not None:
                    h, digest, lo, hi, holders = check
                    if not wait and not digest.done():
                        break
                    if digest.result() != h:
                        # A damaged copy: the next holder's (verified) copy, if there is one.
                        error = ToastyError("chunk %s failed its hash check" % h.hex())
                        data = self._download_fallback(h, holders[1:], error)
                        out[n] = _span(data, lo, hi)
                    del checks[n]
                data = out[n]
                if len(data) > SINK_PIECE:
                    view = memoryview(data)
                    for k in range(0, len(view), SINK_PIECE):
                        sink(view[k : k + SINK_PIECE])
                else:
                    sink(data)
                out[n] = None
                n += 1
            emitted[0] = n

        def got(ctx, reply):
            i, h, lo, hi, holders = ctx
            if isinstance(reply, codec.ErrorReply):
                data = self._download_fallback(h, holders[1:], reply)
            else:
                data = reply.data
                if verify:
                    # SHA-256 releases the GIL: hash on a helper thread while we keep receiving.
                    checks[i] = (h, hasher.submit(sha256, data), lo, hi, holders)
            out[i] = _span(data, lo, hi)
            if progress is not None:
                progress(hi - lo)
            drain(False)

        zeros = sum(hi - lo for i, (lo, hi) in enumerate(spans) if out[i] is not None)
        self._run_pipelined(jobs, got)
        if hasher is not None:
            hasher.flush()
        drain(True)
        if progress is not None and zeros:
            progress(zeros)

    def _reachable(self, h, holders, unreachable):
        """Index of the first holder a connection can be made to."""
        for k, address in enumerate(holders):
            if address in unreachable:
                continue
            try:
                self.chunk_conn(address)
                return k
            except OSError:
                unreachable.add(address)
        raise ToastyError("no holder of chunk %s is reachable" % h.hex())

    def _download_fallback(self, h, holders, first_error):
        for address in holders:
            # A connection of its own: the pooled ones have pipelined requests outstanding.
            try:
                conn = BlockingConnection(address[0], address[1], self.timeout, self.tls_ca)
            except OSError:
                continue
            try:
                reply = conn.call(codec.DownloadChunk(h, True))
            finally:
                conn.close()
            if isinstance(reply, codec.DownloadChunkSuccess):
                verify_chunk(h, reply.data)
                return reply.data
        raise first_error if isinstance(first_error, Exception) else error_of(first_error)


def _span(data, lo, hi):
    """Bytes [lo, hi) of a chunk; a stored chunk shorter than that reads as zeros past its end."""
    piece = data[lo:hi]
    return bytes(piece) + bytes(hi - lo - len(piece)) if len(piece) < hi - lo else piece


class _BytesSource:
    def __init__(self, data):
        self.view = memoryview(data)
        self.pos = 0

    def tell(self):
        return self.pos

    def seek(self, pos):
        self.pos = pos

    def read(self, n):
        out = self.view[self.pos : self.pos + n]
        self.pos += len(out)
        return out


class _SourceReader:
    """``read(lo, hi)`` for plan_uploads over a sequential source, from source position ``start``
    (file offset ``offset``, ``length`` bytes); ``rewind`` seeks back for a retried piece. The
    source is read a block of up to ``BLOCK`` bytes at a time and chunks are handed out as
    views of it (one read call per 16 chunks of 64 KiB, no copy per chunk)."""

    BLOCK = 1024 * 1024

    def __init__(self, source, start, offset, length):
        self.source, self.start, self.offset, self.end = source, start, offset, offset + length
        self.next = None
        self.block, self.block_lo, self.block_hi = None, 0, 0

    def rewind(self):
        if self.next is not None and self.next != self.offset:
            if not hasattr(self.source, "seek"):
                raise ToastyError("the source cannot be re-read for a retried WRITE")
            self.source.seek(self.start)
        self.next = self.offset
        self.block, self.block_lo, self.block_hi = None, self.offset, self.offset

    def read(self, lo, hi):
        if lo != self.next:
            raise AssertionError("chunks are read in order")
        if hi > self.block_hi:
            want = max(hi, min(self.end, lo + self.BLOCK)) - lo
            data = self.source.read(want)
            if len(data) != want:
                raise ToastyError("source ended early (%d bytes short)" % (want - len(data)))
            self.block, self.block_lo, self.block_hi = memoryview(data), lo, lo + want
        self.next = hi
        return self.block[lo - self.block_lo : hi - self.block_lo]
