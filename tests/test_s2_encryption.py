"""S2 stream encryption through the official s2-sdk against a real node: a basin's stream_cipher
(aegis-256, aes-256-gcm) taken by its new streams, records encrypted at rest with the key from the
s2-encryption-key header, round trips (unary and sessions), missing and wrong keys (issue 23)."""

import asyncio
import datetime
import os
import uuid

import pytest
from s2_sdk import (
    S2,
    AppendInput,
    BasinConfig,
    CommandRecord,
    Encryption,
    Endpoints,
    ReadLimit,
    Record,
    Retry,
    S2ServerError,
    SeqNum,
    Timeout,
)

from protocols.s2 import crypto
from tests.nodeproc import NodeProcess

pytestmark = pytest.mark.timeout(180)
KEY = bytes(range(1, 33))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = NodeProcess(tmp_path_factory.mktemp("s2crypt"), fsync="never")
    n.start()
    try:
        yield n
    finally:
        n.terminate()


def client(node):
    ep = "http://127.0.0.1:%d" % node.ports["http"]
    return S2("t", endpoints=Endpoints(account=ep, basin=ep), retry=Retry(max_attempts=1),
              timeout=Timeout(request=datetime.timedelta(seconds=10)))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def failing(awaitable, code):
    with pytest.raises(S2ServerError) as e:
        await awaitable
    assert (e.value.status_code, e.value.code) == (400, code), e.value


@pytest.mark.parametrize("cipher", [Encryption.AEGIS_256, Encryption.AES_256_GCM])
def test_round_trip_wrong_and_missing_key(node, cipher):
    marker = b"plaintext-marker-" + uuid.uuid4().hex.encode()

    async def main():
        async with client(node) as s2:
            basin = "enc-%s" % uuid.uuid4().hex[:10]
            await s2.create_basin(basin, config=BasinConfig(stream_cipher=cipher))
            assert (await s2.get_basin_config(basin)).stream_cipher == cipher
            b = s2.basin(basin)
            info = await b.create_stream("s")
            assert info.cipher == cipher
            st = b.stream("s", encryption_key=KEY)
            await st.append(AppendInput(records=[Record(body=marker, headers=[(b"h", b"secret-header")])]))
            await st.append(AppendInput(records=[CommandRecord.fence("tok")], fencing_token=""))
            async with st.append_session() as session:
                acks = [await (await session.submit(AppendInput(records=[Record(body=b"s%d" % i)], fencing_token="tok")))
                        for i in range(5)]
            assert acks[-1].end.seq_num == 7
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=100))
            assert batch.records[0].body == marker and batch.records[0].headers == [(b"h", b"secret-header")]
            assert batch.records[1].headers == [(b"", b"fence")]  # command records stay plaintext
            got = []
            async for rb in st.read_session(start=SeqNum(0), limit=ReadLimit(count=7)):
                got.extend(r.body for r in rb.records)
            assert got[0] == marker and got[2:] == [b"s%d" % i for i in range(5)]
            # Check tail needs no key; reads and appends do; a wrong key does not decrypt.
            assert (await b.stream("s").check_tail()).seq_num == 7
            await failing(b.stream("s").read(start=SeqNum(0)), "bad_header")
            await failing(b.stream("s").append(AppendInput(records=[Record(body=b"x")])), "bad_header")
            await failing(b.stream("s", encryption_key=bytes(32)).read(start=SeqNum(0)), "decryption_failed")
            with pytest.raises(S2ServerError) as e:
                async for _ in b.stream("s", encryption_key=bytes(32)).read_session(start=SeqNum(0)):
                    pass
            assert e.value.code == "decryption_failed"
            # A stream created before the basin had a cipher stays plaintext.
            plain_basin = "plain-%s" % uuid.uuid4().hex[:10]
            await s2.create_basin(plain_basin)
            await s2.basin(plain_basin).create_stream("old")
            await s2.reconfigure_basin(plain_basin, config=BasinConfig(stream_cipher=cipher))
            assert (await s2.basin(plain_basin).create_stream("new")).cipher == cipher
            old = s2.basin(plain_basin).stream("old")
            await old.append(AppendInput(records=[Record(body=b"clear")]))
            assert [r.body for r in (await old.read(start=SeqNum(0))).records] == [b"clear"]

    run(main())
    # At rest the body and header are ciphertext.
    for root_dir, _, files in os.walk(node.data_dir):
        for f in files:
            with open(os.path.join(root_dir, f), "rb") as fh:
                data = fh.read()
            assert marker not in data and b"secret-header" not in data


def test_record_cipher_units():
    for name in ("aegis-256", "aes-256-gcm"):
        c = crypto.RecordCipher(name, KEY, 7)
        blob = c.seal(((b"k", b"v"),), b"body")
        assert c.open(blob) == (((b"k", b"v"),), b"body")
        with pytest.raises(crypto.S2Error) as e:
            crypto.RecordCipher(name, KEY, 8).open(blob)  # the stream id is the associated data
        assert e.value.code == "decryption_failed"
        with pytest.raises(crypto.S2Error):
            crypto.RecordCipher(name, bytes(32), 7).open(blob)
        with pytest.raises(crypto.S2Error):
            c.open(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert crypto.parse_key("AQIDBAUGBwgJCgsMDQ4PEBESExQVFhcYGRobHB0eHyA=") == KEY
    for bad in (None, "not base64!", "AQID"):
        with pytest.raises(crypto.S2Error) as e:
            crypto.parse_key(bad)
        assert e.value.code == "bad_header"
