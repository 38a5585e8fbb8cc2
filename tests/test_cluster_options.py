"""The cluster options of CONTRACT §9 as the node parses them (node/config.py)."""

import pytest
from twisted.python import usage

from node.tap import Options


def parse(*argv):
    o = Options()
    o.parseOptions(list(argv))
    return o.config


def test_defaults_without_cluster_change_nothing():
    c = parse()
    assert c.cluster is None and c.replication_factor == 1 and c.cluster_prefix == "/sbpnode/" and c.advertise is None


def test_cluster_options():
    c = parse("--cluster", "http://127.0.0.1:2379, https://10.0.0.2:2379", "--cluster-prefix", "/prod",
              "--advertise", "10.0.0.1")
    assert c.cluster == "http://127.0.0.1:2379,https://10.0.0.2:2379"
    assert c.cluster_prefix == "/prod/"  # every key lives under the prefix: it ends with /
    assert c.advertise == "10.0.0.1"
    assert c.replication_factor == 3  # CONTRACT §9: 3 in a cluster
    assert parse("--cluster", "http://127.0.0.1:2379", "--replication-factor", "2").replication_factor == 2


@pytest.mark.parametrize("argv, message", [
    (["--cluster", "127.0.0.1:2379"], "--cluster"),
    (["--cluster", "http://127.0.0.1"], "--cluster"),
    (["--cluster", " , "], "--cluster"),
    (["--cluster", "http://127.0.0.1:2379", "--cluster-prefix", "sbp"], "--cluster-prefix"),
    (["--cluster", "http://127.0.0.1:2379", "--cluster-tls-cert", "/nonexistent"], "go together"),
    (["--cluster-tls-cert", "/a", "--cluster-tls-key", "/b", "--cluster-tls-ca", "/c"], "no file"),
])
def test_bad_cluster_options_are_refused(argv, message):
    with pytest.raises(usage.UsageError) as info:
        parse(*argv)
    assert message in str(info.value)
