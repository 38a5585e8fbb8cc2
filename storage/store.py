"""The store: assembly only. It opens the files, recovers, builds the commit core and the four
facades over it, wires the core's hooks, runs the periodic tasks and closes in order.

How a write becomes durable is in ``storage/commit.py``; each facade owns its data and types:
``log`` (record streams and ranges), ``kv`` (key-value partitions), ``chunks`` (content-addressed
chunks in packs), ``meta`` (transactional metadata). Import direction, one way::

    errors, crc, record_batch, policy, fileops  <-  wal, index, presync  <-  commit  <-  log, kv, chunks, meta  <-  store

See docs/storage.md and docs/architecture.md.
"""

import os
import time

from twisted.internet import defer, task
from twisted.logger import Logger

from storage import errors, index
from storage.chunks import ChunkStore, Packs
from storage.commit import (MAX_GROUP_BYTES, POSTPONED_POLL_S, QUEUE_HARD, QUEUE_HIGH, CommitCore,
                            interval_sync_wait, now_ms, recover)
from storage.kv import KeyValue
from storage.log import RangeMeta, RecordLog, StreamMeta
from storage.meta import Meta
from storage.policy import FsyncPolicy
from storage.wal import Wal

# Names this module exported before the commit core moved out (tests and other modules use them).
__all__ = ["Store", "RangeMeta", "StreamMeta", "interval_sync_wait", "now_ms", "POSTPONED_POLL_S",
           "MAX_GROUP_BYTES", "QUEUE_HIGH", "QUEUE_HARD"]


class Store:
    logger = Logger()  # ``store.log`` is the record log (the API's name)

    def __init__(self):
        raise TypeError("use Store.open(path, fsync=..., reactor=...)")

    @classmethod
    def open(cls, path: str, fsync="always", reactor=None, node_id: int = 0,
             segment_bytes: int = 64 << 20, pack_bytes: int = 256 << 20,
             retention_check_s: float = 1.0, chunk_grace_s: float = 60.0) -> "Store":
        """Open (creating if needed) the store in directory ``path``; blocking, at start-up."""
        if reactor is None:
            from twisted.internet import reactor
        self = object.__new__(cls)
        self._build(path, FsyncPolicy.parse(fsync), reactor, node_id, segment_bytes, pack_bytes,
                    retention_check_s, chunk_grace_s)
        return self

    def _build(self, path, policy, reactor, node_id, segment_bytes, pack_bytes, retention_check_s, chunk_grace_s):
        self.path = path
        self.policy = policy
        self.reactor = reactor
        self.node_id = node_id
        os.makedirs(path, exist_ok=True)
        started = time.monotonic()
        self.env, self.dbs = index.open_env(os.path.join(path, "index"), sync=policy.always)
        self.wal = Wal(os.path.join(path, "wal"), segment_bytes, sync_dir=policy.mode != "never")
        self.packs = Packs(os.path.join(path, "chunks"), pack_bytes, sync_dir=policy.mode != "never")
        self.replayed, checkpoint = recover(self.env, self.dbs, self.wal)
        core = self.core = CommitCore(self.env, self.dbs, self.wal, self.packs, policy, reactor, checkpoint)
        self.log = RecordLog(core, node_id)
        self.chunks = ChunkStore(core, chunk_grace_s)
        self.kv = KeyValue(core)
        self.meta = Meta(core, self.chunks)
        self.log.load()
        self.chunks.load()
        core.on_batch_durable = self.log.advance
        core.on_close += [self.log.close_waiters, self.chunks.close_waiters]
        core.on_resume.append(self.log.forget_unwritten)
        self._timers = []
        if retention_check_s:
            self._timers.append(self._every(retention_check_s, self.log.retention_tick))
            self._timers.append(self._every(max(retention_check_s, chunk_grace_s / 4.0), self.chunks.sweep_tick))
        self.logger.info(
            "store opened at {path} ({streams} streams, replayed {replayed} WAL entries) in {ms:.0f} ms",
            path=path, streams=self.log.stream_count(), replayed=self.replayed,
            ms=(time.monotonic() - started) * 1000,
        )

    def _every(self, seconds, fn):
        def tick():
            d = defer.maybeDeferred(fn)
            d.addErrback(self._tick_failed, fn)
            return d

        loop = task.LoopingCall(tick)
        loop.clock = self.reactor
        loop.start(seconds, now=False)
        return loop

    def _tick_failed(self, failure, fn):
        # a tick racing close() fails with StoreClosed, one during a disk fault with it (logged
        # once by the core): neither is worth a line
        if not self.closed and not failure.check(errors.DiskFault):
            self.logger.failure("periodic store task {task} failed", failure, task=fn.__name__)

    # -- the commit core's surface ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.core.closed

    @property
    def failed(self):
        """None, or why the store stopped accepting writes (an I/O error in the writer)."""
        return self.core.failed

    @property
    def presync(self):
        return self.core.presync

    @property
    def congested(self) -> bool:
        """True while more than QUEUE_HIGH bytes wait for the writer, or the kv memtable is well
        past its flush size (protocols should pause)."""
        return self.core.congested or self.kv.congested

    def queued_bytes(self) -> int:
        return self.core.queued_bytes()

    def when_drained(self) -> defer.Deferred:
        """Fires once the write queue is back below half of QUEUE_HIGH (and the kv memtable's
        running merge, if it was congested, landed)."""
        if self.kv.congested:
            return self.kv.flush().addCallback(lambda _: self.core.when_drained())
        return self.core.when_drained()

    def sync(self) -> defer.Deferred:
        """Make everything written so far durable, whatever the policy."""
        return self.core.sync()

    def transact_raw(self, fn, nbytes=256) -> defer.Deferred:
        """Run ``fn(RawTxn)`` in the writer thread inside the next group's transaction."""
        return self.core.transact(fn, nbytes)

    def in_pool(self, fn, *args):
        return self.core.in_pool(fn, *args)

    def snapshot(self):
        """The reactor thread's read-only LMDB snapshot (``CommitCore.snapshot``)."""
        return self.core.snapshot()

    def stats(self) -> dict:
        """A snapshot of sizes and counters for ``sbpctl status`` (sync, cheap)."""
        txn = self.snapshot()
        entries = {name.decode(): txn.stat(self.dbs[i])["entries"] for i, name in enumerate(index.DB_NAMES)}
        wal_bytes = sum(self.wal.segment_size(b) for b in self.wal.bases)
        return {
            "fsync": str(self.policy),
            "streams": self.log.stream_count(),
            "batches": entries["index"],
            "wal_segments": len(self.wal.bases),
            "wal_bytes": wal_bytes,
            "wal_position": self.wal.end,
            "chunks": entries["chunks"],
            "chunk_packs": len(self.packs.fds),
            "chunk_last_seq": self.chunks.last_seq(),
            "kv_keys": entries["kv"] + self.kv.memtable_keys(),  # memtable: puts, counted once merged
            "kv_memtable_bytes": self.kv.memtable_bytes(),
            "kv_row_cache": self.kv.row_cache.stats() if self.kv.row_cache is not None else None,
            "meta_keys": entries["meta"],
            "queued_bytes": self.core.queued_bytes(),
            "failed": self.core.failed,
            "disk_full": self.core.full,
        }

    # -- close ------------------------------------------------------------------------------------

    def close(self) -> defer.Deferred:
        """Stop the periodic tasks, then the core: queued writes finish and are synced, waiters
        wake, threads stop, files close; fires when done."""
        if self.core.closed:
            return defer.succeed(None)
        for loop in self._timers:
            if loop.running:
                loop.stop()
        # a clean close leaves LMDB complete: the kv memtable merged (a running merge, then the rest)
        d = self.kv.flush().addCallback(lambda _: self.kv.flush())
        d.addErrback(lambda f: self.logger.failure("kv memtable merge at close failed", f))
        return d.addCallback(lambda _: self.core.close())
