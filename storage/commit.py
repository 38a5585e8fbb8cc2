"""The commit core: how a write becomes durable.

Every write of every facade (``log``, ``kv``, ``chunks``, ``meta``) is one named operation handed
to ``CommitCore.submit`` on the reactor thread:

- ``AppendBatch``: a record batch for a stream; the offset was assigned by the log at call time.
- ``AppendRun``: consecutive replica batches of one stream as one operation (each stored as an
  ``AppendBatch`` would be; one Deferred for the run).
- ``AppendBatches``: several batches, of any streams, whose offsets the log assigned at call time,
  as one operation (each stored as an ``AppendBatch`` would be; one Deferred for them all).
- ``Transact``: ``fn(RawTxn)`` run inside the group's LMDB transaction (a nested one: a raising
  ``fn`` writes nothing); every raw write it makes is recorded for the WAL.
- ``Direct``: ``fn(txn)`` run on the group's transaction itself (no nesting, no RawTxn), returning
  ``(result, raw ops for the WAL or None)``; it must not raise for a caller's error. kv's batched
  writes use it with ``memtable=True``: their ops go to the WAL only (LMDB gets them when the kv
  memtable is merged, storage/kv.py), so the checkpoint stays at or before the first such WAL
  entry not yet merged (``kv_floor``, which the merge moves), and a group that changed nothing
  in LMDB does not commit it.
- ``Sync``: make everything written so far durable, whatever the policy.

The path of a write:

1. ``check_writable(nbytes)`` refuses it at once if the store is closed, failed, or its queue is
   over ``QUEUE_HARD`` (``StoreBusy``); ``submit`` queues it (a deque) and wakes the writer.
2. The writer thread (``_writer_loop``) takes a *group*: every queued operation, up to
   ``MAX_GROUP_BYTES``. One group = one LMDB write transaction (``_commit_group``): batches are
   framed into the WAL (``wal.add``) and indexed; raw operations are applied to LMDB and framed
   into the WAL as ``T_OPS`` entries; the WAL checkpoint is stored in the same transaction.
3. Durability, in this order (LevelDB's habit: the log before the index that names it): chunk packs
   are synced before the WAL entry naming them; under ``--fsync always`` the group's WAL bytes are
   synced before the LMDB commit (written with RWF_DSYNC: the write syncs them itself,
   ``Wal.flush(dsync=True)``); then LMDB commits. Under ``interval:MS`` the writer syncs
   packs, WAL and LMDB together at most every MS ms (``interval_sync_wait``; the ``PreSync``
   thread writes the WAL and packs back early so that sync is short). Under ``never`` only close
   syncs. Replica runs (``AppendRun.on_synced``) are announced to the reactor right after the WAL
   sync, before the LMDB commit (a cluster replica answers ``K`` then); they are the group's first
   WAL entries (``synced_runs_first``).
4. Disk faults (docs/storage.md "Disk faults"): the group's operations fail and its WAL bytes are
   cut from the segment (``Wal.rollback``), so nothing answered with an error comes back at the
   next start (once replica runs were announced, only the bytes after them are cut and the store
   goes read-only: a restart replays them). ENOSPC (or EDQUOT) from a write sets ``full``: every
   write is refused with ``DiskFull``, and once nothing is queued and the file system has
   ``RESUME_FREE_BYTES`` free again the core takes writes again (``on_resume`` lets the log take
   back the offsets of the refused appends). Any other error, and any failed fdatasync whatever its errno, sets
   ``failed``: the store is read-only (``StoreReadOnly``) until the node restarts. A failed
   fsync is never retried: Linux reports a write-back error once and may have dropped the dirty
   pages, so a later fsync that succeeds proves nothing (PostgreSQL's "fsyncgate", 2018).
   Reads go on in both states; each change of state is logged once.
5. The group goes back to the reactor thread (``_deliver``): the reused read snapshot is dropped
   (so every acknowledged write is visible to reads), each ``AppendBatch``'s durability is passed
   to the ``on_batch_durable`` hook (the log advances its stream's visible ``next_offset``, in log
   order), each ``Transact``'s ``on_reactor`` steps run, then its Deferred fires.

Recovery (``recover``, at open): the WAL entries past the checkpoint are replayed into LMDB; the
tail is CRC-checked and cut at the first torn or corrupt entry. So a write acknowledged under
``always`` survives a power cut: its WAL bytes were synced before the ack.

Threads: the reactor thread calls everything public here and owns ``_queued_bytes`` and the
snapshot; the writer thread owns the WAL, the packs and the group's LMDB transaction; a small
thread pool (``in_pool``) serves blocking reads. See docs/storage.md.

Tests only: with ``CommitCore.writer_mode = "inline"`` while a store opens (tests/storage_helpers/
inline.py), the core starts no thread. The same ``_write`` commits each group on the caller's
thread, at ``submit`` (or, while ``hold`` is set, when the test calls ``run_queued``), and
delivers it there; blocking reads run inline. Protocol units so run the real facades on real
files, on ``task.Clock``, deterministically.
"""

import collections
import errno
import os
import select
import struct
import threading
import time

import lmdb
import msgpack
from twisted.internet import defer
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from storage import errors, index
from storage.index import INDEX_KEY, INDEX_VAL, U64, PackedOp, RawTxn, apply_ops, pack_ops
from storage.presync import PreSync
from storage.record_batch import HEADER_SIZE
from storage.wal import ENTRY_SIZE, T_BATCH, T_OPS, WriteSyncFailed

BATCH_PREFIX = struct.Struct(">QQ")  # a T_BATCH entry's payload starts: stream_id, append_ms
_BASE = struct.Struct(">q")
# a T_BATCH entry's payload up to the batch's record_count: stream_id, append_ms, then the batch's
# magic byte and its base_offset (written in on the way to the WAL)
_HEAD = struct.Struct(">QQBq")
BATCH_BASE_COUNT = struct.Struct(">qi")  # a record batch's base_offset and record_count (bytes 1..12)
_BLOCK = HEADER_SIZE  # a record batch's records block starts here

MAX_GROUP_BYTES = 16 << 20
QUEUE_HIGH = 64 << 20  # above this many queued bytes the store reports congestion
QUEUE_HARD = 512 << 20  # above this, writes fail with StoreBusy instead of growing memory

POSTPONED_POLL_S = 0.002

# After ENOSPC: how often the reactor looks for free space, and how much it waits for (one full
# group, so that the first group after the resume does not meet ENOSPC again at once).
RESUME_POLL_S = 0.5
RESUME_FREE_BYTES = MAX_GROUP_BYTES
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class SyncFailed(Exception):
    """An fdatasync (of the WAL, the chunk packs or LMDB) failed, whatever its errno."""

    def __init__(self, what, error):
        super().__init__("fdatasync of %s failed: %s" % (what, error))
        self.error = error


def disk_full(e) -> bool:
    """``e`` (raised while writing a group) says the file system is full: ENOSPC or EDQUOT from a
    write, or LMDB's message for them (py-lmdb raises ``lmdb.Error`` with the errno's text). A
    failed sync is never "full", whatever its errno: its pages may be lost."""
    if isinstance(e, SyncFailed):
        return False
    if isinstance(e, OSError):
        return e.errno in _FULL_ERRNOS
    if isinstance(e, lmdb.Error):
        text = str(e)
        return any(os.strerror(code) in text for code in _FULL_ERRNOS)
    return False


def _synced(what, fn):
    try:
        fn()
    except Exception as e:
        raise SyncFailed(what, e) from e


def now_ms() -> int:
    return int(time.time() * 1000)


def interval_sync_wait(now: float, last_sync: float, interval: float, presync_busy: bool) -> float:
    """Seconds until the ``interval`` policy's sync is due; 0.0: sync now.

    It is due ``interval`` after the last one. While a pre-sync is writing (storage/presync.py:
    the disk is slow or stalled) it waits for it, but never past twice the interval, as Redis's
    ``everysec`` postpones its fsync: groups keep committing meanwhile instead of queueing behind
    a sync that would wait for the same disk, and the pre-sync leaves it less to write."""
    due = last_sync + interval - now
    if due > 0:
        return due
    late = now - last_sync
    if presync_busy and late < 2 * interval:
        return min(POSTPONED_POLL_S, 2 * interval - late)
    return 0.0


# -- the operations ---------------------------------------------------------------------------------


class Operation:
    """One queued write. ``done`` fires on the reactor thread with ``value`` (or fails with it)."""

    __slots__ = ("nbytes", "done", "ok", "value")

    def __init__(self, nbytes):
        self.nbytes = nbytes  # counted against QUEUE_HIGH / QUEUE_HARD and MAX_GROUP_BYTES
        self.done = defer.Deferred()
        self.ok = False
        self.value = None  # the result, or a Failure


class AppendBatch(Operation):
    """Store ``batch`` for ``stream_id`` at ``base_offset`` (written into the batch's bytes 1..8);
    ``base_offset`` None: a replica batch kept exactly as it is. ``block_crc``: the CRC-32 of its
    records block (``batch[29:]``) if the caller checked it already: the WAL entry's CRC then
    combines it instead of reading the block again. Fires with the base offset."""

    __slots__ = ("stream_id", "batch", "base_offset", "record_count", "block_crc")

    def __init__(self, stream_id, batch, base_offset, record_count, block_crc=None):
        super().__init__(len(batch) + 64)
        self.stream_id = stream_id
        self.batch = batch
        self.base_offset = base_offset
        self.record_count = record_count
        self.block_crc = block_crc


class AppendRun(Operation):
    """Consecutive replica batches of one stream (``batches``, each kept exactly as it is, its
    base offset in its bytes 1..8; ``block_crcs`` as for ``AppendBatch``, one per batch, None
    where unchecked), stored as ``AppendBatch`` stores each: the same WAL entries and index, in
    the same group, but one operation and one Deferred for the run (a cluster replica stores the
    batches of one received message with it). Fires with the run's end offset.

    ``on_synced``: None, or a callable run on the reactor thread as soon as the run's WAL bytes
    are fdatasync'ed, before the group's LMDB commit (only in a group whose WAL is synced before
    that commit: ``--fsync always``, or a group with a ``Sync``; otherwise never called). Once it
    is called the run is kept whatever happens next: a failed LMDB commit does not cut it from
    the WAL (the store goes read-only, a restart replays it; see ``_commit_group``)."""

    __slots__ = ("stream_id", "batches", "block_crcs", "base_offset", "record_count", "on_synced")

    def __init__(self, stream_id, batches, block_crcs, base_offset, record_count, nbytes, on_synced=None):
        super().__init__(nbytes + 64 * len(batches))
        self.stream_id = stream_id
        self.batches = batches
        self.block_crcs = block_crcs
        self.base_offset = base_offset  # where the run starts
        self.record_count = record_count  # records of the whole run
        self.on_synced = on_synced


class AppendBatches(Operation):
    """``AppendBatch`` of several batches at once (``stream_ids``, ``batches``, ``base_offsets``,
    ``record_counts``, ``block_crcs``: one entry per batch, in log order, each stream's offsets
    assigned by the caller): the same WAL entries and index as one ``AppendBatch`` each, in the
    same group, but one operation and one Deferred for them all (an SBP connection queues the
    one-batch APPENDs of one socket read with it, issue 24). Fires with None."""

    __slots__ = ("stream_ids", "batches", "base_offsets", "record_counts", "block_crcs")

    def __init__(self, stream_ids, batches, base_offsets, record_counts, block_crcs, nbytes):
        super().__init__(nbytes + 64 * len(batches))
        self.stream_ids = stream_ids
        self.batches = batches
        self.base_offsets = base_offsets
        self.record_counts = record_counts
        self.block_crcs = block_crcs


class Transact(Operation):
    """Run ``fn(RawTxn)`` in the group's transaction (nested: a raise writes nothing and fails only
    this operation). Fires with ``fn``'s result once the group is durable."""

    __slots__ = ("fn", "raw")

    def __init__(self, fn, nbytes=256):
        super().__init__(nbytes)
        self.fn = fn
        self.raw = None  # the RawTxn, once run (its on_reactor steps run at delivery)


class Direct(Operation):
    """Run ``fn(txn) -> (result, raw ops or None)`` on the group's LMDB transaction itself. ``fn``
    must not raise for a caller's error: a raise fails the whole group, as an I/O error does.
    With ``memtable=True`` its ops go to the WAL only and ``txn`` may be None (a group of such
    operations alone begins no LMDB transaction)."""

    __slots__ = ("fn", "memtable")

    def __init__(self, fn, nbytes=64, memtable=False):
        super().__init__(nbytes)
        self.fn = fn
        self.memtable = memtable  # its ops are in the WAL only until the kv memtable is merged


class Sync(Operation):
    """Make everything written so far durable (packs, WAL, LMDB), whatever the policy."""

    __slots__ = ()

    def __init__(self):
        super().__init__(64)


class _Stop(Operation):
    __slots__ = ()

    def __init__(self):
        super().__init__(0)


# -- recovery ---------------------------------------------------------------------------------------


def recover(env, dbs, wal) -> (int, int):
    """Replay WAL entries past the checkpoint into LMDB; returns ``(entries replayed, checkpoint)``.
    Blocking, at open, before the writer starts."""
    with env.begin(write=True) as txn:
        raw = txn.get(index.CHECKPOINT, db=dbs[index.SYS])
        checkpoint = U64.unpack(raw)[0] if raw else 0
        n = 0
        live = index.LiveBytes(wal)
        for pos, etype, payload in wal.scan(checkpoint):
            _replay_entry(txn, dbs, pos, etype, payload, live)
            n += 1
        live.flush(txn, dbs)
        end = max(wal.end, checkpoint)
        wal.ensure_at(end)
        txn.put(index.CHECKPOINT, U64.pack(end), db=dbs[index.SYS])
    if n:
        env.sync(True)
    return n, end


def _replay_entry(txn, dbs, pos, etype, payload, live):
    if etype == T_BATCH:
        sid, append_ms = BATCH_PREFIX.unpack_from(payload, 0)
        base = _BASE.unpack_from(payload, 17)[0]
        count = int.from_bytes(payload[25:29], "big", signed=True)
        total = ENTRY_SIZE + len(payload)
        index.put_batch_index(txn, dbs, INDEX_KEY.pack(sid, base), INDEX_VAL.pack(pos, total, count, append_ms),
                              live, pos, total)
    else:
        apply_ops(txn, dbs, msgpack.unpackb(payload, raw=True, use_list=True), live)


def synced_runs_first(work):
    """``(work, runs)``: the group's operations with the ``AppendRun``s that have an ``on_synced``
    hook moved to the front (``runs``, in their order; None if there is none), so that their WAL
    entries are the group's first bytes: if the LMDB commit fails after they were announced
    synced, the WAL is cut back to their end and keeps them, and only the rest is cut (nothing
    answered with an error comes back). A run moves ahead only of operations of other streams:
    not past an append of its own stream, nor past a ``Transact`` or a non-memtable ``Direct``
    (they may touch any stream's index), so every stream's entries keep their order."""
    front, rest = [], []
    seen = set()
    blocked = False
    for op in work:
        kind = type(op)
        if kind is AppendRun and op.on_synced is not None and not blocked and op.stream_id not in seen:
            front.append(op)
            continue
        rest.append(op)
        if kind is AppendRun or kind is AppendBatch:
            seen.add(op.stream_id)
        elif kind is AppendBatches:
            seen.update(op.stream_ids)
        elif not (kind is Direct and op.memtable):
            blocked = True
    if not front:
        return work, None
    return front + rest, front


def _call_now(fn, *args):
    fn(*args)


def _daemon_thread(*args, **kwargs):
    t = threading.Thread(*args, **kwargs)
    t.daemon = True
    return t


# -- the core ---------------------------------------------------------------------------------------


# The reactor writes a kv memtable run itself when nothing is ahead of it (``_submit_direct``)
KV_DIRECT = os.environ.get("SBPNODE_KV_DIRECT", "1") != "0"


def _never():
    return False


class CommitCore:
    """The writer thread, group commit and the read side's snapshot and pool, over an open LMDB
    environment, WAL and chunk packs (``recover`` has run). Built by ``store.Store.open``."""

    logger = Logger()
    writer_mode = "thread"  # "inline": tests only (see the module's docstring); read when a core is built

    def __init__(self, env, dbs, wal, packs, policy, reactor, checkpoint):
        self.env = env  # LMDB; the writer thread owns its write transactions
        self.dbs = dbs
        self.wal = wal  # writer thread (appends); readers pread from any thread
        self.packs = packs  # writer thread (appends); readers pread from any thread
        self.policy = policy
        # a kv run may be written by the reactor itself (``_submit_direct``): not under ``always``,
        # where every group waits for an fsync
        self._direct_ok = KV_DIRECT and not policy.always
        self.reactor = reactor
        self.closed = False  # reactor thread
        self.failed = None  # why the store is read-only (a disk error in the writer); never cleared
        self.full = None  # why writes are refused until space returns (ENOSPC); the reactor clears it
        self.ops = wal.ops  # the disk-fault seam (storage/fileops.py): free_bytes after ENOSPC
        self.on_resume = []  # reactor thread: called when writes resume after ENOSPC
        # Hooks the assembly (store.py) sets, all called on the reactor thread:
        self.on_batch_durable = None  # (stream_id, base_offset, record_count), in log order
        self.on_close = []  # callables run once the writer stopped, before the files close
        self.after_deliver = []  # callables run once per delivered group, after its operations' Deferreds
        # callables run when the outermost hold_wakeups ends, right after the writer is woken (the
        # replicator sends the read's batches to the replicas then, not at the end of the reactor
        # turn: the replicas' group commits start sooner, and the send's system call, made without
        # the GIL, overlaps the woken writer's start)
        self.after_wake = []
        self._checkpoint = checkpoint  # writer thread
        # Writer thread: the WAL position of the oldest entry holding kv memtable writes not yet
        # merged into LMDB (None: none); the checkpoint never passes it. Set by the first such
        # group, moved by the merge (storage/kv.py).
        self.kv_floor = None
        # writer thread: the WAL position up to which the group being written is kept if it fails
        # now (its replica runs were announced synced); None: a failure cuts the whole group
        self._kept_end = None
        self._from_writer = reactor.callFromThread if self.writer_mode != "inline" else _call_now
        self.delivered_wal_end = checkpoint  # reactor thread: the WAL end after the last group delivered whole
        # reactor thread: the WAL end after the group being delivered (or last delivered): every kv
        # run that entered a memtable lies below it (the kv merge worker's range, storage/kv.py)
        self.landing_wal_end = checkpoint
        self._env_dirty = False  # writer thread: an LMDB commit not yet synced
        self._reactor_thread = threading.get_ident()  # built on the reactor's thread
        self._queue = collections.deque()  # appended by the reactor, taken by the writer
        self._cond = threading.Condition()
        self._writer_idle = False
        # Held by the writer from taking a group until it has queued the group's delivery, and by
        # the reactor while it writes a kv run itself (``_submit_direct``): WAL writes in order
        self._group_lock = threading.Lock()
        self._groups_sent = 0  # writer thread: groups whose delivery it queued
        self._groups_delivered = 0  # reactor thread: of those, delivered whole
        self._in_direct = False  # reactor thread: inside a direct write and its delivery
        self.direct_runs = 0  # kv runs the reactor wrote itself (observability, tests)
        self._wakes_held = 0  # reactor thread: hold_wakeups() depth
        self._wake_pending = False  # reactor thread: a submit found the writer idle while held
        self._writer = None
        self._queued_bytes = 0  # reactor thread
        self._drain_waiters = []  # reactor thread
        self._rtxn = None  # reactor thread: the reused read snapshot
        self.presync = None
        self.inline = self.writer_mode == "inline"  # no writer thread (tests only; kv merges in place then)
        if self.inline:
            self._init_inline()
            return
        self._pool = ThreadPool(minthreads=1, maxthreads=4, name="storage-read")
        # daemon workers: a node that fails start-up after opening the store must still exit
        self._pool.threadFactory = _daemon_thread
        self._pool.start()
        if policy.mode == "interval":
            self.presync = PreSync(wal, packs, policy.interval_ms / 1000.0)
            self.presync.start()
        # the writer sleeps in poll() on this eventfd; submit writes it (_wake_writer)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_poll = select.poll()
        self._wake_poll.register(self._wake_fd, select.POLLIN)
        self._writer = threading.Thread(target=self._run_writer, name="storage-writer", daemon=True)
        self._writer.start()

    # -- the write queue (reactor thread) ---------------------------------------------------------

    def check_writable(self, nbytes=0):
        """Raise the StoreError a write of ``nbytes`` would meet now (closed, failed, full)."""
        if self.closed:
            raise errors.StoreClosed("the store is closed")
        if self.failed is not None:
            raise errors.StoreReadOnly("the store is read-only after a disk error: %s" % self.failed)
        if self.full is not None:
            raise errors.DiskFull("the disk is full (%s): writes resume when space returns" % self.full)
        if self._queued_bytes + nbytes > QUEUE_HARD:
            raise errors.StoreBusy("the store's write queue is full")

    def submit(self, op: Operation) -> defer.Deferred:
        """Queue ``op`` for the next group; its Deferred. The caller ran ``check_writable``."""
        if op.__class__ is Direct and op.memtable and self._direct_ok and not self._queue:
            done = self._submit_direct(op)
            if done is not None:
                return done
        self._queued_bytes += op.nbytes
        self._queue.append(op)  # deque.append is atomic; the lock is taken only to wake the writer
        if self._writer_idle:
            if self._wakes_held:
                self._wake_pending = True
            else:
                self._wake_writer()
        return op.done

    def _submit_direct(self, op):
        """Reactor thread, under ``interval`` or ``never`` (no sync per group): a kv memtable run
        whose group would be a WAL write alone is written and delivered here, at once, when
        nothing is ahead of it: the queue empty, the writer not inside a group (its lock), every
        group it wrote delivered (so runs land in WAL order), the checkpoint not moving (no LMDB
        transaction: the merge worker may hold LMDB's writer lock). Saves the hand-off to the
        writer and back (two thread wake-ups and GIL hand-offs per group, ~60% of a SET's time in
        flight under load: docs/benchmarks.md, issue 19's tenth pass). None: queue it."""
        if self._in_direct or self._groups_sent != self._groups_delivered or self.closed \
                or self.failed is not None or self.full is not None:
            return None
        floor = self.kv_floor
        wal = self.wal
        if floor is None or self._checkpoint != min(wal.end, floor):
            return None
        if wal.active is None or wal.end - wal.active + op.nbytes + 4096 > wal.segment_bytes:
            return None  # a new segment (a file created, the directory synced): the writer's
        if not self._group_lock.acquire(False):
            return None
        self._in_direct = True
        try:
            if self._queue or self._groups_sent != self._groups_delivered:
                return None
            was_dirty = self.unsynced()
            self._queued_bytes += op.nbytes
            group = [op]
            self._write(group, _never)
            self.direct_runs += 1
            if not was_dirty:
                # the writer times the interval's sync from its next look (asleep or not: it
                # may have found the WAL clean just before this write)
                self._wake_writer()
            self._deliver(group, self.wal.end)
        finally:
            self._in_direct = False
            self._group_lock.release()
        return op.done

    def _wake_writer(self):
        """Wake the writer waiting in ``_take``: one ``eventfd`` write, with the GIL let go for the
        syscall (``os.eventfd_write``). A ``Condition.notify`` made the same futex wake-up holding
        the GIL: the woken writer, often run at once on the waker's core, found the GIL taken, slept
        again, and the reactor waited for its core back (17-21% of the reactor's GIL-holding samples
        under a SET load, docs/benchmarks.md)."""
        # busy from now on, not once the woken writer has run: until it takes the GIL it could not
        # say so itself (``writer_busy``), and a second wake-up would be wasted. (The writer sets
        # the flag before its last look at the queue, and the eventfd's count stays until read, so
        # clearing it here loses no wake-up.)
        self._writer_idle = False
        os.eventfd_write(self._wake_fd, 1)

    @property
    def writer_busy(self) -> bool:
        """Reactor thread, a hint: the writer is at a group (or about to be) rather than waiting
        for one. A caller about to give up the GIL for a while (a long CRC) keeps it instead while
        the writer is busy, since the writer would take it and hold it up to the switch interval."""
        return not self._writer_idle

    def hold_wakeups(self):
        """Reactor thread: until the matching ``release_wakeups()``, ``submit`` does not wake an
        idle writer. A protocol taking in a read's worth of requests queues them all and wakes it
        once: one group, one commit, one delivery, and one GIL hand-off each way, not one per
        request (issue 24). Calls nest; the caller releases in a ``finally``."""
        self._wakes_held += 1

    def release_wakeups(self):
        self._wakes_held -= 1
        if self._wakes_held:
            return
        if self._wake_pending:
            self._wake_pending = False
            self._wake_writer()
        for fn in self.after_wake:
            try:
                fn()
            except Exception:
                self.logger.failure("store wake-up hook failed")

    def transact(self, fn, nbytes=256) -> defer.Deferred:
        """``check_writable`` then ``submit(Transact(fn, nbytes))``, as a Deferred either way."""
        try:
            self.check_writable(nbytes)
        except errors.StoreError:
            return defer.fail()
        return self.submit(Transact(fn, nbytes))

    def sync(self) -> defer.Deferred:
        """Make everything written so far durable, whatever the policy."""
        return self.submit(Sync())

    @property
    def congested(self) -> bool:
        """True while more than QUEUE_HIGH bytes wait for the writer (protocols should pause)."""
        return self._queued_bytes > QUEUE_HIGH

    def queued_bytes(self) -> int:
        return self._queued_bytes

    def when_drained(self) -> defer.Deferred:
        """Fires once the queue is back below half of QUEUE_HIGH."""
        if self._queued_bytes <= QUEUE_HIGH // 2:
            return defer.succeed(None)
        d = defer.Deferred(lambda d: self._drain_waiters.remove(d))
        self._drain_waiters.append(d)
        return d

    # -- the writer thread ------------------------------------------------------------------------

    def _take(self, timeout):
        if not self._queue:
            # set before re-checking: a submitter that appended before this finds the queue
            # non-empty here; one that appends after sees the flag and writes the eventfd, whose
            # count stays until read, so no wake-up is lost (a stale one only makes a pass for nothing)
            self._writer_idle = True
            if not self._queue:
                self._wake_poll.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999)))
            self._writer_idle = False
            try:
                os.eventfd_read(self._wake_fd)
            except BlockingIOError:
                pass
        self._group_lock.acquire()  # released by _writer_loop once the group's delivery is queued
        with self._cond:
            group, size = [], 0
            q = self._queue
            while q and (not group or size + q[0].nbytes <= MAX_GROUP_BYTES):
                op = q.popleft()
                group.append(op)
                size += op.nbytes
                if type(op) is _Stop:
                    break
            return group

    def _run_writer(self):
        try:
            self._writer_loop()
        except BaseException as e:  # a bug, not an I/O error: refuse writes rather than hang them
            self.failed = "writer thread died: %s: %s" % (type(e).__name__, e)
            self.logger.failure("the store's writer thread died")
            failure = Failure()
            with self._cond:
                rest = list(self._queue)
                self._queue.clear()
            for op in rest:
                op.ok, op.value = False, failure
            self.reactor.callFromThread(self._deliver, rest, None)

    def _writer_loop(self):
        interval = self.policy.interval_ms / 1000.0 if self.policy.mode == "interval" else None
        last_sync = time.monotonic()
        presync = self.presync

        def sync_wait():  # seconds until the interval sync is due, with last_sync as it is now
            return interval_sync_wait(time.monotonic(), last_sync, interval, presync is not None and presync.busy)

        def sync_due():
            return interval is not None and self.unsynced() and not sync_wait()

        stopping = False
        while not stopping:
            timeout = None
            if interval is not None and self.unsynced():
                timeout = sync_wait()
            group = self._take(timeout)
            try:
                synced, stopping = self._write(group, sync_due)
                if synced:
                    last_sync = time.monotonic()
                if group:
                    self._groups_sent += 1
                    self.reactor.callFromThread(self._deliver_sent, group, self.wal.end)
            finally:
                self._group_lock.release()
            if group:
                self.wal.drop_behind_synced()  # (after the hand-off: off the group's latency)

    def _write(self, group, sync_due) -> (bool, bool):
        """Commit ``group`` and sync as the policy says (``sync_due()``: the interval's sync is
        due); returns (synced, a stop was in it). A disk fault fails the group's operations."""
        force_sync = stopping = False
        work = []
        for op in group:
            kind = type(op)
            if kind is _Stop:
                stopping = True
            elif kind is Sync:
                force_sync = True
            else:
                work.append(op)
        answered = [op for op in group if type(op) is not _Stop]  # a stop always goes on to close
        if self.failed is not None:
            # Nothing more reaches the disk, not even a sync: after a failed one, a sync that
            # succeeds proves nothing (the module's docstring).
            self._refuse(answered, errors.StoreReadOnly("the store is read-only after a disk error: %s" % self.failed))
            return False, stopping
        if self.full is not None and work:
            # Queued behind the refused group: appends here carry offsets assigned after its own.
            self._refuse(work, errors.DiskFull("the disk is full (%s): writes resume when space returns" % self.full))
            work = []
        group_start = self.wal.end
        kv_floor = self.kv_floor
        committed = False
        self._kept_end = None
        try:
            presync = self.presync
            if presync is not None and presync.error is not None:
                raise SyncFailed("the WAL or a chunk pack (pre-sync)", presync.error)
            if work:
                self._commit_group(work, self.policy.always or force_sync)
            committed = True
            if force_sync or stopping or sync_due():
                self._sync_all()
                return True, stopping
        except Exception as e:
            self._disk_fault(e, answered, None if committed else group_start, kv_floor, self._kept_end)
        return False, stopping

    def _refuse(self, ops, error):
        failure = Failure(error)
        for op in ops:
            op.ok, op.value = False, failure

    def _disk_fault(self, e, ops, group_start, kv_floor, kept_end=None):
        """Writer thread: fail ``ops`` with ``e``; cut the group's WAL bytes (``group_start`` is
        None when LMDB committed it already: the index names them); enter ``full`` or ``failed``.
        ``kept_end``: the group's first bytes, up to there, were synced and announced durable
        (replica runs, ``AppendRun.on_synced``): only the bytes after them are cut, and the store
        goes read-only whatever the error (ENOSPC too: a store taking writes again would move the
        checkpoint past them before any restart replayed them into LMDB)."""
        full = disk_full(e) and kept_end is None
        reason = "%s: %s" % (type(e).__name__, e)
        if kept_end is not None:
            reason += " (after the group's WAL sync: its replica runs, acknowledged, stay in the WAL up to " \
                      "position %d and are replayed into the index at the next start)" % kept_end
        if group_start is not None:
            self.kv_floor = kv_floor
            try:
                self.wal.rollback(group_start if kept_end is None else kept_end)
            except Exception as cut:  # the disk refuses even that: stop writing
                full = False
                reason += "; then cutting the group from the WAL failed: %s" % cut
        if full:
            error = errors.DiskFull("the disk is full (%s): writes resume when space returns" % reason)
        else:
            error = errors.StoreReadOnly("the store is read-only after a disk error: %s" % reason)
        error.__cause__ = e
        self._refuse(ops, error)
        if full:
            first = self.full is None
            self.full = reason
        else:
            first = self.failed is None
            self.failed = reason
        if first:
            self.reactor.callFromThread(self._fault_seen, full, reason)

    def unsynced(self) -> bool:
        """Written but not yet synced (the interval policy syncs it when due)."""
        return self.wal.dirty or self.packs.dirty or self._env_dirty

    def _sync_all(self):
        _synced("the chunk packs", self.packs.sync)
        _synced("the WAL", self.wal.sync)
        _synced("the LMDB index", lambda: self.env.sync(True))
        self._env_dirty = False

    @property
    def replay_from(self) -> int:
        """Writer thread: the WAL position recovery would replay from now (the checkpoint); no
        WAL segment at or past it may be deleted."""
        return self._checkpoint

    def _commit_group(self, work, durable):
        wal = self.wal
        dbs = self.dbs
        # A group of kv memtable runs alone (the common kv group) writes the WAL and nothing in
        # LMDB: it begins a write transaction only if the checkpoint moves (below), not per group.
        kv_only = all(type(op) is Direct and op.memtable for op in work)
        txn = None if kv_only else self.env.begin(write=True)
        group_start = wal.end
        # the replica runs announced as soon as the WAL is synced (AppendRun.on_synced): written
        # first, so that a failed LMDB commit can keep them and cut the rest (_disk_fault)
        early = last_early = keep_end = None
        if durable:
            work, early = synced_runs_first(work)
            if early is not None:
                last_early = early[-1]
        lmdb_changed = False  # a group of memtable writes alone leaves LMDB as it is
        try:
            raw_txns = []
            live = index.LiveBytes(wal)
            merged = []  # consecutive Direct ops share one WAL entry (one msgpack call)
            packed = False  # some of them are index.PackedOp (packed already: pack_ops)
            for op in work:
                kind = type(op)
                if kind is Direct:
                    op.value, ops = op.fn(txn)
                    op.ok = True
                    if op.memtable:
                        if ops and self.kv_floor is None:
                            self.kv_floor = group_start
                    else:
                        lmdb_changed = True
                    if ops:
                        if ops[0].__class__ is PackedOp:
                            packed = True
                        merged.extend(ops)
                    continue
                lmdb_changed = True
                if merged:
                    wal.add(T_OPS, pack_ops(merged) if packed else (msgpack.packb(merged, use_bin_type=True),))
                    merged = []
                    packed = False
                if kind is AppendBatch:
                    sid, batch, base = op.stream_id, op.batch, op.base_offset
                    append_ms = now_ms()
                    block_crc = op.block_crc
                    if base is None:  # a replica batch keeps its base_offset
                        base = _BASE.unpack_from(batch, 1)[0]
                        if block_crc is None:
                            parts = (BATCH_PREFIX.pack(sid, append_ms), batch)
                        else:
                            view = memoryview(batch)
                            parts = (BATCH_PREFIX.pack(sid, append_ms), view[:_BLOCK], view[_BLOCK:])
                    elif block_crc is None:
                        parts = (BATCH_PREFIX.pack(sid, append_ms), batch[:1], _BASE.pack(base), memoryview(batch)[9:])
                    else:  # the SBP APPEND path: the entry's head in one piece, the records block as it came
                        view = memoryview(batch)
                        parts = (_HEAD.pack(sid, append_ms, batch[0], base) + view[9:_BLOCK], view[_BLOCK:])
                    pos = wal.add(T_BATCH, parts, block_crc)
                    total = ENTRY_SIZE + 16 + len(batch)
                    index.put_batch_index(txn, dbs, INDEX_KEY.pack(sid, base),
                                          INDEX_VAL.pack(pos, total, op.record_count, append_ms), live, pos, total,
                                          wal.active)
                    op.ok, op.value = True, base
                elif kind is AppendBatches:
                    append_ms = now_ms()
                    for sid, batch, base, count, block_crc in zip(op.stream_ids, op.batches, op.base_offsets,
                                                                  op.record_counts, op.block_crcs):
                        if block_crc is None:
                            parts = (BATCH_PREFIX.pack(sid, append_ms), batch[:1], _BASE.pack(base), memoryview(batch)[9:])
                        else:  # as AppendBatch's SBP path: the entry's head in one piece, the block as it came
                            view = memoryview(batch)
                            parts = (_HEAD.pack(sid, append_ms, batch[0], base) + view[9:_BLOCK], view[_BLOCK:])
                        pos = wal.add(T_BATCH, parts, block_crc)
                        total = ENTRY_SIZE + 16 + len(batch)
                        index.put_batch_index(txn, dbs, INDEX_KEY.pack(sid, base),
                                              INDEX_VAL.pack(pos, total, count, append_ms), live, pos, total,
                                              wal.active)
                    op.ok = True
                elif kind is AppendRun:
                    sid = op.stream_id
                    append_ms = now_ms()
                    prefix = BATCH_PREFIX.pack(sid, append_ms)
                    for batch, block_crc in zip(op.batches, op.block_crcs):
                        base, count = BATCH_BASE_COUNT.unpack_from(batch, 1)
                        if block_crc is None:
                            parts = (prefix, batch)
                        else:
                            view = memoryview(batch)
                            parts = (prefix, view[:_BLOCK], view[_BLOCK:])
                        pos = wal.add(T_BATCH, parts, block_crc)
                        total = ENTRY_SIZE + 16 + len(batch)
                        index.put_batch_index(txn, dbs, INDEX_KEY.pack(sid, base),
                                              INDEX_VAL.pack(pos, total, count, append_ms), live, pos, total,
                                              wal.active)
                    op.ok, op.value = True, op.base_offset + op.record_count
                    if op is last_early:
                        keep_end = wal.end
                else:  # Transact
                    live.flush(txn, dbs)  # so the function reads current segment counts
                    sub = self.env.begin(write=True, parent=txn)
                    raw = RawTxn(sub, dbs, wal)
                    try:
                        result = op.fn(raw)
                    except Exception as e:
                        sub.abort()
                        if isinstance(e, OSError) or disk_full(e):
                            raise  # the disk's (a chunk pack's write), not the caller's: the group fails
                        op.ok, op.value = False, Failure()
                        continue
                    sub.commit()
                    live.merge(raw.live)
                    op.ok, op.value, op.raw = True, result, raw
                    if raw.ops:
                        wal.add(T_OPS, (msgpack.packb(raw.ops, use_bin_type=True),))
                    raw_txns.append(raw)
            if merged:
                wal.add(T_OPS, pack_ops(merged) if packed else (msgpack.packb(merged, use_bin_type=True),))
            if self.packs.dirty and durable:
                _synced("the chunk packs", self.packs.sync)  # chunk bytes are durable before the WAL entry naming them
            # Under --fsync always every group's WAL bytes are synced before the LMDB commit names
            # them: batch bytes live only in the WAL, and LMDB's commit (metasync=False) syncs its
            # data pages but not its meta page, so after a power cut it may fall back to the
            # previous commit. Recovery then replays this group from the synced WAL. A group of
            # metadata/kv/chunk-index changes alone is not durable through the commit by itself.
            # The group's write syncs its bytes itself (RWF_DSYNC): between a write and a separate
            # fdatasync this thread took the GIL back, and waited for it up to ~150 us while the
            # reactor ran (docs/benchmarks.md, issue 19's twelfth pass). ``wal.sync`` then syncs
            # what else is unsynced (an earlier segment of the group's), usually nothing.
            try:
                wal.flush(dsync=durable)
            except WriteSyncFailed as e:
                raise SyncFailed("the WAL", e.error) from e.error
            if durable:
                _synced("the WAL", wal.sync)
                if early is not None:
                    # From here the runs are announced durable (a replica answers K for them):
                    # whatever fails next, the WAL keeps them up to ``keep_end`` and the store
                    # goes read-only; a restart replays them into LMDB (recovery replays every
                    # entry past the checkpoint, which this group has not moved)
                    self._kept_end = keep_end
                    self._from_writer(self._announce, early)
            live.flush(txn, dbs)
            checkpoint = wal.end if self.kv_floor is None else min(wal.end, self.kv_floor)
            if checkpoint != self._checkpoint:  # an idle pass (e.g. GC finding nothing) writes nothing
                if txn is None:
                    txn = self.env.begin(write=True)
                txn.put(index.CHECKPOINT, U64.pack(checkpoint), db=dbs[index.SYS])
                lmdb_changed = True
            if lmdb_changed:
                self.ops.commit(txn)
                if not durable:
                    self._env_dirty = True
            elif txn is not None:
                txn.abort()  # nothing to commit: the group lives in the WAL (replayed past the checkpoint)
            self._checkpoint = checkpoint
        except BaseException:
            if txn is not None:
                txn.abort()
            wal.discard()
            raise
        for raw in raw_txns:
            for fn in raw.after_commit:
                try:
                    fn()
                except Exception as e:
                    self.logger.error("post-commit step failed: {error}", error=e)

    # -- completion (reactor thread) --------------------------------------------------------------

    def _deliver_sent(self, group, wal_end):
        """A group the writer wrote; counted delivered once every callback of it has run."""
        try:
            self._deliver(group, wal_end)
        finally:
            self._groups_delivered += 1

    def _deliver(self, group, wal_end):
        self._drop_snapshot()
        if wal_end is not None:
            self.landing_wal_end = wal_end
        batch_durable = self.on_batch_durable
        for op in group:
            self._queued_bytes -= op.nbytes
            if op.ok:
                try:
                    kind = type(op)
                    if kind is AppendBatch:
                        if batch_durable is not None:
                            batch_durable(op.stream_id, op.value, op.record_count)
                    elif kind is AppendBatches:
                        if batch_durable is not None:
                            for sid, base, count in zip(op.stream_ids, op.base_offsets, op.record_counts):
                                batch_durable(sid, base, count)
                    elif kind is AppendRun:
                        if batch_durable is not None:
                            batch_durable(op.stream_id, op.base_offset, op.record_count)
                    elif kind is Transact:
                        for fn in op.raw.on_reactor:
                            fn()
                except Exception:  # never leave the rest of the group unanswered
                    self.logger.failure("store completion step failed")
                op.done.callback(op.value)
            elif op.value is not None:
                op.done.errback(op.value)
            else:
                op.done.callback(None)
        # Only once every operation of the group has been delivered: a kv merge frozen by one of
        # the callbacks above takes this as its floor, and the group's kv runs after that one
        # (not yet in any memtable) lie before the group's end (storage/kv.py, issue 19).
        if wal_end is not None:
            self.delivered_wal_end = wal_end
        for fn in self.after_deliver:
            try:
                fn()
            except Exception:
                self.logger.failure("store delivery hook failed")
        if self._drain_waiters and self._queued_bytes <= QUEUE_HIGH // 2:
            waiters, self._drain_waiters = self._drain_waiters, []
            for d in waiters:
                d.callback(None)

    def _announce(self, runs):
        """Reactor thread: the WAL bytes of ``runs`` (``AppendRun``s with ``on_synced``) are
        synced; their LMDB commit may still be under way."""
        for op in runs:
            try:
                op.on_synced()
            except Exception:
                self.logger.failure("store synced hook failed")

    # -- disk faults (reactor thread) -------------------------------------------------------------

    def _fault_seen(self, full, reason):
        """The writer entered ``full`` or ``failed`` (once per entry): one log line, and after ENOSPC
        the wait for space."""
        if not full:
            self.logger.critical(
                "the store is read-only after a disk error ({reason}): writes get errors until the node is "
                "restarted on a working disk; reads go on; everything acknowledged before is kept",
                reason=reason)
            return
        self.logger.error(
            "the disk is full ({reason}): writes get errors until {need} bytes are free in {dir}; reads go on",
            reason=reason, need=RESUME_FREE_BYTES, dir=self.wal.dir)
        self.reactor.callLater(RESUME_POLL_S, self._wait_for_space)

    def _wait_for_space(self):
        if self.closed or self.failed is not None or self.full is None:
            return
        try:
            free = self.ops.free_bytes(self.wal.dir)
        except OSError:
            free = 0
        # Nothing queued: every operation refused while full has been answered, so no queued
        # append carries an offset the log is about to hand out again.
        if self._queued_bytes or free < RESUME_FREE_BYTES:
            self.reactor.callLater(RESUME_POLL_S, self._wait_for_space)
            return
        for fn in self.on_resume:
            fn()
        self.full = None
        self.logger.info("disk space is back ({free} bytes free in {dir}): the store takes writes again",
                         free=free, dir=self.wal.dir)

    # -- reads ------------------------------------------------------------------------------------

    def in_pool(self, fn, *args):
        """Run the blocking read ``fn(*args)`` in the read pool; its Deferred."""
        if self.closed:
            return defer.fail(errors.StoreClosed("the store is closed"))
        return deferToThreadPool(self.reactor, self._pool, fn, *args)

    def snapshot(self):
        """A read-only LMDB transaction for the synchronous reads of the reactor thread. One is
        reused until the next group is delivered (a begin per read costs more than the read), so
        every acknowledged write is visible and no snapshot outlives one group commit."""
        if threading.get_ident() != self._reactor_thread:
            return self.env.begin()  # another thread: its own snapshot, released when dropped
        txn = self._rtxn
        if txn is None:
            if self.closed and (self._writer is None or not self._writer.is_alive()):
                raise errors.StoreClosed("the store is closed")
            txn = self._rtxn = self.env.begin()
        return txn

    def _drop_snapshot(self):
        txn, self._rtxn = self._rtxn, None
        if txn is not None:
            txn.abort()

    def renew_snapshot(self):
        """Reactor thread: the next read begins a new snapshot (a kv merge worker committing in
        another process meanwhile: the old one would keep LMDB from reusing the pages it frees)."""
        self._drop_snapshot()

    # -- the inline writer (tests only) ---------------------------------------------------------

    def _init_inline(self):
        self.hold = False  # True: submitted operations wait for run_queued()
        self._running = False
        self._pool = None
        self._writer = None
        self.submit = self._submit_inline
        self.in_pool = self._read_inline

    def _submit_inline(self, op):
        self._queued_bytes += op.nbytes
        self._queue.append(op)
        if not self.hold:
            self.run_queued()
        return op.done

    def _read_inline(self, fn, *args):
        if self.closed:
            return defer.fail(errors.StoreClosed("the store is closed"))
        return defer.maybeDeferred(fn, *args)

    def run_queued(self, limit=None, reverse=False) -> int:
        """Inline writer: commit the queued operations (at most ``limit``) on this thread, group
        by group as the writer would, and deliver each group here; ``reverse``: deliver a group's
        operations last first (acks out of order, as a caller of several stores may see them).
        A submit from a delivery is taken by the same call. Returns how many ran."""
        if self._running:
            return 0
        self._running = True
        ran = 0
        try:
            q = self._queue
            while q and (limit is None or ran < limit):
                group, size = [], 0
                while q and (limit is None or ran < limit) and (not group or size + q[0].nbytes <= MAX_GROUP_BYTES):
                    op = q.popleft()
                    group.append(op)
                    size += op.nbytes
                    ran += 1
                self._write(group, lambda: False)
                if reverse:
                    # kv runs enter the memtable as they are delivered, and the writer always
                    # delivers in WAL order: those stay in order, the other acks are reversed
                    kv_runs = [op for op in group if type(op) is Direct and op.memtable]
                    group = kv_runs + [op for op in reversed(group) if not (type(op) is Direct and op.memtable)]
                self._deliver(group, self.wal.end)
        finally:
            self._running = False
        return ran

    def queued(self) -> int:
        """Operations waiting for the writer."""
        return len(self._queue)

    # -- close ------------------------------------------------------------------------------------

    def close(self) -> defer.Deferred:
        """Finish queued writes, sync everything, stop the threads, run the ``on_close`` hooks,
        close the files; fires when done."""
        if self.closed:
            return defer.succeed(None)
        self.closed = True
        stop = _Stop()
        self._queue.append(stop)
        if self._writer is not None:
            self._wake_writer()
        done = defer.Deferred()

        def finish(_):
            if self._writer is not None:
                self._writer.join()
                os.close(self._wake_fd)
            if self.presync is not None:
                self.presync.stop()
            for fn in self.on_close:
                fn()
            if self._pool is not None:
                self._pool.stop()
            self._drop_snapshot()
            self.wal.close()
            self.packs.close()
            self.env.close()
            self.logger.info("store closed")
            done.callback(None)

        stop.done.addBoth(finish)
        if self._writer is None:  # inline: the caller's thread writes what is queued, then stops
            self.run_queued()
        elif not self._writer.is_alive():
            # It died (logged then), or it has taken the stop and ended already (woken above, it
            # can finish before this line runs): a stop it took, it delivers; one still queued,
            # nobody will take
            with self._cond:
                waiting = stop in self._queue
                self._queue.clear()
            if waiting:
                stop.done.callback(None)
        return done
