"""Child for the kill -9 between a replica run's WAL sync and its LMDB commit
(tests/test_storage_faults.py): it opens a store (``--fsync always``, the real writer thread),
stores one replica run normally, then makes the next LMDB commit stall (``StallCommit``: the
seam's ``commit`` blocks) and stores a second run; when the store announces that run's WAL bytes
synced (``append_replica_run(on_synced=...)``, what a cluster replica answers ``K`` on) it prints
``SYNCED end``. The parent SIGKILLs it there, with the LMDB commit not done, and reopens the store.

usage: python -m tests.storage_helpers.synced_child STORE_DIR
"""

import sys
import threading

from storage import Store
from storage.fileops import FileOps
from tests.storage_helpers.util import batch


def at(b, base):
    """``b`` with its base offset set to ``base`` (a replica batch as the primary sent it)."""
    return b[:1] + base.to_bytes(8, "big") + b[9:]


def runs():
    """The two runs (lists of batches, base offsets set) the child stores, and their ends."""
    first = [at(batch(2, 300, 0), 0), at(batch(3, 300, 1), 2)]
    second = [at(batch(4, 2000, 2), 5), at(batch(1, 300, 3), 9)]
    return first, second


class StallCommit(FileOps):
    """The plain calls, but once ``armed`` the LMDB commit never returns."""

    def __init__(self):
        self.armed = False

    def commit(self, txn):
        if self.armed:
            threading.Event().wait()
        txn.commit()


def main(path):
    from twisted.internet import defer, reactor

    store = Store.open(path, fsync="always", reactor=reactor, node_id=1, retention_check_s=0)
    ops = store.wal.ops = store.core.ops = StallCommit()

    def say(line):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    @defer.inlineCallbacks
    def go():
        sid = (yield store.log.create_stream()).stream_id
        first, second = runs()
        yield store.log.append_replica_run(sid, first, [None] * len(first))
        say("STORED %d %d" % (sid, store.log.durable_end(sid)))
        ops.armed = True
        def synced():
            say("SYNCED %d %d" % (store.log.synced_end(sid), store.log.durable_end(sid)))

        store.log.append_replica_run(sid, second, [None] * len(second), synced)

    reactor.callWhenRunning(go)
    reactor.run()


if __name__ == "__main__":
    main(sys.argv[1])
