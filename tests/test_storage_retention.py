"""Retention, trim and reclamation on real files: expired batches are trimmed in the background,
WAL segments holding no live batch are deleted, chunk packs with no live chunk are deleted."""

import glob
import os

import pytest_twisted
from twisted.internet import reactor

from storage import Store
from tests.storage_helpers.util import base_of, batch
from tests.waiting import reactor_until


def wal_files(path):
    return sorted(glob.glob(os.path.join(str(path), "wal", "*.wal")))


async def until(condition, timeout=10.0):
    """Background retention runs on its own schedule: wait for what it should have done."""
    await reactor_until(condition, timeout, what="the background retention task")


@pytest_twisted.ensureDeferred
async def test_retention_trims_and_deletes_segments(tmp_path):
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1, segment_bytes=16 << 10,
                    retention_check_s=0.05)
    old = (await st.log.create_stream(retention_period_ms=150)).stream_id
    keep = (await st.log.create_stream()).stream_id
    for i in range(40):
        await st.log.append(old, batch(1, 2000, i))
    assert len(wal_files(tmp_path)) > 4
    await until(lambda: st.log.stream(old).trim_offset == 40 and len(wal_files(tmp_path)) == 1)
    assert st.log.stream(old).next_offset == 40  # only the active segment is left
    # a stream with infinite retention does not pin old segments: the cleaner re-appends its
    # live batch at the head and the segment goes
    kept = batch(1, 100, 77)
    await st.log.append(keep, kept)
    for i in range(20):
        await st.log.append(old, batch(1, 2000, i))
    await until(lambda: st.log.stream(old).trim_offset == 60 and len(wal_files(tmp_path)) <= 2)
    got = (await st.log.read(keep, 0, 1))[0]
    assert base_of(got) == 0 and got[9:] == kept[9:]
    await st.log.trim(keep, 1)
    await until(lambda: len(wal_files(tmp_path)) == 1)
    await st.close()
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1, segment_bytes=16 << 10)
    assert st.log.stream(old).next_offset == 60 and st.log.stream(keep).next_offset == 1
    assert st.log.stream(keep).trim_offset == 1
    assert await st.log.append(old, batch(1, 10)) == 60
    await st.close()


@pytest_twisted.ensureDeferred
async def test_deleted_stream_frees_segments(tmp_path):
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1, segment_bytes=16 << 10,
                    retention_check_s=0.05)
    sid = (await st.log.create_stream()).stream_id
    for i in range(30):
        await st.log.append(sid, batch(1, 2000, i))
    assert len(wal_files(tmp_path)) > 3
    await st.log.delete_stream(sid)
    await until(lambda: len(wal_files(tmp_path)) == 1)
    await st.close()


@pytest_twisted.ensureDeferred
async def test_chunk_packs_are_few_and_reclaimed(tmp_path):
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1, pack_bytes=64 << 10,
                    retention_check_s=0, chunk_grace_s=0)
    addrs = [await st.chunks.put(os.urandom(4096)) for _ in range(200)]
    packs = glob.glob(os.path.join(str(tmp_path), "chunks", "pack-*"))
    assert 10 <= len(packs) <= 15  # 200 chunks of 4 KiB in 64 KiB packs, not 200 files
    keep = addrs[-3:]
    await st.meta.transact(lambda t: t.chunk_incref(keep))
    assert await st.chunks.sweep_now() == 197
    assert st.chunks.has_many(addrs) == [False] * 197 + [True] * 3
    assert len(glob.glob(os.path.join(str(tmp_path), "chunks", "pack-*"))) <= 2
    assert [a for _, a in st.chunks.by_seq(0, 1 << 40, 1000)] == keep
    for a in keep:
        assert len(await st.chunks.get(a)) == 4096
    await st.close()


@pytest_twisted.ensureDeferred
async def test_cleaner_moves_live_batches_and_replay_agrees(tmp_path):
    """Interleave a long-lived stream with a churning one and collect: the long-lived batches move
    to the head, old segments go; an index that missed the collection replays it from the WAL."""
    import shutil

    st = Store.open(str(tmp_path), fsync="always", reactor=reactor, node_id=1, segment_bytes=16 << 10,
                    retention_check_s=0)
    live = (await st.log.create_stream()).stream_id
    churn = (await st.log.create_stream()).stream_id
    kept = []
    for i in range(60):
        if i % 10 == 0:
            b = batch(1, 300, i)
            kept.append(b)
            await st.log.append(live, b)
        await st.log.append(churn, batch(1, 2000, i))
    before = len(wal_files(tmp_path))
    await st.log.trim(churn, 55)
    await st.close()
    shutil.copytree(tmp_path / "index", tmp_path / "index.snap")
    st = Store.open(str(tmp_path), fsync="always", reactor=reactor, node_id=1, segment_bytes=16 << 10,
                    retention_check_s=0)
    for _ in range(10):
        await st.log.gc_now()
    assert len(wal_files(tmp_path)) < before / 2
    got = await st.log.read(live, 0, 1 << 20)
    assert [g[9:] for g in got] == [b[9:] for b in kept]
    got = await st.log.read(churn, 55, 1 << 20)
    assert [base_of(g) for g in got] == list(range(55, 60))
    await st.close()
    st = Store.open(str(tmp_path), fsync="always", reactor=reactor, node_id=1, segment_bytes=16 << 10,
                    retention_check_s=0)
    got = await st.log.read(live, 0, 1 << 20)
    assert [g[9:] for g in got] == [b[9:] for b in kept]
    await st.close()
    # as if the process died after the WAL writes of the collection but before the index commit
    shutil.rmtree(tmp_path / "index")
    shutil.copytree(tmp_path / "index.snap", tmp_path / "index")
    st = Store.open(str(tmp_path), fsync="always", reactor=reactor, node_id=1, segment_bytes=16 << 10,
                    retention_check_s=0)
    got = await st.log.read(live, 0, 1 << 20)
    assert [g[9:] for g in got] == [b[9:] for b in kept]
    got = await st.log.read(churn, 55, 1 << 20)
    assert [base_of(g) for g in got] == list(range(55, 60))
    await st.log.gc_now()
    got = await st.log.read(live, 0, 1 << 20)
    assert [g[9:] for g in got] == [b[9:] for b in kept]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_partly_dead_packs_are_compacted(tmp_path):
    st = Store.open(str(tmp_path), fsync="always", reactor=reactor, node_id=1, pack_bytes=64 << 10,
                    retention_check_s=0, chunk_grace_s=0)
    datas = [os.urandom(4096) for _ in range(60)]
    addrs = [await st.chunks.put(d) for d in datas]
    keep = {i for i in range(60) if i % 10 == 0}  # one chunk in ten stays referenced
    await st.meta.transact(lambda t: t.chunk_incref([addrs[i] for i in keep]))
    before = len(glob.glob(os.path.join(str(tmp_path), "chunks", "pack-*")))
    for _ in range(6):
        await st.chunks.sweep_now()
    after = len(glob.glob(os.path.join(str(tmp_path), "chunks", "pack-*")))
    assert before >= 4 and after <= 2
    for i in keep:
        assert await st.chunks.get(addrs[i]) == datas[i]
    assert sorted(a for _, a in st.chunks.by_seq(0, 1 << 40, 1000)) == sorted(addrs[i] for i in keep)
    await st.close()
    st = Store.open(str(tmp_path), fsync="always", reactor=reactor, node_id=1, pack_bytes=64 << 10,
                    retention_check_s=0)
    for i in keep:
        assert await st.chunks.get(addrs[i]) == datas[i]
    await st.close()
