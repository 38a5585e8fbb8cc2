"""Placement choices (node/cluster/placement.py) without etcd: R distinct live nodes, one primary,
even spread, 1502 when too few; and the route of a data request."""

from collections import Counter

import pytest

from node.cluster import placement
from node.cluster.placement import NoAvailableRS, PlacementDriver


class Members:
    """The part of Membership placement reads: live ids and their SBP addresses."""

    def __init__(self, ids):
        self.ids = list(ids)

    def live_ids(self):
        return sorted(self.ids)

    def sbp_address(self, node_id, default=None):
        return "127.0.0.1:%d" % (7000 + node_id) if node_id in self.ids else default


def driver(ids, me=1):
    return PlacementDriver(client=type("C", (), {"reactor": None})(), prefix="/t/", node_id=me,
                           membership=Members(ids), store=None, replication_factor=3)


def place(pd, sid, r):
    servers = pd._servers(pd.choose(r))
    pd._set({"stream_id": sid, "replica_nums": r, "ranges": [{"index": 0, "start": 0, "end": -1, "servers": servers}]})
    return servers


@pytest.mark.parametrize("r", [1, 2, 3])
def test_distinct_nodes_one_primary_even_spread(r):
    pd = driver([1, 2, 3, 4, 5])
    for sid in range(1, 51):
        servers = place(pd, sid, r)
        assert len({s["id"] for s in servers}) == r
        assert [s["primary"] for s in servers] == [True] + [False] * (r - 1)  # the primary first
        assert all(s["addr"] == "127.0.0.1:%d" % (7000 + s["id"]) for s in servers)
    held = Counter(s["id"] for rec in pd.streams.values() for s in rec["ranges"][0]["servers"])
    led = Counter(s["id"] for rec in pd.streams.values() for s in rec["ranges"][0]["servers"] if s["primary"])
    # primaries exactly even; copies within 2 (both at once cannot always be within 1)
    assert max(led.values()) - min(led.values()) <= 1, led
    assert max(held.values()) - min(held.values()) <= 2, held


def test_too_few_live_nodes_is_1502():
    pd = driver([1, 2])
    with pytest.raises(NoAvailableRS):
        pd.choose(3)
    assert len(pd.choose(2)) == 2


def test_a_new_node_takes_the_next_streams():
    pd = driver([1, 2])
    for sid in range(1, 11):
        place(pd, sid, 1)
    pd.membership.ids.append(3)
    chosen = [place(pd, sid, 1)[0]["id"] for sid in range(11, 16)]
    assert chosen == [3] * 5  # least loaded first


def test_open_range_and_primary_helpers():
    rec = {"ranges": [{"end": 10, "servers": [{"id": 1, "primary": True}]},
                      {"end": -1, "servers": [{"id": 2, "primary": False}, {"id": 3, "primary": True}]}]}
    assert placement.primary_of(placement.open_range(rec))["id"] == 3
    assert placement.hosts(rec, 1) and not placement.hosts(rec, 4)
    assert placement.ack_count(3) == 2 and placement.ack_count(1) == 1 and placement.ack_count(5) == 3


def test_load_counts_follow_changes_and_deletes():
    pd = driver([1, 2, 3])
    place(pd, 1, 3)
    assert pd._held == {1: 1, 2: 1, 3: 1} and sum(pd._led.values()) == 1
    rec = dict(pd.streams[1])
    rec["ranges"] = [dict(rec["ranges"][0], end=5)]  # sealed: no open range
    pd._set(rec)
    assert set(pd._held.values()) == {0} and set(pd._led.values()) == {0}
    place(pd, 2, 2)
    pd._unset(2)
    assert set(pd._held.values()) == {0}
