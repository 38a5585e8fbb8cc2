"""Mutual TLS between cluster nodes and to etcd (CONTRACT §9 ``--cluster-tls-cert/-key/-ca``).

The cluster CA is the only trust root: a node presents its certificate (signed by the CA) and
accepts peers only with one. ``check_node_certificate`` runs at option parsing, so a node whose
certificate the CA did not sign refuses to start (one line, non-zero exit) rather than join and
be refused by every peer. ``server_options`` / ``client_options`` are the Twisted TLS options for
node-to-node listeners and connections; ``listen`` opens a node-to-node listener with them (the
replica channel, the kv peer port and the S2 forwarding port all do), and ``client_options_for``
hands out one client's options per host (the S2 forwarder's HTTPS client). The etcd client builds
its own from the same files (node/cluster/etcd.py).
"""

from cryptography import x509
from cryptography.hazmat.primitives import serialization


class CertificateRefused(Exception):
    pass


def _load_cert(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise CertificateRefused("%s is not a PEM certificate (%s)" % (path, e))


def check_node_certificate(cert_path, key_path, ca_path) -> None:
    """CertificateRefused unless ``cert_path`` is signed by ``ca_path`` and matches ``key_path``."""
    cert = _load_cert(cert_path)
    ca = _load_cert(ca_path)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as e:
        raise CertificateRefused("%s is not signed by the cluster CA %s (%s)" % (cert_path, ca_path, type(e).__name__))
    with open(key_path, "rb") as f:
        try:
            key = serialization.load_pem_private_key(f.read(), password=None)
        except (ValueError, TypeError) as e:
            raise CertificateRefused("%s is not an unencrypted PEM private key (%s)" % (key_path, e))
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, pub) != cert.public_key().public_bytes(serialization.Encoding.DER, pub):
        raise CertificateRefused("%s does not belong to %s" % (key_path, cert_path))


def _twisted_pems(cert_path, key_path, ca_path):
    from twisted.internet import ssl

    with open(ca_path, "rb") as f:
        ca = ssl.Certificate.loadPEM(f.read())
    with open(cert_path, "rb") as f:
        cert = f.read()
    with open(key_path, "rb") as f:
        key = f.read()
    return ssl.PrivateCertificate.loadPEM(cert + b"\n" + key), ca


def server_options(cert_path, key_path, ca_path):
    """A listener that accepts only peers presenting a certificate the cluster CA signed."""
    mine, ca = _twisted_pems(cert_path, key_path, ca_path)
    return mine.options(ca)  # trust root = the CA, and a client certificate is required


def client_options(hostname, cert_path, key_path, ca_path):
    """A connection that presents this node's certificate and trusts only the cluster CA."""
    from twisted.internet import ssl

    mine, ca = _twisted_pems(cert_path, key_path, ca_path)
    return ssl.optionsForClientTLS(hostname, trustRoot=ca, clientCertificate=mine)


def client_options_for(cert_path, key_path, ca_path):
    """``host -> client_options(host, ...)``, made once per host (the files are read once, not
    on the reactor at every connection)."""
    made = {}

    def options(host):
        if host not in made:
            made[host] = client_options(host, cert_path, key_path, ca_path)
        return made[host]

    return options


def listen(reactor, factory, interface, tls):
    """A node-to-node listener on a free port of ``interface``: mutual TLS with the cluster's
    options when ``tls`` is (cert, key, ca), plain TCP when it is None (loopback tests)."""
    if tls:
        return reactor.listenSSL(0, factory, server_options(*tls), interface=interface)
    return reactor.listenTCP(0, factory, interface=interface)
