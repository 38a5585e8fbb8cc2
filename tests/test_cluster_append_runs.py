"""APPEND runs on a cluster primary (issue 17): the one-batch APPENDs of one socket read to
streams this node sequences are routed, sequenced, stored and replicated as one unit
(``Replicator.append_many``), anything else takes the per-frame path in order. A mixed buffer
(APPENDs to a stream this node is primary of, one to a stream it is not primary of, a bad payload
CRC, a corrupt batch, a FETCH, a PING) sent as one write and one byte at a time gets the same
replies, and leaves the same replicated log on all three nodes. Real etcd, three real nodes
(``--fsync never``), raw sockets."""

import socket
import time

import pytest

from protocols.sbp import codec
from protocols.sbp.codec import T
from storage import record_batch
from tests.etcdproc import etcd_available
from tests.test_cluster import batch, client, three_nodes, wait_for
from tests.test_cluster_replication import fetch_all, roles

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed")


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    with three_nodes(tmp_path_factory.mktemp("runs3")) as cluster:
        yield cluster


def append_wire(rid, sid, b, header=None):
    if header is None:
        header = codec.encode_table("AppendRequest", T.AppendRequest(0, [T.AppendInfo(sid, 0, len(b))]))
    return codec.encode_frame(codec.APPEND, 0, rid, header, b)


def corrupt_block(b):
    x = bytearray(b)
    x[-1] ^= 0x01
    return bytes(x)


def mixed(sid, foreign, fetched, other):
    """The buffer's frames, in order: APPENDs to ``sid`` (this node is its primary), one to
    ``foreign`` (it is not), a bad payload CRC, a corrupt batch, a FETCH of ``fetched``, a PING,
    APPENDs to ``other`` (this node is its primary too) between those to ``sid``."""
    frames = [append_wire(1, sid, batch(2, b"a")), append_wire(2, sid, batch(3, b"b"))]
    frames.append(append_wire(3, foreign, batch(1, b"f")))  # PD_NOT_LEADER naming its primary
    frames.append(append_wire(4, sid, batch(1, b"c")))
    w = bytearray(append_wire(5, sid, batch(1, b"x")))  # the frame's payload CRC is wrong
    w[-1] ^= 0x40
    frames.append(bytes(w))
    frames.append(append_wire(6, sid, corrupt_block(batch(2, b"y"))))  # CORRUPT_BATCH
    frames.append(append_wire(7, sid, batch(4, b"d")))
    header = codec.encode_table("FetchRequest", T.FetchRequest(0, 1, [T.FetchInfo(fetched, 0, 0, 1 << 20)]))
    frames.append(codec.encode_frame(codec.FETCH, 0, 8, header))
    frames.append(append_wire(9, sid, batch(1, b"e")))
    frames.append(codec.encode_frame(codec.PING, 0, 10, b"", b"ping"))
    frames.append(append_wire(11, sid, batch(2, b"g")))
    frames.append(append_wire(12, foreign, batch(1, b"h")))
    frames.append(append_wire(13, sid, batch(1, b"i")))
    frames.append(append_wire(14, other, batch(2, b"t")))
    frames.append(append_wire(15, sid, batch(1, b"j")))
    frames.append(append_wire(16, other, batch(1, b"u")))
    return frames


def normalized(reply, sid, foreign, fetched, other):
    name = {sid: "S", foreign: "F", fetched: "R", other: "T"}.get
    if reply.opcode == codec.PING:
        return ("ping", reply.stream_id, reply.flags, reply.payload)
    h = codec.decode_header(reply)
    if reply.is_system_error:
        return ("error", reply.stream_id, reply.flags, h.status.code)
    if reply.opcode == codec.FETCH:
        return ("fetch", reply.stream_id, reply.flags, [(name(r.stream_id), r.status.code) for r in h.fetch_responses],
                bytes(reply.payload or b""))
    return ("append", reply.stream_id, reply.flags,
            [(name(r.stream_id), r.base_offset, r.status.code, r.status.message if r.status.code else "")
             for r in h.append_responses])


def exchange(node, wire, expect, one_byte):
    """Send ``wire`` to ``node`` (one write, or one byte per write) and read until ``expect``
    replies (frames with the last flag) came: the frames in the order they came."""
    s = socket.create_connection(("127.0.0.1", node.ports["sbp"]), timeout=20)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        if one_byte:
            for i in range(len(wire)):
                s.sendall(wire[i:i + 1])
        else:
            s.sendall(wire)
        buf = codec.FrameBuffer()
        got = []
        done = 0
        deadline = time.monotonic() + 20
        while done < expect and time.monotonic() < deadline:
            data = s.recv(1 << 16)
            assert data, "the node closed the connection"
            buf.feed(data)
            while True:
                f = buf.next()
                if f is None:
                    break
                got.append(f)
                done += f.flags & codec.RESPONSE_LAST == codec.RESPONSE_LAST
        assert done == expect, "%d of %d replies" % (done, expect)
        return got
    finally:
        s.close()


def new_stream(nodes, primary):
    """A new R = 3 stream ``primary`` is the primary of (placement chooses the primary)."""
    for _ in range(12):
        with client(primary) as c:
            sid = c.create_stream(replica_nums=3)["stream_id"]
        if roles(nodes, sid)[0] is primary:
            return sid
    raise AssertionError("no stream placed on node %d" % primary.node_id)


def trial(nodes, primary, foreign, fetched, one_byte):
    sid, other = new_stream(nodes, primary), new_stream(nodes, primary)
    frames = mixed(sid, foreign, fetched, other)
    got = exchange(primary, b"".join(frames), len(frames), one_byte)  # one reply per frame
    replies = [normalized(f, sid, foreign, fetched, other) for f in got]
    # each stream's APPENDs are acknowledged in offset order (per connection, CONTRACT §9)
    for name in ("S", "T"):
        acked = [r[3][0][1] for r in replies if r[0] == "append" and r[3][0][0] == name and r[3][0][2] == codec.OK]
        assert acked == sorted(acked)
    # the replicated logs: byte-identical on all three nodes
    logs = []
    for s, total in ((sid, 2 + 3 + 1 + 4 + 1 + 2 + 1 + 1), (other, 3)):
        copies = []
        for n in nodes:
            wait_for(lambda: fetch_all(n, s, total)[0] == total, what="node %d holds stream %d" % (n.node_id, s))
            copies.append(fetch_all(n, s, total)[1])
        assert copies[0] == copies[1] == copies[2]
        logs.append(copies[0])
    return sorted(replies, key=lambda r: r[1]), logs


def test_a_mixed_buffer_gets_the_same_replies_and_log_however_it_is_read(trio):
    _etcd, nodes = trio
    with client(nodes[0]) as c:
        sids = [c.create_stream(replica_nums=3)["stream_id"] for _ in range(6)]
    prim = {sid: roles(nodes, sid)[0] for sid in sids}
    # a node that is primary of one stream and not of another
    primary = next(p for p in prim.values() if any(q is not p for q in prim.values()))
    foreign = next(sid for sid in sids if prim[sid] is not primary)
    fetched = next(sid for sid in sids if prim[sid] is primary)
    with client(primary) as c:
        for i in range(3):
            c.append(fetched, batch(2, b"r%d-" % i))
    wait_for(lambda: fetch_all(primary, fetched, 6)[0] == 6, what="the fetched stream is confirmed")

    base_replies, base_log = trial(nodes, primary, foreign, fetched, one_byte=False)
    by_rid = {r[1]: r for r in base_replies}
    assert sorted(by_rid) == list(range(1, 17))
    where = prim[foreign].endpoint("sbp")
    assert by_rid[1][3] == [("S", 0, codec.OK, "")]
    assert by_rid[2][3] == [("S", 2, codec.OK, "")]
    assert by_rid[3][3] == [("F", 0, codec.PD_NOT_LEADER, where)]
    assert by_rid[4][3] == [("S", 5, codec.OK, "")]
    assert by_rid[5][0] == "error" and by_rid[5][3] == codec.INVALID_REQUEST
    assert by_rid[6][3] == [("S", 0, codec.CORRUPT_BATCH, by_rid[6][3][0][3])]
    assert by_rid[7][3] == [("S", 6, codec.OK, "")]
    assert by_rid[8][0] == "fetch" and by_rid[8][3] == [("R", codec.OK)]
    assert [bytes(b) for b in record_batch.split(by_rid[8][4])] == fetch_all(primary, fetched, 6)[1]
    assert by_rid[9][3] == [("S", 10, codec.OK, "")]
    assert by_rid[10] == ("ping", 10, codec.RESPONSE_LAST, b"ping")
    assert by_rid[11][3] == [("S", 11, codec.OK, "")]
    assert by_rid[12][3] == [("F", 0, codec.PD_NOT_LEADER, where)]
    assert by_rid[13][3] == [("S", 13, codec.OK, "")]
    assert by_rid[14][3] == [("T", 0, codec.OK, "")]
    assert by_rid[15][3] == [("S", 14, codec.OK, "")]
    assert by_rid[16][3] == [("T", 2, codec.OK, "")]
    bodies = [r.body for b in base_log[0] for r in record_batch.decode(b)[1]]
    assert bodies == [b"a0", b"a1", b"b0", b"b1", b"b2", b"c0", b"d0", b"d1", b"d2", b"d3", b"e0", b"g0", b"g1", b"i0", b"j0"]
    assert [r.body for b in base_log[1] for r in record_batch.decode(b)[1]] == [b"t0", b"t1", b"u0"]

    assert trial(nodes, primary, foreign, fetched, one_byte=True) == (base_replies, base_log)
    assert trial(nodes, primary, foreign, fetched, one_byte=False) == (base_replies, base_log)
