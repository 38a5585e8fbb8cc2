"""KvServerProtocol units over StringTransport: framing, ordering, cursors, limits, backpressure.

The store is the real one (``store.kv`` over LMDB and the WAL in tmp_path) with the inline writer
of tests/storage_helpers/inline.py: a write commits on the test's thread at once, or, once the
store is held, when the test says (``complete``), which is how durable acks are made to wait,
arrive out of order, or the write queue congested. Faults a healthy store never shows (scans out
of order, a failing read or run) are subclasses of the real ``KeyValue`` that inject them.
"""

import contextlib
import shutil
import struct
import tempfile

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, task
from twisted.internet.testing import StringTransport

from protocols.partition import codec as c
from protocols.partition import gets_compiled, sets_compiled
from protocols.partition.server import KvServerFactory, KvServerProtocol
from storage.kv import KeyValue
from tests.storage_helpers.inline import close, complete, congest, hold, open_inline, pending

# one store serves a property test's examples (see each test)
FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@pytest.fixture(params=["python", "compiled"])
def gets_mode(request):
    """The test runs with the server's Python loop for reads of GETs and with the compiled passes
    (protocols/partition/gets_compiled.py) loaded."""
    gets_compiled.start_loading()
    assert gets_compiled.wait(120) and gets_compiled.state == "compiled", gets_compiled.state
    loaded = gets_compiled.frames
    if request.param == "python":
        gets_compiled.frames = None
    try:
        yield request.param
    finally:
        gets_compiled.frames = loaded


@pytest.fixture(params=["python-sets", "compiled-sets"])
def sets_mode(request):
    """The test runs with the server's Python loop for reads of SETs and with the compiled SET
    pass (protocols/partition/sets_compiled.py) loaded. (Not for the hypothesis tests: run twice
    under pytest-twisted they fail; their examples hold SETs too and take whichever is loaded.)"""
    sets_compiled.start_loading()
    assert sets_compiled.wait(120) and sets_compiled.state == "compiled", sets_compiled.state
    loaded = sets_compiled.run
    if request.param == "python-sets":
        sets_compiled.run = None
    try:
        yield request.param
    finally:
        sets_compiled.run = loaded


@pytest.fixture
def store(tmp_path):
    s = open_inline(tmp_path / "store", task.Clock())
    yield s
    close(s)


def contents(store):
    """Every pair the store holds, as a dict."""
    return dict(store.kv.scan_forward(None, 1 << 20))


def record_runs(store):
    """Observe (not replace) ``store.kv.write_many`` and ``write_sets`` (a run of SETs alone): each
    call is appended to the returned list as [(key, value or None)] and then goes on to the real
    facade."""
    runs = []
    real = store.kv.write_many
    real_sets = store.kv.write_sets

    def write_many(ops):
        ops = list(ops)  # the server passes an iterator
        runs.append([(bytes(k), None if v is None else bytes(v)) for k, v in ops])
        return real(ops)

    def write_sets(keys, values, value_bytes=None):
        runs.append([(bytes(k), bytes(v)) for k, v in zip(keys, values)])
        return real_sets(keys, values, value_bytes)

    real_packed = store.kv.write_packed

    def write_packed(run, op, nbytes):  # the compiled SET pass's run (server._sets_compiled)
        _code, _db, keys, stored = msgpack.unpackb(op)
        runs.append([(k, s[1:]) for k, s in zip(keys, stored)])
        return real_packed(run, op, nbytes)

    store.kv.write_many = write_many
    store.kv.write_sets = write_sets
    store.kv.write_packed = write_packed
    return runs


def connect(store, kv=None):
    factory = KvServerFactory(store.kv if kv is None else kv, store=store)
    proto = factory.buildProtocol(None)
    tr = StringTransport()
    proto.makeConnection(tr)
    return proto, tr


def replies(tr, request_cmds):
    """Decode everything written so far as replies to ``request_cmds`` (in order)."""
    data = tr.value()
    tr.clear()
    out = []
    pos = 0
    for cmd in request_cmds:
        (total,) = struct.unpack_from(">Q", data, pos)
        out.append(c.decode_reply(data, cmd, pos))
        pos += total
    assert pos == len(data), "unexpected extra bytes"
    return out


def feed(proto, data, step=None):
    if step is None:
        proto.dataReceived(data)
    else:
        for i in range(0, len(data), step):
            proto.dataReceived(data[i : i + step])


@pytest.mark.parametrize("step", [None, 1, 7])
def test_set_get_remove(store, step, sets_mode):
    proto, tr = connect(store)
    wire = (
        c.encode_set(1, b"k", b"v")
        + c.encode_get(2, b"k")
        + c.encode_remove(3, b"k")
        + c.encode_get(4, b"k")
        + c.encode_remove(5, b"k")
    )
    feed(proto, wire, step)
    r = replies(tr, [c.SET, c.GET, c.REMOVE, c.GET, c.REMOVE])
    assert [x.client_id for x in r] == [1, 2, 3, 4, 5]
    assert [x.cmd for x in r] == [c.OK, c.OK, c.OK, c.DATA_NOT_FOUND, c.DATA_NOT_FOUND]
    assert r[1].items == [(b"k", b"v")]
    assert tr.value() == b"" and tr.connected


def test_empty_key_rules(store, sets_mode):
    proto, tr = connect(store)
    proto.dataReceived(c.encode_set(1, b"", b"v") + c.encode_get(2, b"") + c.encode_remove(3, b""))
    r = replies(tr, [c.SET, c.GET, c.REMOVE])
    assert (r[0].cmd, r[0].error_code) == (c.ERR, c.E_UNKNOWN)
    assert r[1].cmd == r[2].cmd == c.DATA_NOT_FOUND


def test_replies_in_order_when_acks_arrive_out_of_order(store, sets_mode):
    hold(store)
    proto, tr = connect(store)
    # two reads: a write behind an unacked run is its own store write (two acks to reorder)
    proto.dataReceived(c.encode_set(1, b"a", b"1"))
    proto.dataReceived(
        c.encode_set(2, b"b", b"2")
        + c.encode_get(3, b"a")  # must see its own connection's earlier SET
        + c.encode_remove(4, b"a")
        + c.encode_get(5, b"b")
    )
    assert tr.value() == b""
    # issue 19: the GETs read the pending writes at once; nothing waits for the disk but replies
    assert pending(store) == 2  # the first pass's SET and the second pass's run (SET, REMOVE)
    complete(store, None, reverse=True)  # committed in order, acked in reverse
    r = replies(tr, [c.SET, c.SET, c.GET, c.REMOVE, c.GET])
    assert [(x.client_id, x.cmd) for x in r] == [(1, c.OK), (2, c.OK), (3, c.OK), (4, c.OK), (5, c.OK)]
    assert r[2].items == [(b"a", b"1")] and r[4].items == [(b"b", b"2")]


def test_set_get_pairs_in_one_read_are_one_run_and_one_reply_slot(store, sets_mode):
    """``SET k; GET k`` pipelined (issue 19's pattern): the GETs of keys the same read wrote are
    answered in the pass, from those writes, their replies in order among the writes' (one store
    write, nothing sent before it is durable); a GET of another key ends the run and reads the
    store (here: the connection's pending writes first)."""
    store.kv.put(b"old", b"o")
    hold(store)
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.dataReceived(
        c.encode_set(1, b"a", b"1")
        + c.encode_get(2, b"a")
        + c.encode_set(3, b"a", b"2")
        + c.encode_get(4, b"a")
        + c.encode_remove(5, b"a")
        + c.encode_get(6, b"a")
        + c.encode_remove(7, b"nope")
        + c.encode_set(8, b"b", b"3")
        + c.encode_get(9, b"old")
        + c.encode_get(10, b"b")
    )
    assert tr.value() == b""
    assert runs == [[(b"a", b"1"), (b"a", b"2"), (b"a", None), (b"nope", None), (b"b", b"3")]]
    complete(store)
    cmds = [c.SET, c.GET, c.SET, c.GET, c.REMOVE, c.GET, c.REMOVE, c.SET, c.GET, c.GET]
    r = replies(tr, cmds)
    assert [x.client_id for x in r] == list(range(1, 11))
    assert [x.cmd for x in r] == [c.OK, c.OK, c.OK, c.OK, c.OK, c.DATA_NOT_FOUND, c.DATA_NOT_FOUND, c.OK, c.OK, c.OK]
    assert [r[i].items for i in (1, 3, 8, 9)] == [[(b"a", b"1")], [(b"a", b"2")], [(b"old", b"o")], [(b"b", b"3")]]
    assert contents(store) == {b"old": b"o", b"b": b"3"}


def test_sync_replies_before_a_pending_write_are_sent_at_once(store, sets_mode):
    store.kv.put(b"x", b"1")
    hold(store)
    proto, tr = connect(store)
    proto.dataReceived(c.encode_get(1, b"x") + c.encode_set(2, b"y", b"2") + c.encode_get(3, b"y"))
    assert [x.client_id for x in replies(tr, [c.GET])] == [1]
    complete(store)
    r = replies(tr, [c.SET, c.GET])
    assert r[1].items == [(b"y", b"2")]


def test_invalid_command_and_short_messages_keep_the_connection_in_sync(store, sets_mode):
    proto, tr = connect(store)
    wire = (
        struct.pack(">QQQH", 26, 1, 0, 0)  # OK is not a request
        + struct.pack(">QQQH", 26, 2, 0, 99)
        + struct.pack(">QQQH", 29, 3, 1, 2) + b"\x00\x05k"  # key runs past total_len
        + struct.pack(">QQ", 20, 4) + b"\x00" * 4  # total_len 20 < 26: ERR 3, client_id echoed
        + struct.pack(">Q", 12) + b"\x00" * 4  # total_len 12: ERR 3 with client_id 0
        + c.encode_scan(c.GET_FF, 5, 0, b"c")  # count 0
        + c.encode_scan(c.GET_FF, 6, 2000, b"c")  # count 2000
        + c.encode_scan(c.GET_FF, 7, 10, b"nope")  # unknown cursor
        + c.encode_delete_cursor(8, b"nope")
        + struct.pack(">QQQH", 34, 9, 1, 2) + b"\x00\x01k" + b"trailer"  # trailing bytes ignored
    )
    feed(proto, wire, 3)
    r = replies(tr, [0, 99, c.GET, c.GET, c.GET, c.GET_FF, c.GET_FF, c.GET_FF, c.DELETE_CURSOR, c.GET])
    got = [(x.client_id, x.cmd, x.error_code) for x in r]
    assert got == [
        (1, c.INVALID_COMMAND, None),
        (2, c.INVALID_COMMAND, None),
        (3, c.ERR, c.E_MSG_TOO_SHORT),
        (4, c.ERR, c.E_MSG_TOO_SHORT),
        (0, c.ERR, c.E_MSG_TOO_SHORT),
        (5, c.ERR, c.E_TOO_MANY_ELEMENTS),
        (6, c.ERR, c.E_TOO_MANY_ELEMENTS),
        (7, c.ERR, c.E_CURSOR_NOT_FOUND),
        (8, c.ERR, c.E_CURSOR_NOT_FOUND),
        (9, c.DATA_NOT_FOUND, None),
    ]
    assert tr.connected


def test_huge_total_len_is_refused_before_buffering_and_closes(store, sets_mode):
    proto, tr = connect(store)
    proto.dataReceived(c.encode_get(1, b"k"))
    # a claimed 1 TB message: ERR 3 echoing client_id as soon as 16 bytes are in, then close
    proto.dataReceived(struct.pack(">Q", 10**12))
    proto.dataReceived(struct.pack(">Q", 42)[:4])
    assert replies(tr, [c.GET])[0].client_id == 1
    proto.dataReceived(struct.pack(">Q", 42)[4:] + b"\x00" * 100)
    r = replies(tr, [c.GET])
    assert (r[0].client_id, r[0].cmd, r[0].error_code) == (42, c.ERR, c.E_MSG_TOO_SHORT)
    assert tr.disconnecting
    proto.dataReceived(c.encode_get(2, b"k"))  # ignored after the refusal
    assert tr.value() == b""


def test_limit_is_32_mib_exactly(store, sets_mode):
    proto, tr = connect(store)
    # total_len of exactly 32 MiB is accepted (buffered), one byte more is refused
    proto.dataReceived(struct.pack(">QQ", 32 * 1024 * 1024, 1))
    assert tr.value() == b"" and not tr.disconnecting
    proto2, tr2 = connect(store)
    proto2.dataReceived(struct.pack(">QQ", 32 * 1024 * 1024 + 1, 1))
    assert replies(tr2, [c.GET])[0].error_code == c.E_MSG_TOO_SHORT and tr2.disconnecting


def test_total_len_below_8_closes_after_earlier_replies(store, sets_mode):
    hold(store)
    proto, tr = connect(store)
    proto.dataReceived(c.encode_set(1, b"a", b"1") + struct.pack(">Q", 3) + b"zzzzz")
    assert not tr.disconnecting and tr.value() == b""
    complete(store)
    # CONTRACT §4: total_len < 8 gets ERR 3 with client_id 0, after the replies before it, then the close
    assert tr.value() == (
        struct.pack(">QQQH", 26, 1, 0, c.OK)
        + bytes.fromhex("000000000000001c" "0000000000000000" "0000000000000000" "0001" "0003")
    )
    assert tr.disconnecting


@pytest.mark.parametrize("total", [0, 1, 7])
def test_total_len_below_8_alone_is_err3_with_client_id_0(store, total, sets_mode):
    proto, tr = connect(store)
    proto.dataReceived(struct.pack(">Q", total) + b"\x00" * 30)
    assert tr.value() == bytes.fromhex("000000000000001c" + "00" * 16 + "0001" + "0003")
    assert tr.disconnecting


def test_values_up_to_16_mib(store, sets_mode):
    proto, tr = connect(store)
    big = b"v" * (16 * 1024 * 1024)
    feed(proto, c.encode_set(1, b"big", big) + c.encode_get(2, b"big"), 1 << 20)
    r = replies(tr, [c.SET, c.GET])
    assert r[0].cmd == c.OK and r[1].items == [(b"big", big)]
    proto.dataReceived(c.encode_set(3, b"big2", big + b"x"))
    r = replies(tr, [c.SET])
    assert (r[0].cmd, r[0].error_code) == (c.ERR, c.E_UNKNOWN)


# -- cursors and scans --------------------------------------------------------------------------


def fill(store, keys):
    d = store.kv.write_many([(k, b"v" + k) for k in keys])
    complete(store, None)
    assert d.called


def scan_all(proto, tr, cmd, name=b"c", count=3, prefix=b""):
    pages = []
    while True:
        proto.dataReceived(c.encode_scan(cmd, 1, count, name, b"", prefix))
        (r,) = replies(tr, [cmd])
        assert r.cmd == c.OK, r
        if not r.items:
            return pages
        pages.append(r)


KEYS = sorted({bytes([b]) + s for b in (0x00, 0x1F, 0x20, 0x41, 0x7F, 0x80, 0xC0, 0xFF) for s in (b"", b"a", b"b\x00", b"zz")})


def test_full_forward_scan_each_key_once_and_jump_bit(store, sets_mode):
    fill(store, KEYS)
    proto, tr = connect(store)
    proto.dataReceived(c.encode_create_cursor(1, b"c"))
    assert replies(tr, [c.CREATE_CURSOR])[0].cmd == c.OK
    pages = scan_all(proto, tr, c.GET_FF, count=5)
    got = [k for p in pages for k, _ in p.items]
    assert got == KEYS
    for p in pages:
        assert [v for _, v in p.items] == [b"v" + k for k, _ in p.items]
        parts = {c.partition_of(k) for k, _ in p.items}
        assert p.jumped == (len(parts) > 1)
        assert p.count == len(p.items)
    assert any(p.jumped for p in pages) and not all(p.jumped for p in pages)
    # the footer is the next position: the first key of the next page, empty at the end
    for a, b in zip(pages, pages[1:]):
        assert a.next_key == b.items[0][0]
    assert pages[-1].next_key == b""
    # repeated FF at END returns nothing
    assert scan_all(proto, tr, c.GET_FF) == []


def test_full_backward_scan_pages_ascending(store, sets_mode):
    fill(store, KEYS)
    proto, tr = connect(store)
    # FB from BEGIN gives nothing; from END (after a full forward scan) starts at the last key
    proto.dataReceived(c.encode_create_cursor(1, b"c"))
    replies(tr, [c.CREATE_CURSOR])
    assert scan_all(proto, tr, c.GET_FB) == []
    scan_all(proto, tr, c.GET_FF, count=1024)
    pages = scan_all(proto, tr, c.GET_FB, count=4)
    for p in pages:
        assert [k for k, _ in p.items] == sorted(k for k, _ in p.items)
    got = [k for p in reversed(pages) for k, _ in p.items]
    assert got == KEYS
    assert pages[0].items[-1][0] == KEYS[-1]
    assert pages[-1].next_key == b""


def test_boundary_is_inclusive_and_next_key_overrides(store, sets_mode):
    fill(store, [b"a", b"b", b"c", b"d"])
    proto, tr = connect(store)
    proto.dataReceived(c.encode_create_cursor(1, b"x", b"b"))
    proto.dataReceived(c.encode_scan(c.GET_FF, 2, 2, b"x"))
    proto.dataReceived(c.encode_scan(c.GET_FB, 3, 1, b"x"))  # FB from "d" inclusive
    proto.dataReceived(c.encode_scan(c.GET_KEYS, 4, 10, b"x", b"bb"))  # start at "bb"
    proto.dataReceived(c.encode_scan(c.GET_FB, 5, 10, b"x", b"b"))
    r = replies(tr, [c.CREATE_CURSOR, c.GET_FF, c.GET_FB, c.GET_KEYS, c.GET_FB])
    assert r[1].items == [(b"b", b"vb"), (b"c", b"vc")] and r[1].next_key == b"d"
    assert r[2].items == [(b"d", b"vd")] and r[2].next_key == b"c"
    assert r[3].items == [(b"c", None), (b"d", None)] and r[3].next_key == b""
    assert r[4].items == [(b"a", b"va"), (b"b", b"vb")] and r[4].next_key == b""


def test_prefix_scan(store, sets_mode):
    fill(store, [b"a", b"pa", b"pb", b"pc", b"pd", b"q", b"r"])
    proto, tr = connect(store)
    proto.dataReceived(c.encode_create_cursor(1, b"c"))
    replies(tr, [c.CREATE_CURSOR])
    pages = scan_all(proto, tr, c.GET_KEYS_PREFIX, count=3, prefix=b"p")
    assert [[k for k, _ in p.items] for p in pages] == [[b"pa", b"pb", b"pc"], [b"pd"]]
    assert pages[0].next_key == b"pd" and pages[1].next_key == b"q"  # stopped at the first non-match


def test_cursors_are_independent_reset_and_deleted(store, sets_mode):
    fill(store, [b"a", b"b", b"c"])
    proto, tr = connect(store)
    proto.dataReceived(
        c.encode_create_cursor(1, b"x")
        + c.encode_create_cursor(2, b"y", b"c")
        + c.encode_scan(c.GET_KEYS, 3, 1, b"x")
        + c.encode_scan(c.GET_KEYS, 4, 1, b"y")
        + c.encode_scan(c.GET_KEYS, 5, 1, b"x")
        + c.encode_create_cursor(6, b"x")  # re-create resets
        + c.encode_scan(c.GET_KEYS, 7, 1, b"x")
        + c.encode_delete_cursor(8, b"x")
        + c.encode_scan(c.GET_KEYS, 9, 1, b"x")
    )
    r = replies(tr, [9, 9, 4, 4, 4, 9, 4, 10, 4])
    assert [x.items for x in (r[2], r[3], r[4], r[6])] == [[(b"a", None)], [(b"c", None)], [(b"b", None)], [(b"a", None)]]
    assert r[7].cmd == c.OK and (r[8].cmd, r[8].error_code) == (c.ERR, c.E_CURSOR_NOT_FOUND)
    # a new connection does not see the first one's cursors
    proto2, tr2 = connect(store)
    proto2.dataReceived(c.encode_scan(c.GET_KEYS, 1, 1, b"y"))
    assert replies(tr2, [4])[0].error_code == c.E_CURSOR_NOT_FOUND


def test_scan_reply_is_bounded_by_bytes(store, sets_mode):
    big = b"x" * (8 * 1024 * 1024)
    store.kv.write_many([(bytes([0x40 + i]), big) for i in range(6)])
    proto, tr = connect(store)
    proto.dataReceived(c.encode_create_cursor(1, b"c"))
    replies(tr, [9])
    pages = scan_all(proto, tr, c.GET_FF, count=1024)
    assert [len(p.items) for p in pages] == [3, 3]
    assert sum(len(p.items) for p in pages) == 6


# -- backpressure ----------------------------------------------------------------------------


def test_pending_budget_pauses_and_resumes_reading(store, sets_mode):
    hold(store)
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.max_pending = 4
    proto.dataReceived(b"".join(c.encode_set(i, b"k%d" % i, b"v") for i in range(10)))
    assert tr.producerState == "paused"
    assert sum(map(len, runs)) == 4  # the rest stays in the buffer, unparsed
    while pending(store):
        complete(store)
        assert sum(len(run) for run in runs[len(runs) - pending(store):]) <= 4  # at most 4 unacked
    assert tr.producerState == "producing"
    r = replies(tr, [c.SET] * 10)
    assert [x.client_id for x in r] == list(range(10))


def test_write_side_backpressure_stops_processing(store, sets_mode):
    proto, tr = connect(store)
    proto.gate.pauseProducing()  # the transport's send buffer is full
    proto.dataReceived(c.encode_get(1, b"k"))
    assert tr.value() == b"" and tr.producerState == "paused"
    proto.gate.resumeProducing()
    assert replies(tr, [c.GET])[0].client_id == 1


# -- fuzz -----------------------------------------------------------------------------------


# one store for every example: what garbage writes does not matter here
@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.lists(st.binary(min_size=0, max_size=60), max_size=20), st.integers(1, 17))
def test_garbage_never_crashes(store, chunks, step):
    fill(store, [b"a", b"b"])
    proto, tr = connect(store)
    proto.dataReceived(c.encode_create_cursor(0, b""))
    data = b"".join(chunks)
    for i in range(0, len(data), step):
        proto.dataReceived(data[i : i + step])
    # whatever was written parses as a sequence of whole messages
    out = tr.value()
    pos = 0
    while pos < len(out):
        (total,) = struct.unpack_from(">Q", out, pos)
        assert total >= 26
        pos += total
    assert pos == len(out)


# one store for every example: scans write nothing
@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.lists(st.tuples(st.sampled_from([c.GET_FF, c.GET_FB, c.GET_KEYS]), st.integers(1, 6)), max_size=12))
def test_scan_sequences_never_skip_or_repeat_in_one_direction(store, ops):
    if not contents(store):
        fill(store, KEYS)
    proto, tr = connect(store)
    proto.dataReceived(c.encode_create_cursor(0, b"c"))
    replies(tr, [9])
    last_dir = None
    prev_next = None
    for cmd, count in ops:
        proto.dataReceived(c.encode_scan(cmd, 1, count, b"c"))
        (r,) = replies(tr, [cmd])
        keys = [k for k, _ in r.items]
        assert keys == sorted(keys) and len(keys) <= count
        direction = "b" if cmd == c.GET_FB else "f"
        if keys and prev_next and direction == last_dir:
            # consecutive pages in one direction continue exactly at the previous footer
            assert (keys[0] if direction == "f" else keys[-1]) == prev_next
        prev_next = r.next_key
        last_dir = direction


class ShuffledKv(KeyValue):
    """The real key-value facade whose scans return runs of keys out of order (as a broken index
    might)."""

    def scan_forward(self, start, limit):
        out = super().scan_forward(start, limit)
        return out[1::2] + out[0::2] if len(out) > 2 else out

    def scan_keys(self, start, limit, prefix=None):
        out = super().scan_keys(start, limit, prefix)
        return out[::-1] if len(out) > 2 else out

    def scan_backward(self, start, limit):
        out = super().scan_backward(start, limit)
        return out[::-1] if len(out) > 2 else out


@pytest.mark.parametrize("cmd", [c.GET_FF, c.GET_KEYS, c.GET_FB])
@pytest.mark.parametrize("count", [1, 3, 50])
def test_scans_terminate_without_repeats_even_if_the_store_misorders(store, cmd, count, sets_mode):
    fill(store, KEYS)
    proto, tr = connect(store, ShuffledKv(store.core))
    proto.dataReceived(c.encode_create_cursor(1, b"c", b"\xff" * 8 if cmd == c.GET_FB else b""))
    replies(tr, [9])
    seen = []
    for _ in range(len(KEYS) + 2):
        proto.dataReceived(c.encode_scan(cmd, 1, count, b"c"))
        (r,) = replies(tr, [cmd])
        if not r.items:
            break
        keys = [k for k, _ in r.items]
        assert keys == sorted(set(keys))
        seen += keys
    else:
        pytest.fail("the scan did not end")
    assert len(seen) == len(set(seen))


def test_inflight_value_bytes_bound_reading(store, sets_mode):
    hold(store)
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.max_inflight_bytes = 1000
    proto.dataReceived(b"".join(c.encode_set(i, b"k%d" % i, b"x" * 400) for i in range(6)))
    assert sum(map(len, runs)) == 3 and tr.producerState == "paused"
    while pending(store):
        complete(store)
    assert [x.client_id for x in replies(tr, [c.SET] * 6)] == list(range(6))
    assert tr.producerState == "producing"


def test_store_congestion_pauses_reading_until_drained(store, sets_mode):
    hold(store)
    congestion = congest(store)  # the real write queue, over QUEUE_HIGH
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.dataReceived(c.encode_set(1, b"a", b"1"))
    assert tr.producerState == "paused" and proto.gate.reasons == {"store congestion"}
    assert len(store.core._drain_waiters) == 1  # the connection waits for the queue to drain
    proto.dataReceived(c.encode_set(2, b"b", b"2"))  # already in the socket: buffered, not parsed
    assert len(runs) == 1
    complete(store)  # the congesting write: the queue drains
    assert congestion.called and not store.congested
    assert tr.producerState == "producing" and len(runs) == 2
    complete(store)
    complete(store)
    assert [x.client_id for x in replies(tr, [c.SET, c.SET])] == [1, 2]


@pytest.mark.parametrize("step", [None, 1, 5, 100])
def test_runs_of_gets_in_one_read(store, step, gets_mode, sets_mode):
    fill(store, [b"a", b"b", b"c"])
    proto, tr = connect(store)
    wire = b"".join(c.encode_get(i, k) for i, k in enumerate([b"a", b"x", b"b", b"c"]))
    wire += c.encode_get(4, b"")  # not a fast-path GET: ends the run, DATA_NOT_FOUND
    wire += c.encode_get(5, b"a") + c.encode_set(6, b"d", b"vd") + c.encode_get(7, b"d")
    wire += struct.pack(">QQQHH", 31, 8, 1, 2, 5) + b"abc"  # key runs past total_len: ERR 3
    wire += c.encode_get(9, b"c")
    feed(proto, wire, step)
    r = replies(tr, [c.GET] * 6 + [c.SET] + [c.GET] * 3)
    assert [x.client_id for x in r] == list(range(10))
    assert [x.items[0][1] if x.items else x.cmd for x in r] == [
        b"va", c.DATA_NOT_FOUND, b"vb", b"vc", c.DATA_NOT_FOUND, b"va", c.OK, b"vd", c.ERR, b"vc"
    ]


def _idle_read_store(store):
    """A store whose keys lie in every place a GET looks: LMDB (merged), the memtable being merged
    (held in the commit queue), the active memtable; removes over each; keys over KEY_KEEP bytes.
    Returns the expected {key: value or None} and the keys to ask for (missing ones too)."""
    long_a, long_b = b"L" * 500, b"M" * 441
    expected = {}

    def write(ops):
        d = store.kv.write_many(ops)
        complete(store, None)
        assert d.called
        for k, v in ops:
            expected[k] = v

    write([(b"lmdb%d" % i, b"v%d" % i) for i in range(20)] + [(long_a, b"long a"), (b"gone1", b"x")])
    assert store.kv.flush().called
    write([(b"frozen%d" % i, b"f%d" % i) for i in range(10)] + [(b"lmdb3", b"new3"), (b"gone1", None),
                                                                 (long_b, b"long b"), (b"gone2", b"y")])
    hold(store)
    d = store.kv.write_many([(b"active%d" % i, b"a%d" % i) for i in range(5)]
                            + [(b"lmdb4", b"new4"), (b"frozen2", b"new f2"), (b"gone2", None), (long_a, b"long a2")])
    merging = store.kv.flush()  # queued behind that run: the frozen memtable stays in front of LMDB
    assert not merging.called and store.kv.flushing_bytes
    complete(store)  # the run only (into the new active memtable): the merge stays queued
    assert d.called and not merging.called and store.kv.flushing_bytes
    expected.update({b"active%d" % i: b"a%d" % i for i in range(5)})
    expected.update({b"lmdb4": b"new4", b"frozen2": b"new f2", b"gone2": None, long_a: b"long a2"})
    asked = sorted(expected) + [b"missing", b"\x00", b"\xff" * 3, b"L" * 499]
    return expected, asked


@pytest.mark.parametrize("step", [None, 1, 2, 13, 29, 100])
def test_idle_read_of_gets_matches_one_at_a_time(store, step, gets_mode, sets_mode):
    """A read of whole GETs on an idle connection (answered straight from the read) gives the
    same replies as the GETs sent one at a time, whatever the split: LMDB, the merging and the
    active memtable, removes, long keys, missing keys."""
    expected, asked = _idle_read_store(store)
    wire = [c.encode_get(i, k) for i, k in enumerate(asked)]
    one_by_one = []
    proto, tr = connect(store)
    for w in wire:
        proto.dataReceived(w)
        one_by_one += replies(tr, [c.GET])
    assert [x.items[0][1] if x.items else None for x in one_by_one] == [expected.get(k) for k in asked]
    proto, tr = connect(store)
    feed(proto, b"".join(wire), step)
    assert replies(tr, [c.GET] * len(asked)) == one_by_one
    # a malformed frame and a write in the middle: the GETs after them go the general way
    bad = struct.pack(">QQQHH", 31, 900, 1, 2, 5) + b"abc"  # key runs past total_len: ERR 3
    mixed = b"".join(wire[:7]) + bad + c.encode_set(901, b"lmdb0", b"set") + b"".join(wire[7:])
    feed(proto, mixed, step)
    complete(store, None)  # the SET (and the merge still queued)
    r = replies(tr, [c.GET] * 7 + [c.GET, c.SET] + [c.GET] * (len(asked) - 7))
    assert r[:7] == one_by_one[:7]
    assert (r[7].client_id, r[7].cmd, r[8].client_id, r[8].cmd) == (900, c.ERR, 901, c.OK)
    want = [b"set" if k == b"lmdb0" else expected.get(k) for k in asked[7:]]
    assert [x.items[0][1] if x.items else None for x in r[9:]] == want
    # a read that starts with writes (taken straight from the read too): one store write for all
    # of the read's writes, its GETs see them, the malformed frame gets ERR 3 in its place
    runs = record_runs(store)
    writes = c.encode_set(902, b"lmdb1", b"w1") + c.encode_remove(903, b"active0") + c.encode_set(904, b"n", b"w")
    after = c.encode_get(905, b"lmdb1") + c.encode_get(906, b"active0") + bad + c.encode_remove(907, b"n")
    feed(proto, writes + b"".join(wire) + after, step)
    complete(store, None)
    r = replies(tr, [c.SET, c.REMOVE, c.SET] + [c.GET] * len(asked) + [c.GET, c.GET, c.GET, c.REMOVE])
    assert [x.cmd for x in r[:3]] == [c.OK] * 3
    model = dict(expected)
    model[b"lmdb0"], model[b"lmdb1"], model[b"active0"], model[b"n"] = b"set", b"w1", None, b"w"
    assert [x.items[0][1] if x.items else None for x in r[3 : 3 + len(asked)]] == [model.get(k) for k in asked]
    assert [x.items[0][1] if x.items else x.cmd for x in r[-4:]] == [b"w1", c.DATA_NOT_FOUND, c.ERR, c.OK]
    if step is None:
        assert len(runs) == 1 and [k for k, _ in runs[0]] == [b"lmdb1", b"active0", b"n", b"n"]


def test_mixed_frames_split_at_every_byte_give_the_replies_of_one_frame_at_a_time(store, gets_mode, monkeypatch, sets_mode):
    """A buffer of many frames (runs of GETs of one length over LMDB, the memtable and missing
    keys, a GET of another length, SETs and a REMOVE with GETs of them, a malformed GET, a cursor
    and scans) gives the same replies, and leaves the same store, whether it is read one frame at
    a time, in one read, or in two reads split at any byte."""
    k8 = [b"key%05d" % i for i in range(12)]
    fill(store, k8[:6])
    assert store.kv.flush().called  # k8[:6] in LMDB
    fill(store, k8[6:9])  # in the active memtable; k8[9:] missing
    frames = [c.encode_get(i, k) for i, k in enumerate(k8)]
    frames.append(c.encode_get(20, b"key"))  # another length, missing
    frames += [c.encode_get(21, k8[1]), c.encode_get(22, k8[7])]
    frames.append(c.encode_set(23, b"new00000", b"fresh"))
    frames += [c.encode_get(24, b"new00000"), c.encode_get(25, k8[2])]
    frames.append(struct.pack(">QQQHH", 31, 26, 1, c.GET, 5) + b"abc")  # key past total_len: ERR 3
    frames += [c.encode_get(27, k8[3]), c.encode_get(28, k8[8])]
    frames.append(c.encode_create_cursor(29, b"cur"))
    frames.append(c.encode_scan(c.GET_FF, 30, 4, b"cur", b"", b""))
    frames += [c.encode_get(31 + i, k) for i, k in enumerate(k8[4:10])]
    frames.append(c.encode_remove(40, b"new00000"))
    frames += [c.encode_get(41, b"new00000"), c.encode_get(42, k8[0])]
    frames.append(c.encode_scan(c.GET_KEYS, 43, 3, b"cur", b"", b""))
    frames += [c.encode_get(44 + i, k) for i, k in enumerate(k8)]
    wire = b"".join(frames)
    before = contents(store)

    proto, tr = connect(store)
    for f in frames:
        proto.dataReceived(f)
    want = tr.value()
    after = contents(store)
    assert after == before  # the SET and the REMOVE of new00000 cancel out
    tr2 = StringTransport()
    tr2.write(want)
    r = {x.client_id: x for x in replies(tr2, [struct.unpack_from(">H", f, 24)[0] for f in frames])}
    assert len(r) == len(frames)
    found = {cid: (x.items[0][1] if x.items else x.cmd) for cid, x in r.items()}
    assert [found[i] for i in range(12)] == [b"v" + k for k in k8[:9]] + [c.DATA_NOT_FOUND] * 3
    assert [found[i] for i in (20, 23, 24, 26, 40, 41)] == [c.DATA_NOT_FOUND, c.OK, b"fresh", c.ERR, c.OK,
                                                             c.DATA_NOT_FOUND]
    assert [k for k, _ in r[30].items] == k8[:4]
    taken = []  # reads whose run of GETs the compiled pass answered
    if gets_mode == "compiled":
        frames_of = gets_compiled.frames
        monkeypatch.setattr(gets_compiled, "frames", lambda data: taken.append(frames_of(data)) or taken[-1])
    for split in [None] + list(range(1, len(wire))):
        proto, tr = connect(store)
        if split is None:
            proto.dataReceived(wire)
        else:
            proto.dataReceived(wire[:split])
            proto.dataReceived(wire[split:])
        assert tr.value() == want, (gets_mode, split)
        assert not tr.disconnecting
    assert contents(store) == after
    if gets_mode == "compiled":
        assert sum(1 for count, end, frame_len in taken if frame_len == 36) >= len(wire) // 2


class _GeneralPathOnly(KvServerProtocol):
    """The server without the read fast paths (every read through the framer and ``_process``)."""

    def dataReceived(self, data):
        if self._closing or self._lost:
            return
        self.metrics["bytes_in"] = self.metrics.get("bytes_in", 0) + len(data)
        self._frames.feed(data)
        self._process()


def _random_request(rnd, cid):
    key = bytes(rnd.randrange(256) for _ in range(rnd.choice([0, 1, 1, 2, 3, 8, 441])))
    if key and rnd.random() < 0.5:
        key = key[:1]  # few distinct keys: GETs find the writes
    kind = rnd.randrange(10)
    if kind < 4:
        return c.encode_get(cid, key)
    if kind < 7:
        return c.encode_set(cid, key, bytes(rnd.randrange(256) for _ in range(rnd.choice([0, 1, 5, 100]))))
    if kind < 8:
        return c.encode_remove(cid, key)
    if kind < 9:  # malformed: a key length past the message, or a total_len that lies
        b = bytearray(c.encode_get(cid, key) if rnd.random() < 0.5 else c.encode_set(cid, key, b"v"))
        if len(b) > 26 and rnd.random() < 0.7:
            struct.pack_into(">H", b, 26, rnd.randrange(0, 600))
        else:
            struct.pack_into(">Q", b, 0, rnd.choice([len(b) - 1, len(b) + 1, 27, 26, 8]))
        return bytes(b)
    if rnd.random() < 0.5:
        return c.encode_create_cursor(cid, b"c")
    return c.encode_scan(c.GET_FF, cid, 5, b"c", b"", b"")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_read_fast_paths_give_the_general_paths_replies(tmp_path, seed, gets_mode, sets_mode):
    """Differential: random streams of GETs, SETs, REMOVEs (long keys, empty keys), malformed
    messages and scans, split at random points, with the writer held or not and merges started
    in between, give byte for byte the replies (and the close) of the server without the read
    fast paths, each over its own real store."""
    import random

    rnd = random.Random(seed)
    for case in range(40):
        stores, conns = [], []
        for i, cls in enumerate((KvServerProtocol, _GeneralPathOnly)):
            s = open_inline(tmp_path / ("%d-%d-%d" % (seed, case, i)), task.Clock())
            proto = cls(s.kv, {}, s)
            proto.factory = KvServerFactory(s.kv, store=s)
            tr = StringTransport()
            proto.makeConnection(tr)
            stores.append(s)
            conns.append((proto, tr))
        held = rnd.random() < 0.5
        for s in stores:
            hold(s, held)
        for _ in range(rnd.randint(1, 6)):
            stream = b"".join(_random_request(rnd, rnd.randrange(1 << 16)) for _ in range(rnd.randint(1, 40)))
            cuts = sorted(rnd.sample(range(1, len(stream)), min(len(stream) - 1, rnd.randint(0, 5))))
            if rnd.random() < 0.3:
                for s in stores:
                    s.kv.flush()
            for a, b in zip([0] + cuts, cuts + [len(stream)]):
                for proto, _ in conns:
                    proto.dataReceived(stream[a:b])
                if held and rnd.random() < 0.3:
                    for s in stores:
                        complete(s, None)
        for s in stores:
            complete(s, None)
        (fast, fast_tr), (general, general_tr) = conns
        assert fast_tr.value() == general_tr.value(), (seed, case)
        assert fast_tr.disconnecting == general_tr.disconnecting, (seed, case)
        for s in stores:
            close(s)


def test_store_read_failure_is_err0_for_each_get(store, gets_mode, sets_mode):
    class FailingKv(KeyValue):
        def get_many(self, keys):
            raise OSError("disk on fire")

        def point_reader(self):  # the idle connection's GETs (server._answer_read_gets)
            def get(key, default=None, db=None):
                raise OSError("disk on fire")

            return None, None, get, None

    proto, tr = connect(store, FailingKv(store.core))
    proto.dataReceived(c.encode_get(1, b"a") + c.encode_get(2, b"b"))
    r = replies(tr, [c.GET, c.GET])
    assert [(x.client_id, x.cmd, x.error_code) for x in r] == [(1, c.ERR, 0), (2, c.ERR, 0)]
    assert tr.connected


# -- batched writes (store.kv.write_many) ----------------------------------------------------------


@pytest.mark.parametrize("step", [None, 1, 7])
def test_a_pipelined_run_of_writes_is_one_store_call(store, step, sets_mode):
    store.kv.put(b"old", b"o")
    runs = record_runs(store)
    proto, tr = connect(store)
    wire = (
        c.encode_set(1, b"a", b"1")
        + c.encode_set(2, b"b", b"2")
        + c.encode_remove(3, b"old")
        + c.encode_remove(4, b"never")
        + c.encode_set(5, b"a", b"11")
        + c.encode_remove(6, b"b")
    )
    feed(proto, wire, step)
    r = replies(tr, [c.SET, c.SET, c.REMOVE, c.REMOVE, c.SET, c.REMOVE])
    assert [(x.client_id, x.cmd) for x in r] == [
        (1, c.OK), (2, c.OK), (3, c.OK), (4, c.DATA_NOT_FOUND), (5, c.OK), (6, c.OK)]
    assert contents(store) == {b"a": b"11"}
    assert sum(len(run) for run in runs) == 6
    if step is None:
        assert len(runs) == 1


def test_reads_between_writes_see_them_pending_and_do_not_split_the_run(store, sets_mode):
    hold(store)
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.dataReceived(
        c.encode_set(1, b"a", b"1")
        + c.encode_set(2, b"b", b"2")
        + c.encode_get(3, b"a")
        + c.encode_remove(4, b"a")
        + c.encode_set(5, b"c", b"3")
        + c.encode_get(6, b"a")
        + c.encode_get(7, b"c")
    )
    # issue 19: one pass's writes are one store write, whatever reads lie between them
    assert runs == [[(b"a", b"1"), (b"b", b"2"), (b"a", None), (b"c", b"3")]] and tr.value() == b""
    assert contents(store) == {}  # nothing is in the store yet: the GETs read the connection's pending writes
    complete(store)
    r = replies(tr, [c.SET, c.SET, c.GET, c.REMOVE, c.SET, c.GET, c.GET])
    assert [(x.client_id, x.cmd) for x in r] == [
        (1, c.OK), (2, c.OK), (3, c.OK), (4, c.OK), (5, c.OK), (6, c.DATA_NOT_FOUND), (7, c.OK)]
    assert r[2].items == [(b"a", b"1")] and r[6].items == [(b"c", b"3")]


def test_another_connection_never_reads_an_unacked_write(store, sets_mode):
    store.kv.put(b"k", b"old")
    hold(store)
    a, ta = connect(store)
    b, tb = connect(store)
    a.dataReceived(c.encode_set(1, b"k", b"new") + c.encode_get(2, b"k"))
    b.dataReceived(c.encode_get(3, b"k") + c.encode_get(4, b"gone"))
    r = replies(tb, [c.GET, c.GET])
    assert r[0].items == [(b"k", b"old")] and r[1].cmd == c.DATA_NOT_FOUND
    assert ta.value() == b""
    complete(store)
    assert replies(ta, [c.SET, c.GET])[1].items == [(b"k", b"new")]
    b.dataReceived(c.encode_get(5, b"k"))
    assert replies(tb, [c.GET])[0].items == [(b"k", b"new")]


def test_scans_and_cursor_commands_read_the_connections_pending_writes_without_waiting(store, sets_mode):
    store.kv.put(b"gone", b"g")
    store.kv.put(b"old", b"o")
    hold(store)
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.dataReceived(
        c.encode_create_cursor(1, b"x")
        + c.encode_set(2, b"a", b"1")
        + c.encode_remove(3, b"gone")
        + c.encode_scan(c.GET_FF, 4, 10, b"x")
        + c.encode_set(5, b"b", b"2")
        + c.encode_create_cursor(6, b"y")
        + c.encode_scan(c.GET_KEYS, 7, 10, b"y")
    )
    # one store write for the pass; the CREATE_CURSOR before it answered at once
    assert runs == [[(b"a", b"1"), (b"gone", None), (b"b", b"2")]]
    assert replies(tr, [c.CREATE_CURSOR])[0].cmd == c.OK
    complete(store)
    r = replies(tr, [c.SET, c.REMOVE, c.GET_FF, c.SET, c.CREATE_CURSOR, c.GET_KEYS])
    assert r[2].items == [(b"a", b"1"), (b"old", b"o")]
    assert [k for k, _ in r[5].items] == [b"a", b"b", b"old"]


@contextlib.contextmanager
def _store_with(preload):
    """A fresh real store (inline writer) holding ``preload``, removed afterwards."""
    path = tempfile.mkdtemp(prefix="kvunit-")
    s = open_inline(path, task.Clock())
    try:
        for k, v in preload:
            s.kv.put(k, v)
        yield s
    finally:
        close(s)
        shutil.rmtree(path, ignore_errors=True)


def _run_alone(requests, preload):
    """The replies of executing each request on its own (its reply read before the next is sent)."""
    with _store_with(preload) as s:
        proto, tr = connect(s)
        out = b""
        for req in requests:
            proto.dataReceived(req)
            out += tr.value()
            tr.clear()
        return out, contents(s)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c", b"d", b"\xf0"]), st.binary(max_size=2)), max_size=4),
    st.lists(
        st.one_of(
            st.tuples(st.just(c.SET), st.sampled_from([b"a", b"b", b"c", b"d", b"\xf0"])),
            st.tuples(st.just(c.REMOVE), st.sampled_from([b"a", b"b", b"c", b"d", b"\xf0"])),
            st.tuples(st.just(c.GET), st.sampled_from([b"a", b"b", b"\xf0"])),
            st.tuples(st.sampled_from([c.GET_FF, c.GET_FB, c.GET_KEYS]), st.integers(1, 3)),
            st.tuples(st.just(c.CREATE_CURSOR), st.sampled_from([b"", b"b", b"\xff"])),
        ),
        max_size=25,
    ),
    st.integers(1, 60),
)
def test_pipelined_scans_and_writes_match_one_at_a_time_execution(preload, ops, step):
    """Whatever the mix of writes, GETs and scans, their framing and the acks' timing, the reply
    bytes equal those of executing each request alone (scans merge the pending writes)."""
    requests = [c.encode_create_cursor(0, b"s")]
    for i, (cmd, arg) in enumerate(ops, 1):
        if cmd == c.SET:
            requests.append(c.encode_set(i, arg, b"v%d" % i))
        elif cmd == c.REMOVE:
            requests.append(c.encode_remove(i, arg))
        elif cmd == c.GET:
            requests.append(c.encode_get(i, arg))
        elif cmd == c.CREATE_CURSOR:
            requests.append(c.encode_create_cursor(i, b"s", arg))
        else:
            requests.append(c.encode_scan(cmd, i, arg, b"s"))
    expected, data = _run_alone(requests, preload)
    with _store_with(preload) as s:
        hold(s)
        proto, tr = connect(s)
        feed(proto, b"".join(requests), step)
        while pending(s):
            complete(s, None, reverse=True)
        assert tr.value() == expected
        assert contents(s) == data


def test_writes_behind_an_unacked_run_are_issued_at_once_in_order(store, sets_mode):
    hold(store)
    proto, tr = connect(store)
    proto.dataReceived(c.encode_set(1, b"k", b"1"))
    proto.dataReceived(c.encode_set(2, b"k", b"2") + c.encode_remove(3, b"k"))
    assert pending(store) == 2  # the store orders them
    complete(store, None, reverse=True)
    r = replies(tr, [c.SET, c.SET, c.REMOVE])
    assert [(x.client_id, x.cmd) for x in r] == [(1, c.OK), (2, c.OK), (3, c.OK)]
    assert contents(store) == {}


def test_bad_writes_inside_a_run_are_answered_in_place(store, sets_mode):
    proto, tr = connect(store)
    wire = (
        c.encode_set(1, b"a", b"1")
        + c.encode_set(2, b"", b"v")  # empty key: ERR 0
        + c.encode_set(3, b"b", b"2")
        + struct.pack(">QQQHH", 34, 4, 1, 3, 1) + b"k" + b"\x00\x00\x00\x09" + b"x"  # value past total_len: ERR 3
        + c.encode_remove(5, b"")  # empty key: DATA_NOT_FOUND
        + c.encode_remove(6, b"a")
    )
    proto.dataReceived(wire)
    r = replies(tr, [c.SET] * 4 + [c.REMOVE] * 2)
    assert [(x.client_id, x.cmd, x.error_code) for x in r] == [
        (1, c.OK, None), (2, c.ERR, c.E_UNKNOWN), (3, c.OK, None), (4, c.ERR, c.E_MSG_TOO_SHORT),
        (5, c.DATA_NOT_FOUND, None), (6, c.OK, None)]
    assert contents(store) == {b"b": b"2"}


def test_an_oversized_value_behind_a_waiting_read_is_err0_alone(store, sets_mode):
    hold(store)
    proto, tr = connect(store)
    big = b"v" * (16 * 1024 * 1024 + 1)
    proto.dataReceived(c.encode_set(1, b"a", b"1") + c.encode_get(2, b"a") + c.encode_set(3, b"big", big)
                       + c.encode_set(4, b"b", b"2"))
    while pending(store):
        complete(store)
    r = replies(tr, [c.SET, c.GET, c.SET, c.SET])
    assert [(x.client_id, x.cmd, x.error_code) for x in r] == [
        (1, c.OK, None), (2, c.OK, None), (3, c.ERR, c.E_UNKNOWN), (4, c.OK, None)]
    assert contents(store) == {b"a": b"1", b"b": b"2"}


def test_a_failed_run_is_err0_for_each_of_its_writes(store, sets_mode):
    class FailingKv(KeyValue):
        runs = 0

        def write_many(self, ops):
            self.runs += 1
            return defer.fail(OSError("disk on fire")) if self.runs == 1 else super().write_many(ops)

    kv = FailingKv(store.core)
    proto, tr = connect(store, kv)
    proto.dataReceived(c.encode_set(1, b"a", b"1") + c.encode_remove(2, b"b"))
    proto.dataReceived(c.encode_set(3, b"c", b"3"))
    r = replies(tr, [c.SET, c.REMOVE, c.SET])
    assert [(x.client_id, x.cmd, x.error_code) for x in r] == [(1, c.ERR, 0), (2, c.ERR, 0), (3, c.OK, None)]
    # read through this facade: the landed run sits in its memtable until merged
    assert tr.connected and dict(kv.scan_forward(None, 1 << 20)) == {b"c": b"3"}


def test_pending_budget_counts_the_writes_of_a_run(store, sets_mode):
    hold(store)
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.max_pending = 4
    proto.dataReceived(b"".join(c.encode_set(i, b"k%d" % i, b"v") for i in range(10)))
    assert [len(run) for run in runs] == [4] and tr.producerState == "paused"
    while pending(store):
        complete(store)
        assert all(len(run) <= 4 for run in runs)
    assert [len(run) for run in runs] == [4, 4, 2] and tr.producerState == "producing"
    assert [x.client_id for x in replies(tr, [c.SET] * 10)] == list(range(10))


# one store for every example, emptied first
@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_OK)
@given(st.lists(st.tuples(st.sampled_from([c.SET, c.REMOVE, c.GET]), st.sampled_from([b"a", b"b", b""])),
                max_size=30), st.integers(1, 40), st.booleans())
def test_pipelines_match_one_at_a_time_execution(store, ops, step, manual):
    """Whatever the mix, framing and ack order, the replies equal executing each request alone."""
    model = {}
    expected = []
    wire = b""
    for i, (cmd, key) in enumerate(ops):
        if cmd == c.SET:
            wire += c.encode_set(i, key, b"v%d" % i)
            expected.append((i, c.ERR if not key else c.OK, None))
            if key:
                model[key] = b"v%d" % i
        elif cmd == c.REMOVE:
            wire += c.encode_remove(i, key)
            expected.append((i, c.OK if key in model else c.DATA_NOT_FOUND, None))
            model.pop(key, None)
        else:
            wire += c.encode_get(i, key)
            expected.append((i, c.OK, model[key]) if key in model else (i, c.DATA_NOT_FOUND, None))
    hold(store, False)
    store.kv.write_many([(b"a", None), (b"b", None)])
    hold(store, manual)
    proto, tr = connect(store)
    feed(proto, wire, step)
    while pending(store):
        complete(store, None, reverse=True)
    r = replies(tr, [cmd for cmd, _ in ops])
    assert [(x.client_id, x.cmd, x.items[0][1] if x.items else None) for x in r] == expected
    assert contents(store) == model


def test_a_scan_queued_behind_a_write_run_is_not_taken_for_a_write(store, sets_mode):
    """Found by bench/fuzz_wire.py: a run of queued writes stopped at a request without a key
    (cursor, scan) by reading its key, which it has none of."""
    hold(store)
    proto, tr = connect(store)
    proto.dataReceived(
        c.encode_set(1, b"a", b"1")
        + c.encode_get(2, b"a")  # waits for the SET
        + c.encode_set(3, b"b", b"2")
        + c.encode_create_cursor(4, b"cur", b"")
        + c.encode_scan(c.GET_FF, 5, 10, b"cur")
    )
    complete(store)  # the first SET: the GET runs, then the SET run, which must stop at the cursor
    complete(store)
    r = replies(tr, [c.SET, c.GET, c.SET, c.CREATE_CURSOR, c.GET_FF])
    assert [x.client_id for x in r] == [1, 2, 3, 4, 5]
    assert r[4].items == [(b"a", b"1"), (b"b", b"2")]
