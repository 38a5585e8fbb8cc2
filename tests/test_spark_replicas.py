"""The Spark source's replica choice (node/spark/replicas.py): pure planning, no Spark, no node."""

import pytest

from node.spark.replicas import Spreader, bounds, replica_addresses

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


def rng(sid, index, start, end, servers, primary, next_offset=None):
    return {"stream_id": sid, "range_index": index, "start_offset": start, "end_offset": end,
            "next_offset": end if end >= 0 else next_offset,
            "servers": [{"server_id": i + 1, "advertise_addr": a, "is_primary": a == primary} for i, a in enumerate(servers)]}


def test_equal_partitions_land_one_per_replica_and_keep_the_others_as_fallbacks():
    s = Spreader({A, B, C}, A)
    chosen = [s.servers(rng(sid, 0, 0, 100, [A, B, C], A), 0, 100) for sid in (7, 8, 9)]
    assert sorted(c[0] for c in chosen) == [A, B, C]
    assert all(sorted(c) == [A, B, C] for c in chosen)


def test_a_bigger_partition_weighs_more():
    s = Spreader({A, B}, A)
    first = s.servers(rng(1, 0, 0, 1000, [A, B], A), 0, 1000)[0]
    # the next two small ones both go to the other replica
    rest = [s.servers(rng(1, i, 0, 10, [A, B], A), 0, 10)[0] for i in (1, 2)]
    assert rest == [({A, B} - {first}).pop()] * 2


def test_dead_servers_are_skipped_and_the_endpoint_comes_last():
    s = Spreader({B, C}, C)
    r = rng(5, 0, 0, 50, [A, B], A)  # A (its old primary) is not a live member
    assert replica_addresses(r, {B, C}) == [B]
    assert s.servers(r, 0, 50) == [B, C]
    assert Spreader({C}, C).servers(r, 0, 50) == [C]  # no live replica: the endpoint redirects


def test_read_from_endpoint_and_bad_values():
    assert Spreader({A, B, C}, B, "endpoint").servers(rng(1, 0, 0, 9, [A, B, C], A), 0, 9) == [B]
    with pytest.raises(ValueError):
        Spreader({A}, A, "nearest")


def test_bounds_of_sealed_and_open_ranges():
    assert bounds([rng(1, 0, 5, 30, [A], A), rng(1, 1, 30, -1, [A], A, next_offset=31)]) == (5, 31)
    assert bounds([]) == (0, 0)
