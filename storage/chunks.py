"""The content-addressed chunk store: chunks packed into a few large append-only files.

A pack entry is ``u32 len | u32 crc | addr32 | data`` with the CRC over (pack id, position, addr,
data), so a misplaced or stale entry never validates. LMDB maps addr -> (pack, position, length,
arrival seq, pinned, added ms), seq -> addr (the swarm CHUNKS index), addr -> refcount, the
zero-reference candidates, and each pack's live bytes. A background sweep reclaims unpinned chunks
whose refcount stayed 0 for the grace period; a pack whose live bytes reach 0 is deleted.
"""

import errno
import os
import struct
import time

from twisted.internet import defer
from twisted.logger import Logger

from storage import errors, index
from storage import sha256 as multi_sha256
from storage.commit import now_ms
from storage.crc import crc32
from storage.index import U64

PACK_ENTRY = struct.Struct(">II")
PACK_ENTRY_SIZE = PACK_ENTRY.size + 32
CHUNK_VAL = struct.Struct(">IQIQBQ")  # pack, position, data length, seq, pinned, added ms
U32 = struct.Struct(">I")
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)
SWEEP_BATCH = 20000
READ_SPAN = 8 << 20  # get_many reads neighbouring pack entries together up to about this much
COMPACT_BELOW = 0.25  # rewrite a pack's live chunks elsewhere when they fill less than this of it


HASH_IN_POOL_BYTES = 256 * 1024


def _digests(datas):
    # equal-length chunks side by side on the multi-buffer kernel where it pays (storage/sha256.py);
    # both it and hashlib release the GIL for big chunks
    return multi_sha256.digests(datas)


def _pack_crc(pack_id, pos, addr, data):
    return crc32(data, crc32(struct.pack(">IQ", pack_id, pos) + addr))


IOV_MAX = 1024  # Linux's limit on buffers per pwritev


def _pwritev_all(fd, parts, pos):
    """Write ``parts`` (bytes-likes) back to back at ``pos`` with as few ``pwritev`` calls as the
    kernel allows: the chunks' bytes go from the received buffers to the file with no joined copy
    (one pass over each byte fewer than ``b"".join`` + ``pwrite``)."""
    views = [memoryview(p) for p in parts if len(p)]
    i = 0
    while i < len(views):
        n = os.pwritev(fd, views[i : i + IOV_MAX], pos)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        pos += n
        while n:  # drop what was written, cut the part written in half
            k = len(views[i])
            if n >= k:
                n -= k
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


class Packs:
    """Pack files; appended by the writer thread, read from any thread."""

    def __init__(self, directory, pack_bytes, sync_dir=True):
        self.dir = directory
        self.pack_bytes = pack_bytes
        self.sync_dir = sync_dir
        os.makedirs(directory, exist_ok=True)
        ids = sorted(int(n[5:-4]) for n in os.listdir(directory) if n.startswith("pack-") and n.endswith(".dat"))
        self.fds = {i: os.open(self._path(i), os.O_RDWR) for i in ids}
        self.graveyard = []
        self.active = ids[-1] if ids else None
        self.size = os.fstat(self.fds[self.active]).st_size if ids else 0
        self._dirty = set()

    def _path(self, pack_id):
        return os.path.join(self.dir, "pack-%08d.dat" % pack_id)

    def append(self, addr, data):
        total = PACK_ENTRY_SIZE + len(data)
        if self.active is None or (self.size > 0 and self.size + total > self.pack_bytes):
            self._roll()
        pos = self.size
        head = PACK_ENTRY.pack(len(data), _pack_crc(self.active, pos, addr, data)) + addr
        n = os.pwritev(self.fds[self.active], [head, data], pos)
        if n != total:  # short write: finish it
            buf = (head + bytes(data))[n:]
            off = pos + n
            while buf:
                k = os.pwrite(self.fds[self.active], buf, off)
                buf, off = buf[k:], off + k
        self.size += total
        self._dirty.add(self.active)
        return self.active, pos, total

    def append_many(self, entries):
        """Append ``[(addr, data), ...]`` with one write per pack touched (a full pack rolls over
        as in :meth:`append`); returns ``[(pack_id, pos, total), ...]`` in order."""
        out = []
        i, n = 0, len(entries)
        while i < n:
            addr, data = entries[i]
            first = PACK_ENTRY_SIZE + len(data)
            if self.active is None or (self.size > 0 and self.size + first > self.pack_bytes):
                self._roll()
            pack_id, start = self.active, self.size
            pos, parts = start, []
            while i < n:
                addr, data = entries[i]
                total = PACK_ENTRY_SIZE + len(data)
                if parts and pos + total > self.pack_bytes:
                    break
                parts.append(PACK_ENTRY.pack(len(data), _pack_crc(pack_id, pos, addr, data)))
                parts.append(addr)
                parts.append(data)
                out.append((pack_id, pos, total))
                pos += total
                i += 1
            _pwritev_all(self.fds[pack_id], parts, start)
            self.size = pos
            self._dirty.add(pack_id)
        return out

    def _roll(self):
        new = 1 if self.active is None else self.active + 1
        fd = os.open(self._path(new), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fds = dict(self.fds)
        fds[new] = fd
        self.fds = fds
        self.active, self.size = new, 0
        if self.sync_dir:
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def read_span(self, pack_id, pos, length):
        """``length`` raw bytes of a pack from ``pos`` (several neighbouring entries at once), or
        None if the pack is gone; short if the file ends first."""
        fd = self.fds.get(pack_id)
        if fd is None:
            return None
        return os.pread(fd, length, pos)

    def read(self, pack_id, pos, length, addr):
        fd = self.fds.get(pack_id)
        if fd is None:
            raise errors.ChunkNotFound("chunk %s is gone" % addr.hex())
        raw = os.pread(fd, PACK_ENTRY_SIZE + length, pos)
        if len(raw) != PACK_ENTRY_SIZE + length:
            raise errors.DataCorrupted("chunk %s is truncated" % addr.hex())
        n, crc = PACK_ENTRY.unpack_from(raw, 0)
        data = memoryview(raw)[PACK_ENTRY_SIZE:]
        if n != length or raw[8:40] != addr or _pack_crc(pack_id, pos, addr, data) != crc:
            raise errors.DataCorrupted("chunk %s failed its CRC" % addr.hex())
        return data

    def read_cached(self, pack_id, pos, length, addr):
        """``read`` from the page cache only (preadv2 RWF_NOWAIT): None when it would block."""
        fd = self.fds.get(pack_id)
        if fd is None:
            raise errors.ChunkNotFound("chunk %s is gone" % addr.hex())
        if _RWF_NOWAIT is None:
            return None
        total = PACK_ENTRY_SIZE + length
        raw = bytearray(total)
        try:
            n = os.preadv(fd, [raw], pos, _RWF_NOWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no RWF_NOWAIT here
                return None
            raise
        if n != total:
            # Part of it is not cached (or the file is short: ``read`` will say which).
            return None
        n, crc = PACK_ENTRY.unpack_from(raw, 0)
        data = memoryview(raw)[PACK_ENTRY_SIZE:]
        if n != length or raw[8:40] != addr or _pack_crc(pack_id, pos, addr, data) != crc:
            raise errors.DataCorrupted("chunk %s failed its CRC" % addr.hex())
        return data

    def entries(self, pack_id):
        """(position, addr, size) of every entry framed in the pack, in file order."""
        fd = self.fds.get(pack_id)
        if fd is None:
            return
        size = os.fstat(fd).st_size
        pos = 0
        while pos + PACK_ENTRY_SIZE <= size:
            head = os.pread(fd, PACK_ENTRY_SIZE, pos)
            n, _ = PACK_ENTRY.unpack_from(head, 0)
            if pos + PACK_ENTRY_SIZE + n > size:
                return
            yield pos, head[8:40], n
            pos += PACK_ENTRY_SIZE + n

    def file_size(self, pack_id):
        fd = self.fds.get(pack_id)
        return os.fstat(fd).st_size if fd is not None else 0

    @property
    def dirty(self):
        return bool(self._dirty)

    def sync(self):
        for pack_id in self._dirty:
            fd = self.fds.get(pack_id)
            if fd is not None:
                os.fdatasync(fd)
        self._dirty.clear()

    def delete(self, pack_id):
        if pack_id == self.active:
            return
        fds = dict(self.fds)
        fd = fds.pop(pack_id, None)
        self.fds = fds
        self._dirty.discard(pack_id)
        try:
            os.unlink(self._path(pack_id))
        except FileNotFoundError:
            pass
        if fd is not None:
            self.graveyard.append((time.monotonic(), fd))

    def reap(self, grace_s: float = 30.0):
        """Close the fds of packs deleted more than ``grace_s`` ago (readers may still hold them)."""
        cutoff = time.monotonic() - grace_s
        for t, fd in self.graveyard:
            if t <= cutoff:
                os.close(fd)
        self.graveyard = [(t, fd) for t, fd in self.graveyard if t > cutoff]

    def close(self):
        for fd in list(self.fds.values()) + [fd for _, fd in self.graveyard]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}
        self.graveyard = []


class ChunkStore:
    log = Logger()

    def __init__(self, core, grace_s):
        self._core = core
        self._grace_ms = int(grace_s * 1000)
        self._last_seq = 0
        self._waiters = []  # [(seq, Deferred)]
        # put_many's batches are hashed together across callers (and connections), so the
        # multi-buffer SHA-256's lanes fill even when each read brings one big chunk
        self._hashing = multi_sha256.Gatherer(lambda fn: self._core.in_pool(fn), max(1, min(4, os.cpu_count() or 1)))

    def load(self):
        """At open, after recovery: the last arrival sequence number (blocking)."""
        with self._core.env.begin() as txn:
            raw = txn.get(index.CHUNK_SEQ, db=self._core.dbs[index.SYS])
            self._last_seq = U64.unpack(raw)[0] if raw else 0

    def _db(self, n):
        return self._core.dbs[n]

    # -- writes ---------------------------------------------------------------------------------

    def put(self, data, pin=False):
        """Store ``data``; fires with its SHA-256 address once durable (idempotent)."""
        data = bytes(data)
        return self._core.transact(lambda raw: self.put_in(raw, data, pin), len(data) + 64)

    def put_in(self, raw, data, pin=False):
        """Writer thread, inside ``raw``'s transaction: store ``data``, return its address."""
        return self.put_many_in(raw, [data], pin)[0]

    def get_in(self, raw, addr):
        """Writer thread, inside ``raw``'s transaction (so chunks put earlier in the same group
        are seen): chunk ``addr``'s bytes (CRC checked), or None if the store does not hold it."""
        found = raw.get(index.CHUNKS, bytes(addr))
        if found is None:
            return None
        pack_id, pos, size = CHUNK_VAL.unpack(found)[:3]
        return self._core.packs.read(pack_id, pos, size, bytes(addr))

    def put_many(self, datas, pin=False, addrs=None, more=False):
        """Store several chunks in one write transaction (one pack write, one WAL entry); fires
        with their addresses, in order, once durable (idempotent, like :meth:`put`). ``datas`` may
        be memoryviews: they are not copied, so their buffers must stay unchanged until it fires.

        ``addrs``, if given, are the chunks' SHA-256 addresses, already computed and checked by
        the caller (the swarm syncer verifies every delivered chunk against its address), so they
        are not hashed again. Otherwise a big batch is hashed by the read pool first, so the
        writer thread (which every write waits on) does not, together with the other batches
        waiting to be hashed then (``storage.sha256.Gatherer``; ``more``: the caller is already
        receiving its next chunks, so waiting a moment for them fills the hashing lanes)."""
        datas = [d if isinstance(d, (bytes, memoryview)) else bytes(d) for d in datas]
        if addrs is not None:
            addrs = [bytes(a) for a in addrs]
            if len(addrs) != len(datas) or any(len(a) != 32 for a in addrs):
                return defer.fail(errors.InvalidRequest("put_many needs one 32-byte address per chunk"))
        if not datas:
            return defer.succeed([])
        size = sum(len(d) for d in datas)
        nbytes = size + 64 * len(datas)
        if addrs is None and size >= HASH_IN_POOL_BYTES:
            d = self._hashing.submit(datas, more)
            d.addCallback(lambda hashed: self._core.transact(lambda raw: self.put_many_in(raw, datas, pin, hashed), nbytes))
            return d
        return self._core.transact(lambda raw: self.put_many_in(raw, datas, pin, addrs), nbytes)

    def put_many_in(self, raw, datas, pin=False, addrs=None):
        """Writer thread, inside ``raw``'s transaction: :meth:`put_in` for several chunks, with one
        pack write, one ``putmulti`` per table and the counters updated once; returns their
        addresses (``addrs``, if the caller already has them)."""
        out = addrs if addrs is not None else _digests(datas)
        chunks_db = raw.dbs[index.CHUNKS]
        lookup = raw.txn.get
        fresh, seen = [], set()
        for addr, data in zip(out, datas):
            if addr in seen:
                continue
            seen.add(addr)
            existing = lookup(addr, db=chunks_db)
            if existing is None:
                fresh.append((addr, data))
            elif pin:
                fields = list(CHUNK_VAL.unpack(existing))
                if not fields[4]:
                    fields[4] = 1
                    raw.put(index.CHUNKS, addr, CHUNK_VAL.pack(*fields))
                    raw.delete(index.CHUNKFREE, addr)
        if not fresh:
            return out
        placed = self._core.packs.append_many(fresh)
        prev = raw.get(index.SYS, index.CHUNK_SEQ)
        first = (U64.unpack(prev)[0] if prev else 0) + 1
        added = now_ms()
        pinned = 1 if pin else 0
        pack_val = CHUNK_VAL.pack
        rows = [(addr, pack_val(pack_id, pos, len(data), seq, pinned, added))
                for seq, ((addr, data), (pack_id, pos, total)) in enumerate(zip(fresh, placed), first)]
        seqs = [(U64.pack(seq), addr) for seq, (addr, _) in enumerate(fresh, first)]
        # one C call per table for the whole batch, recorded for the WAL exactly as
        # RawTxn.put records each write
        raw.txn.cursor(db=chunks_db).putmulti(rows)
        raw.txn.cursor(db=raw.dbs[index.CHUNKSEQ]).putmulti(seqs)
        raw.ops.extend((index.OP_PUT, index.CHUNKS, k, v) for k, v in rows)
        raw.ops.extend((index.OP_PUT, index.CHUNKSEQ, k, v) for k, v in seqs)
        seq = first + len(fresh) - 1
        if not pin:
            for addr, _ in fresh:
                if raw.get(index.CHUNKREF, addr) is None:
                    raw.put(index.CHUNKFREE, addr, U64.pack(added))
        raw.put(index.SYS, index.CHUNK_SEQ, U64.pack(seq))
        live = {}
        for pack_id, _, total in placed:
            live[pack_id] = live.get(pack_id, 0) + total
        for pack_id, n in live.items():
            key = U32.pack(pack_id)
            cur = raw.get(index.PACKS, key)
            raw.put(index.PACKS, key, U64.pack((U64.unpack(cur)[0] if cur else 0) + n))
        raw.on_reactor.append(lambda: self._arrived(seq))
        return out

    def _arrived(self, seq):
        if seq > self._last_seq:
            self._last_seq = seq
        if self._waiters:
            keep = []
            for want, d in self._waiters:
                if self._last_seq >= want:
                    d.callback(None)
                else:
                    keep.append((want, d))
            self._waiters = keep

    # -- reads ----------------------------------------------------------------------------------

    def _lookup(self, addr):
        raw = self._core.snapshot().get(bytes(addr), db=self._db(index.CHUNKS))
        return CHUNK_VAL.unpack(raw) if raw is not None else None

    def get(self, addr, offset=0, length=None):
        addr = bytes(addr)
        found = self._lookup(addr) if len(addr) == 32 else None
        if found is None:
            return defer.fail(errors.ChunkNotFound("no chunk %s" % addr.hex()))
        pack_id, pos, size = found[0], found[1], found[2]
        if offset < 0 or offset > size or (length is not None and length < 0):
            return defer.fail(errors.InvalidRequest("range %d+%r outside a %d-byte chunk" % (offset, length, size)))
        end = size if length is None else min(size, offset + length)

        def read():
            data = self._core.packs.read(pack_id, pos, size, addr)
            return bytes(data[offset:end])

        return self._core.in_pool(read)

    def get_cached(self, addr):
        """Chunk ``addr``'s bytes (CRC checked) read at once on the calling thread when its pack
        pages are in the page cache, or None when reading would wait for the disk (use ``get``):
        never blocks on I/O, so the reactor may call it. ChunkNotFound / DataCorrupted as ``get``."""
        addr = bytes(addr)
        found = self._lookup(addr) if len(addr) == 32 else None
        if found is None:
            raise errors.ChunkNotFound("no chunk %s" % addr.hex())
        pack_id, pos, size = found[0], found[1], found[2]
        return self._core.packs.read_cached(pack_id, pos, size, addr)

    def get_many(self, addrs):
        """Whole chunks for a list of addresses, read in one pool job from one snapshot:
        neighbouring pack entries are read with one pread. Fires with a list holding, per address,
        the chunk's bytes, None if there is no such chunk, or a DataCorrupted error if its entry
        fails its check (the others are still served)."""
        addrs = [bytes(a) for a in addrs]
        if not addrs:
            return defer.succeed([])
        return self._core.in_pool(self._read_many, addrs)

    def _read_many(self, addrs):
        """Pool thread: look every address up, then read runs of back-to-back entries."""
        db = self._db(index.CHUNKS)
        unpack = CHUNK_VAL.unpack
        found = []
        with self._core.env.begin(buffers=False) as txn:
            get = txn.get
            for i, addr in enumerate(addrs):
                raw = get(addr, db=db) if len(addr) == 32 else None
                if raw is not None:
                    pack_id, pos, size = unpack(raw)[:3]
                    found.append((pack_id, pos, size, i))
        found.sort()
        out = [None] * len(addrs)
        packs = self._core.packs
        entry = PACK_ENTRY
        j, n = 0, len(found)
        while j < n:
            pack_id, start, size, _ = found[j]
            end = start + PACK_ENTRY_SIZE + size
            k = j + 1
            while k < n and found[k][0] == pack_id and found[k][1] == end and end - start < READ_SPAN:
                end += PACK_ENTRY_SIZE + found[k][2]
                k += 1
            buf = packs.read_span(pack_id, start, end - start)
            for pack_id, pos, size, i in found[j:k]:
                addr = addrs[i]
                if buf is None:
                    continue  # the pack went away (swept) since the snapshot: no such chunk now
                off = pos - start
                if len(buf) < off + PACK_ENTRY_SIZE + size:
                    out[i] = errors.DataCorrupted("chunk %s is truncated" % addr.hex())
                    continue
                length, crc = entry.unpack_from(buf, off)
                data = buf[off + PACK_ENTRY_SIZE:off + PACK_ENTRY_SIZE + size]
                if length != size or buf[off + 8:off + PACK_ENTRY_SIZE] != addr or _pack_crc(pack_id, pos, addr, data) != crc:
                    out[i] = errors.DataCorrupted("chunk %s failed its CRC" % addr.hex())
                    continue
                out[i] = data
            j = k
        return out

    def has(self, addr) -> bool:
        return self._lookup(bytes(addr)) is not None

    def has_many(self, addrs):
        db = self._db(index.CHUNKS)
        txn = self._core.snapshot()
        return [txn.get(bytes(a), db=db) is not None for a in addrs]

    def info(self, addr):
        """(size, seq, pinned, refcount) or None."""
        txn = self._core.snapshot()
        raw = txn.get(bytes(addr), db=self._db(index.CHUNKS))
        if raw is None:
            return None
        ref = txn.get(bytes(addr), db=self._db(index.CHUNKREF))
        _, _, size, seq, pinned, _ = CHUNK_VAL.unpack(raw)
        return size, seq, bool(pinned), U64.unpack(ref)[0] if ref else 0

    def last_seq(self) -> int:
        return self._last_seq

    def by_seq(self, from_seq, to_seq, limit):
        out = []
        if limit <= 0:
            return out
        cur = self._core.snapshot().cursor(db=self._db(index.CHUNKSEQ))
        if not cur.set_range(U64.pack(max(0, from_seq))):
            return out
        for key, addr in cur:
            seq = U64.unpack(key)[0]
            if seq > to_seq:
                break
            out.append((seq, addr))
            if len(out) >= limit:
                break
        return out

    def wait_for_seq(self, seq):
        if self._last_seq >= seq or self._core.closed:
            return defer.succeed(None)
        entry = [seq, None]

        def cancel(d):
            try:
                self._waiters.remove(tuple(entry))
            except ValueError:
                pass

        d = defer.Deferred(cancel)
        entry[1] = d
        self._waiters.append(tuple(entry))
        return d

    def close_waiters(self):
        """The store closes: every ``wait_for_seq`` fires."""
        waiters, self._waiters = self._waiters, []
        for _, d in waiters:
            d.callback(None)

    # -- references (inside metadata transactions, writer thread) --------------------------------

    @staticmethod
    def incref_in(raw, addrs):
        """Writer thread, inside ``raw``'s transaction: one more reference to each chunk."""
        for addr in addrs:
            addr = bytes(addr)
            cur = raw.get(index.CHUNKREF, addr)
            raw.put(index.CHUNKREF, addr, U64.pack((U64.unpack(cur)[0] if cur else 0) + 1))
            raw.delete(index.CHUNKFREE, addr)

    @staticmethod
    def decref_in(raw, addrs):
        """Writer thread, inside ``raw``'s transaction: one reference less to each chunk; at 0 an
        unpinned chunk becomes a sweep candidate."""
        for addr in addrs:
            addr = bytes(addr)
            cur = raw.get(index.CHUNKREF, addr)
            n = (U64.unpack(cur)[0] if cur else 0) - 1
            if n > 0:
                raw.put(index.CHUNKREF, addr, U64.pack(n))
                continue
            if cur is not None:
                raw.delete(index.CHUNKREF, addr)
            info = raw.get(index.CHUNKS, addr)
            if info is not None and not CHUNK_VAL.unpack(info)[4]:
                raw.put(index.CHUNKFREE, addr, U64.pack(now_ms()))

    # -- sweep ----------------------------------------------------------------------------------

    def sweep_tick(self):
        """Reclaim chunks unreferenced past the grace period and compact a mostly-dead pack."""
        core = self._core
        if core.closed or core.failed:
            return None
        if core.snapshot().stat(self._db(index.CHUNKFREE))["entries"] == 0 and self._compaction_target(
                core.snapshot().cursor(db=self._db(index.PACKS))) is None:
            return None
        return core.transact(self._sweep)

    def _compaction_target(self, cursor):
        """The non-active pack with the least live data, if under COMPACT_BELOW of its size."""
        packs = self._core.packs
        best = None
        for key, value in cursor:
            pack_id, live = U32.unpack(key)[0], U64.unpack(value)[0]
            if pack_id == packs.active:
                continue
            size = packs.file_size(pack_id)
            if size and live < size * COMPACT_BELOW and (best is None or live < best[1]):
                best = (pack_id, live)
        return best[0] if best else None

    def _sweep(self, raw, cutoff=None):
        """Writer thread: drop unpinned chunks whose refcount stayed 0 past the grace period."""
        if cutoff is None:
            cutoff = now_ms() - self._grace_ms
        victims = []
        for addr, since in raw.cursor(index.CHUNKFREE):
            if U64.unpack(since)[0] <= cutoff:
                victims.append(addr)
                if len(victims) >= SWEEP_BATCH:
                    break
        freed = {}
        for addr in victims:
            raw.delete(index.CHUNKFREE, addr)
            info = raw.get(index.CHUNKS, addr)
            if info is None or raw.get(index.CHUNKREF, addr) is not None:
                continue
            pack_id, pos, size, seq, pinned, _ = CHUNK_VAL.unpack(info)
            if pinned:
                continue
            raw.delete(index.CHUNKS, addr)
            raw.delete(index.CHUNKSEQ, U64.pack(seq))
            freed[pack_id] = freed.get(pack_id, 0) + PACK_ENTRY_SIZE + size
        packs = self._core.packs
        empty = []
        for pack_id, n in freed.items():
            key = U32.pack(pack_id)
            live = raw.get(index.PACKS, key)
            left = max(0, (U64.unpack(live)[0] if live else 0) - n)
            if left == 0 and pack_id != packs.active:
                raw.delete(index.PACKS, key)
                empty.append(pack_id)
            else:
                raw.put(index.PACKS, key, U64.pack(left))
        moved = 0
        target = self._compaction_target(raw.cursor(index.PACKS))
        if target is not None:
            moved = self._compact(raw, target)
            empty.append(target)
        packs.reap()
        if empty:
            def drop():
                if moved:
                    packs.sync()  # the moved copies are on disk before the old pack goes
                for pack_id in empty:
                    packs.delete(pack_id)

            raw.after_commit.append(drop)
        if victims or moved:
            self.log.info("swept {n} unreferenced chunks, moved {moved} out of pack {pack}",
                          n=len(victims), moved=moved, pack=target)
        return len(victims)

    def _compact(self, raw, pack_id):
        """Writer thread: copy the chunks of ``pack_id`` the index still points at to the active
        pack and repoint them (the index change is a WAL entry, so replay agrees)."""
        packs = self._core.packs
        gained = {}
        moved = 0
        for pos, addr, size in list(packs.entries(pack_id)):
            info = raw.get(index.CHUNKS, addr)
            if info is None:
                continue
            fields = list(CHUNK_VAL.unpack(info))
            if fields[0] != pack_id or fields[1] != pos:
                continue
            data = bytes(packs.read(pack_id, pos, size, addr))  # DataCorrupted aborts the sweep
            new_id, new_pos, total = packs.append(addr, data)
            fields[0], fields[1] = new_id, new_pos
            raw.put(index.CHUNKS, addr, CHUNK_VAL.pack(*fields))
            gained[new_id] = gained.get(new_id, 0) + total
            moved += 1
        for new_id, n in gained.items():
            key = U32.pack(new_id)
            live = raw.get(index.PACKS, key)
            raw.put(index.PACKS, key, U64.pack((U64.unpack(live)[0] if live else 0) + n))
        raw.delete(index.PACKS, U32.pack(pack_id))
        return moved

    def sweep_now(self, grace_s=0.0):
        """Run a sweep at once with the given grace (tests, sbpctl)."""
        return self._core.transact(lambda raw: self._sweep(raw, now_ms() - int(grace_s * 1000)))
