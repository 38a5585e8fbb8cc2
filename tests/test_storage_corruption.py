"""Corruption tests on real files: a torn or corrupt WAL tail is cut on open; a corrupt entry the
index already covers is reported as DataCorrupted for that batch and never served."""

import glob
import os
import shutil

import pytest
import pytest_twisted
from twisted.internet import reactor

from storage import Store, errors
from storage.wal import ENTRY_SIZE
from tests.storage_helpers.util import base_of, batch, entry_positions


def open_store(path):
    return Store.open(str(path), fsync="always", reactor=reactor, node_id=1, retention_check_s=0)


def wal_files(path):
    return sorted(glob.glob(os.path.join(str(path), "wal", "*.wal")))


async def two_phase(tmp_path, n_a=5, n_b=6):
    """Write A, snapshot the index, write B, close and restore the snapshot: the WAL now has a tail
    (B) past the index checkpoint, as after a crash between the WAL write and the index commit."""
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    for i in range(n_a):
        await st.log.append(sid, batch(2, 100, i))
    await st.close()
    shutil.copytree(tmp_path / "index", tmp_path / "index.snap")
    st = open_store(tmp_path)
    for i in range(n_b):
        await st.log.append(sid, batch(2, 100, 100 + i))
    positions = entry_positions(st, sid)
    await st.close()
    shutil.rmtree(tmp_path / "index")
    shutil.copytree(tmp_path / "index.snap", tmp_path / "index")
    return sid, positions


def patch_file(pos, mutate, path):
    (wal,) = wal_files(path)
    base = int(os.path.basename(wal)[:-4])
    with open(wal, "r+b") as f:
        mutate(f, pos - base)


def flip(f, off):
    f.seek(off)
    b = f.read(1)
    f.seek(off)
    f.write(bytes([b[0] ^ 0x40]))


@pytest_twisted.ensureDeferred
async def test_tail_replayed_from_checkpoint(tmp_path):
    sid, _ = await two_phase(tmp_path)
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 22
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(g) for g in got] == list(range(0, 22, 2))
    await st.close()


@pytest.mark.parametrize("where", ["header", "payload", "last-byte"])
@pytest_twisted.ensureDeferred
async def test_corrupt_tail_is_cut(tmp_path, where):
    sid, positions = await two_phase(tmp_path)
    pos, length = positions[8]  # the 4th batch of B (offsets 16..17)
    off = {"header": 5, "payload": ENTRY_SIZE + 40, "last-byte": length - 1}[where]
    patch_file(pos + off, flip, tmp_path)
    st = open_store(tmp_path)
    m = st.log.stream(sid)
    assert m.next_offset == 16  # A (10) + B's first three batches (6); the rest is cut
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(g) for g in got] == list(range(0, 16, 2))
    assert os.path.getsize(wal_files(tmp_path)[-1]) == pos - int(os.path.basename(wal_files(tmp_path)[-1])[:-4])
    # the store goes on appending after the cut, and survives another reopen
    assert await st.log.append(sid, batch(1, 10, 7)) == 16
    await st.close()
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 17
    assert base_of((await st.log.read(sid, 16, 1))[0]) == 16
    await st.close()


@pytest_twisted.ensureDeferred
async def test_truncated_tail_is_cut(tmp_path):
    sid, positions = await two_phase(tmp_path)
    pos, length = positions[7]
    (wal,) = wal_files(tmp_path)
    base = int(os.path.basename(wal)[:-4])
    os.truncate(wal, pos - base + length // 2)  # a torn write in the middle of an entry
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 14
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(g) for g in got] == list(range(0, 14, 2))
    await st.close()


@pytest.mark.parametrize("size", [100, 30000])  # small batches are read in runs, big ones alone
@pytest.mark.parametrize("where", ["header", "payload", "base-offset"])
@pytest_twisted.ensureDeferred
async def test_corrupt_middle_is_data_corrupted(tmp_path, where, size):
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    originals = [batch(2, size, i) for i in range(6)]
    for b in originals:
        await st.log.append(sid, b)
    positions = entry_positions(st, sid)
    await st.close()
    pos, length = positions[2]
    off = {"header": 1, "payload": length - 3, "base-offset": ENTRY_SIZE + 16 + 3}[where]
    patch_file(pos + off, flip, tmp_path)
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 12  # the index covers it: not a tail, nothing cut
    with pytest.raises(errors.DataCorrupted):
        await st.log.read(sid, 4, 1)
    with pytest.raises(errors.DataCorrupted):
        await st.log.read(sid, 0, 1 << 20)  # a read spanning it fails rather than skipping it
    got = await st.log.read(sid, 6, 1 << 20)  # batches after it are intact
    assert [base_of(g) for g in got] == [6, 8, 10]
    assert got[0][9:] == originals[3][9:]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_truncated_indexed_data_never_reused(tmp_path):
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    for i in range(6):
        await st.log.append(sid, batch(2, 100, i))
    positions = entry_positions(st, sid)
    await st.close()
    (wal,) = wal_files(tmp_path)
    os.truncate(wal, positions[4][0] - int(os.path.basename(wal)[:-4]))
    st = open_store(tmp_path)
    with pytest.raises(errors.DataCorrupted):
        await st.log.read(sid, 8, 1)
    assert base_of((await st.log.read(sid, 6, 1))[0]) == 6
    # new data goes to a fresh segment past every position the index may still name
    assert await st.log.append(sid, batch(1, 10)) == 12
    assert base_of((await st.log.read(sid, 12, 1))[0]) == 12
    assert len(wal_files(tmp_path)) == 2
    await st.close()


@pytest_twisted.ensureDeferred
async def test_corrupt_chunk_is_data_corrupted(tmp_path):
    st = open_store(tmp_path)
    addr = await st.chunks.put(b"z" * 5000)
    await st.close()
    (pack,) = glob.glob(os.path.join(str(tmp_path), "chunks", "pack-*"))
    with open(pack, "r+b") as f:
        flip(f, 3000)
    st = open_store(tmp_path)
    with pytest.raises(errors.DataCorrupted):
        await st.chunks.get(addr)
    await st.close()


@pytest_twisted.ensureDeferred
async def test_lost_unsynced_metadata_tail(tmp_path):
    """Under --fsync interval/never neither the WAL nor LMDB is synced per group, so an OS crash
    may keep LMDB's pages (checkpoint included) while losing the WAL bytes of the same groups: the
    store still opens, keeps the change and writes on past the checkpoint."""
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch(2, 100))
    end_of_batches = st.wal.end
    await st.kv.put(b"key", b"value")
    await st.meta.transact(lambda t: t.put("t", b"k", 1))
    assert st.wal.end > end_of_batches
    await st.close()
    (wal,) = wal_files(tmp_path)
    os.truncate(wal, end_of_batches - int(os.path.basename(wal)[:-4]))  # as if never written back
    st = open_store(tmp_path)
    assert st.kv.get(b"key") == b"value" and st.meta.read(lambda t: t.get("t", b"k")) == 1
    assert await st.log.append(sid, batch(1, 10)) == 2
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(g) for g in got] == [0, 2]
    await st.close()
    st = open_store(tmp_path)
    assert [base_of(g) for g in await st.log.read(sid, 0, 1 << 20)] == [0, 2]
    await st.close()
