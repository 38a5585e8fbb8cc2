"""truncate_replica (cluster failover, CONTRACT §9): a copy's unacknowledged tail past a seal is
cut at a batch boundary, on real files, and stays cut after a reopen."""

import pytest
import pytest_twisted
from twisted.internet import reactor

from storage import Store, errors
from tests.storage_helpers.util import base_of, batch


def with_base(b, base):
    return b[:1] + base.to_bytes(8, "big", signed=True) + b[9:]


@pytest_twisted.ensureDeferred
async def test_a_tail_is_cut_at_a_batch_boundary_and_stays_cut(tmp_path):
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1)
    sid = (await st.log.create_stream()).stream_id
    for i in range(5):
        assert await st.log.append(sid, batch(2, 20, i)) == 2 * i
    with pytest.raises(errors.InvalidRequest):
        await st.log.truncate_replica(sid, 5)  # inside the batch at 4
    meta = await st.log.truncate_replica(sid, 6)
    assert meta.next_offset == 6 and st.log.assigned_end(sid) == 6 and st.log.durable_end(sid) == 6
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(b) for b in got] == [0, 2, 4]
    assert (await st.log.truncate_replica(sid, 9)).next_offset == 6  # past the end: nothing to cut
    # the copy takes the new range's batches from the cut on
    await st.log.append_replica(sid, with_base(batch(3, 20, 9), 6))
    await st.close()
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1)
    assert st.log.stream(sid).next_offset == 9
    got = await st.log.read(sid, 0, 1 << 20)
    assert [base_of(b) for b in got] == [0, 2, 4, 6] and got[3][9:] == batch(3, 20, 9)[9:]
    await st.close()


@pytest_twisted.ensureDeferred
async def test_a_new_copy_of_a_trimmed_stream_starts_where_the_primarys_copy_begins(tmp_path):
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1)
    sid = (await st.log.create_stream()).stream_id
    st.log.hold_at_confirm(sid)
    meta = await st.log.start_replica_at(sid, 20)
    assert (meta.trim_offset, meta.next_offset, st.log.assigned_end(sid)) == (20, 20, 20)
    await st.log.append_replica(sid, with_base(batch(2, 20, 1), 20))
    st.log.confirm(sid, 22)
    assert [base_of(b) for b in await st.log.read(sid, 20, 1 << 20)] == [20]
    assert (await st.log.start_replica_at(sid, 10)).next_offset == 22  # holds more already: unchanged
    await st.close()
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1)
    assert (st.log.stream(sid).trim_offset, st.log.stream(sid).next_offset) == (20, 22)
    await st.close()


@pytest_twisted.ensureDeferred
async def test_a_replica_told_a_trim_point_past_what_it_shows_reaches_it_as_its_copy_grows(tmp_path):
    # issue 17: trim acts on every replica at the same offset. The record's trim point comes from
    # the primary; a copy that lags (it shows less, held at the confirm offset it learned) trims
    # what it shows, and the rest once the confirm offset reaches it, not only at the next record.
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1)
    sid = (await st.log.create_stream()).stream_id
    st.log.hold_at_confirm(sid)
    for i in range(4):
        await st.log.append_replica(sid, with_base(batch(2, 20, i), 2 * i))
    st.log.confirm(sid, 2)
    assert (await st.log.trim_replica(sid, 6)).trim_offset == 2  # it shows [0, 2) so far
    st.log.confirm(sid, 8)
    assert st.log.stream(sid).trim_offset == 6
    with pytest.raises(errors.OffsetOutOfRange):
        await st.log.read(sid, 4, 1 << 20)
    assert [base_of(b) for b in await st.log.read(sid, 6, 1 << 20)] == [6]
    await st.close()
    st = Store.open(str(tmp_path), fsync="never", reactor=reactor, node_id=1)
    assert st.log.stream(sid).trim_offset == 6
    await st.close()
