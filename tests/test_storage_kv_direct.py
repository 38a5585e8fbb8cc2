"""Key-value runs written by the reactor itself (storage/commit.py ``CommitCore._submit_direct``):
under ``interval`` and ``never`` a kv memtable run with nothing ahead of it (the queue empty, the
writer outside a group, every group it wrote delivered, the checkpoint not moving) is written to
the WAL and delivered at once instead of through the writer thread. Checked here on real stores
with their writer threads: the runs are taken that way, the interval's sync still comes, never
under ``always``, and writes keep their order (each key ends at its last submitted write, before
and after a restart) when direct runs, queued runs, appends through the writer, merges and writes
submitted from delivery callbacks mix."""

import random

import pytest_twisted
from twisted.internet import defer, reactor, task

from storage import FsyncPolicy, Store
from tests.storage_helpers.util import batch
from tests.waiting import reactor_until


def _next_turn():
    return task.deferLater(reactor, 0, lambda: None)


def open_store(path, fsync):
    return Store.open(str(path), fsync=FsyncPolicy.parse(fsync), reactor=reactor, node_id=7)


@pytest_twisted.ensureDeferred
async def test_kv_runs_go_direct_and_the_interval_sync_still_comes(tmp_path):
    st = open_store(tmp_path, "interval:50")
    for i in range(50):
        await st.kv.write_many([(b"k%d" % i, b"v%d" % i)])
        await _next_turn()  # (a write submitted from a delivery's callback waits for the writer)
    assert st.core.direct_runs > 0
    # the WAL written by the reactor is synced by the writer within ~50 ms (waited for: busy machine)
    await reactor_until(lambda: not st.core.unsynced(), timeout=10, what="the interval sync")
    assert [st.kv.get(b"k%d" % i) for i in range(50)] == [b"v%d" % i for i in range(50)]
    await st.close()
    st = open_store(tmp_path, "interval:50")
    assert [st.kv.get(b"k%d" % i) for i in range(50)] == [b"v%d" % i for i in range(50)]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_never_goes_direct_and_always_does_not(tmp_path):
    st = open_store(tmp_path / "never", "never")
    for i in range(20):
        await st.kv.put(b"k%d" % i, b"v")
        await _next_turn()
    assert st.core.direct_runs > 0
    await st.close()
    st = open_store(tmp_path / "always", "always")
    for i in range(20):
        await st.kv.put(b"k%d" % i, b"v")
        await _next_turn()
    assert st.core.direct_runs == 0  # every group waits for its fsync: the writer's
    assert not st.wal.dirty
    await st.close()


@pytest_twisted.ensureDeferred
async def test_direct_and_queued_writes_keep_their_order(tmp_path):
    rng = random.Random(19)
    st = open_store(tmp_path, "interval:20")
    sid = (await st.log.create_stream()).stream_id
    keys = [b"key%d" % i for i in range(12)]
    model = {}  # each key's last submitted write (None: removed)
    pending = []
    nested = [0]

    def submit(ops):
        for k, v in ops:
            model[k] = v
        d = st.kv.write_many(ops)
        pending.append(d)
        return d

    def resubmit(_, n):
        # a write submitted from a delivery callback: after the one delivered, before the rest
        if n:
            nested[0] += 1
            submit([(rng.choice(keys), b"nested%d" % rng.randrange(1000))])
        return _

    for step in range(400):
        r = rng.random()
        if r < 0.15:
            pending.append(st.log.append(sid, batch()))  # through the writer: queued runs behind it
        if r < 0.03:
            pending.append(st.kv.flush())  # a merge now and then
        ops = [(rng.choice(keys), None if rng.random() < 0.2 else b"v%d" % step) for _ in range(rng.randrange(1, 4))]
        submit(ops).addBoth(resubmit, rng.random() < 0.3)
        if rng.random() < 0.3:
            await defer.DeferredList(list(pending))
            await _next_turn()
    await defer.DeferredList(list(pending))
    await defer.DeferredList(list(pending))  # the nested ones
    assert st.core.direct_runs > 0 and nested[0] > 0
    want = {k: v for k, v in model.items()}
    assert {k: st.kv.get(k) for k in keys} == {k: want.get(k) for k in keys}
    await st.kv.flush()
    assert {k: st.kv.get(k) for k in keys} == {k: want.get(k) for k in keys}
    await st.close()
    st = open_store(tmp_path, "interval:20")
    assert {k: st.kv.get(k) for k in keys} == {k: want.get(k) for k in keys}
    await st.close()
