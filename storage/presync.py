"""Early write-back of the WAL and chunk packs under ``--fsync interval:MS``.

Under the interval policy the writer thread syncs every MS ms: the chunk packs, the WAL, then LMDB,
with no group committed in between, so the durable index never names WAL or pack bytes that are
not durable themselves (docs/storage.md). That sync has to write out everything appended since the
previous one; at 20 MB/s and a 1 s interval that is 20 MB, tens of milliseconds during which no
group commits and every append waits (bench/sbp_bench.py measured a p99 of 12 ms).

A PreSync thread fdatasyncs the active WAL segment and the active chunk pack every ``period``
seconds (an eighth of the interval, at most 100 ms) whenever they grew, on duplicates of their fds.
When the writer's own sync comes, most bytes are already on the disk and it takes a few ms.

It changes nothing about what is durable in what order: only the writer's sync counts, and a
pre-sync only makes bytes durable earlier. While a pre-sync is in ``fdatasync`` (``busy``) the
writer postpones its due sync, up to twice the interval (``commit.interval_sync_wait``, like Redis's
``everysec``): on a stalled disk the appends keep committing instead of queueing behind a sync
that waits for the same disk. It never syncs LMDB, which could make an index durable before the WAL
bytes it names.

A failed pre-sync is kept in ``error`` and the writer's next sync fails with it (storage/commit.py):
Linux reports a write-back error to one fdatasync per open file, and the duplicate shares the
writer's, so the writer's own fdatasync would succeed after the pages were lost (PostgreSQL's
"fsyncgate"). The pre-sync thread stops at the first failure.
"""

import os
import threading

from twisted.logger import Logger


class PreSync:
    log = Logger()

    def __init__(self, wal, packs, interval_s: float):
        self._wal = wal
        self._packs = packs
        self.period = min(0.1, max(0.005, interval_s / 8.0))
        self._stop = threading.Event()
        self._seen = {}  # "wal"/"packs" -> (active id, size) at the last pass
        self.passes = 0  # passes that synced something (tests, stats)
        self.busy = False  # True while an fdatasync runs (the writer postpones its sync meanwhile)
        self.error = None  # the OSError of a failed fdatasync: the writer's next sync raises it
        self._thread = threading.Thread(target=self._run, name="storage-presync", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        """Stop and wait for the thread (before the WAL and packs close their fds)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self):
        try:
            self._loop()
        except Exception:  # a bug: the writer's own sync still does all that matters
            self.log.failure("the pre-sync thread stopped")
            self.busy = False

    def _loop(self):
        while self.error is None and not self._stop.wait(self.period):
            synced = self._sync_if_grown("wal", self._wal, lambda: self._wal.end)
            synced |= self._sync_if_grown("packs", self._packs, lambda: self._packs.size)
            if synced:
                self.passes += 1

    def _sync_if_grown(self, name, owner, size_now) -> bool:
        """fdatasync the active file of ``owner`` (the WAL or the packs) if it grew since the last
        pass."""
        active = owner.active
        if active is None:
            return False
        mark = (active, size_now())
        if self._seen.get(name) == mark:
            return False
        fd = owner.fds.get(active)  # copy-on-write dict: safe to read from this thread
        if fd is None:
            return False
        try:
            # A duplicate, so the writer closing or reusing the original fd cannot redirect this
            # sync; dup itself runs while the original is open (fds close only after a 30 s grace).
            dup = os.dup(fd)
        except OSError:
            return False
        self.busy = True
        try:
            owner_ops = getattr(owner, "ops", None) or self._wal.ops  # the disk-fault seam
            owner_ops.fdatasync(dup)
        except OSError as e:
            self.error = e  # the writer's next sync fails with it and the store stops writing
            return False
        finally:
            self.busy = False
            os.close(dup)
        self._seen[name] = mark
        return True
