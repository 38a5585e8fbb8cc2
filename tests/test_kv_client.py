"""The Twisted kv client against the server protocol over real loopback sockets (in-process), on
the real store in tmp_path."""

import pytest
import pytest_twisted
from twisted.internet import defer, endpoints, reactor

from protocols.partition import codec as c
from protocols.partition.client import KvError, connect
from protocols.partition.server import KvServerFactory
from storage import Store


@pytest.fixture
def store(tmp_path):
    s = Store.open(str(tmp_path / "store"), fsync="never", reactor=reactor)
    yield s
    pytest_twisted.blockon(s.close())


@pytest_twisted.ensureDeferred
async def test_twisted_client_round_trip(store):
    factory = KvServerFactory(store.kv, store=store)
    port = await endpoints.TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
    client = None
    try:
        client = await connect(reactor, "127.0.0.1", port.getHost().port)
        # pipelined without waiting: answered in order
        ds = [client.set(b"k%03d" % i, b"v%d" % i) for i in range(200)]
        ds.append(client.get(b"k007"))
        ds.append(client.get(b"missing"))
        ds.append(client.remove(b"k001"))
        ds.append(client.remove(b"k001"))
        results = await defer.gatherResults(ds)
        assert results[200:] == [b"v7", None, True, False]
        await client.create_cursor(b"c")
        seen = []
        while True:
            page = await client.get_ff(b"c", 64)
            if not page.items:
                break
            seen += page.keys
        assert seen == sorted(b"k%03d" % i for i in range(200) if i != 1)
        page = await client.get_keys_prefix(b"c", 5, b"k19", next_key=b"")
        assert page.keys == []  # the cursor is at END
        await client.create_cursor(b"c")
        page = await client.get_keys_prefix(b"c", 5, b"k19")
        assert page.keys == [b"k19%d" % i for i in range(5)]
        with pytest.raises(KvError) as ei:
            await client.get_ff(b"nope", 1)
        assert ei.value.code == c.E_CURSOR_NOT_FOUND
        with pytest.raises(KvError) as ei:
            await client.set(b"", b"x")
        assert ei.value.code == c.E_UNKNOWN
        # the connection is still usable after errors
        assert await client.get(b"k002") == b"v2"
    finally:
        if client is not None:
            client.transport.loseConnection()
        await port.stopListening()
