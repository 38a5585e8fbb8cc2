"""CONTRACT §4.1: the ``--kv-client`` listener in yesSQL's client framing. Byte vectors over
StringTransport for each rule, then real nodes: every command, cursors paging across all
partitions, and the same keys seen through both listeners."""

import socket
import struct

import pytest
from twisted.internet import task
from twisted.internet.testing import StringTransport

from protocols.framing import Framer, read_frame
from protocols.partition import client_framing as y
from protocols.partition import codec as c
from protocols.partition.client import BlockingKvClient
from protocols.partition.client_server import KvClientServerFactory
from tests.test_kv_integration import spread_keys
from tests.storage_helpers.inline import close, complete, hold, open_inline
from tests.test_kv_protocol import record_runs

OFF = dict(sbp="none", meta="none", chunks="none", swarm="none", http="none")


@pytest.fixture
def store(tmp_path):
    """The real store (LMDB and the WAL in tmp_path), written inline (tests/storage_helpers/inline.py)."""
    s = open_inline(tmp_path / "store", task.Clock())
    yield s
    close(s)


def connect(store):
    proto = KvClientServerFactory(store.kv, store=store).buildProtocol(None)
    tr = StringTransport()
    proto.makeConnection(tr)
    return proto, tr


def ok():
    return struct.pack(">QQH", 18, 0, c.OK)


def err(code):
    return struct.pack(">QQHH", 20, 0, c.ERR, code)


# -- byte vectors -----------------------------------------------------------------------------


def test_set_get_remove_bytes(store):
    proto, tr = connect(store)
    # SET "k" = "vv": total 18 + 2 + 1 + 4 + 2 = 27, NumElems 1 as yesSQL's clients send it
    proto.dataReceived(bytes.fromhex("000000000000001b" "0000000000000001" "0003" "0001" "6b" "00000002" "7676"))
    assert tr.value() == bytes.fromhex("0000000000000012" "0000000000000000" "0000")
    tr.clear()
    proto.dataReceived(bytes.fromhex("0000000000000015" "0000000000000001" "0002" "0001" "6b"))
    # OK, one element: u16 key_len, key, u32 value_len, value
    assert tr.value() == bytes.fromhex("000000000000001b" "0000000000000001" "0000" "0001" "6b" "00000002" "7676")
    tr.clear()
    proto.dataReceived(y.encode_remove(b"k") + y.encode_remove(b"k") + y.encode_get(b"k"))
    # REMOVE of a missing key is OK here (§4 would say DATA_NOT_FOUND); GET of it DATA_NOT_FOUND
    assert tr.value() == ok() + ok() + struct.pack(">QQH", 18, 0, c.DATA_NOT_FOUND)


def test_cursor_commands_and_scans_have_no_next_key_and_no_footer(store):
    for k in (b"\x01a", b"\x01b", b"\xf0z"):  # partitions 0 and 7
        store.kv.put(k, b"v" + k)
    proto, tr = connect(store)
    proto.dataReceived(y.encode_create_cursor(b"cur") + y.encode_scan(c.GET_FF, 2, b"cur"))
    elems = b"\x00\x02\x01a\x00\x00\x00\x03v\x01a" + b"\x00\x02\x01b\x00\x00\x00\x03v\x01b"
    assert tr.value() == ok() + struct.pack(">QQH", 18 + len(elems), 2, c.OK) + elems
    tr.clear()
    # the scan continues from the cursor; two partitions in one page: no flag bit in NumElems
    proto.dataReceived(y.encode_scan(c.GET_KEYS, 5, b"cur"))
    assert tr.value() == struct.pack(">QQH", 18 + 4, 1, c.OK) + b"\x00\x02\xf0z"
    tr.clear()
    proto.dataReceived(y.encode_create_cursor(b"b") + y.encode_scan(c.GET_FB, 1024, b"b"))
    assert tr.value() == ok() + struct.pack(">QQH", 18, 0, c.OK)  # from BEGIN backwards: nothing
    tr.clear()
    proto.dataReceived(y.encode_scan(c.GET_KEYS, 1024, b"cur"))
    assert tr.value() == struct.pack(">QQH", 18, 0, c.OK)  # at END: nothing


def test_trailing_bytes_after_a_scan_name_and_prefix_are_ignored(store):
    for k in (b"pa", b"pb", b"q"):
        store.kv.put(k, b"v")
    proto, tr = connect(store)
    msg = y.encode_scan(c.GET_KEYS_PREFIX, 10, b"x", prefix=b"p") + b"trailing"
    msg = struct.pack(">Q", len(msg)) + msg[8:]
    proto.dataReceived(y.encode_create_cursor(b"x") + msg)
    assert tr.value() == ok() + struct.pack(">QQH", 18 + 8, 2, c.OK) + b"\x00\x02pa\x00\x02pb"


def test_unknown_or_deleted_cursor_is_err0(store):
    proto, tr = connect(store)
    proto.dataReceived(
        y.encode_scan(c.GET_FF, 1, b"nope")
        + y.encode_delete_cursor(b"nope")
        + y.encode_create_cursor(b"c")
        + y.encode_delete_cursor(b"c")
        + y.encode_scan(c.GET_KEYS_PREFIX, 1, b"c", prefix=b"a")
    )
    assert tr.value() == err(0) + err(0) + ok() + ok() + err(0)


def test_count_rules_and_short_messages_keep_the_connection(store):
    proto, tr = connect(store)
    proto.dataReceived(
        y.encode_create_cursor(b"c")
        + y.encode_scan(c.GET_FF, 0, b"c")
        + y.encode_scan(c.GET_FF, 1025, b"c")
        + struct.pack(">QQ", 17, 1) + b"\x00"  # under the 18-byte header: ERR 3, kept
        + struct.pack(">QQH", 20, 0, c.GET_FF) + b"\x05c"  # cursor name past total_len: ERR 3
        + struct.pack(">QQH", 18, 0, 99)  # unknown command
        + y.encode_get(b"x")
    )
    assert tr.value() == (ok() + err(c.E_TOO_MANY_ELEMENTS) + err(c.E_TOO_MANY_ELEMENTS) + err(3) + err(3)
                          + struct.pack(">QQH", 18, 0, c.INVALID_COMMAND) + struct.pack(">QQH", 18, 0, c.DATA_NOT_FOUND))
    assert not tr.disconnecting


@pytest.mark.parametrize("total", [0, 7])
def test_total_len_below_8_is_err3_then_close(store, total):
    hold(store)
    proto, tr = connect(store)
    proto.dataReceived(y.encode_set(b"a", b"1") + struct.pack(">Q", total) + b"more bytes")
    assert tr.value() == b"" and not tr.disconnecting
    complete(store)
    assert tr.value() == ok() + err(3) and tr.disconnecting


def test_total_len_over_32_mib_is_err3_and_close_without_the_body(store):
    proto, tr = connect(store)
    proto.dataReceived(y.encode_get(b"a") + struct.pack(">QQH", 32 * 1024 * 1024 + 1, 1, c.SET))
    assert tr.value() == struct.pack(">QQH", 18, 0, c.DATA_NOT_FOUND) + err(3) and tr.disconnecting


def test_pipelined_set_get_read_pending_writes_in_order(store):
    hold(store)
    runs = record_runs(store)
    proto, tr = connect(store)
    proto.dataReceived(y.encode_set(b"a", b"1") + y.encode_get(b"a") + y.encode_remove(b"zz") + y.encode_get(b"zz"))
    assert len(runs) == 1 and tr.value() == b""
    complete(store)
    assert tr.value() == (ok() + struct.pack(">QQHH", 18 + 8, 1, c.OK, 1) + b"a" + struct.pack(">I", 1) + b"1"
                          + ok() + struct.pack(">QQH", 18, 0, c.DATA_NOT_FOUND))


@pytest.mark.parametrize("step", [1, 5])
def test_split_reads(store, step):
    proto, tr = connect(store)
    wire = y.encode_set(b"k", b"v") + y.encode_get(b"k") + y.encode_create_cursor(b"c") + y.encode_scan(c.GET_FF, 3, b"c")
    for i in range(0, len(wire), step):
        proto.dataReceived(wire[i : i + step])
    data = tr.value()
    assert data.startswith(ok())
    assert data.endswith(struct.pack(">QQH", 18 + 8, 1, c.OK) + b"\x00\x01k\x00\x00\x00\x01v")


# -- real nodes -------------------------------------------------------------------------------


class YesSqlClient:
    """A blocking client sending exactly the bytes of yesSQL's cli.py / cli.go (one request, one reply)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.frames = Framer(y.Layout())

    def call(self, cmd, message):
        self.sock.sendall(message)
        buf, pos, _end = read_frame(self.frames, self.sock.recv)
        return y.decode_reply(buf, cmd, pos)

    def pipeline(self, calls):
        self.sock.sendall(b"".join(m for _, m in calls))
        out = []
        for cmd, _ in calls:
            buf, pos, _end = read_frame(self.frames, self.sock.recv)
            out.append(y.decode_reply(buf, cmd, pos))
        return out

    def scan_all(self, cmd, name, page, prefix=b""):
        got = []
        while True:
            rcmd, code, items = self.call(cmd, y.encode_scan(cmd, page, name, prefix))
            assert rcmd == c.OK, code
            if not items:
                return got
            got.append(items)

    def close(self):
        self.sock.close()


def test_every_command_on_a_real_node_and_both_listeners_share_the_store(node_factory):
    node = node_factory(fsync="always", **OFF)
    keys = spread_keys(1500, seed=7)
    assert {c.partition_of(k) for k in keys} == set(range(8))
    yc = YesSqlClient(node.ready["kv_client"])
    try:
        r = yc.pipeline([(c.SET, y.encode_set(k, b"y:" + k)) for k in keys])
        assert all(x == (c.OK, None, []) for x in r)
        # the same keys through the §4 listener
        with BlockingKvClient(*node.address("kv")) as kv:
            assert [k for p in kv.iter_scan(c.GET_FF, page=1024) for k, _ in p.items] == keys
            assert kv.get(keys[5]) == b"y:" + keys[5]
            kv.set(b"\x05from-kv", b"partition listener")
            assert kv.remove(keys[0]) is True
        assert yc.call(c.GET, y.encode_get(b"\x05from-kv")) == (c.OK, None, [(b"\x05from-kv", b"partition listener")])
        assert yc.call(c.GET, y.encode_get(keys[0]))[0] == c.DATA_NOT_FOUND
        assert yc.call(c.REMOVE, y.encode_remove(keys[0])) == (c.OK, None, [])  # missing: OK
        everything = sorted(set(keys[1:]) | {b"\x05from-kv"})

        # cursors paging across all partitions, each key once, in order
        assert yc.call(c.CREATE_CURSOR, y.encode_create_cursor(b"ff"))[0] == c.OK
        pages = yc.scan_all(c.GET_FF, b"ff", 97)
        assert [k for p in pages for k, _ in p] == everything
        assert all(v == (b"partition listener" if k == b"\x05from-kv" else b"y:" + k) for p in pages for k, v in p)
        assert yc.call(c.GET_FF, y.encode_scan(c.GET_FF, 10, b"ff")) == (c.OK, None, [])  # at the end: []
        assert yc.call(c.GET_FB, y.encode_scan(c.GET_FB, 1024, b"ff"))[2][-1][0] == everything[-1]
        assert yc.call(c.CREATE_CURSOR, y.encode_create_cursor(b"fb"))[0] == c.OK
        # a full backward scan from the end: create at the last key
        yc.call(c.CREATE_CURSOR, y.encode_create_cursor(b"fb", everything[-1]))
        pages = yc.scan_all(c.GET_FB, b"fb", 100)
        assert [k for p in reversed(pages) for k, _ in p] == everything
        assert all([k for k, _ in p] == sorted(k for k, _ in p) for p in pages)
        yc.call(c.CREATE_CURSOR, y.encode_create_cursor(b"keys"))
        assert [k for p in yc.scan_all(c.GET_KEYS, b"keys", 333) for k, _ in p] == everything
        prefix = everything[len(everything) // 2][:1]
        yc.call(c.CREATE_CURSOR, y.encode_create_cursor(b"pre"))
        got = [k for p in yc.scan_all(c.GET_KEYS_PREFIX, b"pre", 7, prefix) for k, _ in p]
        assert got == [k for k in everything if k.startswith(prefix)]
        # a cursor started at a key; deleted then unknown (ERR 0); re-created resets it
        yc.call(c.CREATE_CURSOR, y.encode_create_cursor(b"at", everything[100]))
        assert yc.call(c.GET_KEYS, y.encode_scan(c.GET_KEYS, 2, b"at"))[2] == [(everything[100], None), (everything[101], None)]
        assert yc.call(c.DELETE_CURSOR, y.encode_delete_cursor(b"at")) == (c.OK, None, [])
        assert yc.call(c.GET_KEYS, y.encode_scan(c.GET_KEYS, 2, b"at")) == (c.ERR, 0, [])
        assert yc.call(c.DELETE_CURSOR, y.encode_delete_cursor(b"at")) == (c.ERR, 0, [])
        yc.call(c.CREATE_CURSOR, y.encode_create_cursor(b"ff"))
        assert yc.call(c.GET_KEYS, y.encode_scan(c.GET_KEYS, 1, b"ff"))[2] == [(everything[0], None)]
    finally:
        yc.close()


def test_kv_client_listener_can_be_turned_off(node_factory):
    node = node_factory(kv_client="none", **OFF)
    assert node.ready["kv_client"] is None and isinstance(node.ready["kv"], int)
