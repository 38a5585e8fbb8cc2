"""S2 access tokens, metrics and locations through the official s2-sdk against a real node with a
root token (--http-token): issue, scoped allow and deny, auto-prefixed stream names, revoke,
expiry, durability across a restart; /v1/metrics and /v1/locations (issue 23)."""

import asyncio
import datetime
import json
import time
import uuid

import pytest
from s2_sdk import (
    S2,
    AccessTokenScope,
    AccountMetricSet,
    AppendInput,
    BasinMetricSet,
    CommandRecord,
    Endpoints,
    ExactMatch,
    Operation,
    OperationGroupPermissions,
    Permission,
    PrefixMatch,
    ReadLimit,
    Record,
    Retry,
    S2ServerError,
    SeqNum,
    StreamMetricSet,
    Timeout,
    TimeseriesInterval,
)

from tests.nodeproc import NodeProcess

pytestmark = pytest.mark.timeout(180)
ROOT = "root-secret-token"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = NodeProcess(tmp_path_factory.mktemp("s2tokens"), fsync="never", http_token=ROOT)
    n.start()
    try:
        yield n
    finally:
        n.terminate()


def url(node):
    return "http://127.0.0.1:%d" % node.ports["http"]


def client(node, token):
    ep = url(node)
    return S2(token, endpoints=Endpoints(account=ep, basin=ep), retry=Retry(max_attempts=1),
              timeout=Timeout(request=datetime.timedelta(seconds=10)))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def unique(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:10])


async def denied(awaitable, status=403, code="permission_denied"):
    with pytest.raises(S2ServerError) as e:
        await awaitable
    assert (e.value.status_code, e.value.code) == (status, code), e.value


def test_issue_scoped_allow_deny_and_revoke(node):
    async def main():
        async with client(node, ROOT) as root:
            basin = unique("tok-basin")
            other = unique("tok-other")
            await root.create_basin(basin)
            await root.create_basin(other)
            await root.basin(basin).create_stream("logs/a")
            await root.basin(basin).create_stream("secret")
            await root.basin(other).create_stream("logs/a")
            tid = unique("reader")
            token = await root.issue_access_token(tid, scope=AccessTokenScope(
                basins=ExactMatch(basin), streams=PrefixMatch("logs/"),
                op_groups=OperationGroupPermissions(stream=Permission.READ), ops=[Operation.APPEND]))
            assert token.startswith("s2at_") and token != ROOT
            page = await root.list_access_tokens(prefix=tid)
            assert [t.id for t in page.items] == [tid]
            assert page.items[0].scope.basins == ExactMatch(basin)
            assert page.items[0].scope.ops == [Operation.APPEND]

            async with client(node, token) as scoped:
                st = scoped.basin(basin).stream("logs/a")
                ack = await st.append(AppendInput(records=[Record(body=b"ok")]))  # ops: append
                assert ack.end.seq_num == 1
                batch = await st.read(start=SeqNum(0), limit=ReadLimit(count=10))  # op group: stream read
                assert [r.body for r in batch.records] == [b"ok"]
                assert (await st.check_tail()).seq_num == 1
                # Deny: another stream, another basin, a write outside the grant, account ops.
                await denied(scoped.basin(basin).stream("secret").read(start=SeqNum(0)))
                await denied(scoped.basin(other).stream("logs/a").check_tail())
                await denied(st.append(AppendInput(records=[CommandRecord.fence("f")])))  # fence op
                await denied(scoped.basin(basin).create_stream("logs/new"))
                await denied(scoped.create_basin(unique("tok-new")))
                await denied(scoped.list_access_tokens())
                await denied(scoped.issue_access_token(unique("x"), scope=AccessTokenScope(
                    streams=PrefixMatch(""), ops=[Operation.READ])))

            await root.revoke_access_token(tid)
            assert (await root.list_access_tokens(prefix=tid)).items == []
            async with client(node, token) as revoked:
                await denied(revoked.basin(basin).stream("logs/a").check_tail(), 401, "authn")
            await denied(root.revoke_access_token(tid), 404, "access_token_not_found")

    run(main())


def test_validation_expiry_and_auto_prefix(node):
    async def main():
        async with client(node, ROOT) as root:
            await denied(root.issue_access_token(unique("none"), scope=AccessTokenScope()), 422, "invalid")
            await denied(root.issue_access_token(unique("ap"), scope=AccessTokenScope(
                op_groups=OperationGroupPermissions(stream=Permission.READ_WRITE)), auto_prefix_streams=True),
                422, "invalid")
            dup = unique("dup")
            await root.issue_access_token(dup, scope=AccessTokenScope(streams=PrefixMatch(""), ops=[Operation.READ]))
            await denied(root.issue_access_token(dup, scope=AccessTokenScope(streams=PrefixMatch(""),
                                                                             ops=[Operation.READ])),
                         409, "resource_already_exists")

            # Expiry: works before, 401 after.
            soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=2)
            tid = unique("short")
            token = await root.issue_access_token(tid, expires_at=soon, scope=AccessTokenScope(
                basins=PrefixMatch(""), streams=PrefixMatch(""), ops=[Operation.LIST_STREAMS]))
            info = (await root.list_access_tokens(prefix=tid)).items[0]
            assert abs(info.expires_at.timestamp() - soon.timestamp()) < 0.01
            async with client(node, token) as short:
                await short.basin("sbpnode-default").list_streams(limit=1)
                while datetime.datetime.now(datetime.timezone.utc) < soon:
                    await asyncio.sleep(0.1)
                await denied(short.basin("sbpnode-default").list_streams(limit=1), 401, "authn")

            # Auto-prefix: the token names streams without its prefix; the node stores them with it.
            basin = unique("tok-prefix")
            await root.create_basin(basin)
            await root.basin(basin).create_stream("elsewhere")
            tid = unique("tenant")
            token = await root.issue_access_token(tid, auto_prefix_streams=True, scope=AccessTokenScope(
                basins=ExactMatch(basin), streams=PrefixMatch("tenant-1/"),
                op_groups=OperationGroupPermissions(basin=Permission.READ_WRITE, stream=Permission.READ_WRITE)))
            async with client(node, token) as tenant:  # stream read-write also grants stream-metrics
                b = tenant.basin(basin)
                info = await b.create_stream("events")
                assert info.name == "events"
                await b.stream("events").append(AppendInput(records=[Record(body=b"t1")]))
                assert [s.name for s in (await b.list_streams()).items] == ["events"]
                now = int(time.time())
                storage = await tenant.stream_metrics(basin, "events", set=StreamMetricSet.STORAGE,
                                                      start=now - 60, end=now)
                assert storage[0].values[0][1] > 0
            names = [s.name for s in (await root.basin(basin).list_streams()).items]
            assert names == ["elsewhere", "tenant-1/events"]
            batch = await root.basin(basin).stream("tenant-1/events").read(start=SeqNum(0))
            assert [r.body for r in batch.records] == [b"t1"]

    run(main())


def test_tokens_survive_a_restart_and_are_stored_hashed(tmp_path):
    n = NodeProcess(tmp_path, fsync="always", http_token=ROOT)
    n.start()
    try:
        async def issue():
            async with client(n, ROOT) as root:
                return await root.issue_access_token("kept", scope=AccessTokenScope(
                    basins=PrefixMatch(""), streams=PrefixMatch(""), ops=[Operation.LIST_BASINS]))

        token = run(issue())
        n.restart()

        async def use():
            async with client(n, token) as c:
                return [b.name for b in (await c.list_basins()).items]

        assert "sbpnode-default" in run(use())
    finally:
        n.terminate()
    # Only the token's hash is on disk.
    import os

    found = False
    for root_dir, _, files in os.walk(n.data_dir):
        for f in files:
            with open(os.path.join(root_dir, f), "rb") as fh:
                data = fh.read()
            assert token.encode() not in data
            found = found or b"kept" in data
    assert found


def test_metrics_and_locations(node):
    async def main():
        async with client(node, ROOT) as root:
            locations = await root.list_locations()
            assert [(loc.name, loc.is_private) for loc in locations] == [("local", True)]
            assert (await root.get_default_location()).name == "local"
            assert (await root.set_default_location("local")).name == "local"
            await denied(root.set_default_location("aws:us-east-1"), 422, "invalid")

            basin = unique("met-basin")
            await root.create_basin(basin)
            await root.basin(basin).create_stream("m")
            st = root.basin(basin).stream("m")
            for _ in range(3):
                await st.append(AppendInput(records=[Record(body=b"x" * 100)]))
            await st.read(start=SeqNum(0))

            now = int(time.time())
            rng = {"start": now - 3600, "end": now + 1}
            stored = await root.stream_metrics(basin, "m", set=StreamMetricSet.STORAGE, **rng)
            assert stored[0].name == "storage" and stored[0].values[0][1] >= 300
            basin_storage = await root.basin_metrics(basin, set=BasinMetricSet.STORAGE, **rng)
            assert basin_storage[0].values[0][1] == stored[0].values[0][1]
            appends = await root.basin_metrics(basin, set=BasinMetricSet.APPEND_OPS, **rng)
            assert sum(v for _, v in appends[0].values) == 3
            throughput = await root.basin_metrics(basin, set=BasinMetricSet.APPEND_THROUGHPUT, **rng,
                                                interval=TimeseriesInterval.MINUTE)
            assert sum(v for _, v in throughput[0].values) == 3 * (8 + 100)
            reads = await root.basin_metrics(basin, set=BasinMetricSet.READ_THROUGHPUT, **rng)
            assert sum(v for _, v in reads[0].values) == 3 * (8 + 100)
            basin_ops = {m.name: sum(v for _, v in m.values)
                         for m in await root.basin_metrics(basin, set=BasinMetricSet.BASIN_OPS, **rng)}
            assert basin_ops["append"] == 3 and basin_ops["create-stream"] == 1
            active = await root.account_metrics(set=AccountMetricSet.ACTIVE_BASINS, **rng)
            assert basin in active[0].values
            ops = {m.name: sum(v for _, v in m.values)
                   for m in await root.account_metrics(set=AccountMetricSet.ACCOUNT_OPS, **rng,
                                                           interval=TimeseriesInterval.DAY)}
            assert ops["create-basin"] >= 1 and ops["list-locations"] >= 1
            # S2's rules (its SDK suites check them): start and end required, start <= end, end not in
            # the future, at most 30 days; storage per hour for a basin, per minute for a stream.
            for bad in ({"start": now, "end": now - 10}, {"start": now - 3600, "end": now + 600},
                        {"start": now - 40 * 86400, "end": now}, {"end": now}, {"start": now - 60}):
                await denied(root.basin_metrics(basin, set=BasinMetricSet.APPEND_OPS, **bad), 422, "invalid")
            await denied(root.basin_metrics(basin, set=BasinMetricSet.STORAGE, interval=TimeseriesInterval.MINUTE,
                                            **rng), 422, "invalid")
            await denied(root.stream_metrics(basin, "m", set=StreamMetricSet.STORAGE, interval=TimeseriesInterval.HOUR,
                                             **rng), 422, "invalid")
            old = await root.stream_metrics(basin, "m", set=StreamMetricSet.STORAGE, start=0, end=3600)
            assert old[0].values == []
            await denied(root.stream_metrics(basin, "nope", set=StreamMetricSet.STORAGE, **rng), 404, "stream_not_found")

    run(main())


def test_raw_http_bodies(node):
    """The error bodies and shapes as plain HTTP/1.1 clients see them."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", node.ports["http"], timeout=10)
    conn.request("GET", "/v1/access-tokens", headers={"authorization": "Bearer wrong"})
    resp = conn.getresponse()
    assert resp.status == 401 and json.loads(resp.read())["code"] == "authn"
    conn.request("POST", "/v1/access-tokens", json.dumps({"id": "raw", "scope": {"ops": ["read"]}}),
                 {"authorization": "Bearer " + ROOT, "content-type": "application/json"})
    resp = conn.getresponse()
    token = json.loads(resp.read())["access_token"]
    assert resp.status == 201
    conn.request("GET", "/v1/streams", headers={"authorization": "Bearer " + token})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 403 and body["code"] == "permission_denied" and "list-streams" in body["message"]
    now = int(time.time())
    conn.request("GET", "/v1/metrics?set=nope&start=%d&end=%d" % (now - 60, now), headers={"authorization": "Bearer " + ROOT})
    resp = conn.getresponse()
    assert resp.status == 422 and json.loads(resp.read())["code"] == "invalid"
    conn.close()
