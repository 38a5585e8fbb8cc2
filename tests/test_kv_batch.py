"""The key-value server's batch path (issue 19's speed pass): a read's runs of SETs and GETs are
taken as batches (one ``get_many`` per run of GETs; a run of SETs alone is one
``store.kv.write_sets``, without a step per SET in the store), and answer exactly as message by
message would: the same reply bytes, in the same order, for a buffer of many messages of every
kind fed whole, split at every byte boundary, and a byte at a time. (``write_sets`` across
restarts and kill -9: tests/test_storage_kv_memtable.py and tests/test_storage_kv_crash.py.)

Real store (inline writer, tests/storage_helpers/inline.py), real server over StringTransport.
"""

import struct

from twisted.internet import task
from twisted.internet.testing import StringTransport

from protocols.partition import codec as c
from protocols.partition import sets_compiled
from protocols.partition.server import KvServerFactory
from tests.storage_helpers.inline import close, complete, hold, open_inline


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
    parts += [c.encode_set(200, keys[30], b""), c.encode_get(201, keys[30])]  # SET k; GET k
    parts += [c.encode_set(2 ** 64 - 1, keys[31], b"max id"), c.encode_set(2 ** 63, keys[31], b"again")]
    parts += [c.encode_get(2 ** 64 - 2, keys[31]), c.encode_get(2 ** 63 + 1, keys[0])]
    parts += [c.encode_set(300, b"", b"empty key"), c.encode_set(301, b"k" * 441, b"long key")]
    parts += [c.encode_get(302, b"k" * 441), c.encode_get(303, b"k" * 439)]  # 439: never set
    parts += [c.encode_set(304, b"k" * 440, b"longest kept"), c.encode_set(305, b"z", b"1")]
    parts += [c.encode_get(306, b"k" * 440), c.encode_remove(307, keys[1]), c.encode_remove(308, keys[39])]
    parts += [c.encode_get(309, keys[1]), c.encode_get(310, keys[2])]
    # a SET whose value length runs past total_len (ERR 3, skipped), then a run goes on
    bad = bytearray(c.encode_set(311, b"bad", b"xyz"))
    bad[-5:-3] = b"\x00\x09"
    parts += [bytes(bad), c.encode_set(312, keys[32], b"a"), c.encode_set(313, keys[33], b"b")]
    parts += [struct.pack(">QQQH", 26, 314, 0, 99)]  # unknown cmd
    parts += [struct.pack(">QQ", 20, 315) + b"\x00" * 4]  # total_len 20 < 26: ERR 3, skipped
    parts += [c.encode_get(316 + i, k) for i, k in enumerate(keys[30:36])]
    return b"".join(parts)


def run(store, pieces):
    proto, tr = connect(store)
    for piece in pieces:
        proto.dataReceived(piece)
    while complete(store):
        pass
    out = tr.value()
    proto.connectionLost(None)
    return out


def test_a_buffer_split_at_every_byte_gives_the_same_replies(tmp_path):
    data = wire()
    store = open_inline(tmp_path / "s", task.Clock())
    whole = run(store, [data])
    assert run(store, [data]) == whole  # the wire's answers do not depend on what it left behind
    for cut in range(1, len(data)):
        assert run(store, [data[:cut], data[cut:]]) == whole, cut
    assert run(store, [data[i : i + 1] for i in range(len(data))]) == whole
    close(store)


def test_a_run_of_sets_alone_is_one_write_sets(tmp_path, monkeypatch):
    # the Python loop's path (the compiled SET pass, once loaded by another test, would take this
    # read of SETs and GETs of their keys whole: tests/test_kv_sets_compiled.py)
    monkeypatch.setattr(sets_compiled, "run", None)
    store = open_inline(tmp_path / "s", task.Clock())
    sets, manys = [], []
    real_sets, real_many = store.kv.write_sets, store.kv.write_many
    store.kv.write_sets = lambda keys, values, nbytes=None: sets.append(len(keys)) or real_sets(keys, values, nbytes)
    store.kv.write_many = lambda ops: manys.append(1) or real_many(ops)
    data = b"".join(c.encode_set(i, b"key%d" % i, b"v") for i in range(50))
    data += b"".join(c.encode_get(100 + i, b"key%d" % i) for i in range(50))
    proto, tr = connect(store)
    proto.dataReceived(data)
    assert sets == [50] and manys == []
    raw = tr.value()
    replies = []
    pos = 0
    for cmd in [c.SET] * 50 + [c.GET] * 50:
        replies.append(c.decode_reply(raw, cmd, pos))
        pos += struct.unpack_from(">Q", raw, pos)[0]
    assert pos == len(raw)
    assert [r.client_id for r in replies] == list(range(50)) + list(range(100, 150))
    assert [r.items for r in replies[50:]] == [[(b"key%d" % i, b"v")] for i in range(50)]
    proto.dataReceived(c.encode_set(1, b"a", b"1") + c.encode_remove(2, b"key0"))  # a REMOVE: write_many
    assert sets == [50] and manys == [1]
    close(store)


def test_the_budget_bounds_a_run_of_sets(tmp_path):
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
    d = store.kv.write_sets([b"k" * 441, b"x"], [b"long", memoryview(b"view")])
    assert d.called and d.result == [True, True]
    d = store.kv.write_sets([b""], [b"v"])
    assert d.called and d.result.check(Exception)
    d.addErrback(lambda _: None)
    assert dict(store.kv.scan_forward(None, 10)) == {b"k" * 441: b"long", b"x": b"view"}
    close(store)
