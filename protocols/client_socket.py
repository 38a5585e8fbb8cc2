"""The socket a blocking client (sbpctl, scripts, benchmarks) talks through: plain TCP, or TLS
verified against a CA file (``tls_ca``) when the node's listener is a Twisted ``ssl:`` endpoint.

An ``ssl.SSLSocket`` takes ``send``/``recv`` without flags only (no ``sendmsg``, ``MSG_WAITALL``
or ``MSG_DONTWAIT``): clients that use them check :func:`is_tls` first.
"""

import socket
import ssl


def connect(host, port, timeout=None, tls_ca=None):
    """A connected TCP socket with TCP_NODELAY; with ``tls_ca`` (a PEM file of trusted CAs) wrapped
    in TLS, the handshake done and the server's certificate checked against ``host``."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls_ca is None:
        return sock
    context = ssl.create_default_context(cafile=tls_ca)
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def is_tls(sock) -> bool:
    return isinstance(sock, ssl.SSLSocket)
