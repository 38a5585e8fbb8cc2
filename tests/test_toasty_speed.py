"""The Toasty chunk data paths made faster (issue 18, "Toasty speed"): block reads of the source,
chunks written to a pack with one pwritev, replies taken from big receive reads, and the read's
output written as chunks are verified. Real nodes on loopback and real files."""

import glob
import hashlib
import os

import pytest
import pytest_twisted
from twisted.internet import reactor

from protocols.toasty.client import BlockingToastyClient, ToastyError
from storage import Store

MiB = 1024 * 1024
CHUNK = 64 * 1024


def file_of(path, size, seed):
    """A file of ``size`` bytes that never repeats a chunk (nothing deduplicates); its SHA-256."""
    h = hashlib.sha256()
    block = hashlib.sha256(seed).digest()
    with open(path, "wb") as f:
        left = size
        while left:
            block = hashlib.sha256(block).digest()
            part = (block * (MiB // 32))[: min(left, MiB)]
            f.write(part)
            h.update(part)
            left -= len(part)
    return h.digest()


def sha_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for part in iter(lambda: f.read(MiB), b""):
            h.update(part)
    return h.digest()


def test_big_file_round_trip_with_hashes_checked(node, tmp_path):
    # 40 MiB + a tail in 64 KiB chunks: one piece of 1024 chunks and a second piece, blocks of the
    # source that end inside a piece, and a short last chunk.
    size = 40 * MiB + 12345
    src, got = str(tmp_path / "src.bin"), str(tmp_path / "got.bin")
    digest = file_of(src, size, b"big")
    progress = []
    with BlockingToastyClient(*node.address("meta"), parallel=32) as c:
        with open(src, "rb") as f:
            c.write_stream("/big", f, size, truncate=True, chunk_size=CHUNK, progress=progress.append)
        assert sum(progress) == size
        seen = []
        with open(got, "wb") as out:
            assert c.read_into("/big", out.write, progress=seen.append) == size
        assert sum(seen) == size
        assert os.path.getsize(got) == size and sha_of(got) == digest
        # a range that starts and ends inside chunks, across the piece boundary
        lo, hi = 1024 * CHUNK - 777, 1024 * CHUNK + 3 * CHUNK + 5
        with open(src, "rb") as f:
            f.seek(lo)
            want = f.read(hi - lo)
        assert c.read("/big", lo, hi - lo) == want
        # written from a position inside an open file: the source is read from where it stands
        with open(src, "rb") as f:
            f.seek(CHUNK)
            c.write_stream("/tail", f, 3 * MiB, truncate=True, chunk_size=CHUNK)
            f.seek(CHUNK)
            assert c.read("/tail") == f.read(3 * MiB)


def test_a_damaged_chunk_on_disk_fails_the_read(node, tmp_path):
    # The node checks the pack entry's CRC on every download (and the client the SHA-256): with no
    # other holder, the read fails with a clear error and the node keeps serving other chunks.
    good, bad = os.urandom(CHUNK), os.urandom(CHUNK)
    with BlockingToastyClient(*node.address("meta")) as c:
        c.write("/good", good, truncate=True, chunk_size=CHUNK)
        c.write("/bad", bad, truncate=True, chunk_size=CHUNK)
        assert c.read("/bad") == bad
        packs = glob.glob(os.path.join(node.data_dir, "**", "pack-*.dat"), recursive=True)
        damaged = 0
        for path in packs:
            with open(path, "r+b") as f:
                content = f.read()
                at = content.find(bad[1000:1032])
                if at >= 0:
                    f.seek(at)
                    f.write(bytes(b ^ 0xFF for b in bad[1000:1004]))
                    damaged += 1
        assert damaged == 1
        with pytest.raises(ToastyError, match="failed its (CRC|hash check)"):
            c.read("/bad")
    with BlockingToastyClient(*node.address("meta")) as c:  # the failed read's connections are gone
        assert c.read("/good") == good


@pytest_twisted.inlineCallbacks
def test_a_batch_of_more_chunks_than_iov_max_is_one_pack_write(tmp_path):
    # 600 chunks are 1800 buffers (head, address, data each): more than one pwritev may take.
    store = Store.open(str(tmp_path / "store"), fsync="never", reactor=reactor, node_id=1)
    try:
        datas = [os.urandom(100 + i) for i in range(600)]
        addrs = yield store.chunks.put_many([memoryview(d) for d in datas])
        assert addrs == [hashlib.sha256(d).digest() for d in datas]
        got = yield store.chunks.get_many(addrs)
        assert [bytes(g) for g in got] == datas
    finally:
        yield store.close()
    store = Store.open(str(tmp_path / "store"), fsync="never", reactor=reactor, node_id=1)
    try:  # and all of it is there after a reopen, each entry's CRC checked
        for a, d in zip(addrs[::37], datas[::37]):
            assert (yield store.chunks.get(a)) == d
    finally:
        yield store.close()
