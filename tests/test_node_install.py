"""Packaging: the twistd drop-in is discoverable and sbpctl is on PATH in the installed environment."""

import os
import shutil
import subprocess
import sys

import pytest
from twisted.application.service import IServiceMaker
from twisted.plugin import getPlugins

from tests.nodeproc import REPO


def test_plugin_is_discovered_and_builds_options():
    makers = {p.tapname: p for p in getPlugins(IServiceMaker)}
    assert "sbpnode" in makers
    options = makers["sbpnode"].options()
    options.parseOptions(["--data-dir", "/tmp/x", "--fsync", "never", "--kv", "none"])
    assert options.config.kv is None
    assert options.config.fsync is not None


def _installed():
    result = subprocess.run([sys.executable, "-m", "pip", "show", "-f", "sbpnode"], capture_output=True, text=True)
    return result.returncode == 0


@pytest.mark.skipif(not _installed(), reason="sbpnode is not pip-installed in this environment")
def test_installed_twistd_lists_sbpnode_outside_the_repo(tmp_path):
    # Outside the repo and without PYTHONPATH, only the installation can make the plugin visible
    # (the editable-install trap of research note §2.2).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    twistd = shutil.which("twistd") or os.path.join(os.path.dirname(sys.executable), "twistd")
    result = subprocess.run([twistd, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert "sbpnode" in result.stdout
    sbpctl = shutil.which("sbpctl") or os.path.join(os.path.dirname(sys.executable), "sbpctl")
    result = subprocess.run([sbpctl, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for group in ("status", "stream", "kv", "fs", "peer", "s2"):
        assert group in result.stdout


def test_sbpctl_status_reports_an_unreachable_node_without_a_traceback(tmp_path):
    s = __import__("socket").socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", "status", "--endpoint", "127.0.0.1:%d" % port],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert "not reachable" in result.stderr
    assert "Traceback" not in result.stderr


def test_sbpctl_status_of_a_running_node(node):
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", "status", "--endpoint", node.endpoint("sbp"), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "{" in result.stdout
