"""The Twisted etcd v3 gateway client (node/cluster/etcd.py) against a real etcd."""

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, task

from node.cluster import etcd as e
from tests.etcdproc import free_port


def test_prefix_end():
    assert e.prefix_end(b"/a/") == b"/a0"
    assert e.prefix_end(b"a\xff") == b"b"
    assert e.prefix_end(b"\xff") == b"\0"


async def _until(cond, timeout=10.0, step=0.02):
    deadline = reactor.seconds() + timeout
    while not cond():
        assert reactor.seconds() < deadline, "condition not met in %ss" % timeout
        await task.deferLater(reactor, step, lambda: None)


@pytest_twisted.ensureDeferred
async def test_kv_txn_lease_watch(etcd):
    c = e.EtcdClient(etcd.client_urls)
    try:
        assert await c.get("/t/missing") is None
        await c.put("/t/a", b"1")
        kv = await c.get("/t/a")
        assert kv.value == b"1" and kv.version == 1
        # compare-and-swap: create only if absent
        r = await c.txn([e.compare_version("/t/a", 0)], [e.op_put("/t/a", b"2")], [e.op_get("/t/a")])
        assert not r.succeeded and r.kvs(0)[0].value == b"1"
        r = await c.txn([e.compare_mod_revision("/t/a", kv.mod_revision)], [e.op_put("/t/a", b"2")])
        assert r.succeeded
        kvs, rev = await c.get_prefix("/t/")
        assert [k.value for k in kvs] == [b"2"] and rev >= kv.mod_revision + 1

        seen = []
        w = c.watch_prefix("/t/", rev + 1, seen.extend)
        await _until(lambda: w.connected or seen, 5)
        lease = await c.lease_grant(2)
        assert await c.lease_keepalive(lease) == 2
        await c.put("/t/leased", b"x", lease=lease)
        await c.delete("/t/a")
        await _until(lambda: len(seen) >= 2)
        assert [(k, kv.key) for k, kv in seen[:2]] == [("PUT", b"/t/leased"), ("DELETE", b"/t/a")]
        await c.lease_revoke(lease)
        await _until(lambda: len(seen) >= 3)
        assert seen[2][0] == "DELETE" and seen[2][1].key == b"/t/leased"
        assert await c.lease_keepalive(lease) == 0  # gone
        await c.lease_revoke(lease)  # revoking a gone lease is not an error
        w.stop()
    finally:
        await c.close()


@pytest_twisted.ensureDeferred
async def test_election(etcd):
    c = e.EtcdClient(etcd.client_urls)
    try:
        l1, l2 = await c.lease_grant(5), await c.lease_grant(5)
        k1 = await c.campaign("/t/el", l1, b"one")
        second = c.campaign("/t/el", l2, b"two")
        won = []
        second.addCallback(lambda k: won.append(k) or k)
        await task.deferLater(reactor, 0.3, lambda: None)
        assert not won  # waits behind the leader
        await c.lease_revoke(l1)
        k2 = await second
        assert k1 != k2 and k2.startswith(b"/t/el/")
        await c.lease_revoke(l2)
    finally:
        await c.close()


@pytest_twisted.ensureDeferred
async def test_unreachable_url_fails_within_deadline():
    c = e.EtcdClient("http://127.0.0.1:%d" % free_port(), deadline=0.5)
    start = reactor.seconds()
    with pytest.raises(e.EtcdUnavailable) as info:
        await c.get("/x")
    assert reactor.seconds() - start < 3
    assert "etcd unreachable" in str(info.value)
    assert not c.available
    await c.close()


@pytest_twisted.ensureDeferred
async def test_fails_over_to_a_live_url(etcd):
    # the first URL is dead: the client moves on to the next
    c = e.EtcdClient("http://127.0.0.1:%d,%s" % (free_port(), etcd.client_urls), deadline=5)
    try:
        await c.put("/f/x", b"1")
        assert (await c.get("/f/x")).value == b"1"
    finally:
        await c.close()
