import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.nodeproc import NodeProcess  # noqa: E402

try:
    from hypothesis import settings

    settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True)
    settings.register_profile("dev", max_examples=200, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
except ImportError:
    pass


@pytest.fixture
def node_factory(tmp_path):
    """Start real nodes: ``node_factory(name="a", fsync="never", ...)``; all are killed at the end."""
    started = []

    def start(name=None, **options):
        node = NodeProcess(tmp_path, name=name or "node%d" % len(started), **options)
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.kill9()


@pytest.fixture
def node(node_factory):
    """One running node with every listener on a free loopback port."""
    return node_factory()


@pytest.fixture
def etcd(tmp_path):
    """One real etcd member on free loopback ports (tests/etcdproc.py); stopped at the end."""
    from tests.etcdproc import EtcdCluster

    d = tmp_path / "etcd"
    d.mkdir()
    cluster = EtcdCluster(d, members=1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd3(tmp_path):
    """Three real etcd members (fault tests)."""
    from tests.etcdproc import EtcdCluster

    d = tmp_path / "etcd3"
    d.mkdir()
    cluster = EtcdCluster(d, members=3).start()
    yield cluster
    cluster.stop()
