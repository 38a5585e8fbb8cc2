"""Real node processes for tests: `twistd -n --pidfile= sbpnode` on tcp:0 ports with --ready-file."""

import json
import os
import signal
import subprocess
import sys
import time

from node.config import LISTENERS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def twistd_command():
    # twistd through this interpreter, so the node runs in the test's environment (venv); the
    # repo on PYTHONPATH lets plugin discovery find twisted/plugins/ even without an install.
    return [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]


class NodeProcess:
    """One node. Options are keyword arguments named like the CLI with ``_`` for ``-``:
    ``NodeProcess(tmp_path, fsync="never", peer=[...], http_token="t")``. Every listener defaults to
    ``tcp:0:interface=127.0.0.1``; pass ``sbp="none"`` to turn one off."""

    def __init__(self, base_dir, name="node", **options):
        self.base_dir = str(base_dir)
        self.name = name
        self.data_dir = os.path.join(self.base_dir, name + "-data")
        self.ready_file = os.path.join(self.base_dir, name + ".ready")
        self.log_path = os.path.join(self.base_dir, name + ".log")
        self.options = options
        self.proc = None
        self.ready = None

    @property
    def ports(self):
        return self.ready

    @property
    def node_id(self):
        return self.ready["node_id"]

    def address(self, listener):
        return ("127.0.0.1", self.ready[listener])

    def endpoint(self, listener):
        return "127.0.0.1:%d" % self.ready[listener]

    def peer_endpoint(self):
        """This node's swarm listener as a --peer client endpoint string."""
        return "tcp:host=127.0.0.1:port=%d" % self.ready["swarm"]

    def argv(self):
        args = twistd_command() + ["-n", "--pidfile=", "sbpnode", "--data-dir", self.data_dir, "--ready-file", self.ready_file]
        opts = dict(self.options)
        for name in LISTENERS:
            opts.setdefault(name, "tcp:0:interface=127.0.0.1")
        for key, value in opts.items():
            flag = "--" + key.replace("_", "-")
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                args += [flag, str(v)]
        return args

    def start(self, timeout=30.0):
        if os.path.exists(self.ready_file):
            os.remove(self.ready_file)
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=self._log, stderr=subprocess.STDOUT, cwd=self.base_dir, env=env)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                raise RuntimeError("node exited with %s before ready:\n%s" % (self.proc.returncode, self.log_text()[-4000:]))
            if time.monotonic() > deadline:
                self.kill9()
                raise RuntimeError("node not ready after %ss:\n%s" % (timeout, self.log_text()[-4000:]))
            time.sleep(0.02)
        with open(self.ready_file) as f:
            self.ready = json.load(f)
        return self

    def log_text(self):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def kill9(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def terminate(self, timeout=30.0):
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise RuntimeError("node did not exit within %ss of SIGTERM:\n%s" % (timeout, self.log_text()[-4000:]))
        self._close_log()
        return self.proc.returncode

    def restart(self, **kw):
        self.terminate()
        return self.start(**kw)

    def _close_log(self):
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.kill9()
