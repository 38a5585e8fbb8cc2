"""Smoke tests of the whole storage API against a real store in a temp dir."""

import pytest
import pytest_twisted
from twisted.internet import defer, reactor

from storage import FsyncPolicy, Store, errors
from storage import record_batch as rb
from tests.storage_helpers.util import base_of, batch, same_except_base
from tests.waiting import reactor_until


def open_store(path, fsync="always", **kw):
    return Store.open(str(path), fsync=FsyncPolicy.parse(fsync), reactor=reactor, node_id=7, **kw)


def test_fsync_policy_parse():
    assert str(FsyncPolicy.parse("always")) == "always"
    assert str(FsyncPolicy.parse("never")) == "never"
    p = FsyncPolicy.parse("interval:1000")
    assert (p.mode, p.interval_ms) == ("interval", 1000)
    for bad in ("", "sometimes", "interval:", "interval:0", "interval:-5", "interval:1.5"):
        with pytest.raises(ValueError) as e:
            FsyncPolicy.parse(bad)
        assert "always" in str(e.value) and "\n" not in str(e.value)


@pytest_twisted.ensureDeferred
async def test_log_roundtrip_and_reopen(tmp_path):
    st = open_store(tmp_path)
    meta = await st.log.create_stream(replica_nums=2, retention_period_ms=0, attrs={"a": 1})
    sid = meta.stream_id
    assert sid == (7 << 32) | 1
    assert meta.ranges[0].start_offset == 0 and meta.ranges[0].end_offset == -1
    batches = [batch(3, 50, i) for i in range(10)]
    bases = await defer.gatherResults([st.log.append(sid, b) for b in batches])
    assert bases == list(range(0, 30, 3))
    assert st.log.stream(sid).next_offset == 30
    got = await st.log.read(sid, 4, 1)
    assert len(got) == 1 and base_of(got[0]) == 3 and same_except_base(got[0], batches[1])
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(g) for g in got] == bases
    assert await st.log.read(sid, 30, 100) == []
    with pytest.raises(errors.OffsetOutOfRange):
        await st.log.read(sid, 31, 100)
    assert st.log.batches(sid, 5, 2) == [(3, 3, len(batches[1])), (6, 3, len(batches[2]))]
    with pytest.raises(errors.ExpectationFailed):
        await st.log.append(sid, batches[0], expect_offset=5)
    assert await st.log.append(sid, batches[0], expect_offset=30) == 30
    await st.close()

    st = open_store(tmp_path)
    m = st.log.stream(sid)
    assert (m.next_offset, m.replica_nums, m.attrs) == (33, 2, {"a": 1})
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(g) for g in got] == bases + [30]
    m2 = await st.log.create_stream()
    assert m2.stream_id == (7 << 32) | 2
    await st.close()


@pytest_twisted.ensureDeferred
async def test_trim_seal_ranges(tmp_path):
    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    for i in range(5):
        await st.log.append(sid, batch(2, 10, i))
    sealed, new = await st.log.seal_range(sid, 0)
    assert (sealed.end_offset, new.range_index, new.start_offset, new.end_offset) == (10, 1, 10, -1)
    with pytest.raises(errors.RangeAlreadySealed):
        await st.log.seal_range(sid, 0)
    with pytest.raises(errors.RangeNotFound):
        await st.log.seal_range(sid, 9)
    with pytest.raises(errors.InvalidRequest):
        await st.log.create_range(sid)
    await st.log.append(sid, batch(2, 10, 9))
    m = await st.log.trim(sid, 11)
    assert m.trim_offset == 11 and [r.range_index for r in m.ranges] == [1] and m.ranges[0].start_offset == 11
    got = await st.log.read(sid, 11, 1)
    assert base_of(got[0]) == 10  # the batch holding the trim point, whole
    with pytest.raises(errors.OffsetOutOfRange):
        await st.log.read(sid, 9, 1)
    m = await st.log.trim(sid, 5)  # never moves back
    assert m.trim_offset == 11
    m = await st.log.trim(sid, 1000)  # capped at next_offset
    assert m.trim_offset == 12
    await st.close()


@pytest_twisted.ensureDeferred
async def test_a_replica_run_is_stored_whole_or_not_at_all(tmp_path):
    """``append_replica_run``: consecutive replica batches as one store operation (a cluster
    replica's received message), read back byte for byte, kept across a reopen; a run that does
    not start at the next offset or has a gap is refused whole, nothing of it assigned."""
    st = open_store(tmp_path)
    sid = (9 << 32) | 5
    await st.log.create_replica_stream(sid, "10.0.0.1:7000", 1, 0)
    run = [rb.with_base_offset(batch(2, 40, i), 2 * i) for i in range(5)]
    crcs = [rb.read_header(b).crc if i % 2 else None for i, b in enumerate(run)]
    views = [memoryview(b) for b in run]  # (a replica stores views of the received bytes)
    assert await st.log.append_replica_run(sid, views, crcs) == 10
    assert st.log.stream(sid).next_offset == 10
    with pytest.raises(errors.ExpectationFailed):
        await st.log.append_replica_run(sid, [rb.with_base_offset(batch(1), 11)], [None])
    with pytest.raises(errors.ExpectationFailed):  # a gap inside the run
        await st.log.append_replica_run(sid, [rb.with_base_offset(batch(1), 10), rb.with_base_offset(batch(1), 12)],
                                        [None, None])
    assert st.log.assigned_end(sid) == 10
    assert await st.log.append_replica_run(sid, [rb.with_base_offset(batch(1), 10)], [None]) == 11
    await st.close()
    st = open_store(tmp_path)
    got = await st.log.read(sid, 0, 1 << 20)
    assert [bytes(g) for g in got] == run + [rb.with_base_offset(batch(1), 10)]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_replica_stream_and_wait(tmp_path):
    st = open_store(tmp_path)
    sid = (9 << 32) | 4
    m = await st.log.create_replica_stream(sid, "10.0.0.1:7000", 1, 0, {"x": 1})
    assert m.origin == "10.0.0.1:7000"
    with pytest.raises(errors.ReadOnlyStream) as e:
        await st.log.append(sid, batch())
    assert e.value.origin == "10.0.0.1:7000"
    b = rb.with_base_offset(batch(2), 0)
    assert await st.log.append_replica(sid, b) == 0
    with pytest.raises(errors.ExpectationFailed):
        await st.log.append_replica(sid, b)
    w = st.log.wait_for_data(sid, 2)
    assert not w.called
    await st.log.append_replica(sid, rb.with_base_offset(batch(1), 2))
    await w
    w = st.log.wait_for_data(sid, 3)
    w.cancel()
    with pytest.raises(defer.CancelledError):
        await w
    w = st.log.wait_for_data(sid, 3)
    await st.log.delete_stream(sid)
    await w
    with pytest.raises(errors.StreamNotFound):
        st.log.stream(sid)
    await st.close()


@pytest_twisted.ensureDeferred
async def test_chunks_kv_meta(tmp_path):
    st = open_store(tmp_path, chunk_grace_s=0.0, retention_check_s=0)
    a = await st.chunks.put(b"hello world")
    assert await st.chunks.put(b"hello world") == a
    assert st.chunks.has(a) and st.chunks.has_many([a, b"\0" * 32]) == [True, False]
    assert await st.chunks.get(a) == b"hello world"
    assert await st.chunks.get(a, 6, 3) == b"wor"
    with pytest.raises(errors.ChunkNotFound):
        await st.chunks.get(b"\1" * 32)
    assert st.chunks.last_seq() == 1 and st.chunks.by_seq(1, 10, 10) == [(1, a)]
    w = st.chunks.wait_for_seq(2)
    b = await st.chunks.put(b"other", pin=True)
    await w
    await st.meta.transact(lambda t: t.chunk_incref([a]))
    assert await st.chunks.sweep_now() == 0
    await st.meta.transact(lambda t: t.chunk_decref([a]))
    await st.chunks.sweep_now()
    assert not st.chunks.has(a) and st.chunks.has(b)

    await st.kv.put(b"\x00a", b"1")
    await st.kv.put(b"\xffz", b"2")
    await st.kv.put(b"m" * 1000, b"long")
    assert st.kv.get(b"m" * 1000) == b"long"
    assert [k for k, _ in st.kv.scan_forward(None, 10)] == [b"\x00a", b"m" * 1000, b"\xffz"]
    assert [k for k, _ in st.kv.scan_backward(None, 10)] == [b"\xffz", b"m" * 1000, b"\x00a"]
    assert [k for k, _ in st.kv.scan_backward(b"n", 10)] == [b"m" * 1000, b"\x00a"]
    stats = st.stats()
    assert stats["kv_keys"] == 3 and stats["chunks"] == 1 and stats["wal_segments"] == 1 and not stats["failed"]
    assert await st.kv.delete(b"\x00a") is True
    assert await st.kv.delete(b"\x00a") is False

    assert await st.meta.next_id("files") == 1
    assert await st.meta.next_id("files") == 2

    def boom(txn):
        txn.put("t", b"k", 1)
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        await st.meta.transact(boom)
    assert st.meta.read(lambda t: t.get("t", b"k")) is None
    await st.meta.transact(lambda t: [t.put("t", b"k%d" % i, {"i": i}) for i in range(5)])
    assert [k for k, _ in st.meta.read(lambda t: t.scan("t", reverse=True, limit=2))] == [b"k4", b"k3"]
    assert st.meta.read(lambda t: t.scan("t", start=b"k2", limit=1)) == [(b"k2", {"i": 2})]
    await st.close()
    st = open_store(tmp_path)
    assert st.kv.get(b"\xffz") == b"2" and st.meta.read(lambda t: t.get("t", b"k1")) == {"i": 1}
    assert st.chunks.has(b) and st.chunks.last_seq() == 2
    await st.close()


@pytest_twisted.ensureDeferred
async def test_offsets_in_call_order_and_acks_in_log_order(tmp_path):
    st = open_store(tmp_path, fsync="interval:50")
    a = (await st.log.create_stream()).stream_id
    b = (await st.log.create_stream()).stream_id
    acks = []
    ds = []
    for i in range(200):
        sid = a if i % 3 else b
        d = st.log.append(sid, bytearray(batch(1 + i % 4, 100 * (i % 7), i)))
        d.addCallback(lambda base, i=i: (acks.append(i), base)[1])
        ds.append(d)
    bases = await defer.gatherResults(ds)
    assert acks == list(range(200))
    for sid in (a, b):
        got = await st.log.read(sid, 0, 1 << 30)
        assert [base_of(g) for g in got] == [base for i, base in enumerate(bases) if (a if i % 3 else b) == sid]
    kv = [st.kv.put(b"k%03d" % i, b"v%d" % i) for i in range(100)]
    await defer.gatherResults(kv)
    assert st.kv.scan_keys(b"k05", 3) == [b"k050", b"k051", b"k052"]
    assert st.kv.scan_keys(None, 2, prefix=b"k09") == [b"k090", b"k091"]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_congestion_signal_and_closed_store(tmp_path):
    st = open_store(tmp_path)
    assert not st.congested and st.queued_bytes() == 0
    await st.when_drained()
    sid = (await st.log.create_stream()).stream_id
    await st.close()
    with pytest.raises(errors.StoreClosed):
        await st.log.append(sid, batch())
    await st.close()  # idempotent


@pytest_twisted.ensureDeferred
async def test_fsync_policies_sync_when_they_say(tmp_path):
    st = open_store(tmp_path / "always", fsync="always")
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch())
    assert not st.wal.dirty  # acked only after the fdatasync
    # Groups without batches too: LMDB's commit (metasync=False) alone may be undone by a power
    # cut, so their WAL entries are synced before the ack as well.
    await st.kv.put(b"key", b"value")
    assert not st.wal.dirty
    await st.meta.transact(lambda t: t.put("t", b"k", 1))
    assert not st.wal.dirty
    await st.chunks.put(b"chunk" * 100)
    assert not st.wal.dirty and not st.packs.dirty
    await st.close()

    st = open_store(tmp_path / "never", fsync="never")
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch())
    assert st.core.unsynced()
    await st.sync()
    assert not st.core.unsynced()
    await st.close()

    st = open_store(tmp_path / "interval", fsync="interval:50")
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch())
    assert st.core.unsynced()
    # synced by the writer within ~50 ms (waited for: the machine may be busy)
    await reactor_until(lambda: not st.core.unsynced(), timeout=10, what="the interval sync")
    await st.close()


@pytest_twisted.ensureDeferred
async def test_interval_presync_writes_back_early_and_stops_with_the_store(tmp_path):
    """Under interval:MS the pre-sync thread fdatasyncs the growing WAL segment and chunk pack
    every MS/8 (at most 100 ms) so the writer's sync finds little left; only the writer's sync
    clears the dirty marks (what is durable when does not change)."""
    from twisted.internet import task

    st = open_store(tmp_path, fsync="interval:60000")
    presync = st.presync
    assert presync is not None and presync.period == 0.1
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch())
    await st.chunks.put(b"chunk" * 100)
    await reactor_until(lambda: set(presync._seen) == {"wal", "packs"}, timeout=10, what="pre-sync of the WAL and packs")
    assert presync._seen["wal"] == (st.wal.active, st.wal.end)
    assert st.core.unsynced()  # the writer's 60 s sync has not come: the dirty marks stay
    passes = presync.passes
    # a negative check needs a window: three pre-sync periods in which nothing grew
    await task.deferLater(reactor, 0.3, lambda: None)
    assert presync.passes == passes  # nothing grew: no further syncs
    await st.close()
    assert not presync._thread.is_alive()
    st = open_store(tmp_path / "always", fsync="always")
    assert st.presync is None  # every group is synced before its ack: nothing to write back early
    await st.close()


@pytest_twisted.ensureDeferred
async def test_interval_presync_across_segment_rolls_and_deletes(tmp_path):
    """Segments roll and are deleted while the pre-sync thread syncs every 10 ms: nothing fails,
    and every acknowledged batch is there after a reopen."""
    st = open_store(tmp_path, fsync="interval:80", segment_bytes=64 << 10)
    doomed = (await st.log.create_stream()).stream_id
    kept = (await st.log.create_stream()).stream_id
    for i in range(60):
        await defer.gatherResults([st.log.append(doomed, batch(8, 1000, tag=i)), st.log.append(kept, batch(2, 100, tag=i))])
        if i % 10 == 0:  # let a pre-sync pass run over what grew
            passes = st.presync.passes
            await reactor_until(lambda: st.presync.passes > passes, what="a pre-sync pass")
    assert len(st.wal.bases) > 4
    await st.log.delete_stream(doomed)
    deleted, _ = await st.log.gc_now()
    assert deleted > 0
    for i in range(10):
        await st.log.append(kept, batch(2, 100, tag=100 + i))
    await reactor_until(lambda: st.presync.passes > 0, what="a pre-sync pass")
    assert st.presync.passes > 0 and st.failed is None
    await st.close()
    st = open_store(tmp_path, fsync="interval:80", segment_bytes=64 << 10)
    got = await st.log.read(kept, 0, 1 << 20)
    assert sum(rb.read_header(b).record_count for b in got) == 140
    await st.close()


def test_interval_sync_waits_for_a_busy_presync_up_to_twice_the_interval():
    from storage.store import POSTPONED_POLL_S, interval_sync_wait

    assert interval_sync_wait(10.0, 9.5, 1.0, False) == pytest.approx(0.5)  # not due yet
    assert interval_sync_wait(10.0, 9.5, 1.0, True) == pytest.approx(0.5)
    assert interval_sync_wait(10.0, 9.0, 1.0, False) == 0.0  # due, disk idle: now
    assert interval_sync_wait(10.0, 9.0, 1.0, True) == POSTPONED_POLL_S  # due, pre-sync writing: poll
    assert interval_sync_wait(10.0, 8.001, 1.0, True) == pytest.approx(0.001)  # never past 2 x interval
    assert interval_sync_wait(10.0, 8.0, 1.0, True) == 0.0
    assert interval_sync_wait(10.0, 5.0, 1.0, True) == 0.0


@pytest_twisted.ensureDeferred
async def test_io_error_fails_the_group_and_later_writes(tmp_path):
    import os

    st = open_store(tmp_path)
    sid = (await st.log.create_stream()).stream_id
    await st.log.append(sid, batch())
    from storage.wal import segment_name

    # swap the active segment's fd for a read-only one: the next pwrite fails with EBADF
    path = os.path.join(str(tmp_path), "wal", segment_name(st.wal.active))
    old_fd = st.wal.fds[st.wal.active]
    st.wal.fds = {**st.wal.fds, st.wal.active: os.open(path, os.O_RDONLY)}
    os.close(old_fd)
    with pytest.raises(errors.StoreReadOnly):
        await st.log.append(sid, batch())
    assert st.failed
    with pytest.raises(errors.StoreError):
        await st.kv.put(b"k", b"v")
    assert base_of((await st.log.read(sid, 0, 1))[0]) == 0  # reads go on
    await st.close()
    st = open_store(tmp_path)
    assert st.log.stream(sid).next_offset == 1
    await st.close()


@pytest_twisted.ensureDeferred
async def test_close_when_the_writer_ends_before_close_looks_at_it(tmp_path):
    """``close`` wakes the writer with its stop; the writer may take the stop, deliver it and end
    before ``close`` asks whether it is alive. The stop is then delivered once (by the writer), not
    also by ``close``: no AlreadyCalledError in the delivery, the close fires once."""
    from twisted.logger import globalLogPublisher

    st = open_store(tmp_path)
    await st.kv.put(b"k", b"v")
    core = st.core
    wake = core._wake_writer

    def wake_and_wait_for_the_end():
        wake()
        if core.closed:  # close's wake-up, its stop queued
            core._writer.join(10)  # the writer has taken the stop and ended: close looks only now
            assert not core._writer.is_alive()

    core._wake_writer = wake_and_wait_for_the_end
    errors_seen = []

    def observer(event):
        if event.get("log_failure") is not None or event.get("isError"):
            errors_seen.append(event)

    globalLogPublisher.addObserver(observer)
    try:
        await st.close()
        d = defer.Deferred()
        reactor.callLater(0.05, d.callback, None)  # let the writer's delivery run, if queued
        await d
    finally:
        globalLogPublisher.removeObserver(observer)
    assert not [e for e in errors_seen if "AlreadyCalled" in repr(e)], errors_seen
    assert core.closed
    st = open_store(tmp_path)
    assert st.kv.get(b"k") == b"v"
    await st.close()
