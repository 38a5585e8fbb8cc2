"""``store.log.read_spans``: the zero-copy read path (big batches as FileSpans: where they lie in the
WAL files) against ``read`` on real files: same batches, page-cache and read-pool paths, spans that
outlive their segment, and the integrity checks (every byte but the records block verified on the
server; a changed records block no longer matches the stored CRC a reader checks against)."""

import glob
import os

import pytest
import pytest_twisted
from twisted.internet import reactor

from storage import Store, errors
from storage import record_batch as rb
from storage import wal as wal_module
from storage.wal import FileSpan
from tests.storage_helpers.util import batch, entry_positions
from tests.waiting import reactor_until

BIG = 40  # records of 1000 B: a ~41 KB batch, above the 16 KiB FileSpan threshold


def open_store(path, **kw):
    kw.setdefault("segment_bytes", 256 << 10)
    return Store.open(str(path), fsync="never", reactor=reactor, node_id=1, retention_check_s=0, **kw)


def wal_files(path):
    return sorted(glob.glob(os.path.join(str(path), "wal", "*.wal")))


def as_bytes(items):
    return [x.read() if isinstance(x, FileSpan) else x for x in items]


def evict(path):
    """Drop the WAL files' pages from the page cache (written back first)."""
    for name in wal_files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached(path):
    """True if the first WAL page is in the page cache (preadv2 RWF_NOWAIT)."""
    fd = os.open(wal_files(path)[0], os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


async def fill(st, n=30):
    """A stream of big batches with a small one every fifth, across several 256 KiB segments."""
    sid = (await st.log.create_stream()).stream_id
    for i in range(n):
        await st.log.append(sid, batch(2, 50, i) if i % 5 == 4 else batch(BIG, 1000, i))
    return sid


async def read_all(st, sid, fn, max_bytes):
    out = []
    offset = 0
    while offset < st.log.stream(sid).next_offset:
        got = await fn(sid, offset, max_bytes)
        out.append(got)
        last = rb.read_header(got[-1].header if isinstance(got[-1], FileSpan) else got[-1])
        offset = last.base_offset + last.record_count
    return out


@pytest.mark.parametrize("max_bytes", [1, 100_000, 1 << 20])
@pytest_twisted.ensureDeferred
async def test_spans_hold_the_same_batches_as_read(tmp_path, max_bytes):
    st = open_store(tmp_path)
    sid = await fill(st)
    assert len(wal_files(tmp_path)) >= 4
    plain = await read_all(st, sid, st.log.read, max_bytes)
    spans = await read_all(st, sid, st.log.read_spans, max_bytes)
    assert [as_bytes(r) for r in spans] == plain
    kinds = [type(x) for r in spans for x in r]
    assert FileSpan in kinds and bytes in kinds  # big batches as spans, small ones as bytes
    for r in spans:
        for x in r:
            if isinstance(x, FileSpan):
                assert len(x) == x.length >= 16 << 10 and x.header == x.read()[:rb.HEADER_SIZE]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_page_cache_path_and_read_pool_path(tmp_path):
    st = open_store(tmp_path, segment_bytes=64 << 20)
    sid = (await st.log.create_stream()).stream_id
    for i in range(12):
        await st.log.append(sid, batch(BIG, 1000, i))
    want = as_bytes(await st.log.read(sid, 0, 1 << 20))
    d = st.log.read_spans(sid, 0, 1 << 20)
    assert d.called  # in the page cache: answered at once, no thread hop
    assert as_bytes(await d) == want
    evict(tmp_path)
    if cached(tmp_path):
        pytest.skip("cannot evict pages here")
    d = st.log.read_spans(sid, 0, 1 << 20)
    assert not d.called  # not cached: the read pool reads it (and brings it into the cache)
    got = await d
    assert all(isinstance(x, FileSpan) for x in got) and as_bytes(got) == want
    assert cached(tmp_path)
    assert st.log.read_spans(sid, 0, 1 << 20).called
    await st.close()


@pytest_twisted.ensureDeferred
async def test_span_outlives_its_deleted_segment(tmp_path):
    st = open_store(tmp_path)
    sid = await fill(st, 20)
    first = await st.log.read_spans(sid, 0, 1)
    (span,) = first
    want = span.read()
    first_segment = wal_files(tmp_path)[0]
    # trim everything, collect the segments and close their fds (no grace): the span's own fd
    # still reads the batch it named
    await st.log.trim(sid, st.log.stream(sid).next_offset)
    await st.log.gc_now()
    assert not os.path.exists(first_segment)
    for fd in st.wal.reap(0):
        os.close(fd)
    for _ in range(8):  # fds opened since may reuse the closed numbers
        os.open(os.devnull, os.O_RDONLY)
    assert span.read() == want
    await st.close()


def patch(path, pos, off, mutate):
    for name in wal_files(path):
        base = int(os.path.basename(name)[:-4])
        if base <= pos < base + os.path.getsize(name):
            with open(name, "r+b") as f:
                mutate(f, pos - base + off)
            return
    raise AssertionError("position %d not found" % pos)


def flip(f, off):
    f.seek(off)
    b = f.read(1)
    f.seek(off)
    f.write(bytes([b[0] ^ 0x40]))


# offsets in the batch entry: 9-byte framing, 16-byte stream id + append time, then the batch
@pytest.mark.parametrize("where,off", [("entry framing", 5), ("stream prefix", 12), ("base offset", 25 + 4),
                                       ("timestamp", 25 + 15), ("records crc", 25 + 22), ("records len", 25 + 27)])
@pytest.mark.parametrize("evicted", [False, True])
@pytest_twisted.ensureDeferred
async def test_corrupt_head_is_data_corrupted(tmp_path, where, off, evicted):
    st = open_store(tmp_path, segment_bytes=64 << 20)
    sid = (await st.log.create_stream()).stream_id
    for i in range(6):
        await st.log.append(sid, batch(BIG, 1000, i))
    pos, _ = entry_positions(st, sid)[2]
    patch(tmp_path, pos, off, flip)
    if evicted:
        evict(tmp_path)
    with pytest.raises(errors.DataCorrupted):
        await st.log.read_spans(sid, 2 * BIG, 1)
    with pytest.raises(errors.DataCorrupted):
        await st.log.read_spans(sid, 0, 1 << 20)  # a read spanning it fails rather than skip it
    got = await st.log.read_spans(sid, 3 * BIG, 1 << 20)  # batches after it are intact
    assert [rb.read_header(x.header).base_offset for x in got] == [3 * BIG, 4 * BIG, 5 * BIG]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_corrupt_records_block_fails_the_stored_crc(tmp_path):
    """The server does not pass over a span's records block; the block's CRC stored in the
    batch header (checked against the entry's CRC) is what the reader verifies it with."""
    st = open_store(tmp_path, segment_bytes=64 << 20)
    sid = (await st.log.create_stream()).stream_id
    for i in range(4):
        await st.log.append(sid, batch(BIG, 1000, i))
    pos, length = entry_positions(st, sid)[1]
    patch(tmp_path, pos, length - 100, flip)
    (span,) = await st.log.read_spans(sid, BIG, 1)
    data = span.read()
    with pytest.raises(rb.InvalidBatch):
        rb.validate(data)  # the reader's check: the block no longer matches its stored CRC
    with pytest.raises(errors.DataCorrupted):
        await st.log.read(sid, BIG, 1)  # the copying read still checks the whole entry
    await st.close()


@pytest_twisted.ensureDeferred
async def test_truncated_segment_is_data_corrupted(tmp_path):
    st = open_store(tmp_path, segment_bytes=64 << 20)
    sid = (await st.log.create_stream()).stream_id
    for i in range(6):
        await st.log.append(sid, batch(BIG, 1000, i))
    pos, length = entry_positions(st, sid)[4]
    (name,) = wal_files(tmp_path)
    os.truncate(name, pos - int(os.path.basename(name)[:-4]) + length - 10)  # inside batch 4's block
    with pytest.raises(errors.DataCorrupted):
        await st.log.read_spans(sid, 4 * BIG, 1)
    for i in range(4):  # the batches before it are intact
        (span,) = await st.log.read_spans(sid, i * BIG, 1)
        assert rb.read_header(span.header).base_offset == i * BIG and len(span.read()) == len(span)
    await st.close()


@pytest_twisted.ensureDeferred
async def test_spans_stop_at_the_visible_end(tmp_path):
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch(BIG, 1000, 0))
    d = st.log.append(sid, batch(BIG, 1000, 1))  # not yet durable/visible when read below
    got = await st.log.read_spans(sid, 0, 1 << 20)
    assert len(got) == 1 and rb.read_header(got[0].header).base_offset == 0
    await d
    assert len(await st.log.read_spans(sid, 0, 1 << 20)) == 2
    assert await st.log.read_spans(sid, 2 * BIG, 1 << 20) == []
    with pytest.raises(errors.OffsetOutOfRange):
        await st.log.read_spans(sid, 2 * BIG + 1, 1)
    await st.close()


def evict_range(path, pos, length):
    """Drop ``length`` bytes at WAL position ``pos`` from the page cache (written back first)."""
    for name in wal_files(path):
        base = int(os.path.basename(name)[:-4])
        if base <= pos < base + os.path.getsize(name):
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, pos - base, length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            return
    raise AssertionError("position %d not found" % pos)


needs_cachestat = pytest.mark.skipif(wal_module.cachestat is None, reason="no cachestat(2) here (Linux < 6.5)")


def punch_holes(path, st, sid, keep):
    """Evict the WAL, then read back (readahead off) only the pages ``keep(pos, total)`` names
    for each of ``sid``'s batch entries: what memory reclaim leaves behind."""
    evict(path)
    for pos, total in entry_positions(st, sid):
        for name in wal_files(path):
            base = int(os.path.basename(name)[:-4])
            if base <= pos < base + os.path.getsize(name):
                fd = os.open(name, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                    for at in keep(pos - base, total):
                        os.pread(fd, 1, at)
                finally:
                    os.close(fd)


@needs_cachestat
@pytest_twisted.ensureDeferred
async def test_page_missing_inside_a_batch_goes_to_the_read_pool(tmp_path):
    """Memory reclaim drops pages anywhere: with every batch's first and last pages cached but a
    page in between not, the read goes to the pool instead of to a reactor sendfile that would
    wait for the disk."""
    st = open_store(tmp_path, segment_bytes=64 << 20)
    sid = (await st.log.create_stream()).stream_id
    for i in range(12):
        await st.log.append(sid, batch(BIG, 1000, i))
    want = as_bytes(await st.log.read(sid, 0, 1 << 20))
    punch_holes(tmp_path, st, sid, lambda off, total: (off - 1, off, off + 64, off + total - 1))
    fd = st.wal.fds[st.wal.bases[0]]
    pos, total = entry_positions(st, sid)[5]
    middle = (pos + total // 2) & ~4095
    if wal_module.cachestat(fd, middle, 4096) or not wal_module.cachestat(fd, pos, 64):
        pytest.skip("cannot evict single pages here")
    d = st.log.read_spans(sid, 0, 1 << 20)
    assert not d.called  # to the read pool
    assert as_bytes(await d) == want
    assert st.log.read_spans(sid, 0, 1 << 20).called  # the pool brought the pages back
    await st.close()


@needs_cachestat
@pytest_twisted.ensureDeferred
async def test_prefetch_brings_evicted_batches_back_into_the_page_cache(tmp_path):
    st = open_store(tmp_path, segment_bytes=1 << 20)  # several segments
    sid = (await st.log.create_stream()).stream_id
    for i in range(80):
        await st.log.append(sid, batch(BIG, 1000, i))
    assert len(wal_files(tmp_path)) >= 3
    evict(tmp_path)
    positions = entry_positions(st, sid)
    if not st.wal.uncached(positions[0][0], 4096):  # (cached() would read the page back in)
        pytest.skip("cannot evict pages here")
    start = BIG * 10  # batch 10
    assert st.wal.uncached(positions[10][0], 2 << 20)
    st.log.prefetch(sid, start, 2 << 20)  # 2 MiB of WAL from batch 10 on, across segments
    # the pages are in and their reads done (cachestat counts a page whose read is in flight)
    await reactor_until(lambda: not st.wal.uncached(positions[10][0], 2 << 20) and not st.wal.fetching,
                        what="the prefetched pages")
    assert st.log.read_spans(sid, start, 1 << 20).called  # from the page cache, on this thread
    assert st.wal.uncached(positions[0][0], 4096)  # what lies before was not read
    assert st.wal.uncached(positions[-1][0], 4096)  # nor what lies well after
    st.log.prefetch(sid, st.log.stream(sid).next_offset, 1 << 20)  # at the end: nothing to do
    await st.close()


@needs_cachestat
@pytest_twisted.ensureDeferred
async def test_reads_of_pieces_still_being_prefetched_go_to_the_read_pool(tmp_path):
    """cachestat counts a page whose read is in flight as cached, and a reactor sendfile of it
    would wait for the disk: while a prefetched piece is being read in (Wal.fetch_in), cached
    reads that touch it go to the read pool; once it is in, they are answered at once again."""
    st = open_store(tmp_path, segment_bytes=64 << 20)
    sid = (await st.log.create_stream()).stream_id
    for i in range(12):
        await st.log.append(sid, batch(BIG, 1000, i))
    want = as_bytes(await st.log.read(sid, 0, 1 << 20))
    positions = entry_positions(st, sid)
    assert st.log.read_spans_now(sid, 0, 1 << 20) is not None  # all in the page cache
    piece = (positions[6][0], 4096)  # a page inside the read
    assert st.wal.mark_fetching([piece]) == [piece]
    assert st.wal.mark_fetching([piece]) == []  # already being read: left to that task
    assert st.log.read_spans_now(sid, 0, 1 << 20) is None
    assert st.log.read_spans_now(sid, BIG * 8, 1 << 20) is not None  # a read clear of it
    d = st.log.read_spans(sid, 0, 1 << 20)
    assert not d.called  # to the read pool
    assert as_bytes(await d) == want
    await st.core.in_pool(st.wal.fetch_in, [piece])  # reads it in and unmarks it
    assert st.wal.fetching == {}
    assert st.log.read_spans(sid, 0, 1 << 20).called
    await st.close()


@pytest_twisted.ensureDeferred
async def test_synced_wal_pages_far_behind_the_end_are_dropped_and_still_read(tmp_path, monkeypatch):
    # drop-behind (storage/wal.py DROP_BEHIND_BYTES): after a sync the pages of WAL bytes far
    # behind the end leave the page cache; reads of them come from the disk through the read pool
    monkeypatch.setattr(wal_module, "DROP_STEP_BYTES", 64 << 10)
    advised = []  # (fd, offset, length) of each DONTNEED the WAL gave, then the kernel's call
    real_fadvise = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            advised.append((fd, offset, length))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(wal_module.os, "posix_fadvise", fadvise)
    st = Store.open(str(tmp_path), fsync="always", reactor=reactor, node_id=1, retention_check_s=0,
                    segment_bytes=256 << 10)
    try:
        st.wal.drop_behind = 300 << 10
        sid = await fill(st, 30)  # ~1.2 MB over five segments, each append synced
        first = wal_files(tmp_path)[0]
        # the first segment's synced pages are advised out of the page cache from its start: the
        # writer does it after handing its group back (off the group's latency), so the last
        # append's answer may come just before. Whether the kernel drops them at once is its own
        # affair (on an idle machine it does: the first page is then not cached)
        first_fd = st.wal.fds[st.wal.bases[0]]
        await reactor_until(lambda: any(fd == first_fd and off == 0 and n > 0 for fd, off, n in advised),
                            timeout=10.0, what="the first segment's pages advised out")
        fd = os.open(wal_files(tmp_path)[-1], os.O_RDONLY)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)  # the newest bytes stay cached
        finally:
            os.close(fd)
        got = as_bytes([b for r in await read_all(st, sid, st.log.read_spans, 1 << 20) for b in r])
        want = [b for r in await read_all(st, sid, st.log.read, 1 << 20) for b in r]
        assert got == want and len(want) == 30
        assert first in wal_files(tmp_path)
    finally:
        await st.close()
