"""The node as a real daemon: start options, ready file, data-dir lock, listeners, SIGTERM."""

import json
import os
import socket
import subprocess
import sys

import pytest

from node.config import LISTENERS
from tests.nodeproc import REPO, NodeProcess, twistd_command

READY_KEYS = set(LISTENERS) | {"node_id"}


def run_twistd(args, cwd, timeout=60):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        twistd_command() + ["-n", "--pidfile=", "sbpnode"] + args,
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_ready_file_lists_every_bound_port(node):
    with open(node.ready_file) as f:
        ready = json.load(f)
    assert set(ready) == READY_KEYS
    assert 1 <= ready["node_id"] <= 2**31 - 1
    for name in LISTENERS:
        assert isinstance(ready[name], int) and ready[name] > 0
        socket.create_connection(("127.0.0.1", ready[name]), timeout=5).close()


def test_ready_means_the_compiled_append_check_has_loaded(node):
    """Issue 21: the ready file waits for the warm-ups (no client meets the reactor stalled behind
    numba's import), and the log says how long start-up took."""
    from protocols.sbp.client import BlockingSbpClient

    c = BlockingSbpClient("127.0.0.1", node.ports["sbp"])
    try:
        assert c.status()["append_check"] in ("compiled", "msgpack")  # never "loading"
    finally:
        c.close()
    line = [x for x in node.log_text().splitlines() if " ready in " in x]
    assert len(line) == 1 and "since process start" in line[0], node.log_text()[-2000:]


def test_a_listener_can_be_turned_off_and_logs_one_line_each(node_factory):
    n = node_factory(kv="none", http="none")
    assert n.ready["kv"] is None and n.ready["http"] is None
    assert isinstance(n.ready["sbp"], int)
    log = n.log_text()
    for name in LISTENERS:
        assert log.count("%s listening on" % name) == 1, name


def test_sigterm_exits_zero_and_removes_the_ready_file(node):
    assert os.path.exists(node.ready_file)
    assert node.terminate() == 0
    assert not os.path.exists(node.ready_file)
    assert "store closed cleanly" in node.log_text()


def test_node_id_is_persisted_across_restarts(node_factory):
    n = node_factory()
    first = n.node_id
    n.restart()
    assert n.node_id == first


def test_node_id_option_is_used_and_a_mismatch_is_refused(tmp_path):
    n = NodeProcess(tmp_path, node_id=4242).start()
    try:
        assert n.node_id == 4242
    finally:
        n.terminate()
    result = run_twistd(["--data-dir", n.data_dir, "--node-id", "7", "--sbp", "none"], cwd=tmp_path)
    assert result.returncode != 0
    assert "belongs to node 4242" in result.stderr + result.stdout


def test_second_node_on_the_same_data_dir_refuses_to_start(node, tmp_path):
    result = run_twistd(
        ["--data-dir", node.data_dir] + [a for name in LISTENERS for a in ("--" + name.replace("_", "-"), "tcp:0:interface=127.0.0.1")],
        cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "in use by another sbpnode" in result.stderr + result.stdout
    # The first node is unharmed.
    socket.create_connection(("127.0.0.1", node.ports["sbp"]), timeout=5).close()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fsync", "sometimes"], "allowed: always, interval:MS"),
        (["--fsync", "interval:0"], "allowed: always, interval:MS"),
        (["--sbp", "bogus:thing"], "--sbp"),
        (["--node-id", "0"], "--node-id"),
        (["--log-level", "loud"], "--log-level"),
        (["--peer", "nonsense:::"], "--peer"),
        (["--idle-timeout", "bogus=3"], "--idle-timeout"),
        (["--idle-timeout", "-1"], "--idle-timeout"),
        (["--max-connections", "none"], "--max-connections"),
        (["--max-unsent-bytes", "-5"], "--max-unsent-bytes"),
        (["--kv-cache-mb", "-1"], "--kv-cache-mb"),
        (["--kv-cache-mb", "lots"], "--kv-cache-mb"),
    ],
)
def test_bad_options_give_a_clear_error_and_a_non_zero_exit(tmp_path, args, message):
    result = run_twistd(["--data-dir", str(tmp_path / "d")] + args, cwd=tmp_path)
    assert result.returncode != 0
    out = result.stderr + result.stdout
    assert message in out
    assert "Traceback" not in out


def test_an_unwritable_ready_file_fails_start_up_cleanly(tmp_path):
    result = run_twistd(["--data-dir", str(tmp_path / "d"), "--ready-file", str(tmp_path / "no" / "such" / "ready")]
                        + [a for name in LISTENERS for a in ("--" + name.replace("_", "-"), "none")], cwd=tmp_path)
    assert result.returncode != 0
    assert "--ready-file" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr + result.stdout


def test_a_port_in_use_fails_start_up_cleanly(tmp_path):
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        result = run_twistd(
            ["--data-dir", str(tmp_path / "d"), "--sbp", "tcp:%d:interface=127.0.0.1" % port]
            + [a for name in LISTENERS if name != "sbp" for a in ("--" + name.replace("_", "-"), "none")],
            cwd=tmp_path,
        )
    finally:
        blocker.close()
    assert result.returncode != 0
    assert "cannot listen on --sbp" in result.stderr + result.stdout


def test_help_documents_every_option(tmp_path):
    result = run_twistd(["--help"], cwd=tmp_path)
    assert result.returncode == 0
    for option in ["data-dir", "node-id", "peer", "fsync", "http-token", "max-batch-bytes", "ready-file", "log-level",
                   "idle-timeout", "max-connections", "max-unsent-bytes", "kv-cache-mb"] + [n.replace("_", "-") for n in LISTENERS]:
        assert "--%s=" % option in result.stdout, option


def test_log_level_filters_info_lines(node_factory):
    n = node_factory(log_level="warn")
    assert "listening on" not in n.log_text()
