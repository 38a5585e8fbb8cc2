"""Under ``--fsync always`` a group's WAL write syncs its own bytes (pwritev2 with RWF_DSYNC,
``Wal.flush(dsync=True)``, issue 19's twelfth pass) instead of a write and then an fdatasync.
Checked on real stores and files: the writes take that path and leave nothing to sync, what is
acknowledged is there after a restart, a failure of such a write is told apart as the kernel
reports it (refused before writing: its own error, ENOSPC a full disk; after its bytes reached the
file: a failed sync, the store read-only, the bytes cut), and a kernel that refuses the flag
falls back to a write and an fdatasync."""

import errno
import os

import pytest
import pytest_twisted
from twisted.internet import reactor

from storage import FsyncPolicy, Store, commit, errors, fileops
from storage.fileops import FileOps
from tests.storage_helpers.util import batch
from tests.waiting import reactor_until

pytestmark = pytest.mark.skipif(fileops.RWF_DSYNC is None, reason="no RWF_DSYNC on this platform")


def open_store(path, fsync="always"):
    return Store.open(str(path), fsync=FsyncPolicy.parse(fsync), reactor=reactor, node_id=7, retention_check_s=0)


class Counting(FileOps):
    """The real calls, counting the write-and-sync ones."""

    def __init__(self):
        self.dsync_calls = 0

    def pwritev_dsync(self, fd, parts, offset):
        self.dsync_calls += 1
        return FileOps.pwritev_dsync(self, fd, parts, offset)


class SyncFails(FileOps):
    """A write whose bytes reach the file and whose sync then fails, as pwritev2(RWF_DSYNC)
    reports a failed write-back: the call raises ``code`` after writing."""

    def __init__(self, code):
        self.code = code

    def pwritev_dsync(self, fd, parts, offset):
        os.pwritev(fd, parts, offset)
        raise OSError(self.code, "%s (injected, after the write)" % os.strerror(self.code))


class Refuses(FileOps):
    """Every write-and-sync call refused with ``code`` before it writes anything."""

    def __init__(self, code):
        self.code = code
        self.calls = 0

    def pwritev_dsync(self, fd, parts, offset):
        self.calls += 1
        raise OSError(self.code, "%s (injected)" % os.strerror(self.code))


@pytest_twisted.ensureDeferred
async def test_always_groups_sync_with_their_write_and_leave_nothing_to_sync(tmp_path):
    st = open_store(tmp_path)
    ops = st.wal.ops = Counting()
    flushes = st.wal.flushes
    sid = (await st.log.create_stream()).stream_id
    for i in range(5):
        await st.log.append(sid, batch(2, 300, i))
        await st.kv.put(b"k%d" % i, b"v%d" % i)
        assert not st.wal.dirty and st.wal.synced_end == st.wal.end
    assert ops.dsync_calls == st.wal.flushes - flushes >= 10
    await st.close()
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 10
    assert [st.kv.get(b"k%d" % i) for i in range(5)] == [b"v%d" % i for i in range(5)]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_interval_writes_do_not_sync_with_their_write(tmp_path):
    st = open_store(tmp_path, "interval:60000")
    ops = st.wal.ops = Counting()
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch())
    await st.kv.put(b"k", b"v")
    assert ops.dsync_calls == 0 and st.wal.dirty
    await st.sync()  # a Sync operation alone: the separate fdatasync
    assert not st.wal.dirty
    await st.close()


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
@pytest_twisted.ensureDeferred
async def test_a_write_whose_sync_failed_makes_the_store_read_only_and_is_cut(tmp_path, code):
    """Its bytes reached the file: whatever the errno (ENOSPC too), a failed sync, never the
    resumable full disk (the kernel may have dropped the pages). The group is cut from the WAL:
    a restart replays none of it."""
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch(2, 100, 0))
    await st.kv.put(b"a", b"1")
    end = st.wal.end
    st.wal.ops = SyncFails(code)
    with pytest.raises(errors.StoreReadOnly) as e:
        await st.log.append(sid, batch(2, 100, 1))
    assert "fdatasync of the WAL failed" in str(e.value)
    assert st.failed and st.core.full is None
    assert st.wal.end == end and os.fstat(st.wal.fds[st.wal.active]).st_size == end - st.wal.active
    with pytest.raises(errors.StoreReadOnly):
        await st.kv.put(b"b", b"2")
    await st.close()
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 2 and st.kv.get(b"a") == b"1" and st.kv.get(b"b") is None
    assert not st.failed
    await st.close()


@pytest_twisted.ensureDeferred
async def test_a_write_refused_with_enospc_before_writing_is_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "RESUME_POLL_S", 0.02)
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch(2, 100, 0))
    real = st.wal.ops
    st.wal.ops = Refuses(errno.ENOSPC)
    with pytest.raises(errors.DiskFull):
        await st.log.append(sid, batch(2, 100, 1))
    assert st.core.full and not st.failed
    st.wal.ops = real  # space is back (the real free-space check passes on this disk)
    await reactor_until(lambda: st.core.full is None, what="writes to resume")
    assert await st.log.append(sid, batch(2, 100, 2)) == 2
    await st.close()
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 4
    await st.close()


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.EINVAL])
@pytest_twisted.ensureDeferred
async def test_a_kernel_refusing_the_flag_falls_back_to_write_and_fdatasync(tmp_path, code):
    st = open_store(tmp_path)
    ops = st.wal.ops = Refuses(code)
    sid = (await st.log.create_stream()).stream_id
    for i in range(3):
        await st.log.append(sid, batch(2, 100, i))
        await st.kv.put(b"k%d" % i, b"v")
        assert not st.wal.dirty  # synced by the fdatasync after the plain write
    assert ops.calls == 1 and st.wal.dsync is False and not st.failed
    await st.close()
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 6 and st.kv.get(b"k2") == b"v"
    await st.close()
