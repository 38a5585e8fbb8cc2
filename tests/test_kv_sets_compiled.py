"""The compiled SET pass (protocols/partition/sets_kernel.py, server ``_sets_compiled``) against the
Python loop it stands in for (``_write_run``), and its WAL op against ``msgpack.packb``.

- the kernel's framing, fuzzed with hypothesis against a model of ``_write_run``'s checks on
  reads of SETs, malformed SETs, other commands and cut frames, with random budgets: the same run,
  its WAL op exactly ``msgpack.packb([OP_PUTS, KV, keys, stored])``, its OK replies;
- ``index.pack_ops`` (a ``T_OPS`` entry holding packed ops) is ``msgpack.packb`` of the ops;
- random reads of those frames into a server with the pass and one without (hypothesis): the same
  bytes sent, close and store;
- the kernel's GETs of the run's keys (``SET k; GET k``): the newest SET's value, the lookback's
  edge, replies outgrowing the reply buffer, budgets (hypothesis, against the model);
- mixed buffers (SETs, empty keys, a value over the limit, a key over KEY_KEEP, GETs of the run's
  keys and of keys in LMDB, the row cache, the memtable or missing, REMOVEs, a SET or GET cut by
  total_len, total_len < 8 or oversize at the end) read at once, split at every byte and in steps,
  with and without the compiled pass: the replies and the store of one frame at a time;
- packed runs through the real writer thread and merge worker, and a reopen that replays them.
"""

import random
import shutil
import struct
import tempfile

import msgpack
import numpy
import pytest
import pytest_twisted
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import reactor, task
from twisted.internet.testing import StringTransport

from protocols.partition import codec as c
from protocols.partition import server, sets_compiled, sets_kernel
from protocols.partition.server import KvServerFactory, KvServerProtocol
from storage import Store, index
from storage.index import KEY_KEEP, PackedOp, pack_ops
from storage.kv import PackedRun
from tests.storage_helpers.inline import close, complete, hold, open_inline


def _kernel():
    sets_compiled.start_loading()
    assert sets_compiled.wait(120) and sets_compiled.state == "compiled", sets_compiled.state
    return sets_compiled.run


@pytest.fixture(params=["python", "compiled"])
def sets_mode(request):
    loaded = _kernel()
    if request.param == "python":
        sets_compiled.run = None
    try:
        yield request.param
    finally:
        sets_compiled.run = loaded


def model_run(buf, room, room_bytes):
    """``_write_run``'s loop over SETs and GETs of keys the run set (a key over KEY_KEEP ends the
    run, as in the kernel, and so does a GET of a key none of the run's last GET_LOOKBACK SETs
    set): ``(items, end, budget)``, items ``("set", cid, key, value)`` or ``("get", cid, key,
    value the GET is answered with)``."""
    n = len(buf)
    pos = 0
    items = []
    nbytes = 0
    budget = 0
    while n - pos >= 28:
        total, cid, _n, cmd, klen = struct.unpack_from(">QQQHH", buf, pos)
        if not klen or total > n - pos or total > c.MAX_MESSAGE:
            break
        kend = pos + 28 + klen
        key = buf[pos + 28 : kend]
        if cmd == c.SET:
            if klen > KEY_KEEP or kend + 4 > pos + total:
                break
            (vlen,) = struct.unpack_from(">I", buf, kend)
            if vlen > c.MAX_VALUE or kend + 4 + vlen > pos + total:
                break
            items.append(("set", cid, key, buf[kend + 4 : kend + 4 + vlen]))
            nbytes += vlen
        elif cmd == c.GET and items:
            if kend > pos + total:
                break
            sets = [it for it in items if it[0] == "set"][-sets_kernel.GET_LOOKBACK :]
            found = [it[3] for it in reversed(sets) if it[2] == key]
            if not found:
                break
            items.append(("get", cid, key, found[0]))
        else:
            break
        pos += total
        if len(items) >= room or nbytes >= room_bytes:
            budget = 1
            break
    return items, pos, budget


def _kernel_call(kernel, buf, room, room_bytes, replies_size=None):
    """The kernel over ``buf`` as the server calls it, its replies buffer grown while it says
    ``full``: ``(count, end, plen, kbytes, vbytes, budget, items, rlen), payload, replies``."""
    payload = bytearray(len(buf) + 16)
    replies = bytearray(c.HEADER_LEN * min(room, len(buf) // 33 + 1) if replies_size is None else replies_size)
    where = numpy.empty(2 * (len(buf) // 28 + 1), numpy.int64)
    while True:
        got = kernel(buf, room, room_bytes, payload, replies, where)
        if not got[8]:
            return got[:8], payload, replies
        replies = bytearray(2 * len(replies) + len(buf))


def _frame(kind, cid, key, value, extra):
    if kind == "set":
        return c.encode_set(cid, key, value)
    if kind == "get":
        return c.encode_get(cid, key)
    if kind == "remove":
        return c.encode_remove(cid, key)
    if kind == "get-long":  # trailing bytes after the GET's key: taken
        b = bytearray(c.encode_get(cid, key)) + b"\x00" * (extra % 5 + 1)
        struct.pack_into(">Q", b, 0, len(b))
        return bytes(b)
    if kind == "get-short" and key:  # total_len cuts the GET's key
        b = bytearray(c.encode_get(cid, key))
        struct.pack_into(">Q", b, 0, len(b) - 1 - extra % len(key))
        return bytes(b)
    b = bytearray(c.encode_set(cid, key, value))
    if kind == "long-total":  # trailing bytes inside the frame: taken, skipped
        b += b"\x00" * (extra % 5 + 1)
        struct.pack_into(">Q", b, 0, len(b))
    elif kind == "short-total" and len(b) > 28:  # total_len cuts the value or the value_len
        struct.pack_into(">Q", b, 0, max(28, len(b) - 1 - extra % 6))
    elif kind == "big-vlen":
        struct.pack_into(">I", b, 28 + len(key), c.MAX_VALUE + 1 + extra % 3)
    elif kind == "bad-klen" and len(b) > 28:
        struct.pack_into(">H", b, 26, extra % 700)
    elif kind == "huge-total":
        struct.pack_into(">Q", b, 0, [c.MAX_MESSAGE + 1, 1 << 40, 7][extra % 3])
    return bytes(b)


frames = st.lists(
    st.tuples(
        st.sampled_from(["set"] * 6 + ["get"] * 4 + ["get-long", "get-short", "remove", "long-total", "short-total",
                                                      "big-vlen", "bad-klen", "huge-total"]),
        st.integers(0, (1 << 64) - 1),
        # a few keys often, so that GETs of the run's keys (and of keys set before it) come up
        st.one_of(st.binary(min_size=0, max_size=12), st.sampled_from([b"a", b"b", b"ab", b"k" * 440, b"k" * 441])),
        st.one_of(st.binary(max_size=40), st.sampled_from([b"v" * 254, b"v" * 255, b"v" * 300, b"v" * 65535, b"v" * 70000])),
        st.integers(0, 100),
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=600, deadline=None)
@given(frames, st.integers(1, 40), st.integers(1, 200000), st.integers(0, 60))
def test_set_run_frames_as_write_run_and_packs_as_msgpack(spec, room, room_bytes, cut):
    kernel = _kernel()
    buf = b"".join(_frame(*f) for f in spec)
    if cut:
        buf = buf[: max(0, len(buf) - cut)]
    (count, end, plen, kbytes, vbytes, budget, items, rlen), payload, replies = _kernel_call(kernel, buf, room, room_bytes)
    want, want_end, want_budget = model_run(buf, room, room_bytes)
    sets = [it for it in want if it[0] == "set"]
    assert (count, items) == (len(sets), len(want))
    if not count:
        return
    assert (end, budget) == (want_end, want_budget)
    assert (kbytes, vbytes) == (sum(len(it[2]) for it in sets), sum(len(it[3]) for it in sets))
    op = [index.OP_PUTS, index.KV, [it[2] for it in sets], [b"\x00" + it[3] for it in sets]]
    assert bytes(payload[:plen]) == msgpack.packb(op, use_bin_type=True)
    assert msgpack.unpackb(bytes(payload[:plen])) == op
    assert bytes(replies[:rlen]) == b"".join(
        c.encode_status(cid, c.OK) if kind == "set" else c.encode_get_reply(cid, key, value)
        for kind, cid, key, value in want)
    assert server._OkReplies(replies[:rlen]).cids() == [
        cid if kind == "set" else c.encode_get_reply(cid, key, value) for kind, cid, key, value in want]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b"a", b"b", b"c"]), min_size=1, max_size=90), st.integers(1, 60000),
       st.integers(0, 40), st.integers(1, 300))
def test_set_run_answers_gets_of_the_runs_keys_from_the_newest_set(keys, value_size, replies_size, room):
    """``SET k; GET k`` shapes: GETs of keys set 1..90 SETs back (the lookback's edge), repeated
    keys, values up to 60 KB so that the GETs' replies outgrow the reply buffer (``full``, the
    buffer grown), budgets cutting the run anywhere."""
    kernel = _kernel()
    frames = []
    for i, key in enumerate(keys):
        frames.append(c.encode_set(2 * i, key, (b"%d:" % i) * (value_size // 8 + 1)))
        frames.append(c.encode_get(2 * i + 1, keys[(i * 7) % (i + 1)]))
    buf = b"".join(frames)
    (count, end, plen, kbytes, vbytes, budget, items, rlen), payload, replies = _kernel_call(
        kernel, buf, room, 1 << 30, replies_size)
    want, want_end, want_budget = model_run(buf, room, 1 << 30)
    assert (items, end, budget) == (len(want), want_end, want_budget)
    assert bytes(replies[:rlen]) == b"".join(
        c.encode_status(cid, c.OK) if kind == "set" else c.encode_get_reply(cid, key, value)
        for kind, cid, key, value in want)


@settings(max_examples=150, deadline=None)
@given(frames, st.lists(st.integers(1, 4000), max_size=4), st.booleans())
def test_servers_with_and_without_the_pass_give_the_same_replies_and_store(spec, cuts, held):
    """Hypothesis against the Python path itself: the same reads (the frames above, cut at random
    points) into a server with the compiled pass and one without, each over its own real store,
    the writer held or not: the same bytes sent, the same close, the same store."""
    kernel = _kernel()
    skip, server.SETS_SKIP_READS = server.SETS_SKIP_READS, 0  # the pass tried on every read
    wire = b"".join(_frame(*f) for f in spec)
    bounds = sorted({0, len(wire)} | {c_ % (len(wire) + 1) for c_ in cuts})
    reads = [wire[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    results = []
    tmp = tempfile.mkdtemp(prefix="kv-sets-hyp-")
    try:
        for i, run in enumerate((kernel, None)):
            sets_compiled.run = run
            s = open_inline("%s/%d" % (tmp, i), task.Clock())
            hold(s, held)
            try:
                results.append(_run(s, reads))
            finally:
                close(s)
    finally:
        sets_compiled.run = kernel
        server.SETS_SKIP_READS = skip
        shutil.rmtree(tmp, ignore_errors=True)
    assert results[0] == results[1]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_pack_ops_is_msgpack_of_the_ops(n):
    rnd = random.Random(n)
    ops = []
    for i in range(n):
        keys = [b"k%d" % j for j in range(rnd.randrange(1, 20))]
        stored = [b"\x00" + b"v" * rnd.choice([0, 3, 300]) for _ in keys]
        if rnd.random() < 0.5:
            ops.append(PackedOp(msgpack.packb([index.OP_PUTS, index.KV, keys, stored], use_bin_type=True)))
        else:
            ops.append((index.OP_PUT, index.KV, keys[0], stored[0]))
    plain = [msgpack.unpackb(op) if op.__class__ is PackedOp else op for op in ops]
    assert b"".join(pack_ops(ops)) == msgpack.packb(plain, use_bin_type=True)


def _mixed_frames():
    f = []
    f += [c.encode_set(1 + i, b"key%02d" % i, b"value%d" % i) for i in range(6)]
    f.append(c.encode_get(10, b"key01"))  # a GET of the run's key
    f += [c.encode_set(11, b"key06", b"x" * 300), c.encode_set(12, b"key00", b"again")]
    f.append(c.encode_set(13, b"", b"empty"))  # empty key: ERR 0
    f += [c.encode_set(14, b"key07", b"seven"), c.encode_remove(15, b"key02"), c.encode_remove(16, b"nope")]
    b = bytearray(c.encode_set(17, b"key08", b"v"))
    struct.pack_into(">I", b, 28 + 5, c.MAX_VALUE + 1)  # a value over the limit
    f.append(bytes(b))
    f += [c.encode_set(18, b"L" * 441, b"long key"), c.encode_set(19, b"key09", b"")]
    f += [c.encode_get(20, b"key02"), c.encode_get(21, b"L" * 441)]
    b = bytearray(c.encode_set(22, b"key10", b"cut"))
    struct.pack_into(">Q", b, 0, len(b) - 2)  # total_len cuts the value: ERR
    f.append(bytes(b))
    f += [c.encode_set(23 + i, b"key1%d" % i, b"w%d" % i) for i in range(5)]
    f += [c.encode_get(30, b"key13"), c.encode_remove(31, b"key11"), c.encode_set(32, b"key11", b"back")]
    f += [c.encode_set(33 + i, b"key2%d" % i, b"z" * i) for i in range(4)]
    b = bytearray(c.encode_set(40, b"key99", b"v"))
    struct.pack_into(">Q", b, 0, c.MAX_MESSAGE + 1)  # refused: ERR 3 and the close
    f.append(bytes(b)[:28])
    return f


def _run(store, reads):
    factory = KvServerFactory(store.kv, store=store)
    proto = factory.buildProtocol(None)
    tr = StringTransport()
    proto.makeConnection(tr)
    for data in reads:
        proto.dataReceived(data)
    complete(store, None)
    return tr.value(), tr.disconnecting, dict(store.kv.scan_forward(None, 1 << 20))


def test_mixed_writes_split_anywhere_give_the_replies_of_one_frame_at_a_time(tmp_path, sets_mode, monkeypatch):
    frames = _mixed_frames()
    wire = b"".join(frames)
    n = [0]

    def fresh():
        n[0] += 1
        s = open_inline(tmp_path / str(n[0]), task.Clock())
        s.kv.put(b"key05", b"old")
        complete(s, None)
        return s

    python, sets_compiled.run = sets_compiled.run, None
    try:
        s = fresh()
        want = _run(s, frames)  # one frame at a time, the Python loop
        close(s)
    finally:
        sets_compiled.run = python
    assert want[1]  # the oversize total_len closes
    assert want[2][b"key00"] == b"again" and b"key02" not in want[2] and want[2][b"L" * 441] == b"long key"
    taken = []
    real = KvServerProtocol._sets_compiled

    def spy(self, data, n):
        pos = real(self, data, n)
        taken.append(pos)
        return pos

    monkeypatch.setattr(KvServerProtocol, "_sets_compiled", spy)
    monkeypatch.setattr(server, "SETS_SKIP_READS", 0)  # the pass tried on every read
    cases = [[wire]] + [[wire[:i], wire[i:]] for i in range(1, len(wire))]
    cases += [[wire[i : i + step] for i in range(0, len(wire), step)] for step in (1, 7, 29, 33, 64, 129, 500)]
    for reads in cases:
        s = fresh()
        hold(s, len(reads) % 2 == 0)  # acks at once, or all at the end
        got = _run(s, reads)
        close(s)
        assert got == want, [len(r) for r in reads]
    if sets_mode == "compiled":
        assert sum(1 for pos in taken if pos) >= 200  # the splits inside the first run of SETs, and steps
    else:
        assert not taken


def _setget_frames(ending):
    """SETs with GETs of the run's keys (the pass's shape), then GETs of keys the store holds in
    LMDB only, in LMDB and the row cache, in the memtable, and of a missing key, REMOVEs (a missing
    key's too), GETs after them, malformed frames (an empty key, a value over the limit, a GET
    whose total_len cuts its key), more SET/GET pairs, and ``ending``: total_len < 8 or over 32
    MiB (ERR 3 and the close)."""
    f = []
    for i in range(4):
        f += [c.encode_set(1 + 2 * i, b"a%d" % i, b"one%d" % i), c.encode_get(2 + 2 * i, b"a%d" % i)]
    f += [c.encode_get(9, b"a0"), c.encode_set(10, b"a0", b"two" * 90), c.encode_get(11, b"a0")]
    f += [c.encode_set(12, b"a1", b"three"), c.encode_get(13, b"lm01"), c.encode_get(14, b"a1")]
    f += [c.encode_get(15, b"rc01"), c.encode_get(16, b"mt01"), c.encode_get(17, b"missing")]
    f += [c.encode_set(18, b"lm01", b"over"), c.encode_get(19, b"lm01"), c.encode_remove(20, b"a2")]
    f += [c.encode_get(21, b"a2"), c.encode_remove(22, b"nope"), c.encode_set(23, b"a2", b"back")]
    f += [c.encode_get(24, b"a2"), c.encode_set(25, b"", b"empty"), c.encode_get(26, b"a3")]
    b = bytearray(c.encode_set(27, b"a4", b"v"))
    struct.pack_into(">I", b, 28 + 2, c.MAX_VALUE + 1)  # a value over the limit
    f += [bytes(b), c.encode_get(28, b"a4")]
    b = bytearray(c.encode_get(29, b"a1"))
    struct.pack_into(">Q", b, 0, len(b) - 1)  # total_len cuts the GET's key
    f.append(bytes(b))
    for i in range(5):
        f += [c.encode_set(30 + 2 * i, b"p%d" % i, b"x" * (50 * i)), c.encode_get(31 + 2 * i, b"p%d" % i)]
    f += [c.encode_get(40, b"rc02"), c.encode_set(41, b"rc02", b"new"), c.encode_get(42, b"rc02")]
    b = bytearray(c.encode_set(43, b"zz", b"v"))
    if ending == "short":
        struct.pack_into(">Q", b, 0, 7)  # total_len < 8: ERR 3 (client_id 0), then the close
    else:
        struct.pack_into(">Q", b, 0, c.MAX_MESSAGE + 1)  # refused: ERR 3 and the close
    f.append(bytes(b)[:28])
    return f


@pytest.mark.parametrize("ending", ["short", "oversize"])
def test_set_get_mixes_split_anywhere_give_the_replies_of_one_frame_at_a_time(tmp_path, sets_mode, monkeypatch, ending):
    """SETs and GETs of the run's keys taken by the pass, mixed with GETs of keys in LMDB only, in
    LMDB and the row cache, in the memtable and missing, REMOVEs and malformed frames: read at
    once, split at every byte and in steps, with and without the pass, the replies, the close and
    the store are those of one frame at a time through the Python loop."""
    from protocols.partition import gets_compiled

    gets_compiled.start_loading()
    assert gets_compiled.wait(120) and gets_compiled.state == "compiled", gets_compiled.state
    frames = _setget_frames(ending)
    wire = b"".join(frames)
    n = [0]

    def fresh():
        n[0] += 1
        s = open_inline(tmp_path / str(n[0]), task.Clock())
        s.kv.write_sets([b"lm%02d" % i for i in range(4)], [b"lmdb%d" % i for i in range(4)])
        s.kv.flush()
        s.kv.flush()  # in LMDB, not in the row cache (made after this merge)
        cache = s.kv.start_row_cache()
        s.kv.write_sets([b"rc%02d" % i for i in range(4)], [b"cached%d" % i for i in range(4)])
        s.kv.flush()
        s.kv.flush()  # in LMDB and the row cache (the merge fills it)
        s.kv.write_sets([b"mt%02d" % i for i in range(4)], [b"memtable%d" % i for i in range(4)])
        complete(s, None)
        return s, cache

    python, sets_compiled.run = sets_compiled.run, None
    try:
        s, cache = fresh()
        want = _run(s, frames)  # one frame at a time, the Python loop
        close(s)
    finally:
        sets_compiled.run = python
    assert want[1]  # the ending closes
    assert want[2][b"a0"] == b"two" * 90 and want[2][b"a2"] == b"back" and want[2][b"lm01"] == b"over"
    assert c.encode_get_reply(15, b"rc01", b"cached1") in want[0] and c.encode_get_reply(13, b"lm01", b"lmdb1") in want[0]
    assert c.encode_get_reply(16, b"mt01", b"memtable1") in want[0] and c.encode_status(17, c.DATA_NOT_FOUND) in want[0]
    taken = []
    real = KvServerProtocol._sets_compiled

    def spy(self, data, n):
        pos = real(self, data, n)
        taken.append(pos)
        return pos

    monkeypatch.setattr(KvServerProtocol, "_sets_compiled", spy)
    monkeypatch.setattr(server, "SETS_SKIP_READS", 0)  # the pass tried on every read
    # every byte for one ending; for the other (the same frames before it) the bytes of its end
    first = 1 if ending == "short" else len(wire) - 64
    cases = [[wire]] + [[wire[:i], wire[i:]] for i in range(first, len(wire))]
    cases += [[wire[i : i + step] for i in range(0, len(wire), step)] for step in (1, 7, 29, 33, 64, 129, 500)]
    cases += [frames]
    hits = 0
    for reads in cases:
        s, cache = fresh()
        hold(s, len(reads) % 2 == 0)  # acks at once, or all at the end
        got = _run(s, reads)
        hits += cache.hits
        close(s)
        assert got == want, [len(r) for r in reads]
    assert hits  # the row cache answered some GETs
    if sets_mode == "compiled":
        assert sum(1 for pos in taken if pos) >= (100 if ending == "short" else 10)  # the splits inside the first run, and steps
    else:
        assert not taken


def test_after_a_read_it_cannot_take_the_pass_waits_some_reads(tmp_path, monkeypatch):
    """``SET k; GET j`` pipelined, j set by an earlier read (or never): the pass cannot take such
    reads whole (the GET reads the pending table or the store), so after one try the next
    SETS_SKIP_READS reads go to the loop without trying it; reads of SETs alone are taken again
    after that. The replies are the loop's throughout."""
    _kernel()
    calls = []
    real = KvServerProtocol._sets_compiled
    monkeypatch.setattr(KvServerProtocol, "_sets_compiled", lambda self, data, n: calls.append(n) or real(self, data, n))
    s = open_inline(tmp_path / "s", task.Clock())
    try:
        proto = KvServerFactory(s.kv, store=s).buildProtocol(None)
        tr = StringTransport()
        proto.makeConnection(tr)
        want = []
        for i in range(server.SETS_SKIP_READS + 2):
            key, prev = b"p%d" % i, b"p%d" % (i - 1) if i else b"none"
            proto.dataReceived(c.encode_set(2 * i, key, b"v") + c.encode_get(2 * i + 1, prev))
            want += [c.encode_status(2 * i, c.OK),
                     c.encode_get_reply(2 * i + 1, prev, b"v") if i else c.encode_status(1, c.DATA_NOT_FOUND)]
        assert len(calls) == 2  # the first read and the one after SETS_SKIP_READS skipped
        proto.dataReceived(c.encode_set(100, b"a", b"1") + c.encode_set(101, b"b", b"2"))
        assert len(calls) == 2  # still skipping: the second try bailed too
        complete(s, None)
        assert tr.value() == b"".join(want) + c.encode_status(100, c.OK) + c.encode_status(101, c.OK)
    finally:
        close(s)


@pytest.mark.parametrize("held", [False, True])
def test_set_get_pairs_of_the_runs_keys_are_taken_by_the_pass(tmp_path, monkeypatch, held):
    """``SET k; GET k`` pipelined (issue 19's SETGET): every read is taken by the pass, the GETs
    answered from the read and held behind the SETs' replies until the run is durable; the replies
    and the store are the loop's, and the GETs are counted."""
    kernel = _kernel()
    taken = []
    real = KvServerProtocol._sets_compiled
    monkeypatch.setattr(KvServerProtocol, "_sets_compiled", lambda self, data, n: taken.append(real(self, data, n)) or taken[-1])
    reads = []
    for r in range(20):
        reads.append(b"".join(c.encode_set(100 * r + 2 * i, b"k%d" % (i % 5), b"v%d.%d" % (r, i))
                              + c.encode_get(100 * r + 2 * i + 1, b"k%d" % (i % 5)) for i in range(8)))
    results = []
    for i, run in enumerate((kernel, None)):
        sets_compiled.run = run
        s = open_inline(tmp_path / str(i), task.Clock())
        hold(s, held)
        try:
            factory = KvServerFactory(s.kv, store=s)
            proto = factory.buildProtocol(None)
            tr = StringTransport()
            proto.makeConnection(tr)
            for data in reads:
                proto.dataReceived(data)
                if held:
                    assert tr.value() == b""  # nothing leaves before the run is durable
            complete(s, None)
            results.append((tr.value(), dict(s.kv.scan_forward(None, 1 << 20)), factory.metrics["responses"]))
        finally:
            close(s)
            sets_compiled.run = kernel
    assert taken == [len(r) for r in reads]
    assert results[0] == results[1]
    assert results[0][2][server._GET_OK] == 160


# -- the store: packed runs through the writer thread, the merge worker, and a replay -----------


def _packed(reads_of_sets):
    """(run, op, nbytes) of a read of SETs, as the server's compiled pass makes them."""
    kernel = _kernel()
    (count, end, plen, kbytes, vbytes, budget, items, rlen), payload, replies = _kernel_call(
        kernel, reads_of_sets, 1024, 1 << 30)
    assert end == len(reads_of_sets)
    op = PackedOp(memoryview(payload)[:plen])
    _code, _db, keys, stored = msgpack.unpackb(op)
    return PackedRun(keys, stored), op, kbytes + vbytes


@pytest_twisted.ensureDeferred
async def test_packed_runs_are_merged_by_the_worker_and_replayed_after_a_stop():
    d = tempfile.mkdtemp(prefix="kv-sets-")
    st = Store.open(d, fsync="always", reactor=reactor, node_id=1, retention_check_s=0)
    try:
        first = st.kv.write_packed(*_packed(b"".join(c.encode_set(i, b"a%03d" % i, b"%d" % i * 3) for i in range(200))))
        second = st.kv.write_many([(b"a001", None), (b"b", b"many")])  # the same group, likely: one T_OPS entry
        third = st.kv.write_packed(*_packed(c.encode_set(1, b"a002", b"new") + c.encode_set(2, b"a002", b"newer")))
        assert await first == [True] * 200 and await third == [True] * 2
        assert await second == [True, True]
        assert st.kv.get_many([b"a000", b"a001", b"a002", b"b"]) == [b"000", None, b"newer", b"many"]
        await st.kv.flush()
        assert st.kv.memtable_keys() == 0
        txn = st.snapshot()
        assert txn.get(b"a199", db=st.dbs[index.KV]) == b"\x00" + b"199" * 3
        assert txn.get(b"a002", db=st.dbs[index.KV]) == b"\x00newer" and txn.get(b"a001", db=st.dbs[index.KV]) is None
        assert await st.kv.write_packed(*_packed(c.encode_set(3, b"c", b"last") + c.encode_set(4, b"a000", b"x"))) == [True] * 2
        await st.core.close()  # no merge of the last run: the WAL replays it
        st = Store.open(d, fsync="always", reactor=reactor, node_id=1, retention_check_s=0)
        assert st.kv.get_many([b"a000", b"a001", b"a002", b"a150", b"b", b"c"]) == [
            b"x", None, b"newer", b"150" * 3, b"many", b"last"]
    finally:
        await st.close()
        shutil.rmtree(d, ignore_errors=True)


def test_a_packed_run_refused_for_room_fails_whole(tmp_path, monkeypatch):
    import storage.kv as kvmod

    monkeypatch.setattr(kvmod, "HARD_BYTES", 10)
    s = open_inline(tmp_path / "s", task.Clock())
    try:
        proto = KvServerFactory(s.kv, store=s).buildProtocol(None)
        tr = StringTransport()
        proto.makeConnection(tr)
        _kernel()
        proto.dataReceived(c.encode_set(5, b"k1", b"v" * 20) + c.encode_set(6, b"k2", b"v"))
        complete(s, None)
        assert tr.value() == c.encode_error(5, c.E_UNKNOWN) + c.encode_error(6, c.E_UNKNOWN)
        assert s.kv.get_many([b"k1", b"k2"]) == [None, None]
    finally:
        close(s)


def test_a_failed_run_with_gets_answers_as_the_loop(tmp_path, monkeypatch, sets_mode):
    """A run of ``SET k; GET k`` the store refuses: its SETs get ERR 0, its GETs the replies the
    read gave them (what the loop's failed run sends), in order; nothing stored."""
    import storage.kv as kvmod

    monkeypatch.setattr(kvmod, "HARD_BYTES", 10)
    s = open_inline(tmp_path / "s", task.Clock())
    try:
        proto = KvServerFactory(s.kv, store=s).buildProtocol(None)
        tr = StringTransport()
        proto.makeConnection(tr)
        proto.dataReceived(c.encode_set(5, b"k1", b"v" * 20) + c.encode_get(6, b"k1")
                           + c.encode_set(7, b"k2", b"w") + c.encode_get(8, b"k1") + c.encode_get(9, b"k2"))
        complete(s, None)
        assert tr.value() == b"".join([
            c.encode_error(5, c.E_UNKNOWN), c.encode_get_reply(6, b"k1", b"v" * 20), c.encode_error(7, c.E_UNKNOWN),
            c.encode_get_reply(8, b"k1", b"v" * 20), c.encode_get_reply(9, b"k2", b"w")])
        assert s.kv.get_many([b"k1", b"k2"]) == [None, None]
    finally:
        close(s)


def test_gets_of_a_big_value_past_the_replies_scratch_go_to_the_loop(tmp_path, monkeypatch, sets_mode):
    """A read that SETs a 60 KB value and GETs it 100 times (6 MB of replies, past
    REPLIES_SCRATCH_MAX): the pass leaves it to the loop, the scratch stays within its bound, the
    replies are the loop's; a read of a few such GETs is taken (the scratch grown)."""
    taken = []
    real = KvServerProtocol._sets_compiled
    monkeypatch.setattr(KvServerProtocol, "_sets_compiled", lambda self, data, n: taken.append(real(self, data, n)) or taken[-1])
    s = open_inline(tmp_path / "s", task.Clock())
    try:
        proto = KvServerFactory(s.kv, store=s).buildProtocol(None)
        tr = StringTransport()
        proto.makeConnection(tr)
        big = bytes(range(256)) * 240
        proto.dataReceived(c.encode_set(1, b"big", big) + b"".join(c.encode_get(2 + i, b"big") for i in range(100)))
        proto.dataReceived(c.encode_set(200, b"big", big[::-1]) + b"".join(c.encode_get(201 + i, b"big") for i in range(3)))
        complete(s, None)
        assert tr.value() == b"".join(
            [c.encode_status(1, c.OK)] + [c.encode_get_reply(2 + i, b"big", big) for i in range(100)]
            + [c.encode_status(200, c.OK)] + [c.encode_get_reply(201 + i, b"big", big[::-1]) for i in range(3)])
        assert len(server._SCRATCH[1]) <= server.REPLIES_SCRATCH_MAX
        if sets_mode == "compiled":
            assert taken[0] == 0 and taken[1] > 0
    finally:
        close(s)
