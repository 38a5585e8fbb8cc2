"""The S2 API on every node of a cluster (CONTRACT §9 "Every interface, every node"; issues 18 and
23): the official s2-sdk against three real nodes and one etcd. Basins, streams and tokens made
through one node work through the others; appends through a node that is not the stream's
primary are forwarded to it; reads and tails are served by any node; kill -9 of the primary in
the middle of an append session loses no acknowledged record."""

import asyncio
import datetime
import json
import time
import urllib.request
import uuid

import pytest
from s2_sdk import (
    S2,
    AccessTokenScope,
    AppendInput,
    BasinConfig,
    CommandRecord,
    Encryption,
    Endpoints,
    ExactMatch,
    FencingTokenMismatchError,
    OperationGroupPermissions,
    Permission,
    PrefixMatch,
    ReadLimit,
    Record,
    Retry,
    S2ServerError,
    SeqNum,
    SeqNumMismatchError,
    StreamConfig,
    Timeout,
)

from tests.etcdproc import EtcdCluster, etcd_available
from tests.test_cluster import client as sbp_client
from tests.test_cluster import start_nodes, wait_for

pytestmark = [pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed"),
              pytest.mark.timeout(240)]
ROOT = "cluster-root-token"


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """One etcd and nodes 1, 2, 3 with one root token; the last test kills a node."""
    base = tmp_path_factory.mktemp("s2cluster")
    etcd = EtcdCluster(base, members=1).start()
    try:
        nodes = start_nodes(base, etcd.client_urls, [1, 2, 3], http_token=ROOT)
        try:
            yield nodes
        finally:
            for n in nodes:
                n.kill9()
    finally:
        etcd.stop()


def url(node):
    return "http://127.0.0.1:%d" % node.ports["http"]


def s2(node, token=ROOT, attempts=1):
    ep = url(node)
    return S2(token, endpoints=Endpoints(account=ep, basin=ep), retry=Retry(max_attempts=attempts),
              timeout=Timeout(request=datetime.timedelta(seconds=30)))


def run(coro, timeout=180):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def unique(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:10])


def stream_id(node, basin, name):
    req = urllib.request.Request(url(node) + "/v1/streams/" + urllib.request.quote(name, safe=""),
                                 headers={"authorization": "Bearer " + ROOT, "s2-basin": basin})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.headers["sbp-stream-id"])


def new_basin_with_stream(node, prefix, stream):
    """A new basin named ``prefix-<random>`` holding ``stream``, made through ``node``; its name."""
    async def create():
        async with s2(node) as root:
            basin = unique(prefix)
            await root.create_basin(basin)
            await root.basin(basin).create_stream(stream)
            return basin

    return run(create(), timeout=60)


def roles(nodes, sid):
    """(primary node, [the others]) of the stream's open range, as the placement driver says."""
    ranges = sbp_client(nodes[0]).list_ranges(sid)
    open_range = ranges[-1]
    pid = next(s["server_id"] for s in open_range["servers"] if s["is_primary"])
    primary = next(n for n in nodes if n.node_id == pid)
    return primary, [n for n in nodes if n is not primary]


def test_control_plane_and_data_through_different_nodes(trio):
    a, b, c = trio

    async def main():
        async with s2(a) as on_a, s2(b) as on_b, s2(c) as on_c:
            basin = unique("cluster-basin")
            await on_a.create_basin(basin, config=BasinConfig(create_stream_on_append=True))
            # every node sees the basin at once (a node whose watch is behind reads etcd)
            assert (await on_b.get_basin_config(basin)).create_stream_on_append is True
            assert basin in [x.name for x in (await on_c.list_basins(prefix=basin)).items]
            with pytest.raises(S2ServerError) as e:
                await on_c.create_basin(basin)
            assert e.value.status_code == 409

            await on_a.basin(basin).create_stream("events", config=StreamConfig(retention_policy=3600))
            with pytest.raises(S2ServerError) as e:
                await on_b.basin(basin).create_stream("events")
            assert e.value.status_code == 409
            assert (await on_c.basin(basin).get_stream_config("events")).retention_policy == 3600
            assert [s.name for s in (await on_b.basin(basin).list_streams()).items] == ["events"]

            st_b = on_b.basin(basin).stream("events")
            st_c = on_c.basin(basin).stream("events")
            ack = await st_b.append(AppendInput(records=[Record(body=b"r%d" % i) for i in range(10)]))
            assert (ack.start.seq_num, ack.end.seq_num) == (0, 10)
            # acknowledged through B: readable through C at once
            batch = await st_c.read(start=SeqNum(0), limit=ReadLimit(count=100))
            assert [r.body for r in batch.records] == [b"r%d" % i for i in range(10)]
            tail = await st_c.check_tail()
            assert tail.seq_num == 10 and tail.timestamp == ack.end.timestamp

            # an append session through B and a read session tailing through C
            got = []

            async def follow():
                async for rb in st_c.read_session(start=SeqNum(10)):
                    got.extend(r.body for r in rb.records)
                    if len(got) >= 100:
                        return

            follower = asyncio.ensure_future(follow())
            async with st_b.append_session() as session:
                tickets = [await session.submit(AppendInput(records=[Record(body=b"s%d" % i)] * 5)) for i in range(20)]
                acks = [await t for t in tickets]
            assert [x.start.seq_num for x in acks] == list(range(10, 110, 5))
            await asyncio.wait_for(follower, 30)
            assert got == [b"s%d" % (i // 5) for i in range(100)]

            # S2 semantics on the primary whichever node the client talks to
            await on_a.basin(basin).stream("events").append(AppendInput(records=[CommandRecord.fence("tok-1")]))
            with pytest.raises(FencingTokenMismatchError):
                await st_c.append(AppendInput(records=[Record(body=b"x")], fencing_token="wrong"))
            await st_b.append(AppendInput(records=[Record(body=b"y")], fencing_token="tok-1", match_seq_num=111))
            with pytest.raises(SeqNumMismatchError) as e:
                await st_c.append(AppendInput(records=[Record(body=b"z")], match_seq_num=5))
            assert e.value.expected_seq_num == 112

            # create_stream_on_append through C, reconfigure through A, seen through B
            await on_c.basin(basin).stream("auto").append(AppendInput(records=[Record(body=b"a")]))
            await on_a.basin(basin).reconfigure_stream("auto", config=StreamConfig(retention_policy="infinite"))
            assert (await on_b.basin(basin).get_stream_config("auto")).retention_policy == "infinite"
            await on_b.basin(basin).delete_stream("auto")
            with pytest.raises(S2ServerError) as e:
                await on_a.basin(basin).get_stream_config("auto")
            assert e.value.status_code == 404

            await on_c.delete_basin(basin)
            with pytest.raises(S2ServerError) as e:
                await on_a.get_basin_config(basin)
            assert e.value.code == "basin_not_found"

    run(main())


def test_an_encrypted_stream_across_nodes(trio):
    a, b, c = trio
    key = bytes(range(1, 33))

    async def main():
        async with s2(a) as on_a, s2(b) as on_b, s2(c) as on_c:
            basin = unique("enc")
            await on_a.create_basin(basin, config=BasinConfig(stream_cipher=Encryption.AES_256_GCM))
            assert (await on_b.basin(basin).create_stream("s")).cipher == Encryption.AES_256_GCM
            await on_c.basin(basin).stream("s", encryption_key=key).append(
                AppendInput(records=[Record(body=b"secret", headers=[(b"h", b"v")])]))
            batch = await on_a.basin(basin).stream("s", encryption_key=key).read(start=SeqNum(0))
            assert [(r.body, r.headers) for r in batch.records] == [(b"secret", [(b"h", b"v")])]
            with pytest.raises(S2ServerError) as e:
                await on_b.basin(basin).stream("s", encryption_key=bytes(32)).read(start=SeqNum(0))
            assert e.value.code == "decryption_failed"

    run(main())


def test_tokens_issued_on_one_node_work_on_every_node(trio):
    a, b, c = trio

    async def main():
        async with s2(a) as root_a, s2(c) as root_c:
            basin = unique("tok-basin")
            await root_a.create_basin(basin)
            await root_a.basin(basin).create_stream("logs/a")
            await root_a.basin(basin).create_stream("secret")
            tid = unique("reader")
            token = await root_a.issue_access_token(tid, scope=AccessTokenScope(
                basins=ExactMatch(basin), streams=PrefixMatch("logs/"),
                op_groups=OperationGroupPermissions(stream=Permission.READ_WRITE)))
            assert [t.id for t in (await root_c.list_access_tokens(prefix=tid)).items] == [tid]
            async with s2(b, token) as scoped:
                st = scoped.basin(basin).stream("logs/a")
                assert (await st.append(AppendInput(records=[Record(body=b"ok")]))).end.seq_num == 1
                with pytest.raises(S2ServerError) as e:
                    await scoped.basin(basin).stream("secret").check_tail()
                assert e.value.status_code == 403
            await root_c.revoke_access_token(tid)
            async with s2(b, token) as revoked:
                async def refused():
                    try:
                        await revoked.basin(basin).stream("logs/a").check_tail()
                    except S2ServerError as e:
                        return e.status_code == 401
                    return False

                for _ in range(100):  # B's cache drops it when its watch delivers the revoke
                    if await refused():
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("a token revoked on C still works on B")
            async with s2(c, "not-a-token") as wrong:
                with pytest.raises(S2ServerError) as e:
                    await wrong.list_basins()
                assert e.value.status_code == 401

    run(main())


def test_a_node_without_a_replica_forwards_reads_and_appends(trio):
    # an SBP stream with 2 replicas appears (and is listed) in the default basin under its decimal
    # id; the third node holds no replica, so it forwards appends, unary reads, the tail and read sessions
    with sbp_client(trio[0]) as c:
        sid = c.create_stream(replica_nums=2)["stream_id"]
    ranges = sbp_client(trio[0]).list_ranges(sid)
    holders = {s["server_id"] for s in ranges[-1]["servers"]}
    (outsider,) = [n for n in trio if n.node_id not in holders]

    basin = unique("named")

    async def main():
        async with s2(outsider) as client:
            await client.create_basin(basin)
            await client.basin(basin).create_stream("named")
            st = client.basin("sbpnode-default").stream(str(sid))
            # listed in the default basin as on one node; a stream made through S2 is not
            listed = [x.name for x in (await client.basin("sbpnode-default").list_streams(prefix=str(sid))).items]
            assert str(sid) in listed
            s2_sid = stream_id(trio[0], basin, "named")
            listed = [x.name for x in (await client.basin("sbpnode-default").list_streams(prefix=str(s2_sid))).items]
            assert str(s2_sid) not in listed
            ack = await st.append(AppendInput(records=[Record(body=b"a%d" % i) for i in range(5)]))
            assert (ack.start.seq_num, ack.end.seq_num) == (0, 5)
            batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=100))
            assert [r.body for r in batch.records] == [b"a%d" % i for i in range(5)]
            assert (await st.check_tail()).seq_num == 5
            got = []
            async for rb in st.read_session(start=SeqNum(2), limit=ReadLimit(count=3)):
                got.extend(r.seq_num for r in rb.records)
            assert got == [2, 3, 4]
            async with st.append_session() as session:
                acks = [await (await session.submit(AppendInput(records=[Record(body=b"s")]))) for _ in range(3)]
            assert [x.start.seq_num for x in acks] == [5, 6, 7]

    run(main())
    # being forwarded is a property of the forwarding port, not of a header: a client's request
    # to --http that claims it (the header older nodes marked forwarded requests with) is
    # forwarded to the primary as any other, not answered 503 by a node that does not sequence it
    req = urllib.request.Request(url(outsider) + "/v1/streams/%d/records" % sid, method="POST",
                                 data=json.dumps({"records": [{"body": "h"}]}).encode(),
                                 headers={"authorization": "Bearer " + ROOT, "content-type": "application/json",
                                          "sbp-forwarded": "1"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["start"]["seq_num"] == 8
    # SSE (HTTP/1.1) through the node without a replica: relayed as the primary sends it
    req = urllib.request.Request(url(outsider) + "/v1/streams/%d/records?seq_num=0&count=5" % sid,
                                 headers={"authorization": "Bearer " + ROOT, "accept": "text/event-stream"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line for line in text.splitlines() if line.startswith("data: ") and '"records"' in line]
    bodies = [r["body"] for e in events for r in json.loads(e[6:])["records"]]
    assert bodies == ["a%d" % i for i in range(5)] and "[DONE]" in text


@pytest.mark.slow
def test_kill9_of_the_primary_during_an_append_session(trio):
    """kill -9 of the stream's primary while an append session through another node has inputs
    in flight: every input is acknowledged or failed with S2's retryable 503 within a bounded
    time, and with match_seq_num (S2's way to append exactly once) every record is stored
    exactly once, in order, at the seq_num its acknowledgement named."""
    nodes = trio
    total = 400

    basin = new_basin_with_stream(nodes[0], "failover", "log")
    sid = stream_id(nodes[0], basin, "log")
    primary, (via, reader) = roles(nodes, sid)

    acked = []
    outcome = {"sessions": 0, "errors": []}

    async def write():
        # the SDK's default append retry policy ("all"): a 503 reconnects the session and resends
        # the unacknowledged inputs; input i names seq_num i, so a resent input that was kept
        # after all is refused (412), and the writer goes on from the tail in a new session
        killer = None
        nxt = 0
        async with s2(via, attempts=20) as client:
            st = client.basin(basin).stream("log")
            while nxt < total:
                outcome["sessions"] += 1
                try:
                    async with st.append_session() as session:
                        pending = []
                        for i in range(nxt, total):
                            inp = AppendInput(records=[Record(body=b"%d" % i)], match_seq_num=i)
                            pending.append((i, await session.submit(inp)))
                            while len(pending) > 8 or i == total - 1 and pending:
                                j, t = pending.pop(0)
                                try:
                                    ack = await asyncio.wait_for(t, 90)
                                except asyncio.TimeoutError:
                                    raise AssertionError("input %d neither acknowledged nor failed in 90 s" % j)
                                acked.append((j, ack.start.seq_num))
                                nxt = j + 1
                            if i == 100 and killer is None:
                                # from another thread, while inputs are in flight to the primary
                                outcome["killed_after"] = len(acked)
                                killer = asyncio.get_running_loop().run_in_executor(None, primary.kill9)
                            await asyncio.sleep(0.002)
                except (SeqNumMismatchError, S2ServerError) as e:
                    # 412: kept after all; 503 (retries spent): unknown. Either way the tail says
                    # where the next input goes (this is the stream's only writer)
                    if not isinstance(e, SeqNumMismatchError):
                        assert e.status_code == 503, e
                    outcome["errors"].append("%d %s" % (e.status_code, e.code))
                    nxt = (await st.check_tail()).seq_num
        await killer

    followed = []

    async def follow():
        # a read session tailing through a node that survives: it goes on across the failover
        async with s2(reader, attempts=20) as client:
            session = client.basin(basin).stream("log").read_session(start=SeqNum(0))
            async for rb in session:
                followed.extend((r.seq_num, int(r.body)) for r in rb.records)
                if followed and followed[-1][1] == -1:  # the marker appended after the writer ended
                    return

    async def write_and_follow():
        follower = asyncio.ensure_future(follow())
        await write()
        async with s2(reader) as client:
            await client.basin(basin).stream("log").append(AppendInput(records=[Record(body=b"-1")]))
        await asyncio.wait_for(follower, 60)

    started = time.monotonic()
    run(write_and_follow(), timeout=200)
    outcome["seconds"] = round(time.monotonic() - started, 1)
    assert len(acked) > outcome["killed_after"]

    async def read_all():
        async with s2(reader) as client:
            st = client.basin(basin).stream("log")
            tail = await st.check_tail()
            out = []
            pos = 0
            while pos < tail.seq_num:
                batch = await st.read(start=SeqNum(pos), limit=ReadLimit(count=1000))
                out.extend((r.seq_num, int(r.body)) for r in batch.records)
                pos = out[-1][0] + 1
            return out

    stored = run(read_all())
    assert followed == stored
    # every input exactly once, in order, at seq_num == input; nothing acknowledged lost
    assert stored == [(k, k) for k in range(total)] + [(total, -1)], stored
    for i, seq in acked:
        assert seq == i, (i, seq)
    print("failover outcome:", json.dumps(outcome), "acked", len(acked), "stored", len(stored))
