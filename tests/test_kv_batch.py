"""The key-value server's batch path (issue 19's speed pass): the compiled scan of a read's runs of
SETs and GETs (``protocols/partition/frame_scan.py``) and the store's run of SETs in one step
(``store.kv.write_sets``) answer exactly as the Python loops and ``write_many`` do: the same reply
bytes, in the same order, for a buffer of many messages split at every byte boundary, and the same
store contents. (``write_sets`` across restarts and kill -9: tests/test_storage_kv_memtable.py and
tests/test_storage_kv_crash.py.)

Real store (inline writer, tests/storage_helpers/inline.py), real server over StringTransport.
"""

import struct

import pytest
from twisted.internet import task
from twisted.internet.testing import StringTransport

from protocols.partition import codec as c
from protocols.partition import frame_scan
from protocols.partition.server import KvServerFactory
from tests.storage_helpers.inline import close, complete, hold, open_inline

frame_scan.load()
COMPILED = frame_scan.scan_run
needs_compiled = pytest.mark.skipif(COMPILED is None, reason="numba not available: " + frame_scan.state)


@pytest.fixture
def scan_mode(monkeypatch):
    """``use(name)``: run the server with the compiled scan ("compiled") or the Python loops."""

    def use(name):
        monkeypatch.setattr(frame_scan, "scan_run", COMPILED if name == "compiled" else None)

    return use


def connect(store):
    proto = KvServerFactory(store.kv, store=store).buildProtocol(None)
    tr = StringTransport()
    proto.makeConnection(tr)
    return proto, tr


def wire():
    """Many messages of every kind the batch path takes or must leave alone, each answer fixed by
    the messages before it (so the same bytes give the same replies on every run)."""
    val = bytes(range(100))
    keys = [struct.pack(">Q", (i * 0x9E3779B97F4A7C15) & (2 ** 64 - 1)) for i in range(40)]
    parts = [c.encode_set(i, k, val + bytes([i])) for i, k in enumerate(keys[:20])]  # a run of SETs
    parts += [c.encode_get(100 + i, k) for i, k in enumerate(keys[:25])]  # GETs: 20 found, 5 missing
    parts += [c.encode_set(200, keys[30], b""), c.encode_get(201, keys[30])]  # SET k; GET k (Python loop)
    parts += [c.encode_set(2 ** 64 - 1, keys[31], b"max id"), c.encode_set(2 ** 63, keys[31], b"again")]
    parts += [c.encode_get(2 ** 64 - 2, keys[31]), c.encode_get(2 ** 63 + 1, keys[0])]
    parts += [c.encode_set(300, b"", b"empty key"), c.encode_set(301, b"k" * 441, b"long key")]
    parts += [c.encode_get(302, b"k" * 441), c.encode_get(303, b"k" * 439)]  # 439: never set
    parts += [c.encode_set(304, b"k" * 440, b"longest kept"), c.encode_set(305, b"z", b"1")]
    parts += [c.encode_get(306, b"k" * 440), c.encode_remove(307, keys[1]), c.encode_remove(308, keys[39])]
    parts += [c.encode_get(309, keys[1]), c.encode_get(310, keys[2])]
    # a SET whose value runs past total_len (ERR 3, skipped), then a valid run goes on
    bad = bytearray(c.encode_set(311, b"bad", b"xyz"))
    bad[-5:-3] = b"\x00\x09"  # value length 0x0009xxxx... wrong: past total_len
    parts += [bytes(bad), c.encode_set(312, keys[32], b"a"), c.encode_set(313, keys[33], b"b")]
    parts += [struct.pack(">QQQH", 26, 314, 0, 99)]  # unknown cmd
    parts += [struct.pack(">QQ", 20, 315) + b"\x00" * 4]  # total_len 20 < 26: ERR 3, skipped
    parts += [c.encode_get(316 + i, k) for i, k in enumerate(keys[30:36])]
    cmds = []
    for p in parts:
        total, _cid, _n, cmd = struct.unpack_from(">QQQH", p) if len(p) >= 26 else (20, 0, 0, 0)
        cmds.append(cmd if cmd in (c.GET, c.SET, c.REMOVE) else c.OK)
    return b"".join(parts), cmds


def run(store, data, pieces):
    proto, tr = connect(store)
    for piece in pieces:
        proto.dataReceived(piece)
    while complete(store):
        pass
    out = tr.value()
    proto.connectionLost(None)
    return out


def test_a_buffer_split_at_every_byte_gives_the_same_replies(tmp_path, scan_mode):
    data, _ = wire()
    stores = {}
    expected = {}
    for mode in ("python", "compiled"):
        scan_mode(mode)
        store = stores[mode] = open_inline(tmp_path / mode, task.Clock())
        expected[mode] = run(store, data, [data])
    assert expected["compiled"] == expected["python"]
    assert dict(stores["compiled"].kv.scan_forward(None, 1 << 20)) == dict(stores["python"].kv.scan_forward(None, 1 << 20))
    for mode, store in stores.items():
        scan_mode(mode)
        for cut in range(1, len(data)):
            assert run(store, data, [data[:cut], data[cut:]]) == expected["python"], (mode, cut)
        assert run(store, data, [data[i : i + 1] for i in range(len(data))]) == expected["python"]
        close(store)


@needs_compiled
def test_the_compiled_path_takes_the_runs(tmp_path, scan_mode, monkeypatch):
    """The runs of SETs and GETs go through the compiled scan and ``write_sets`` (not the loops)."""
    scan_mode("compiled")
    store = open_inline(tmp_path / "s", task.Clock())
    calls = []
    monkeypatch.setattr(frame_scan, "scan_run", lambda *a: calls.append(a[3]) or COMPILED(*a))
    sets = []
    real = store.kv.write_sets
    store.kv.write_sets = lambda keys, values, nbytes=None: sets.append(len(keys)) or real(keys, values, nbytes)
    data = b"".join(c.encode_set(i, b"key%d" % i, b"v") for i in range(50))
    data += b"".join(c.encode_get(100 + i, b"key%d" % i) for i in range(50))
    proto, tr = connect(store)
    proto.dataReceived(data)
    assert calls == [c.SET, c.GET] and sets == [50]
    replies = []
    pos = 0
    raw = tr.value()
    for cmd in [c.SET] * 50 + [c.GET] * 50:
        replies.append(c.decode_reply(raw, cmd, pos))
        pos += struct.unpack_from(">Q", raw, pos)[0]
    assert [r.client_id for r in replies] == list(range(50)) + list(range(100, 150))
    assert [r.items for r in replies[50:]] == [[(b"key%d" % i, b"v")] for i in range(50)]
    close(store)


@needs_compiled
def test_the_budget_bounds_a_compiled_run(tmp_path, scan_mode):
    scan_mode("compiled")
    store = open_inline(tmp_path / "s", task.Clock())
    hold(store)
    proto, tr = connect(store)
    proto.max_pending = 4
    proto.dataReceived(b"".join(c.encode_set(i, b"k%d" % i, b"v") for i in range(10)))
    assert tr.producerState == "paused" and proto._unacked == 4
    while complete(store):
        assert proto._unacked <= 4
    assert tr.producerState == "producing" and proto._unacked == 0
    assert len(tr.value()) == 10 * c.HEADER_LEN
    close(store)


def test_write_sets_falls_back_for_anything_else(tmp_path):
    store = open_inline(tmp_path / "s", task.Clock())
    d = store.kv.write_sets([b"k" * 441, bytearray(b"x")], [b"long", memoryview(b"view")])
    assert d.called and d.result == [True, True]
    d = store.kv.write_sets([b""], [b"v"])
    assert d.called and d.result.check(Exception)
    d.addErrback(lambda _: None)
    assert dict(store.kv.scan_forward(None, 10)) == {b"k" * 441: b"long", b"x": b"view"}
    close(store)
