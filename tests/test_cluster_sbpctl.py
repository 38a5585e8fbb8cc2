"""sbpctl against a 3-node cluster (CONTRACT §9 "every interface, every node"; issue 18): every
stream command given any node, and ``stream describe`` with ranges, replicas, the primary and
each replica's progress, before and after a kill -9 of the primary."""

import json

import pytest

from tests.etcdproc import etcd_available
from tests.test_cluster import client, sbpctl, three_nodes, view, wait_for

pytestmark = [pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed"), pytest.mark.slow]


def describe(node, sid):
    return json.loads(sbpctl("stream", "describe", str(sid), "--endpoint", node.endpoint("sbp"), "--json"))


def test_every_stream_command_through_any_node_and_describe_across_a_failover(tmp_path):
    with three_nodes(tmp_path) as (etcd, nodes):
        a, b, c = nodes
        sid = int(sbpctl("stream", "create", "--replicas", "3", "--endpoint", a.endpoint("sbp")))
        # appends through B, C, A: each goes to the primary
        for i, n in enumerate((b, c, a)):
            out = sbpctl("stream", "append", str(sid), "--endpoint", n.endpoint("sbp"), "--no-progress",
                         input="".join("line %d\n" % (10 * i + j) for j in range(10)))
            assert "offsets %d..%d" % (10 * i, 10 * i + 9) in out
        for n in nodes:
            # every node lists every stream of the cluster, with the same offsets
            listed = [json.loads(x) for x in sbpctl("stream", "list", "--endpoint", n.endpoint("sbp"), "--json").splitlines()]
            (s,) = [x for x in listed if x["stream_id"] == sid]
            assert s["ranges"][0]["range_index"] == 0 and len(s["ranges"][0]["servers"]) == 3
        out = sbpctl("stream", "fetch", str(sid), "--endpoint", b.endpoint("sbp"), "--offset", "12", "--limit", "2")
        assert out.splitlines() == ["line 12", "line 13"]
        assert sbpctl("stream", "tail", str(sid), "--endpoint", c.endpoint("sbp"), "-n", "1").splitlines() == ["line 29"]

        # describe through C: one open range on three replicas, each durable and confirmed to 30
        def settled():
            d = describe(c, sid)
            reps = d["ranges"][0]["servers"]
            return d if all(r.get("durable_end") == 30 and r.get("confirm_offset") == 30 for r in reps) else None

        d = wait_for(settled, what="every replica durable and confirmed at 30")
        (r0,) = d["ranges"]
        assert d["next_offset"] == 30 and r0["end_offset"] == -1
        assert sorted(x["server_id"] for x in r0["servers"]) == [1, 2, 3]
        primary = [x for x in r0["servers"] if x["is_primary"]]
        assert len(primary) == 1 and r0["servers"][0]["is_primary"]  # the primary listed first
        # the primary's own view: every other replica acknowledged up to 30
        assert all(x["acked_by_primary"] == 30 for x in r0["servers"] if not x["is_primary"])
        text = sbpctl("stream", "describe", str(sid), "--endpoint", b.endpoint("sbp"))
        assert "range 0: [0, open) next=30" in text and text.count("durable=30 confirm=30") == 3
        assert " primary " in text

        # trim through a node that is not the primary
        other = next(n for n in nodes if n.node_id != primary[0]["server_id"])
        assert "now starts at 5" in sbpctl("stream", "trim", str(sid), "5", "--endpoint", other.endpoint("sbp"))

        # kill -9 the primary: range 0 sealed, range 1 open on the two others
        dead = next(n for n in nodes if n.node_id == primary[0]["server_id"])
        live = [n for n in nodes if n is not dead]
        dead.kill9()
        wait_for(lambda: dead.node_id not in view(live[0])[0], timeout=15, what="the dead node to leave")
        wait_for(lambda: len(client(live[0]).list_ranges(sid)) == 2, timeout=30, what="the failover")
        out = sbpctl("stream", "append", str(sid), "--endpoint", live[1].endpoint("sbp"), "--no-progress", input="after\n")
        assert "appended 1 records" in out

        def after():
            d = describe(live[0], sid)
            r1 = d["ranges"][1]
            return d if all(x.get("durable_end") == d["next_offset"] for x in r1["servers"]) else None

        d = wait_for(after, what="both survivors durable at the new end")
        r0, r1 = d["ranges"]
        assert r0["end_offset"] == r1["start_offset"] and r1["end_offset"] == -1 and d["next_offset"] == r1["start_offset"] + 1
        down = [x for x in r0["servers"] if x["server_id"] == dead.node_id]
        assert down[0]["error"] == "down"
        assert all(x["holds_range"] for x in r0["servers"] if x["server_id"] != dead.node_id)
        assert sorted(x["server_id"] for x in r1["servers"]) == sorted(n.node_id for n in live)
        text = sbpctl("stream", "describe", str(sid), "--endpoint", live[1].endpoint("sbp"))
        assert "sealed" in text and " down" in text and text.count("complete") == 2
        out = sbpctl("stream", "fetch", str(sid), "--endpoint", live[0].endpoint("sbp"), "--offset", str(r1["start_offset"]))
        assert out.splitlines() == ["after"]
