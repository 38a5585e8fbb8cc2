"""The real store with an inline writer, for protocol units on ``task.Clock`` + ``StringTransport``.

``open_inline(path, clock)`` opens a real ``Store`` (real LMDB, WAL and packs in ``path``) whose
commit core starts no thread (``CommitCore.writer_mode = "inline"``, storage/commit.py): each
write is committed and delivered on the test's thread, at once, or, after ``hold(store)``, when
the test says (``complete``), which is how a test makes acks wait, arrive out of order, or the
write queue congested. Nothing here stands in for the store: the group commit, the facades and
their files are the node's own.
"""

from storage import Store
from storage.commit import QUEUE_HIGH, CommitCore


def open_inline(path, clock, fsync="never", **options) -> Store:
    """A real store in ``path`` on ``clock`` (its timers too), written inline."""
    CommitCore.writer_mode = "inline"
    try:
        return Store.open(str(path), fsync=fsync, reactor=clock, **options)
    finally:
        CommitCore.writer_mode = "thread"


def hold(store, on=True):
    """While held, writes wait in the commit queue until ``complete``."""
    store.core.hold = on
    if not on:
        store.core.run_queued()


def pending(store) -> int:
    """Operations waiting in the commit queue (each a write call: a kv run, an append, ...)."""
    return store.core.queued()


def complete(store, n=1, reverse=False) -> int:
    """Commit and acknowledge the first ``n`` queued operations (None: all); ``reverse``: ack each
    group last first."""
    return store.core.run_queued(n, reverse)


def congest(store):
    """Make the real write queue congested: one held operation declaring more than QUEUE_HIGH bytes
    (a no-op transaction, so draining it costs nothing). ``complete`` drains it."""
    assert store.core.hold, "congestion needs a held writer"
    d = store.transact_raw(lambda txn: None, nbytes=QUEUE_HIGH + 1)
    assert store.congested
    return d


def close(store):
    """Close the store (inline: finishes at once). A held writer is let go first: a clean close
    merges the kv memtable through the commit queue before the core closes."""
    hold(store, False)
    d = store.close()
    assert d.called
    return d
