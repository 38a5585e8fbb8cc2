"""SBP routing in cluster mode (protocols/sbp/cluster.py ClusterRouter) over a StringTransport and
a real store (the inline writer, on a task.Clock, as in test_sbp_server.py); the cluster's placement answers are given by a stand-in (which node serves which
stream), since placement itself is tested against etcd in test_cluster.py."""

import pytest
import pytest_twisted
from twisted.internet import defer

from protocols.sbp import codec
from protocols.sbp.codec import T
from tests.test_sbp_server import Conn, Node, batch, clock, store  # noqa: F401 (fixtures)


class Placement:
    """Where each stream is served: None here, an address elsewhere, or a Deferred (a lookup)."""

    def __init__(self):
        self.where = {}

    def route(self, sid, read=False, offset=None, wait=False):
        return self.where.get(sid)


class Cluster:
    def __init__(self):
        self.pd = Placement()

    @staticmethod
    def classify(e):
        return None


@pytest.fixture
def cnode(store):  # noqa: F811
    n = Node(store)
    n.cluster = Cluster()
    return n


async def append(conn, entries):
    infos = [T.AppendInfo(sid, i, len(b)) for i, (sid, b) in enumerate(entries)]
    sid, _ = conn.request(codec.APPEND, "AppendRequest", T.AppendRequest(0, infos), b"".join(b for _, b in entries))
    return sid


async def results(conn, sid):
    (f,) = await conn.reply(sid)
    return sorted(codec.decode_header(f).append_responses, key=lambda r: r.request_index)


@pytest_twisted.ensureDeferred
async def test_served_here_redirected_and_mixed(cnode):
    log = cnode.store.log
    here = (await log.create_stream()).stream_id
    there = (await log.create_stream()).stream_id
    cnode.cluster.pd.where[there] = "10.0.0.2:7700"
    c = Conn(cnode)
    (r,) = await results(c, await append(c, [(here, batch(2))]))
    assert r.status.code == 0 and r.base_offset == 0
    (r,) = await results(c, await append(c, [(there, batch(1))]))
    assert (r.status.code, r.status.message) == (codec.PD_NOT_LEADER, "10.0.0.2:7700")
    # a frame for streams on two nodes: every entry names the node for its stream
    rs = await results(c, await append(c, [(here, batch(1)), (there, batch(1))]))
    assert [(x.status.code, x.status.message) for x in rs] == [(codec.PD_NOT_LEADER, "127.0.0.1:7700"),
                                                              (codec.PD_NOT_LEADER, "10.0.0.2:7700")]
    assert log.stream(here).next_offset == 2 and log.stream(there).next_offset == 0
    # FETCH is routed the same way
    sid, _ = c.request(codec.FETCH, "FetchRequest", T.FetchRequest(0, 0, [T.FetchInfo(there, 0, 0, 1 << 20)]))
    (f,) = await c.reply(sid)
    (fr,) = codec.decode_header(f).fetch_responses
    assert (fr.status.code, fr.status.message) == (codec.PD_NOT_LEADER, "10.0.0.2:7700")


@pytest_twisted.ensureDeferred
async def test_a_lookup_keeps_the_connection_order(cnode):
    log = cnode.store.log
    slow = (await log.create_stream()).stream_id
    fast = (await log.create_stream()).stream_id
    lookup = defer.Deferred()
    cnode.cluster.pd.where[slow] = lookup  # this node must ask etcd about it first
    c = Conn(cnode)
    first = await append(c, [(slow, batch(1))])
    second = await append(c, [(fast, batch(1))])
    third = await append(c, [(slow, batch(1))])
    c.poll()
    assert c.got == []  # everything behind the lookup waits
    cnode.cluster.pd.where[slow] = None
    lookup.callback(None)  # served here after all
    assert [r.base_offset for r in await results(c, first)] == [0]
    assert [r.base_offset for r in await results(c, second)] == [0]
    assert [r.base_offset for r in await results(c, third)] == [1]
    assert log.stream(slow).next_offset == 2


@pytest_twisted.ensureDeferred
async def test_a_failed_lookup_answers_every_entry(cnode):
    log = cnode.store.log
    sid = (await log.create_stream()).stream_id
    cnode.cluster.pd.where[sid] = defer.fail(RuntimeError("etcd went away"))
    c = Conn(cnode)
    (r,) = await results(c, await append(c, [(sid, batch(1))]))
    assert r.status.code == codec.UNKNOWN and "etcd went away" in r.status.message
    assert log.stream(sid).next_offset == 0
