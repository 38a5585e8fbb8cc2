"""Mutual TLS in cluster mode (CONTRACT §9): etcd requiring client certificates of the cluster CA,
nodes with CA-signed certificates, and a node with a foreign certificate refused; S2 requests
forwarded between nodes over the S2 forwarding port's mutual TLS, which a client without a
CA-signed certificate cannot use."""

import asyncio
import base64
import http.client
import json
import os
import ssl as stdlib_ssl
import subprocess

import pytest
import pytest_twisted
from twisted.internet import defer, reactor, ssl
from twisted.internet.endpoints import SSL4ClientEndpoint, SSL4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol

from node.cluster import tls
from protocols.sbp.client import BlockingSbpClient, call_describe_cluster
from s2_sdk import AppendInput, ReadLimit, Record, SeqNum
from tests.etcdproc import EtcdCluster, etcd_available
from storage import record_batch
from tests.nodeproc import NodeProcess
from tests.test_cluster import start_nodes, wait_for
from tests.test_s2_cluster import ROOT, new_basin_with_stream, roles, s2, stream_id
from tests.tlscerts import CA

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def pki(tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    ca = CA(d)
    other = CA(d, name="stranger-ca")
    return ca, other


def test_check_node_certificate(pki):
    ca, other = pki
    cert, key = ca.issue("n1")
    tls.check_node_certificate(cert, key, ca.path)
    bad_cert, bad_key = other.issue("intruder")
    with pytest.raises(tls.CertificateRefused, match="not signed by the cluster CA"):
        tls.check_node_certificate(bad_cert, bad_key, ca.path)
    with pytest.raises(tls.CertificateRefused, match="does not belong"):
        tls.check_node_certificate(cert, bad_key, ca.path)


def test_nodes_join_a_tls_etcd_and_a_foreign_certificate_is_refused(pki, tmp_path):
    ca, other = pki
    etcd_cert, etcd_key = ca.issue("etcd")
    etcd = EtcdCluster(tmp_path, members=1, tls=(etcd_cert, etcd_key, ca.path)).start()
    try:
        nodes = []
        for i in (1, 2):
            cert, key = ca.issue("n%d" % i)
            nodes.append(NodeProcess(tmp_path, name="n%d" % i, cluster=etcd.client_urls, node_id=i, fsync="never",
                                     cluster_tls_cert=cert, cluster_tls_key=key, cluster_tls_ca=ca.path).start(timeout=60))
        with BlockingSbpClient("127.0.0.1", nodes[0].ports["sbp"], timeout=10) as c:
            assert sorted(int(m["name"]) for m in c.call(call_describe_cluster())) == [1, 2]
            sid = c.create_stream(replica_nums=2)["stream_id"]
            servers = c.list_ranges(sid)[0]["servers"]
            assert len(servers) == 2
        # replication runs over the mutual-TLS replica channel: R=2 (ack 2) acknowledges only
        # once the other node holds the batch, and both serve it
        by_id = {n.node_id: n for n in nodes}
        primary = by_id[next(s["server_id"] for s in servers if s["is_primary"])]
        with BlockingSbpClient("127.0.0.1", primary.ports["sbp"], timeout=20) as c:
            assert c.append(sid, record_batch.encode([(1, [], b"over tls")])) == 0
        for n in nodes:
            with BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=10) as c:
                wait_for(lambda: c.fetch(sid, 0), what="node %d serves the batch" % n.node_id)
        env = dict(os.environ, PYTHONPATH=REPO)
        # a certificate the cluster CA did not sign: the node does not start
        cert, key = other.issue("intruder")
        n = NodeProcess(tmp_path, name="intruder", cluster=etcd.client_urls, fsync="never",
                        cluster_tls_cert=cert, cluster_tls_key=key, cluster_tls_ca=ca.path)
        r = subprocess.run(n.argv(), capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode != 0 and "not signed by the cluster CA" in r.stdout + r.stderr
        # no certificate at all against an etcd that requires one: refused, one line, non-zero
        n = NodeProcess(tmp_path, name="plain", cluster=etcd.client_urls, fsync="never")
        r = subprocess.run(n.argv(), capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode != 0 and "cannot join the cluster" in r.stderr, r.stderr
        for node in nodes:
            assert node.terminate() == 0
    finally:
        etcd.stop()


@pytest_twisted.ensureDeferred
async def test_node_to_node_options_require_a_ca_signed_client(pki):
    """server_options / client_options (the replication channel's): a peer with a CA-signed
    certificate gets through, one with a foreign certificate is refused in the handshake."""
    ca, other = pki
    s_cert, s_key = ca.issue("server")
    got = []

    class Echo(Protocol):
        def dataReceived(self, data):
            got.append(data)
            self.transport.write(data)

    port = await SSL4ServerEndpoint(reactor, 0, tls.server_options(s_cert, s_key, ca.path), interface="127.0.0.1").listen(
        Factory.forProtocol(Echo))
    try:
        async def talk(cert, key):
            done = defer.Deferred()

            class Client(Protocol):
                def connectionMade(self):
                    self.transport.write(b"hi")

                def dataReceived(self, data):
                    if not done.called:
                        done.callback(data)
                    self.transport.loseConnection()

                def connectionLost(self, reason):
                    if not done.called:
                        done.errback(reason)

            options = tls.client_options("127.0.0.1", cert, key, ca.path)
            await SSL4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port, options).connect(Factory.forProtocol(Client))
            return await done

        good_cert, good_key = ca.issue("peer")
        assert await talk(good_cert, good_key) == b"hi"
        bad_cert, bad_key = other.issue("intruder")
        with pytest.raises(Exception):
            await talk(bad_cert, bad_key)
        assert got == [b"hi"]
    finally:
        await port.stopListening()


def member_records(etcd):
    """node_id -> member record, read from etcd (``/sbpnode/members/``)."""
    key = base64.b64encode(b"/sbpnode/members/").decode()
    end = base64.b64encode(b"/sbpnode/members0").decode()
    kvs = etcd.request(0, "/v3/kv/range", {"key": key, "range_end": end}).get("kvs", [])
    recs = [json.loads(base64.b64decode(kv["value"])) for kv in kvs]
    return {int(r["node_id"]): r for r in recs}


def peer_request(address, ca, cert=None, key=None, tls=True):
    """GET /health on a node's S2 forwarding port: (status, body), or the exception it raised."""
    host, port = address.rsplit(":", 1)
    try:
        if tls:
            ctx = stdlib_ssl.create_default_context(cafile=ca)
            if cert:
                ctx.load_cert_chain(cert, key)
            conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=10)
        else:
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as e:  # stdlib_ssl.SSLError is an OSError
        return e


def test_s2_forwarding_over_mutual_tls(pki, tmp_path):
    """Three nodes with the cluster TLS options: s2-sdk appends (unary and a session) through a
    node that is not the stream's primary reach it over the S2 forwarding port's mutual TLS, and
    reads and the tail through the third node see them; that port serves only a client presenting
    a certificate the cluster CA signed (plain HTTP, no certificate and a foreign CA's: refused)."""
    ca, other = pki
    etcd_cert, etcd_key = ca.issue("etcd")
    etcd = EtcdCluster(tmp_path, members=1, tls=(etcd_cert, etcd_key, ca.path)).start()
    cert, key = ca.issue("node")
    nodes = []
    try:
        nodes = start_nodes(tmp_path, etcd.client_urls, [1, 2, 3], cluster_tls_cert=cert, cluster_tls_key=key,
                            cluster_tls_ca=ca.path, http_token=ROOT)

        basin = new_basin_with_stream(nodes[0], "tls-basin", "log")
        sid = stream_id(nodes[0], basin, "log")
        primary, (via, reader) = roles(nodes, sid)

        async def write_and_read():
            async with s2(via) as on_b, s2(reader) as on_c:
                st_b = on_b.basin(basin).stream("log")
                ack = await st_b.append(AppendInput(records=[Record(body=b"u%d" % i) for i in range(5)]))
                assert (ack.start.seq_num, ack.end.seq_num) == (0, 5)
                async with st_b.append_session() as session:
                    tickets = [await session.submit(AppendInput(records=[Record(body=b"s%d" % i)])) for i in range(20)]
                    acks = [await t for t in tickets]
                assert [a.start.seq_num for a in acks] == list(range(5, 25))
                st_c = on_c.basin(basin).stream("log")
                assert (await st_c.check_tail()).seq_num == 25  # forwarded to the primary too
                batch = await st_c.read(start=SeqNum(0), limit=ReadLimit(count=100))
                return [r.body for r in batch.records]

        bodies = asyncio.run(asyncio.wait_for(write_and_read(), 90))
        assert bodies == [b"u%d" % i for i in range(5)] + [b"s%d" % i for i in range(20)]

        members = member_records(etcd)
        port = members[primary.node_id]["s2_peer"]
        assert port != members[primary.node_id]["http"]
        # a member's certificate gets through; anything else is refused in the handshake
        assert peer_request(port, ca.path, cert, key) == (200, b'{"status":"ok"}')
        stranger_cert, stranger_key = other.issue("intruder")
        # the server's alerts: unknown ca, certificate required
        for refused in (peer_request(port, ca.path, stranger_cert, stranger_key), peer_request(port, ca.path)):
            assert isinstance(refused, stdlib_ssl.SSLError) and "ALERT" in str(refused), refused
        refused = peer_request(port, ca.path, tls=False)
        assert isinstance(refused, (OSError, http.client.HTTPException)), refused
        for n in nodes:
            assert n.terminate() == 0
        nodes = []
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()
