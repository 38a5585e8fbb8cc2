"""The one door to Twisted's TCP transport internals (protocols/tcp_internals.py): on a Twisted
upgrade that renames what it relies on, this fails loudly (the node itself falls back to plain
``transport.write``)."""

import socket

from twisted.internet import tcp
from twisted.internet.testing import StringTransport

from protocols import tcp_internals


def test_every_attribute_the_door_relies_on_exists_in_this_twisted():
    assert tcp_internals.MISSING == [], "Twisted changed its TCP transport: %s" % tcp_internals.MISSING
    assert tcp_internals.AVAILABLE


def test_the_door_reads_a_real_connection():
    a, b = socket.socketpair()
    try:
        conn = tcp.Connection(a, None, reactor=object())
        conn.connected = 1
        assert tcp_internals.is_plain_tcp(conn)
        assert not tcp_internals.has_unsent(conn)
        assert tcp_internals.idle_socket(conn) is a
        conn.dataBuffer = b"queued"
        assert tcp_internals.has_unsent(conn) and tcp_internals.idle_socket(conn) is None
        calls = []
        original = tcp_internals.take_over_writes(conn, lambda: calls.append(1))
        conn.doWrite()
        assert calls == [1] and original.__name__ == "doWrite"
        tcp_internals.set_read_size(conn, 1 << 20)
        tcp_internals.set_send_limit(conn, 4 << 20)
        assert conn.bufferSize == 1 << 20 and conn.SEND_LIMIT == 4 << 20
    finally:
        a.close()
        b.close()


def test_other_transports_stay_outside():
    tr = StringTransport()
    assert not tcp_internals.is_plain_tcp(tr) and tcp_internals.idle_socket(tr) is None
    tcp_internals.set_read_size(tr, 1 << 20)  # no such knob: nothing happens
    tcp_internals.set_send_limit(tr, 1 << 20)


def test_nothing_else_reads_twisted_private_transport_attributes():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    private = re.compile(r"transport\.(_[a-zA-Z]\w*|dataBuffer|offset|doWrite|SEND_LIMIT|bufferSize)\b")
    offenders = []
    for path in list(root.glob("protocols/**/*.py")) + list(root.glob("node/**/*.py")):
        if path.name == "tcp_internals.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if private.search(line):
                offenders.append("%s:%d: %s" % (path.relative_to(root), n, line.strip()))
    assert offenders == []
