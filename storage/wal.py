"""The shared write-ahead log: append-only segment files holding every stream's batches and every
metadata change, in one order.

Entry framing (big-endian)::

    u32 payload_len | u32 crc | u8 type | payload

``crc`` = CRC-32 over (u64 segment base position, u32 payload_len, u8 type, payload). Binding the
segment's base position means bytes left over from another segment (a reused or misplaced file,
a stale tail) never validate as an entry here (research note §3.4, elastic-stream #549/#673/#675).

Positions are global: a segment file is named by the position of its first byte
(``%020d.wal``), and an entry's position is its segment base + its offset in the file. An entry
never straddles two segments. Only the writer thread appends; readers ``pread`` from any thread.
"""

import bisect
import errno
import os
import struct
import threading
import time

from storage import fileops
from storage.crc import COMBINE_IS_NATIVE, crc32, crc32_combine, crc32_held
from storage.errors import DataCorrupted, OffsetOutOfRange

ENTRY = struct.Struct(">IIB")
ENTRY_SIZE = ENTRY.size  # 9
_CRC_PREFIX = struct.Struct(">QIB")
MAX_PAYLOAD = 1 << 30

T_BATCH = 1  # payload: u64 stream_id | u64 append_ms | record batch
T_OPS = 2  # payload: msgpack list of raw index operations (storage.index.apply_ops)

# A batch entry's fixed head: entry framing, u64 stream_id | u64 append_ms, the record batch's
# 29-byte header (u8 magic | i64 base_offset | i32 record_count | i64 base_ts | u32 crc | i32 records_len)
_BATCH_HEAD = struct.Struct(">IIBQQBqiqIi")
BATCH_HEAD_SIZE = _BATCH_HEAD.size  # 54
BATCH_AT = ENTRY_SIZE + 16  # where the record batch starts in a batch entry
_BATCH_MAGIC = 0x22

IOV_MAX = 1024  # Linux's limit on buffers per pwritev
SUFFIX = ".wal"
GRAVE_S = 30.0  # deleted segments' fds stay open this long
# Drop-behind (HDFS datanodes' "drop cache behind writes"), off unless a caller sets
# ``Wal.drop_behind``: once a group is handed back, the page cache pages of synced WAL bytes more
# than ``drop_behind`` bytes behind the last sync's end are dropped (they are clean), at most once
# per DROP_STEP_BYTES written (``drop_behind_synced``). The WAL's pages are then a bounded set the
# kernel hands out again, instead of a page cache growing into memory not written before: on the
# benchmark VM each first write of such a page costs a hypervisor fault, and the writers'
# page-cache copy ran 4-5x slower once the memory they had been reusing ran out; with 256 MiB the
# replicated path's CPU per record fell 20-24% in that state. Off by default because readers that
# far behind are read from the disk (the read pool, as after any eviction): issue 24's read-back
# of a fresh ~1 GB stream (bench/sbp_bench.py --pipelined) cost +35% CPU per record even with
# 1 GiB (docs/benchmarks.md, issue 17 part 10).
DROP_BEHIND_BYTES = None
DROP_STEP_BYTES = 8 << 20


# ``flush(dsync=True)`` writes and syncs in one call where the kernel can (RWF_DSYNC);
# SBPNODE_WAL_DSYNC=0: a write, then an fdatasync (A/B runs, docs/benchmarks.md)
WRITE_DSYNC = fileops.RWF_DSYNC is not None and os.environ.get("SBPNODE_WAL_DSYNC", "1") != "0"


class WriteSyncFailed(Exception):
    """A write made with its sync (``Wal.flush(dsync=True)``) failed after its bytes reached the
    file: its sync failed, with ``error``."""

    def __init__(self, error):
        super().__init__("the write's sync failed: %s" % error)
        self.error = error


def entry_crc(base: int, etype: int, parts, crc32=crc32, tail_crc=None) -> int:
    """The entry CRC. The writer thread passes ``crc32=crc32_held`` (storage/crc.py).
    ``tail_crc``: the CRC-32 of the last part, known already (a record batch's checked
    records-block CRC): combined in, not computed again."""
    length = sum(len(p) for p in parts)
    crc = crc32(_CRC_PREFIX.pack(base, length, etype))
    if tail_crc is None or not COMBINE_IS_NATIVE:
        for p in parts:
            crc = crc32(p, crc)
        return crc
    for p in parts[:-1]:
        crc = crc32(p, crc)
    return crc32_combine(crc, tail_crc, len(parts[-1]))


def segment_name(base: int) -> str:
    return "%020d%s" % (base, SUFFIX)


_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_PAGE = 4096


def _load_cachestat():
    """cachestat(2) (Linux 6.5+: how many pages of a file range are in the page cache, one call,
    never waits) through ctypes as ``fn(fd, offset, length) -> pages cached``; None when the
    kernel or platform lacks it. Called through PyDLL: the GIL is kept (the call is a few us;
    giving the GIL up and taking it back behind the store's threads would cost more)."""
    try:
        import ctypes
        import errno
        import sys
        import tempfile

        if not sys.platform.startswith("linux"):
            return None

        class Range(ctypes.Structure):
            _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

        class Stat(ctypes.Structure):
            _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]

        syscall = ctypes.PyDLL(None, use_errno=True).syscall
        syscall.restype = ctypes.c_long
        syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        rng, st = Range(), Stat()
        rng_p, st_p = ctypes.addressof(rng), ctypes.addressof(st)
        nr = 451  # the same number on every architecture (the generic table)

        def cachestat(fd, offset, length):
            rng.off = offset
            rng.len = length
            if syscall(nr, fd, rng_p, st_p, 0) != 0:
                raise OSError(ctypes.get_errno(), "cachestat")
            return st.cache

        with tempfile.TemporaryFile() as f:
            f.write(b"x" * _PAGE)
            f.flush()
            if cachestat(f.fileno(), 0, _PAGE) != 1:
                return None
        return cachestat
    except OSError as e:  # ENOSYS: an older kernel
        if e.errno not in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
            raise
        return None
    except Exception:
        return None


cachestat = _load_cachestat()


class SegmentFile:
    """A private duplicate of a WAL segment's fd, closed when the last reference goes. It stays valid
    however long a reader holds it: after the segment is deleted, and after the WAL closes the
    segment's own fd (whose number the OS may then reuse for another file)."""

    __slots__ = ("fd", "__weakref__")

    def __init__(self, fd: int):
        self.fd = os.dup(fd)

    def __del__(self):
        try:
            os.close(self.fd)
        except OSError:
            pass


class FileSpan:
    """Where one stored record batch lies: ``length`` bytes at ``offset`` of ``file.fd`` (a
    SegmentFile). ``header`` is a copy of the batch's first 29 bytes (its record batch header).
    ``crc``: the CRC-32 of the whole batch as stored (its header's bytes combined with the
    records-block CRC the header holds), or None when not worked out.
    The bytes never change (stored batches are immutable); ``len(span)`` is the batch's length."""

    __slots__ = ("file", "offset", "length", "header", "crc")

    def __init__(self, file: SegmentFile, offset: int, length: int, header: bytes, crc=None):
        self.file = file
        self.offset = offset
        self.length = length
        self.header = header
        self.crc = crc

    def __len__(self):
        return self.length

    def read(self) -> bytes:
        """The batch's bytes (blocking: a read pool, a test, a transport that cannot sendfile)."""
        data = os.pread(self.file.fd, self.length, self.offset)
        if len(data) != self.length:
            raise DataCorrupted("batch at file offset %d is truncated" % self.offset)
        return data


def _span_from_head(head, f, base, off, total, sid, base_offset, count):
    """The FileSpan of the batch entry at ``off`` of segment ``base`` (file ``f``) whose first 54
    bytes are ``head``, if they check out (``Wal.batch_span``); else None."""
    if len(head) < BATCH_HEAD_SIZE or total < BATCH_HEAD_SIZE:
        return None
    (length, crc, t, h_sid, _ms, magic, h_base, h_count, _ts, records_crc,
     records_len) = _BATCH_HEAD.unpack(head)
    if (t != T_BATCH or length != total - ENTRY_SIZE or h_sid != sid or magic != _BATCH_MAGIC
            or h_base != base_offset or h_count != count or records_len != total - BATCH_HEAD_SIZE):
        return None
    head_crc = crc32(head[ENTRY_SIZE:], crc32(_CRC_PREFIX.pack(base, length, t)))
    if crc32_combine(head_crc, records_crc, records_len) != crc:
        return None
    return FileSpan(f, off + BATCH_AT, total - BATCH_AT, bytes(head[BATCH_AT:]))


def _pages_cached(fd, start, end, _one=[memoryview(bytearray(1))]):
    """True if every page of bytes ``start`` to ``end`` of ``fd`` is in the page cache
    (cachestat) and the file reaches ``end`` (its last byte read with RWF_NOWAIT: cachestat
    counts the pages a truncated file still has, and a truncated batch must go to the read
    pool, which reports it). A short count is asked again once: on a busy machine cachestat now and then
    counts a few pages short of what is there (0.1-0.3% of calls here, never twice in a row),
    and a false miss costs a read-pool round trip. (Every page, not only the heads: memory
    reclaim drops pages anywhere, and the reactor's sendfile of a page not in the cache would
    wait for the disk.)"""
    if os.preadv(fd, _one, end - 1, _NOWAIT) != 1:
        return False
    pages = (end - 1) // _PAGE - start // _PAGE + 1
    return cachestat(fd, start, end - start) >= pages or cachestat(fd, start, end - start) >= pages


def _run_ready(fd, seg_base, start, end, fetching):
    """``_pages_cached``, and no prefetched piece still being read overlaps the run (``cachestat``
    counts a page whose read is in flight as cached, and the reactor's ``sendfile`` of it would
    wait for the disk: such a read goes to the read pool, which waits for it)."""
    if fetching:
        lo, hi = seg_base + start, seg_base + end
        for p, e in fetching.items():
            if p < hi and lo < e:
                return False
    return _pages_cached(fd, start, end)


class Wal:
    def __init__(self, directory: str, segment_bytes: int, sync_dir: bool = True):
        self.dir = directory
        self.segment_bytes = segment_bytes
        self.sync_dir = sync_dir
        os.makedirs(directory, exist_ok=True)
        bases = sorted(int(n[: -len(SUFFIX)]) for n in os.listdir(directory) if n.endswith(SUFFIX) and n[:-len(SUFFIX)].isdigit())
        # Copy-on-write containers: readers in other threads see a consistent pair without locks.
        self.bases = bases
        self.fds = {b: os.open(os.path.join(directory, segment_name(b)), os.O_RDWR) for b in bases}
        self.graveyard = []  # fds of deleted segments, closed a while later (readers may hold them)
        self.active = bases[-1] if bases else None
        self.end = (bases[-1] + os.fstat(self.fds[bases[-1]]).st_size) if bases else 0
        # the group's entries not yet written, as the buffers they are made of (written with
        # pwritev: the batches go from the caller's bytes to the file, not through a joined copy)
        self._buf = []
        self._buf_start = self.end  # global position of _buf's first byte
        self._dirty = set()
        self._sizes = {}  # final sizes of retired segments
        self._null = os.open(os.devnull, os.O_WRONLY)  # warm(): sendfile's sink
        # Prefetched pieces whose reads may still be in flight (``fetch_in``): WAL position -> end.
        # Copy-on-write (the reactor reads it without a lock; writers take _fetching_lock).
        self.fetching = {}
        self._fetching_lock = threading.Lock()
        # Observability (writer thread writes, any thread reads): flushes = group commits that
        # wrote bytes; on_sync(seconds) is told each fdatasync's duration (the node's histogram).
        self.flushes = 0
        self.on_sync = None
        # writer thread: drop-behind (see DROP_BEHIND_BYTES; None: off) and the WAL position below
        # which the synced pages were dropped (what an earlier run left cached is left as it is)
        self.drop_behind = DROP_BEHIND_BYTES
        self._dropped = self.end
        self.synced_end = self.end  # writer thread: the WAL end at the last sync
        self.dsync = WRITE_DSYNC  # flush(dsync=True) may write and sync in one call
        # Every write, sync and cut of a segment goes through ``ops`` (storage/fileops.py: the
        # disk-fault seam; tests replace it).
        self.ops = fileops.from_environment()

    # -- recovery ---------------------------------------------------------------------------------

    def scan(self, start: int):
        """Yield ``(pos, type, payload)`` for every valid entry from ``start``; at the first invalid
        or torn entry cut the log there (truncate that segment, remove later ones)."""
        for base in list(self.bases):
            size = os.fstat(self.fds[base]).st_size
            if base + size <= start:
                continue
            stop = [size]
            yield from self.entries(base, max(0, start - base), stop)
            if stop[0] < size:
                self._cut(base, stop[0])
                return

    def entries(self, base: int, off: int = 0, stop=None):
        """Yield the valid entries of segment ``base`` from file offset ``off``; ``stop[0]`` is set
        to the offset where the valid entries end."""
        fd = self.fds[base]
        size = os.fstat(fd).st_size
        buf = b""
        buf_off = off  # file offset of buf[0]
        while off < size:
            rel = off - buf_off
            if len(buf) - rel < ENTRY_SIZE:
                buf, buf_off, rel = self._refill(fd, buf, buf_off, rel, ENTRY_SIZE)
                if len(buf) < ENTRY_SIZE:
                    break
            length, crc, etype = ENTRY.unpack_from(buf, rel)
            if length > MAX_PAYLOAD or off + ENTRY_SIZE + length > size or etype not in (T_BATCH, T_OPS):
                break
            if len(buf) - rel < ENTRY_SIZE + length:
                buf, buf_off, rel = self._refill(fd, buf, buf_off, rel, ENTRY_SIZE + length)
                if len(buf) < ENTRY_SIZE + length:
                    break
            payload = memoryview(buf)[rel + ENTRY_SIZE: rel + ENTRY_SIZE + length]
            ok = entry_crc(base, etype, (payload,)) == crc
            if ok:
                data = bytes(payload)
            payload.release()
            if not ok:
                break
            yield base + off, etype, data
            off += ENTRY_SIZE + length
        if stop is not None:
            stop[0] = min(off, size)

    @staticmethod
    def _refill(fd, buf, buf_off, rel, need):
        read_at = buf_off + len(buf)
        rest = buf[rel:]
        more = os.pread(fd, max(1 << 22, need - len(rest)), read_at)
        return rest + more, buf_off + rel, 0

    def _cut(self, base: int, off: int):
        os.ftruncate(self.fds[base], off)
        os.fsync(self.fds[base])
        for later in [b for b in self.bases if b > base]:
            self._unlink(later)
        self.active = base
        self.end = base + off
        self._buf_start = self.end

    def ensure_at(self, position: int):
        """Continue writing at ``position`` when the index already covers more than the files hold
        (a truncated segment): never reuse a position the index may still point at."""
        if position > self.end:
            self._new_segment(position)

    # -- writing (writer thread) ----------------------------------------------------------------

    def add(self, etype: int, parts, tail_crc=None) -> int:
        """Frame one entry into the group buffer; return its global position. ``tail_crc``: the
        last part's CRC-32, if known (``entry_crc``)."""
        length = sum(len(p) for p in parts)
        total = ENTRY_SIZE + length
        if self.active is None or (self.end - self.active > 0 and self.end - self.active + total > self.segment_bytes):
            self.flush()
            self._new_segment(self.end)
        pos = self.end
        buf = self._buf
        buf.append(ENTRY.pack(length, entry_crc(self.active, etype, parts, crc32_held, tail_crc), etype))
        buf.extend(parts)  # (immutable bytes or views of them: kept, not copied, until flush)
        self.end += total
        return pos

    def _new_segment(self, base: int):
        if self.active is not None:
            self._sizes[self.active] = self.end - self.active if self.end > self.active else 0
        path = os.path.join(self.dir, segment_name(base))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.fds = dict(self.fds)
        self.fds[base] = fd
        self.bases = self.bases + [base]
        self.active = base
        self.end = base
        self._buf_start = base
        if self.sync_dir:
            self._sync_dir()

    def _sync_dir(self):
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def flush(self, dsync=False):
        """Write the group's entries. ``dsync``: and sync them in the same system calls
        (``FileOps.pwritev_dsync``: no fdatasync after, so the writer thread does not wait for the
        GIL between the two) as ``sync`` would, when the segment held nothing unsynced before
        them; a caller that then calls ``sync`` finds only other segments to sync (or none).
        Raises ``WriteSyncFailed`` when such a call failed once bytes of it had reached the file
        (its sync failed: never a full disk), the write's own OSError otherwise."""
        if self._buf:
            fd = self.fds[self.active]
            parts = self._buf
            off = self._buf_start - self.active
            dsync = dsync and self.dsync and self.active not in self._dirty
            pwritev = self.ops.pwritev_dsync if dsync else self.ops.pwritev
            on_sync = self.on_sync
            i = 0
            while i < len(parts):
                if dsync:
                    t0 = time.perf_counter()
                    try:
                        n = pwritev(fd, parts[i:i + IOV_MAX], off)
                    except OSError as e:
                        if not self._dsync_unsupported(fd, off, e):
                            raise
                        dsync, pwritev = False, self.ops.pwritev
                        continue
                    if on_sync is not None:
                        on_sync(time.perf_counter() - t0)
                else:
                    n = pwritev(fd, parts[i:i + IOV_MAX], off)
                if n <= 0:
                    raise OSError(errno.EIO, "pwritev wrote nothing")
                off += n
                while n:  # drop what was written; a part written in part goes on as its rest
                    k = len(parts[i])
                    if n >= k:
                        n -= k
                        i += 1
                    else:
                        parts[i] = memoryview(parts[i])[n:]
                        n = 0
            if not dsync:
                self._dirty.add(self.active)
            self._buf = []
            self.flushes += 1
        self._buf_start = self.end

    def _dsync_unsupported(self, fd, off, error) -> bool:
        """A write-and-sync call at segment offset ``off`` failed with ``error``. True: RWF_DSYNC
        is not supported here (EOPNOTSUPP, EINVAL, refused before writing anything): plain writes
        and fdatasync from now on, this one included. Else, if the file now reaches past ``off``
        (its size was ``off`` before: the WAL only appends), the write happened and its sync
        failed: raises ``WriteSyncFailed``; a file that cannot be looked at counts as such. False:
        the write itself failed (its error stands: ENOSPC is a full disk)."""
        try:
            size = os.fstat(fd).st_size
        except OSError:
            size = None
        if size == off and error.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            self.dsync = False
            return True
        if size is None or size > off:
            raise WriteSyncFailed(error) from error
        return False

    def discard(self):
        """Forget the unflushed group (its transaction was aborted)."""
        self.end = self._buf_start
        self._buf = []

    def rollback(self, position: int):
        """Cut the log back to ``position``, the start of a group that failed (after ``discard``):
        its bytes, flushed or not, leave the files (segments it opened are removed), and the cut
        is synced, so a restart cannot replay a write that was answered with an error. Raises
        OSError when the disk refuses; the caller then stops writing."""
        self._buf = []
        bases = self.bases
        i = bisect.bisect_right(bases, position) - 1
        for later in bases[i + 1:] if i >= 0 else bases:
            self._unlink(later)
        if i < 0:  # the group opened the first segment and it is gone: as if the log were new
            self.active = None
            self.end = self._buf_start = position
            return
        base = bases[i]
        fd = self.fds[base]
        if os.fstat(fd).st_size > position - base:
            self.ops.ftruncate(fd, position - base)
            self.ops.fdatasync(fd)
        self._sizes.pop(base, None)
        self.active = base
        self.end = self._buf_start = position

    def sync(self):
        on_sync = self.on_sync
        fdatasync = self.ops.fdatasync
        for base in self._dirty:
            fd = self.fds.get(base)
            if fd is not None:
                if on_sync is None:
                    fdatasync(fd)
                    continue
                t0 = time.perf_counter()
                fdatasync(fd)
                on_sync(time.perf_counter() - t0)
        self._dirty.clear()
        self.synced_end = self.end

    def drop_behind_synced(self):
        """Writer thread, once a group is handed back (off its latency): drop the page cache pages
        of synced WAL bytes more than ``drop_behind`` behind the last sync's end (DROP_BEHIND_BYTES;
        advice only), once at least DROP_STEP_BYTES more are that far behind."""
        if self.drop_behind is None:
            return
        target = self.synced_end - self.drop_behind
        if target - self._dropped < DROP_STEP_BYTES:
            return
        bases = self.bases
        fds = self.fds
        lo = self._dropped
        i = max(0, bisect.bisect_right(bases, lo) - 1)
        for j in range(i, len(bases)):
            base = bases[j]
            if base >= target:
                break
            stop = min(target, bases[j + 1]) if j + 1 < len(bases) else target
            start = max(lo, base)
            fd = fds.get(base)
            if fd is not None and start < stop:
                try:
                    os.posix_fadvise(fd, start - base, stop - start, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
        self._dropped = target

    @property
    def dirty(self) -> bool:
        return bool(self._dirty)

    # -- reading (any thread) -------------------------------------------------------------------

    def segment_size(self, base: int) -> int:
        if base == self.active:
            return self.end - base
        fd = self.fds.get(base)
        return os.fstat(fd).st_size if fd is not None else 0

    def segment_of(self, pos: int):
        """The base of the segment holding ``pos``, or None if that segment is gone."""
        bases = self.bases
        i = bisect.bisect_right(bases, pos) - 1
        if i < 0:
            return None
        base = bases[i]
        if base == self.active:
            return base if pos < self.end else None
        size = self._sizes.get(base)
        if size is None:
            fd = self.fds.get(base)
            if fd is None:
                return None
            size = self._sizes[base] = os.fstat(fd).st_size
        return base if pos < base + size else None

    def read(self, pos: int, total: int, etype: int) -> memoryview:
        """The payload of the ``total``-byte entry at ``pos``, CRC-checked."""
        bases = self.bases
        i = bisect.bisect_right(bases, pos) - 1
        if i < 0:
            raise OffsetOutOfRange("position %d is no longer stored" % pos)
        base = bases[i]
        fd = self.fds.get(base)
        if fd is None:
            raise OffsetOutOfRange("position %d is no longer stored" % pos)
        data = os.pread(fd, total, pos - base)
        return self.check(data, base, etype, pos)

    @staticmethod
    def check(data, base: int, etype: int, pos: int) -> memoryview:
        if len(data) < ENTRY_SIZE:
            raise DataCorrupted("entry at %d is truncated" % pos)
        length, crc, t = ENTRY.unpack_from(data, 0)
        view = memoryview(data)[ENTRY_SIZE:]
        if t != etype or length != len(view) or entry_crc(base, t, (view,)) != crc:
            raise DataCorrupted("entry at %d failed its CRC" % pos)
        return view

    def read_batch(self, pos: int, total: int) -> bytes:
        """The record batch of the ``total``-byte batch entry at ``pos``, CRC-checked, read into
        its own bytes object (no slicing copy)."""
        bases = self.bases
        i = bisect.bisect_right(bases, pos) - 1
        fd = self.fds.get(bases[i]) if i >= 0 else None
        if fd is None:
            raise OffsetOutOfRange("position %d is no longer stored" % pos)
        base = bases[i]
        head = os.pread(fd, ENTRY_SIZE + 16, pos - base)
        body = os.pread(fd, total - ENTRY_SIZE - 16, pos - base + ENTRY_SIZE + 16)
        if len(head) < ENTRY_SIZE + 16:
            raise DataCorrupted("entry at %d is truncated" % pos)
        length, crc, t = ENTRY.unpack_from(head, 0)
        if t != T_BATCH or length != 16 + len(body) or entry_crc(base, t, (memoryview(head)[ENTRY_SIZE:], body)) != crc:
            raise DataCorrupted("entry at %d failed its CRC" % pos)
        return body

    def batch_span(self, pos: int, total: int, sid: int, base_offset: int, count: int, files: dict):
        """A FileSpan for the ``total``-byte batch entry at ``pos`` (stream ``sid``, batch at
        ``base_offset`` with ``count`` records per the index), or None when the quick check below
        fails (the caller then reads the entry with the full CRC check, ``read_batch``).

        The check reads only the entry's 54-byte head: framing, stream id, the batch header
        against the index, and the entry's CRC recomputed from the head's bytes and the batch's
        stored records CRC with ``crc32_combine`` (O(1), no pass over the records block). So every
        byte but the records block is verified, and the stored records CRC is the one the block
        had when it was written: a reader checking the block against it (SBP's frame CRC) detects
        a block that changed on disk. ``files`` maps segment base -> SegmentFile for this read."""
        base, f = self._segment_file(pos, files)
        off = pos - base
        return _span_from_head(os.pread(f.fd, BATCH_HEAD_SIZE, off), f, base, off, total, sid, base_offset, count)

    def cached_spans(self, sid: int, entries, files: dict):
        """``batch_span`` for each ``(pos, total, base_offset, count)`` without ever waiting for
        the disk (the reactor thread). None if any page of the batches is not in the page cache
        or any check fails (the caller goes to the read pool, which checks properly).

        With cachestat(2): one cachestat call per run of adjacent batches (the WAL's entry
        framing between them) counts every page, and each head is read with
        preadv2(RWF_NOWAIT) (which fails rather than wait should a page go meanwhile). The same
        checks as ``batch_span``; each span also gets its batch's CRC (``FileSpan.crc``), which
        the entry CRC check works out anyway, so a FETCH reply's frame CRC is one combine per
        batch. Without cachestat: ``_probed_spans``."""
        if _NOWAIT is None:
            return None
        if cachestat is None:
            return self._probed_spans(sid, entries, files)
        out = []
        buf = bytearray(BATCH_HEAD_SIZE)
        head = memoryview(buf)
        iov = [head]
        batch_hdr = head[BATCH_AT:]
        entry_mid = head[ENTRY_SIZE:BATCH_AT]
        preadv = os.preadv
        unpack = _BATCH_HEAD.unpack
        combine = crc32_combine
        bases = self.bases
        seg_end = -1
        f = None
        prefix_crcs = {}
        run_start = run_end = -1  # the current run of adjacent batches (file offsets)
        fetching = self.fetching  # prefetched pieces still being read: cachestat counts their pages
        try:
            for pos, total, base_offset, count in entries:
                if not (seg_base <= pos < seg_end if f is not None else False):
                    if run_end >= 0 and not _run_ready(f.fd, seg_base, run_start, run_end, fetching):
                        return None
                    seg_base, f = self._segment_file(pos, files)
                    i = bisect.bisect_right(bases, pos)
                    seg_end = bases[i] if i < len(bases) else 1 << 62
                    run_start = run_end = -1
                    prefix_crcs.clear()
                off = pos - seg_base
                if preadv(f.fd, iov, off, _NOWAIT) != BATCH_HEAD_SIZE:
                    return None
                (length, crc, t, h_sid, _ms, magic, h_base, h_count, _ts, records_crc,
                 records_len) = unpack(buf)
                if (t != T_BATCH or length != total - ENTRY_SIZE or h_sid != sid or magic != _BATCH_MAGIC
                        or h_base != base_offset or h_count != count or records_len != total - BATCH_HEAD_SIZE):
                    return None
                # the batch's CRC (header bytes + stored records CRC), then the entry's from it
                bcrc = combine(crc32(batch_hdr), records_crc, records_len)
                pcrc = prefix_crcs.get(length)
                if pcrc is None:
                    pcrc = prefix_crcs[length] = crc32(_CRC_PREFIX.pack(seg_base, length, t))
                if combine(crc32(entry_mid, pcrc), bcrc, total - BATCH_AT) != crc:
                    return None
                out.append(FileSpan(f, off + BATCH_AT, total - BATCH_AT, bytes(batch_hdr), bcrc))
                if run_end >= 0 and 0 <= off - run_end <= _PAGE:
                    run_end = off + total  # the next batch in the same file (the WAL's entry framing between)
                else:
                    if run_end >= 0 and not _run_ready(f.fd, seg_base, run_start, run_end, fetching):
                        return None
                    run_start, run_end = off, off + total
            if run_end >= 0 and not _run_ready(f.fd, seg_base, run_start, run_end, fetching):
                return None
        except OSError:  # EAGAIN: not in the page cache; EOPNOTSUPP: the file system cannot tell
            return None
        return out

    def _probed_spans(self, sid: int, entries, files: dict):
        """``cached_spans`` without cachestat(2): the heads are read with preadv2(RWF_NOWAIT),
        and each batch's last byte (plus one byte every 64 KiB back from it in batches over 68
        KiB) is probed the same way, one batch's last byte in the same read as the next batch's
        head when they are adjacent."""
        out = []
        buf = bytearray(1 + BATCH_HEAD_SIZE)
        view = memoryview(buf)
        head = view[1:]
        whole = [view]
        head_only = [head]
        preadv = os.preadv
        prev_f = prev_end = None
        try:
            for pos, total, base_offset, count in entries:
                base, f = self._segment_file(pos, files)
                off = pos - base
                if f is prev_f and off == prev_end:
                    n = preadv(f.fd, whole, off - 1, _NOWAIT) - 1  # the previous batch's last byte too
                else:
                    if prev_f is not None and preadv(prev_f.fd, [view[:1]], prev_end - 1, _NOWAIT) != 1:
                        return None
                    n = preadv(f.fd, head_only, off, _NOWAIT)
                if n != BATCH_HEAD_SIZE:
                    return None
                for at in range(off + total - 1 - (64 << 10), off + 4096, -(64 << 10)):
                    if preadv(f.fd, [view[:1]], at, _NOWAIT) != 1:
                        return None
                span = _span_from_head(head, f, base, off, total, sid, base_offset, count)
                if span is None:
                    return None
                out.append(span)
                prev_f, prev_end = f, off + total
            if prev_f is not None and preadv(prev_f.fd, [view[:1]], prev_end - 1, _NOWAIT) != 1:
                return None
        except OSError:  # EAGAIN: not in the page cache; EOPNOTSUPP: the file system cannot tell
            return None
        return out

    def uncached(self, pos: int, nbytes: int, piece: int = 4 << 20, check: int = 16 << 20):
        """The parts of the WAL's ``nbytes`` from position ``pos`` (up to what is written, across
        segments) that have pages missing from the page cache, as ``(pos, length)`` pieces of at
        most ``piece`` bytes (``will_need`` reads at most the device's read-ahead size, 8 MiB
        here, per call): one cachestat call per ``check`` bytes, never waiting (the reactor
        thread); the pieces of a range with pages missing are all named. Without cachestat(2)
        every piece is named."""
        out = []
        bases = self.bases
        i = bisect.bisect_right(bases, pos) - 1
        if i < 0:
            return out
        end = pos + nbytes
        while pos < end and i < len(bases):
            base = bases[i]
            fd = self.fds.get(base)
            if fd is None:
                break
            if base == self.active:
                stop = min(end, self._buf_start)  # written to the file so far
            else:
                size = self._sizes.get(base)
                stop = min(end, base + (size if size is not None else self.segment_size(base)))
            while pos < stop:
                n = min(check, stop - pos)
                off = pos - base
                if cachestat is None or cachestat(fd, off, n) < (off + n - 1) // _PAGE - off // _PAGE + 1:
                    out.extend((p, min(piece, pos + n - p)) for p in range(pos, pos + n, piece))
                pos += n
            i += 1
            if i < len(bases):
                pos = max(pos, bases[i])
        return out

    def will_need(self, pieces):
        """Ask the kernel to read the ``(pos, length)`` pieces of the WAL into the page cache
        (``posix_fadvise(WILLNEED)``: the reads are submitted, none is waited for). Read pool: it
        may block while the requests are submitted. Pieces no longer stored are skipped."""
        bases, fds = self.bases, self.fds
        for pos, length in pieces:
            i = bisect.bisect_right(bases, pos) - 1
            fd = fds.get(bases[i]) if i >= 0 else None
            if fd is None:
                continue
            try:
                os.posix_fadvise(fd, pos - bases[i], length, os.POSIX_FADV_WILLNEED)
            except OSError:  # the segment went away meanwhile (its fd closed): nothing to read
                pass

    def mark_fetching(self, pieces):
        """Reactor: the ``(pos, length)`` pieces ``fetch_in`` is about to read in; until it has,
        ``cached_spans`` sends reads of them to the read pool. Returns the pieces not already
        being read (the others are left to the task reading them)."""
        with self._fetching_lock:
            cur = self.fetching
            new = [(p, n) for p, n in pieces if p not in cur]
            if new:
                d = dict(cur)
                for p, n in new:
                    d[p] = p + n
                self.fetching = d
        return new

    def unmark_fetching(self, positions):
        with self._fetching_lock:
            cur = self.fetching
            if any(p in cur for p in positions):
                d = dict(cur)
                for p in positions:
                    d.pop(p, None)
                self.fetching = d

    def fetch_in(self, pieces):
        """Read pool: ``will_need`` the ``(pos, length)`` pieces (marked with ``mark_fetching``),
        then wait for each to be in the page cache (``sendfile`` to /dev/null: waits for the reads
        in flight, copies nothing) and unmark it, so the reactor serves it from then on."""
        try:
            self.will_need(pieces)
            bases, fds, null = self.bases, self.fds, self._null
            for pos, length in pieces:
                try:
                    i = bisect.bisect_right(bases, pos) - 1
                    fd = fds.get(bases[i]) if i >= 0 else None
                    off, left = pos - bases[i], length
                    while fd is not None and left > 0:
                        n = os.sendfile(null, fd, off, left)
                        if n <= 0:
                            break  # the segment ends here (the active one, or cut)
                        off += n
                        left -= n
                except OSError:  # the segment went away meanwhile: nothing to wait for
                    pass
                finally:
                    self.unmark_fetching((pos,))
        finally:
            self.unmark_fetching([p for p, _ in pieces])

    def _segment_file(self, pos: int, files: dict):
        """(segment base, SegmentFile) of the segment holding ``pos``, one per read in ``files``."""
        bases = self.bases
        i = bisect.bisect_right(bases, pos) - 1
        base = bases[i] if i >= 0 else None
        f = files.get(base)
        if f is None:
            fd = self.fds.get(base) if base is not None else None
            if fd is None:
                raise OffsetOutOfRange("position %d is no longer stored" % pos)
            f = files[base] = SegmentFile(fd)
        return base, f

    def warm(self, spans):
        """Bring the spans' bytes into the page cache (read pool), so a later ``sendfile`` of them
        on the reactor thread finds them in memory instead of waiting for the disk. ``sendfile``
        to /dev/null reads the pages without copying them anywhere. A file shorter than a span
        (truncated behind our back) raises DataCorrupted."""
        ranges = {}
        for s in spans:
            r = ranges.get(s.file)
            end = s.offset + s.length
            if r is None:
                ranges[s.file] = [s.offset, end]
            else:
                r[0] = min(r[0], s.offset)
                r[1] = max(r[1], end)
        if not ranges:
            return
        null = self._null
        for f, (lo, hi) in ranges.items():
            while lo < hi:
                n = os.sendfile(null, f.fd, lo, hi - lo)
                if n <= 0:
                    raise DataCorrupted("a WAL segment ends before the batches the index names")
                lo += n

    def read_span(self, pos: int, total: int):
        """Raw bytes of ``total`` bytes at ``pos`` in one segment and that segment's base."""
        bases = self.bases
        i = bisect.bisect_right(bases, pos) - 1
        if i < 0 or bases[i] not in self.fds:
            raise OffsetOutOfRange("position %d is no longer stored" % pos)
        base = bases[i]
        return os.pread(self.fds[base], total, pos - base), base

    # -- retention (writer thread) ----------------------------------------------------------------

    def deletable(self, watermark: int):
        """Segments wholly below ``watermark`` (never the active one)."""
        out = []
        bases = self.bases
        for i, base in enumerate(bases[:-1]):
            if bases[i + 1] <= watermark and base != self.active:
                out.append(base)
        return out

    def delete(self, base: int):
        self._unlink(base)

    def _unlink(self, base: int):
        try:
            os.unlink(os.path.join(self.dir, segment_name(base)))
        except FileNotFoundError:
            pass
        fds = dict(self.fds)
        fd = fds.pop(base, None)
        self.fds = fds
        self.bases = [b for b in self.bases if b != base]
        self._dirty.discard(base)
        if fd is not None:
            self.graveyard.append((time.monotonic(), fd))

    def reap(self, grace_s: float = GRAVE_S):
        """The fds of segments deleted more than ``grace_s`` ago (for the caller to close): a reader
        that looked an fd up just before the delete finishes with the file it meant."""
        cutoff = time.monotonic() - grace_s
        old = [fd for t, fd in self.graveyard if t <= cutoff]
        self.graveyard = [(t, fd) for t, fd in self.graveyard if t > cutoff]
        return old

    def close(self):
        for fd in list(self.fds.values()) + [fd for _, fd in self.graveyard]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
        self.graveyard = []
        if self._null is not None:
            os.close(self._null)
            self._null = None
