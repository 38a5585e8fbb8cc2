"""Disk faults in the commit core (issue 21): a real store on real files, with the OS calls of its
WAL made to fail through the disk-fault seam (storage/fileops.py ``Faults``), nothing else faked.

- a failed fdatasync, and EIO from a write: the group fails with StoreReadOnly, the store stays
  read-only (a failed fsync is never retried), reads go on, and after a restart every
  acknowledged write is there and no refused one is;
- ENOSPC: writes fail with DiskFull while the disk is full and resume once space returns, with the
  refused appends' offsets given back (no gap in a stream);
- a failed pre-sync (``--fsync interval``) makes the writer's next sync fail, not succeed.
"""

import errno

import pytest
import pytest_twisted
from twisted.internet import defer, reactor

from storage import FsyncPolicy, Store, commit, errors
from storage import kv as kv_module
from storage.fileops import Faults
from tests.storage_helpers.util import base_of, batch, same_except_base
from tests.waiting import reactor_until


def open_store(path, fsync="always"):
    return Store.open(str(path), fsync=FsyncPolicy.parse(fsync), reactor=reactor, node_id=7, retention_check_s=0)


def with_faults(st):
    faults = Faults()
    st.wal.ops = st.core.ops = faults
    return faults


async def read_all(st, sid):
    out, offset = [], 0
    while offset < st.log.stream(sid).next_offset:
        got = await st.log.read(sid, offset, 1 << 20)
        out += got
        last = got[-1]
        offset = base_of(last) + int.from_bytes(last[9:13], "big")
    return out


async def refused(d, kind):
    with pytest.raises(kind) as e:
        await d
    return e.value


@pytest.fixture
def logged():
    """The log events of the test (``log_format`` rendered), to count the fault lines."""
    from twisted.logger import formatEvent, globalLogPublisher

    lines = []

    def observe(event):
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


@pytest.mark.parametrize("call,code", [("fdatasync", errno.EIO), ("fdatasync", errno.ENOSPC), ("pwrite", errno.EIO)])
@pytest_twisted.ensureDeferred
async def test_a_failed_sync_or_write_makes_the_store_read_only_and_loses_nothing_acked(tmp_path, logged, call, code):
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    acked = [batch(2, 100, i) for i in range(3)]
    for b in acked:
        await st.log.append(sid, b)
    await st.kv.put(b"k", b"v")
    faults = with_faults(st)
    faults.fail[call] = code
    # three appends in one turn (one group or several): all refused, none acknowledged
    results = await defer.DeferredList([st.log.append(sid, batch(2, 100, 10 + i)) for i in range(3)], consumeErrors=True)
    assert all(not ok and f.check(errors.StoreReadOnly) for ok, f in results)
    assert "Errno %d" % code in str(results[0][1].value) or "(injected)" in str(results[0][1].value)
    assert st.failed and st.core.full is None
    # the disk is fine again: the store still refuses, and never calls fdatasync again
    del faults.fail[call]
    syncs = faults.calls.get("fdatasync", 0)
    await refused(st.log.append(sid, batch()), errors.StoreReadOnly)
    await refused(st.kv.put(b"k2", b"v"), errors.StoreReadOnly)
    await refused(st.meta.transact(lambda t: t.put("t", b"k", 1)), errors.StoreReadOnly)
    await refused(st.sync(), errors.StoreReadOnly)
    assert faults.calls.get("fdatasync", 0) == syncs
    # reads go on
    assert st.log.stream(sid).next_offset == 6
    got = await read_all(st, sid)
    assert [same_except_base(g, b) for g, b in zip(got, acked)] == [True] * 3
    assert st.kv.get(b"k") == b"v"
    assert sum("read-only after a disk error" in line for line in logged) == 1
    await st.close()
    # the refused group was cut from the WAL: a restart replays none of it
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 6 and not st.failed
    got = await read_all(st, sid)
    assert [same_except_base(g, b) for g, b in zip(got, acked)] == [True] * 3
    assert st.kv.get(b"k") == b"v" and st.kv.get(b"k2") is None
    assert await st.log.append(sid, batch()) == 6
    await st.close()


@pytest_twisted.ensureDeferred
async def test_enospc_refuses_writes_until_space_returns_and_leaves_no_gap(tmp_path, logged, monkeypatch):
    monkeypatch.setattr(commit, "RESUME_POLL_S", 0.02)
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch(3, 100, 0))
    faults = with_faults(st)
    faults.fail["pwrite"] = errno.ENOSPC
    faults.free = 0
    results = await defer.DeferredList(
        [st.log.append(sid, batch(2, 100, 1)), st.kv.put(b"a", b"1"), st.chunks.put(b"c" * 5000)], consumeErrors=True)
    assert all(not ok and f.check(errors.DiskFull) for ok, f in results), results
    assert st.core.full and not st.failed
    e = await refused(st.log.append(sid, batch()), errors.DiskFull)
    assert "writes resume when space returns" in str(e)
    assert st.log.stream(sid).next_offset == 3
    assert len(await read_all(st, sid)) == 1  # reads go on
    # the write error is gone but the disk is still full: still refused, without trying
    del faults.fail["pwrite"]
    writes = faults.calls["pwrite"]
    await refused(st.log.append(sid, batch()), errors.DiskFull)
    assert faults.calls["pwrite"] == writes
    # space returns: writes resume at the stream's durable end (the refused appends' offsets back)
    faults.free = commit.RESUME_FREE_BYTES
    await reactor_until(lambda: st.core.full is None, what="writes to resume")
    assert await st.log.append(sid, batch(2, 100, 2)) == 3
    await st.kv.put(b"a", b"1")
    assert sum("the disk is full" in line for line in logged) == 1
    assert sum("disk space is back" in line for line in logged) == 1
    await st.close()
    st = open_store(tmp_path)
    got = await read_all(st, sid)
    assert [base_of(g) for g in got] == [0, 3] and st.log.stream(sid).next_offset == 5
    assert st.kv.get(b"a") == b"1"
    await st.close()


@pytest_twisted.ensureDeferred
async def test_enospc_in_the_middle_of_a_group_cuts_its_bytes_from_the_wal(tmp_path, monkeypatch):
    """A write that fails part-way leaves no torn entry behind: the next group starts where the
    refused one did, and a restart between the two replays nothing refused."""
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch(1, 100, 0))
    end = st.wal.end
    faults = with_faults(st)
    real = Faults.pwrite

    def half_then_full(fd, data, offset):  # the file system had room for part of it
        if len(data) > 64:
            return real(faults, fd, memoryview(data)[:64], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    faults.pwrite = half_then_full
    await refused(st.log.append(sid, batch(1, 5000, 1)), errors.DiskFull)
    assert st.wal.end == end and st.wal.segment_size(st.wal.active) == end - st.wal.active
    import os
    assert os.fstat(st.wal.fds[st.wal.active]).st_size == end - st.wal.active
    await st.close()
    st = open_store(tmp_path)
    assert st.replayed == 0 and st.log.stream(sid).next_offset == 1
    await st.close()


@pytest_twisted.ensureDeferred
async def test_a_failed_presync_fails_the_writers_next_sync(tmp_path, logged):
    """Under ``--fsync interval`` the pre-sync thread's fdatasync shares the writer's open file:
    once it has seen the error, the writer's own fdatasync would succeed. So its failure is kept
    and the store goes read-only instead."""
    st = open_store(tmp_path, fsync="interval:60000")
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch())
    faults = with_faults(st)
    faults.fail["fdatasync"] = errno.EIO
    await st.log.append(sid, batch())  # interval: acknowledged before any sync
    await reactor_until(lambda: st.presync.error is not None, what="the pre-sync to fail")
    del faults.fail["fdatasync"]
    await refused(st.sync(), errors.StoreReadOnly)
    assert "pre-sync" in st.failed
    await refused(st.log.append(sid, batch()), errors.StoreReadOnly)
    assert st.log.stream(sid).next_offset == 2
    assert sum("read-only after a disk error" in line for line in logged) == 1
    await st.close()


@pytest_twisted.ensureDeferred
async def test_short_wal_writes_resume_where_they_stopped(tmp_path):
    """The WAL writes a group with pwritev from the batches' own buffers (issue 24); a write that
    takes only part of them (as a file system may) goes on from the first byte not written, inside
    a buffer or between two, and every batch reads back as appended, before and after a restart."""
    import os

    from storage.fileops import FileOps

    class Short(FileOps):
        calls = 0

        def pwritev(self, fd, buffers, offset):  # at most 1000 bytes per call, however many buffers
            Short.calls += 1
            out, left = [], 1000
            for b in buffers:
                if not left:
                    break
                out.append(memoryview(b)[:left])
                left -= len(out[-1])
            return os.pwritev(fd, out, offset)

    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    st.wal.ops = Short()
    sent = [batch(3, 5000 + 700 * i, 0) for i in range(4)]
    await defer.gatherResults([st.log.append(sid, b) for b in sent])
    assert Short.calls > 4 * 5000 // 1000
    got = await read_all(st, sid)
    assert len(got) == 4 and all(same_except_base(g, b) for g, b in zip(got, sent))
    await st.close()
    st = open_store(tmp_path)
    got = await read_all(st, sid)
    assert len(got) == 4 and all(same_except_base(g, b) for g, b in zip(got, sent))
    await st.close()


# -- a cluster replica's runs, acknowledged once their WAL bytes are synced (issue 17) -----------


def replica_batch(n, size, tag, base):
    """A record batch as a primary sends it to a replica: its base offset set in bytes 1..8."""
    b = batch(n, size, tag)
    return b[:1] + base.to_bytes(8, "big") + b[9:]


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest_twisted.ensureDeferred
async def test_a_replica_run_announced_synced_survives_a_failed_lmdb_commit(tmp_path, logged, code):
    """Under ``--fsync always`` a replica run's ``on_synced`` is called once its WAL bytes are
    synced, before the group's LMDB commit (a cluster replica answers ``K`` then). If that commit
    fails (EIO, or ENOSPC: not the resumable "full" state here), the run is not cut from the WAL:
    the store goes read-only, the run is not readable (the index does not name it), and a restart
    replays it. The other operations of the same group were answered with an error and are cut:
    none of them comes back."""
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    other = (await st.log.create_stream()).stream_id
    first = [replica_batch(2, 100, 0, 0), replica_batch(3, 100, 1, 2)]
    assert await st.log.append_replica_run(sid, first, [None, None]) == 5
    await st.log.append(other, batch(1, 100, 9))
    await st.kv.put(b"k", b"v")
    faults = with_faults(st)
    faults.fail["commit"] = code
    second = [replica_batch(4, 3000, 2, 5), replica_batch(1, 100, 3, 9)]
    announced = []
    core = st.core
    core.hold_wakeups()  # one group: the plain append and the kv put first, then the run
    try:
        d_other = st.log.append(other, batch(2, 100, 10))
        d_kv = st.kv.put(b"k2", b"v2")
        d_run = st.log.append_replica_run(sid, second, [None, None],
                                          lambda: announced.append((st.log.synced_end(sid), st.log.durable_end(sid))))
    finally:
        core.release_wakeups()
    results = await defer.DeferredList([d_other, d_kv, d_run], consumeErrors=True)
    assert [ok for ok, _ in results] == [False] * 3
    assert all(f.check(errors.StoreReadOnly) for _, f in results), results
    # announced once, with the run's end, while the index still ended at the first run
    assert announced == [(10, 5)]
    assert st.failed and st.core.full is None
    assert "stay in the WAL" in st.failed
    assert st.log.synced_end(sid) == 10 and st.log.durable_end(sid) == 5
    assert st.log.stream(sid).next_offset == 5  # reads see only what the index names
    assert len(await read_all(st, sid)) == 2
    await refused(st.log.append_replica_run(sid, [replica_batch(1, 100, 4, 10)], [None], lambda: None),
                  errors.StoreReadOnly)
    assert sum("read-only after a disk error" in line for line in logged) == 1
    await st.close()
    # the restart replays the announced run (and nothing of the group's other operations)
    st = open_store(tmp_path)
    assert not st.failed
    assert st.log.stream(sid).next_offset == 10 and st.log.durable_end(sid) == 10
    got = await read_all(st, sid)
    assert got == first + second
    assert st.log.stream(other).next_offset == 1
    assert st.kv.get(b"k") == b"v" and st.kv.get(b"k2") is None
    # and the store goes on from there
    assert await st.log.append_replica_run(sid, [replica_batch(1, 100, 5, 10)], [None]) == 11
    await st.close()


@pytest_twisted.ensureDeferred
async def test_an_lmdb_commit_failing_before_any_announcement_cuts_the_whole_group(tmp_path):
    """Without ``on_synced`` (or under another policy) nothing was acknowledged before the LMDB
    commit: a failed commit cuts the group as every other fault does (ENOSPC: full, resumable)."""
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    assert await st.log.append_replica_run(sid, [replica_batch(2, 100, 0, 0)], [None]) == 2
    faults = with_faults(st)
    faults.fail["commit"] = errno.ENOSPC
    faults.free = 0
    await refused(st.log.append_replica_run(sid, [replica_batch(1, 100, 1, 2)], [None]), errors.DiskFull)
    assert st.core.full and not st.failed
    assert st.log.synced_end(sid) == 2
    await st.close()
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 2 and st.replayed == 0
    await st.close()


@pytest_twisted.ensureDeferred
async def test_never_policy_does_not_announce_runs(tmp_path):
    """``on_synced`` means "the WAL bytes are synced": a store that does not sync per group never
    calls it (the run's Deferred is the answer there)."""
    st = open_store(tmp_path, fsync="never")
    sid = (await st.log.create_stream()).stream_id
    called = []
    assert await st.log.append_replica_run(sid, [replica_batch(2, 100, 0, 0)], [None], lambda: called.append(1)) == 2
    assert called == [] and st.log.synced_end(sid) == 2
    await st.close()


@pytest_twisted.ensureDeferred
async def test_kill_9_between_a_runs_wal_sync_and_its_lmdb_commit_keeps_it(tmp_path):
    """A child's store announces a replica run synced while its LMDB commit is stalled (the seam's
    ``commit`` blocks); SIGKILL there. The reopened store holds the run: what a replica
    acknowledged at its WAL sync survives a crash before the index names it."""
    import os
    import signal
    import subprocess
    import sys

    from tests.storage_helpers.synced_child import runs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    path = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-m", "tests.storage_helpers.synced_child", str(path)],
                             stdout=subprocess.PIPE, cwd=root, env=env)
    try:
        stored = child.stdout.readline().split()
        assert stored[:1] == [b"STORED"] and int(stored[2]) == 5, stored
        synced = child.stdout.readline().split()
        # announced at the WAL sync: the run's end, while the index still ends at the first run
        assert synced == [b"SYNCED", b"10", b"5"], synced
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    sid = int(stored[1])
    first, second = runs()
    st = open_store(path)
    assert st.replayed >= 2
    assert st.log.stream(sid).next_offset == 10
    assert await read_all(st, sid) == first + second
    await st.close()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest_twisted.ensureDeferred
async def test_a_kv_merge_the_store_refuses_keeps_every_write_readable(tmp_path, monkeypatch, code):
    """A memtable merge whose LMDB commit fails (the writer thread's merge, which is also the merge
    worker's fallback) keeps its frozen memtable: every acknowledged SET stays readable while the
    disk is full (ENOSPC) or the store is read-only (EIO). Space back: the next flush merges it
    again from its first key. Either way a restart has every write."""
    monkeypatch.setattr(commit, "RESUME_POLL_S", 0.02)
    monkeypatch.setattr(kv_module, "MERGE_WORKER", False)
    st = open_store(tmp_path)
    keys = [b"k%05d" % i for i in range(3000)]
    for i in range(0, len(keys), 500):
        await st.kv.write_many([(k, b"v" + k) for k in keys[i:i + 500]])
    assert await st.kv.delete(keys[7])
    kept = [k for k in keys if k != keys[7]]
    faults = with_faults(st)
    faults.fail["commit"] = code
    faults.free = 0
    await st.kv.flush()  # refused part-way: fires, the memtable kept
    assert (st.core.full is not None) if code == errno.ENOSPC else (st.failed is not None)
    assert st.kv.flushing_bytes > 0
    assert st.kv.get(keys[7]) is None
    assert all(st.kv.get(k) == b"v" + k for k in kept)
    assert [k for k, _ in st.kv.scan_forward(None, 10)] == kept[:10]
    if code == errno.ENOSPC:
        del faults.fail["commit"]
        faults.free = commit.RESUME_FREE_BYTES
        await reactor_until(lambda: st.core.full is None, what="writes to resume")
        await st.kv.flush()
        assert st.kv.flushing_bytes == 0 and st.kv.memtable_keys() == 0
        assert all(st.kv.get(k) == b"v" + k for k in kept) and st.kv.get(keys[7]) is None
    await st.close()  # does not wait for a merge that cannot run
    st = open_store(tmp_path)
    assert all(st.kv.get(k) == b"v" + k for k in kept) and st.kv.get(keys[7]) is None
    await st.close()
