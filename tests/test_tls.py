"""Every listener on a Twisted ``ssl:`` endpoint (issue 21): SBP, kv, Toasty, swarm and HTTP over
TLS with the project's own clients (``sbpctl --tls-ca``), a peer syncing over TLS, and a plain
client refused by a TLS listener."""

import datetime
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.nodeproc import REPO

LISTENERS = ("sbp", "kv", "meta", "chunks", "swarm", "http")


def _write_certs(d):
    """A CA and a server certificate it signed for 127.0.0.1 and localhost (PEM files in ``d``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject, issuer, public_key, signer, ca, san=None):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), False)
        if ca:
            b = b.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), True)
        return b.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sbpnode test CA")])
    ca = build(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = build(name, ca_name, key.public_key(), ca_key, False, san)
    pem = serialization.Encoding.PEM
    os.makedirs(os.path.join(d, "ca"), exist_ok=True)
    paths = {"ca": os.path.join(d, "ca", "ca.pem"), "cert": os.path.join(d, "cert.pem"), "key": os.path.join(d, "key.pem")}
    with open(paths["ca"], "wb") as f:
        f.write(ca.public_bytes(pem))
    with open(paths["cert"], "wb") as f:
        f.write(cert.public_bytes(pem))
    with open(paths["key"], "wb") as f:
        f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


@pytest.fixture
def certs(tmp_path):
    return _write_certs(str(tmp_path / "tls"))


def tls_endpoint(certs):
    return "ssl:0:interface=127.0.0.1:privateKey=%s:certKey=%s" % (certs["key"], certs["cert"])


def sbpctl(certs, *args, stdin=None):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "node.cli", "--tls-ca", certs["ca"]] + list(args),
                         input=stdin, capture_output=True, env=env, timeout=120)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout.decode()


@pytest.mark.slow
def test_every_listener_over_tls_with_sbpctl(node_factory, certs, tmp_path):
    ep = tls_endpoint(certs)
    node = node_factory(fsync="never", **{name: ep for name in LISTENERS})
    # SBP
    status = json.loads(sbpctl(certs, "status", "--endpoint", node.endpoint("sbp"), "--json"))
    assert status["node_id"] == node.node_id
    from protocols.sbp.client import BlockingSbpClient
    from storage import record_batch

    with BlockingSbpClient(*node.address("sbp"), tls_ca=certs["ca"]) as c:  # big batches: no sendfile under TLS
        sid = c.create_stream()["stream_id"]
        batches = [record_batch.encode([(i, [], os.urandom(1024)) for i in range(256)]) for _ in range(8)]
        for b in batches:
            c.append(sid, b)
        got = list(record_batch.split(c.fetch(sid, 0, 16 << 20)))
        assert got == [record_batch.with_base_offset(b, 256 * k) for k, b in enumerate(batches)]
    # kv
    sbpctl(certs, "kv", "set", "--endpoint", node.endpoint("kv"), "greeting", "hello")
    assert "hello" in sbpctl(certs, "kv", "get", "--endpoint", node.endpoint("kv"), "greeting")
    # Toasty: metadata and chunk listeners both over TLS
    local = tmp_path / "file.bin"
    local.write_bytes(os.urandom(200_000))
    sbpctl(certs, "fs", "--endpoint", node.endpoint("meta"), "put", "--no-progress", str(local), "/f.bin")
    got = tmp_path / "back.bin"
    sbpctl(certs, "fs", "--endpoint", node.endpoint("meta"), "get", "--no-progress", "/f.bin", str(got))
    assert got.read_bytes() == local.read_bytes()
    # HTTP (S2 API)
    sbpctl(certs, "s2", "--endpoint", node.endpoint("http"), "create-stream", "tls")
    sbpctl(certs, "s2", "--endpoint", node.endpoint("http"), "append", "tls", "one", "two")
    lines = sbpctl(certs, "s2", "--endpoint", node.endpoint("http"), "read", "tls", "--count", "2").splitlines()
    assert [json.loads(x)["body"] for x in lines] == ["one", "two"]
    # swarm, with the swarm client and a peer syncing from it over TLS
    from protocols.swarm.client import BlockingSwarmClient

    with BlockingSwarmClient(*node.address("swarm"), tls_ca=certs["ca"]) as c:
        want = c.stream_info()
    assert want
    peer = "ssl:host=127.0.0.1:port=%d:caCertsDir=%s:hostname=127.0.0.1" % (node.ports["swarm"], os.path.dirname(certs["ca"]))
    b = node_factory(name="b", fsync="never", peer=peer, sbp="none", kv="none", meta="none", chunks="none", http="none")
    deadline = time.monotonic() + 60
    while True:
        with BlockingSwarmClient(*b.address("swarm")) as c:
            if c.stream_info() == want:
                break
        assert time.monotonic() < deadline, "the peer did not sync over TLS:\n" + b.log_text()[-3000:]
        time.sleep(0.1)


def test_a_plain_client_cannot_talk_to_a_tls_listener(node_factory, certs):
    from protocols.partition.client import BlockingKvClient
    from protocols.sbp.client import BlockingSbpClient, SbpConnectionError

    ep = tls_endpoint(certs)
    node = node_factory(fsync="never", sbp=ep, kv=ep)
    with pytest.raises(SbpConnectionError):
        BlockingSbpClient(*node.address("sbp"), timeout=5).status()
    with pytest.raises((OSError, Exception)) as e:
        c = BlockingKvClient(*node.address("kv"), timeout=5)
        c.get(b"k")
    assert not isinstance(e.value, AssertionError)
    # and a TLS client that does not trust the node's CA is refused by its own check
    import ssl

    with pytest.raises(ssl.SSLError):
        BlockingKvClient(*node.address("kv"), timeout=5, tls_ca=certs["cert"])  # not the CA
    # the node is unharmed and serves a TLS client
    with BlockingKvClient(*node.address("kv"), timeout=5, tls_ca=certs["ca"]) as c:
        c.set(b"k", b"v")
        assert c.get(b"k") == b"v"
    raw = socket.create_connection(node.address("kv"), timeout=5)
    raw.close()
