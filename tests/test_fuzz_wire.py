"""A short over-the-wire fuzz campaign against every listener of a live node (issue 21; the long
campaigns are ``bench/fuzz_wire.py``): no crash, no hang of a kept connection, bounded memory,
no traceback in the node's log."""

import pytest

from bench.fuzz_wire import LISTENERS, campaign


@pytest.mark.slow
def test_every_listener_survives_random_and_mutated_frames(node_factory):
    # the idle timeout reaps the connections cases leave open; it must outlast the gap between two
    # witness checks (20 cases), which passed 5 s on a loaded machine and closed the SBP witness
    node = node_factory(fsync="never", log_level="warn", idle_timeout="30")
    counts, rss_start, rss_end, worst = campaign(node, LISTENERS, cases=60, check_every=20, log=lambda *a: None)
    assert counts == {name: 60 for name in LISTENERS}
    assert rss_end - rss_start < 128
    assert max(worst.values()) < 5.0
