"""The official s2-sdk (0.13.x) against a real node process: HTTP/2 cleartext with prior knowledge,
control plane, unary appends and reads, sessions, producer, append conditions, command records,
timestamping, 416/422/404 errors, bearer tokens (CONTRACT §7)."""

import asyncio
import os
import time
import uuid

import pytest
from s2_sdk import (
    S2,
    AppendInput,
    BasinConfig,
    CommandRecord,
    Endpoints,
    FencingTokenMismatchError,
    ReadLimit,
    ReadUnwrittenError,
    Record,
    Retry,
    S2ServerError,
    SeqNum,
    SeqNumMismatchError,
    StreamConfig,
    TailOffset,
    Timeout,
    Timestamp,
    Timestamping,
    TimestampingMode,
)

from tests.nodeproc import NodeProcess

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    # S2_TEST_ENDPOINT lets a developer aim the suite at an already running node.
    if os.environ.get("S2_TEST_ENDPOINT"):
        yield os.environ["S2_TEST_ENDPOINT"]
        return
    node = NodeProcess(tmp_path_factory.mktemp("s2sdk"), fsync="never")
    node.start()
    try:
        yield "http://127.0.0.1:%d" % node.ports["http"]
    finally:
        node.terminate()


def client(endpoint, token="ignored", **kw):
    return S2(token, endpoints=Endpoints(account=endpoint, basin=endpoint),
              retry=Retry(max_attempts=1), timeout=Timeout(request=timedelta_s(10)), **kw)


def timedelta_s(s):
    import datetime

    return datetime.timedelta(seconds=s)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


def unique(prefix="s"):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:10])


async def new_stream(s2, config=None, basin="sbpnode-default"):
    name = unique()
    b = s2.basin(basin)
    await b.create_stream(name, config=config)
    return b.stream(name)


def test_basins_and_streams_control_plane(endpoint):
    async def main():
        async with client(endpoint) as s2:
            basins = await s2.list_basins()
            assert "sbpnode-default" in [b.name for b in basins.items]
            name = unique("basin")
            info = await s2.create_basin(name, config=BasinConfig(create_stream_on_append=True))
            assert info.name == name and info.created_at is not None
            with pytest.raises(S2ServerError) as e:
                await s2.create_basin(name)
            assert e.value.status_code == 409 and e.value.code == "resource_already_exists"
            assert (await s2.get_basin_config(name)).create_stream_on_append is True
            cfg = await s2.reconfigure_basin(name, config=BasinConfig(create_stream_on_read=True))
            assert cfg.create_stream_on_read is True and cfg.create_stream_on_append is True
            ensured = await s2.ensure_basin(name)
            assert ensured.basin.name == name

            basin = s2.basin(name)
            for i in range(5):
                await basin.create_stream("logs/%d" % i, config=StreamConfig(retention_policy=3600))
            await basin.create_stream("other")
            page = await basin.list_streams(prefix="logs/", limit=2)
            assert [s.name for s in page.items] == ["logs/0", "logs/1"] and page.has_more
            page = await basin.list_streams(prefix="logs/", start_after="logs/1")
            assert [s.name for s in page.items] == ["logs/2", "logs/3", "logs/4"] and not page.has_more
            cfg = await basin.get_stream_config("logs/0")
            assert cfg.retention_policy == 3600
            cfg = await basin.reconfigure_stream("logs/0", config=StreamConfig(retention_policy="infinite"))
            assert cfg.retention_policy == "infinite"
            other = await basin.get_stream_config("other")  # CONTRACT §2: S2's defaults
            assert other.retention_policy == 7 * 24 * 3600 and other.storage_class == "express"
            await s2.reconfigure_basin(name, config=BasinConfig(
                default_stream_config=StreamConfig(retention_policy="infinite", storage_class="standard")))
            await basin.create_stream("third")
            third = await basin.get_stream_config("third")
            assert third.retention_policy == "infinite" and third.storage_class == "standard"
            with pytest.raises(S2ServerError) as e:
                await basin.create_stream("other")
            assert e.value.status_code == 409

            # create_stream_on_append: appending to a missing stream creates it.
            ack = await basin.stream("auto").append(AppendInput(records=[Record(body=b"a")]))
            assert ack.end.seq_num == 1

            await basin.delete_stream("other")
            with pytest.raises(S2ServerError) as e:
                await basin.get_stream_config("other")
            assert e.value.status_code == 404 and e.value.code == "stream_not_found"
            await s2.delete_basin(name)
            with pytest.raises(S2ServerError) as e:
                await s2.get_basin_config(name)
            assert e.value.code == "basin_not_found"
            with pytest.raises(S2ServerError) as e:
                await s2.basin(name).list_streams()
            assert e.value.status_code == 404

    run(main())


def test_append_read_tail(endpoint):
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            assert (await st.check_tail()).seq_num == 0
            ack = await st.append(AppendInput(records=[Record(body=b"hello"), Record(body=b"", headers=[(b"k", b"")])]))
            assert (ack.start.seq_num, ack.end.seq_num, ack.tail.seq_num) == (0, 2, 2)
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=10))
            assert [(r.seq_num, r.body, r.headers) for r in batch.records] == [(0, b"hello", []), (1, b"", [(b"k", b"")])]
            tail = await st.check_tail()
            assert tail.seq_num == 2 and tail.timestamp == ack.end.timestamp
            for i in range(3):
                await st.append(AppendInput(records=[Record(body=b"r%d" % i)] * 10))
            batch = await st.read(start=SeqNum(5), limit=ReadLimit(count=3))
            assert [r.seq_num for r in batch.records] == [5, 6, 7]
            batch = await st.read(start=TailOffset(4))
            assert [r.seq_num for r in batch.records] == [28, 29, 30, 31]
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(bytes=13 + 10))
            assert len(batch.records) == 1  # 13 + 11 metered bytes would pass the limit
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=0))
            assert batch.records == []

    run(main())


def test_read_errors_416_and_422(endpoint):
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            with pytest.raises(ReadUnwrittenError):
                await st.read(start=SeqNum(0))  # empty stream, no wait
            batch = await st.read(start=SeqNum(0), wait=1)
            assert batch.records == []
            await st.append(AppendInput(records=[Record(body=b"x")] * 3))
            with pytest.raises(ReadUnwrittenError) as e:
                await st.read(start=SeqNum(10))
            assert e.value.tail.seq_num == 3
            with pytest.raises(ReadUnwrittenError):
                await st.read(start=SeqNum(10), clamp_to_tail=True)  # clamped to the tail, cannot wait
            batch = await st.read(start=SeqNum(10), clamp_to_tail=True, wait=1)
            assert batch.records == []
            with pytest.raises(ReadUnwrittenError):
                await st.read(start=Timestamp(int(time.time() * 1000) + 3_600_000))
            with pytest.raises(S2ServerError) as e:
                await st.read(start=Timestamp(100), until_timestamp=100)
            assert e.value.status_code == 422
            with pytest.raises(S2ServerError) as e:
                await s2.basin("sbpnode-default").stream(unique("missing")).read(start=SeqNum(0))
            assert e.value.status_code == 404 and e.value.code == "stream_not_found"

    run(main())


def test_match_seq_num_and_fencing(endpoint):
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            await st.append(AppendInput(records=[Record(body=b"a")], match_seq_num=0))
            with pytest.raises(SeqNumMismatchError) as e:
                await st.append(AppendInput(records=[Record(body=b"b")], match_seq_num=0))
            assert e.value.expected_seq_num == 1
            await st.append(AppendInput(records=[CommandRecord.fence("tok-1")]))
            with pytest.raises(FencingTokenMismatchError) as e:
                await st.append(AppendInput(records=[Record(body=b"c")], fencing_token="wrong"))
            assert e.value.expected_fencing_token == "tok-1"
            ack = await st.append(AppendInput(records=[Record(body=b"c")], fencing_token="tok-1"))
            assert ack.start.seq_num == 2
            await st.append(AppendInput(records=[CommandRecord.fence("")], fencing_token="tok-1"))
            await st.append(AppendInput(records=[Record(body=b"d")], fencing_token=""))
            # Command records take a seq_num and are read back.
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=10))
            assert [r.headers for r in batch.records][1] == [(b"", b"fence")]
            with pytest.raises(S2ServerError) as e:
                await st.append(AppendInput(records=[Record(body=b"", headers=[(b"", b"bogus")])]))
            assert e.value.status_code == 422
            with pytest.raises(S2ServerError) as e:
                await st.append(AppendInput(records=[Record(body=b"", headers=[(b"", b"fence"), (b"x", b"y")])]))
            assert e.value.status_code == 422

    run(main())


def test_trim_command(endpoint):
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            for _ in range(5):
                await st.append(AppendInput(records=[Record(body=b"x")] * 10))
            await st.append(AppendInput(records=[CommandRecord.trim(20)]))
            for _ in range(50):
                batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=1))
                if batch.records[0].seq_num >= 20:
                    break
                await asyncio.sleep(0.05)
            assert batch.records[0].seq_num == 20
            # Beyond the tail: the trim point is capped at the command's own seq_num + 1.
            await st.append(AppendInput(records=[CommandRecord.trim(10_000)]))
            for _ in range(20):  # the trim is applied after the ack: until a read sees it
                batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=5), wait=1)
                if batch.records == [] or batch.records[0].seq_num == 52:
                    break
            assert batch.records == [] or batch.records[0].seq_num == 52

    run(main())


def test_timestamping(endpoint):
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            now = int(time.time() * 1000)
            ack = await st.append(AppendInput(records=[Record(body=b"a", timestamp=now - 5000),
                                                       Record(body=b"b", timestamp=now - 9000)]))
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=2))
            assert [r.timestamp for r in batch.records] == [now - 5000, now - 5000]  # never decreasing
            ack = await st.append(AppendInput(records=[Record(body=b"f", timestamp=now + 3_600_000)]))
            assert ack.end.timestamp <= int(time.time() * 1000)  # capped at arrival
            batch = await st.read(start=Timestamp(now - 5000), limit=ReadLimit(count=1))
            assert batch.records[0].seq_num == 0
            batch = await st.read(start=SeqNum(0), until_timestamp=now - 4999)
            assert [r.seq_num for r in batch.records] == [0, 1]

            req = await new_stream(s2, StreamConfig(timestamping=Timestamping(mode=TimestampingMode.CLIENT_REQUIRE)))
            with pytest.raises(S2ServerError) as e:
                await req.append(AppendInput(records=[Record(body=b"x")]))
            assert e.value.status_code == 422
            await req.append(AppendInput(records=[Record(body=b"x", timestamp=5)]))
            unc = await new_stream(s2, StreamConfig(timestamping=Timestamping(uncapped=True)))
            ack = await unc.append(AppendInput(records=[Record(body=b"x", timestamp=now + 3_600_000)]))
            assert ack.end.timestamp == now + 3_600_000
            arr = await new_stream(s2, StreamConfig(timestamping=Timestamping(mode=TimestampingMode.ARRIVAL)))
            ack = await arr.append(AppendInput(records=[Record(body=b"x", timestamp=5)]))
            assert ack.end.timestamp >= now

    run(main())


def test_append_session_producer_and_read_session(endpoint):
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            async with st.append_session() as session:
                tickets = [await session.submit(AppendInput(records=[Record(body=b"%d" % i)] * 5)) for i in range(20)]
                acks = [await t for t in tickets]
            assert [a.start.seq_num for a in acks] == list(range(0, 100, 5))
            async with st.producer() as p:
                tickets = [await p.submit(Record(body=b"p%d" % i)) for i in range(50)]
                seqs = [(await t).seq_num for t in tickets]
            assert seqs == list(range(100, 150))

            got = []
            async for batch in st.read_session(start=SeqNum(90), limit=ReadLimit(count=20)):
                got.extend(r.seq_num for r in batch.records)
            assert got == list(range(90, 110))

            # Follow the tail: catch up, receive a heartbeat, then a live append.
            live = []

            async def follow():
                async for batch in st.read_session(start=SeqNum(148)):
                    live.extend(r.body for r in batch.records)
                    if len(live) >= 3:
                        return

            task = asyncio.ensure_future(follow())
            for _ in range(200):  # until the session has caught up with what exists
                if len(live) >= 2 or task.done():
                    break
                await asyncio.sleep(0.05)
            await st.append(AppendInput(records=[Record(body=b"live")]))
            await asyncio.wait_for(task, 10)
            assert live == [b"p48", b"p49", b"live"]

            with pytest.raises(ReadUnwrittenError):
                async for _ in st.read_session(start=SeqNum(1000)):
                    pass

    run(main())


def test_read_session_is_caught_up_from_the_batch_reaching_the_tail(endpoint):
    # The SDK counts a session as caught up from a data batch whose tail is its last seq_num + 1
    # (issue 23: the catch-up batch came without tail, and a loop on is_caught_up() never ended).
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            await st.append(AppendInput(records=[Record(body=b"%d" % i) for i in range(30)]))
            got = []
            session = st.read_session(start=SeqNum(0))
            async for batch in session:
                got.extend(r.seq_num for r in batch.records)
                assert batch.tail is not None and batch.tail.seq_num == 30
                if session.is_caught_up():
                    break
            await session.close()
            assert got == list(range(30))

    run(main())


def test_append_session_errors(endpoint):
    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            with pytest.raises(SeqNumMismatchError):
                async with st.append_session() as session:
                    t1 = await session.submit(AppendInput(records=[Record(body=b"a")], match_seq_num=0))
                    t2 = await session.submit(AppendInput(records=[Record(body=b"b")], match_seq_num=0))
                    await t1
                    await t2
            with pytest.raises(S2ServerError) as e:
                async with s2.basin("sbpnode-default").stream(unique("nope")).append_session() as session:
                    await (await session.submit(AppendInput(records=[Record(body=b"a")])))
            assert e.value.status_code == 404

    run(main())


def test_bearer_token(tmp_path):
    node = NodeProcess(tmp_path, fsync="never", http_token="s3cret")
    node.start()
    try:
        ep = "http://127.0.0.1:%d" % node.ports["http"]

        async def main():
            async with client(ep, token="wrong") as s2:
                with pytest.raises(S2ServerError) as e:
                    await s2.list_basins()
                assert e.value.status_code == 401 and e.value.code == "authn"
            async with client(ep, token="s3cret") as s2:
                assert (await s2.list_basins()).items

        run(main())
    finally:
        node.terminate()


@pytest.mark.parametrize("compression", ["GZIP", "ZSTD"])
def test_compression(endpoint, compression):
    from s2_sdk import Compression

    async def main():
        async with client(endpoint, compression=getattr(Compression, compression)) as s2:
            st = await new_stream(s2)
            big = b"0123456789" * 500  # above the SDK's 1 KiB compression threshold
            await st.append(AppendInput(records=[Record(body=big)] * 3))
            async with st.append_session() as session:
                await (await session.submit(AppendInput(records=[Record(body=big)] * 3)))
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=10))
            assert [r.body for r in batch.records] == [big] * 6

    run(main())


def test_tls_alpn_h2(tmp_path, monkeypatch):
    """With --http-tls-cert/--http-tls-key the listener speaks TLS; the SDK negotiates h2 by ALPN."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    node = NodeProcess(tmp_path, fsync="never", http_tls_cert=str(cert_path), http_tls_key=str(key_path))
    node.start()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert_path))  # the SDK has no switch to skip verification
    try:
        ep = "https://127.0.0.1:%d" % node.ports["http"]

        async def main():
            async with client(ep) as s2:
                st = await new_stream(s2)
                await st.append(AppendInput(records=[Record(body=b"tls")]))
                batch = await st.read(start=SeqNum(0))
                assert batch.records[0].body == b"tls"

        run(main())
        import ssl
        import urllib.request

        ctx = ssl.create_default_context(cafile=str(cert_path))
        with urllib.request.urlopen(ep + "/health", context=ctx) as resp:  # HTTP/1.1 over TLS
            assert resp.status == 200
    finally:
        node.terminate()


def test_ensure_and_limits(endpoint):
    from s2_sdk import EnsureStatus

    async def main():
        async with client(endpoint) as s2:
            basin = s2.basin("sbpnode-default")
            name = unique("ens")
            r = await basin.ensure_stream(name)
            assert r.status == EnsureStatus.CREATED
            r = await basin.ensure_stream(name)
            assert r.status == EnsureStatus.CONFIG_UNCHANGED
            r = await basin.ensure_stream(name, config=StreamConfig(retention_policy=60))
            assert r.status == EnsureStatus.CONFIG_UPDATED
            assert (await basin.get_stream_config(name)).retention_policy == 60
            st = basin.stream(name)
            # A full batch: 1000 records; unary reads are capped at 1000 records.
            await st.append(AppendInput(records=[Record(body=b"")] * 1000))
            await st.append(AppendInput(records=[Record(body=b"x", headers=[(b"h", b"")])] * 1000))
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=5000))
            assert len(batch.records) == 1000 and batch.records[0].body == b""
            batch = await st.read(start=SeqNum(1000), limit=ReadLimit(count=1))
            assert batch.records[0].headers == [(b"h", b"")]
            # A bound that stops before the first record: 200 with no records.
            batch = await st.read(start=SeqNum(0), until_timestamp=1)
            assert batch.records == []

    run(main())


def test_concurrent_sessions_on_one_stream(endpoint):
    """Four append sessions and a follower on one stream: every ack's range holds exactly that
    batch's records, ranges do not overlap, and the follower sees every record once, in order."""

    async def main():
        async with client(endpoint) as s2:
            st = await new_stream(s2)
            total = 4 * 30 * 5
            seen = []

            async def follow():
                async for batch in st.read_session(start=SeqNum(0), limit=ReadLimit(count=total), wait=10):
                    seen.extend((r.seq_num, r.body) for r in batch.records)

            reader = asyncio.ensure_future(follow())

            async def writer(w):
                acks = []
                async with st.append_session() as session:
                    tickets = [await session.submit(AppendInput(records=[Record(body=b"w%d-%d-%d" % (w, b, i))
                                                                         for i in range(5)]))
                               for b in range(30)]
                    for b, t in enumerate(tickets):
                        acks.append((b, await t))
                return w, acks

            results = await asyncio.gather(*(writer(w) for w in range(4)))
            await asyncio.wait_for(reader, 30)
            assert [s for s, _ in seen] == list(range(total))
            by_seq = dict(seen)
            for w, acks in results:
                starts = [a.start.seq_num for _, a in acks]
                assert starts == sorted(starts)
                for b, a in acks:
                    assert a.end.seq_num - a.start.seq_num == 5
                    assert [by_seq[s] for s in range(a.start.seq_num, a.end.seq_num)] == [
                        b"w%d-%d-%d" % (w, b, i) for i in range(5)]

    run(main())
