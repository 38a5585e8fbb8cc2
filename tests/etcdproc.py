"""Real etcd processes for tests and benchmarks: one member or several, on free loopback ports, data
in a temp dir. ``EtcdCluster(base_dir, members=3).start()``; ``client_urls`` is what ``--cluster``
takes; ``kill9(i)`` / ``start_member(i)`` for fault tests; ``stop()`` ends every member."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port():
    """A loopback port that is free now, for a server that must keep its port across restarts.
    Chosen below the kernel's ephemeral range: a port the kernel hands out (port 0) can be taken
    again by any outgoing connection before our server binds it (seen as EADDRINUSE on restart)."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_available():
    return os.path.exists(ETCD)


class EtcdCluster:
    def __init__(self, base_dir, members=1, name="etcd", tls=None):
        """``tls``: (cert, key, ca) PEM paths: clients must present a CA-signed certificate."""
        self.base_dir = str(base_dir)
        self.name = name
        self.n = members
        self.tls = tls
        self.scheme = "https" if tls else "http"
        self.names = ["%s%d" % (name, i) for i in range(members)]
        self.client_ports = [free_port() for _ in range(members)]
        self.peer_ports = [free_port() for _ in range(members)]
        self.procs = [None] * members
        self._logs = [None] * members

    @property
    def client_urls(self):
        return ",".join(self.url(i) for i in range(self.n))

    def url(self, i):
        return "%s://127.0.0.1:%d" % (self.scheme, self.client_ports[i])

    def data_dir(self, i):
        return os.path.join(self.base_dir, self.names[i] + ".data")

    def argv(self, i):
        initial = ",".join("%s=http://127.0.0.1:%d" % (self.names[j], self.peer_ports[j]) for j in range(self.n))
        args = [
            ETCD, "--name", self.names[i], "--data-dir", self.data_dir(i),
            "--listen-client-urls", self.url(i), "--advertise-client-urls", self.url(i),
            "--listen-peer-urls", "http://127.0.0.1:%d" % self.peer_ports[i],
            "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % self.peer_ports[i],
            "--initial-cluster", initial, "--initial-cluster-token", "t-%d" % self.peer_ports[0],
            "--initial-cluster-state", "new",
            # fast failure detection between members on loopback (fault tests)
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--logger", "zap", "--log-outputs", "stderr",
        ]
        if self.tls:
            cert, key, ca = self.tls
            args += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth"]
        return args

    def start(self, timeout=30.0):
        for i in range(self.n):
            self.start_member(i, wait=False)
        self.wait_healthy(timeout)
        return self

    def start_member(self, i, wait=True, timeout=30.0):
        log = open(os.path.join(self.base_dir, self.names[i] + ".log"), "ab")
        self._logs[i] = log
        self.procs[i] = subprocess.Popen(self.argv(i), stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_healthy(timeout, members=[i])

    def _ssl_context(self):
        if not self.tls:
            return None
        import ssl

        cert, key, ca = self.tls
        ctx = ssl.create_default_context(cafile=ca)
        ctx.load_cert_chain(cert, key)
        return ctx

    def request(self, i, path, body, timeout=2.0):
        req = urllib.request.Request(self.url(i) + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout, context=self._ssl_context()) as r:
            return json.loads(r.read())

    def wait_healthy(self, timeout=30.0, members=None):
        members = range(self.n) if members is None else members
        deadline = time.monotonic() + timeout
        for i in members:
            while True:
                p = self.procs[i]
                if p is not None and p.poll() is not None:
                    raise RuntimeError("etcd member %d exited with %s:\n%s" % (i, p.returncode, self.log_text(i)[-3000:]))
                try:
                    # a linearizable read answers only once the member has a leader
                    self.request(i, "/v3/kv/range", {"key": "AA=="})
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError("etcd member %d not healthy after %ss:\n%s" % (i, timeout, self.log_text(i)[-3000:]))
                    time.sleep(0.05)

    def log_text(self, i):
        try:
            with open(os.path.join(self.base_dir, self.names[i] + ".log"), "rb") as f:
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def kill9(self, i):
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        if self._logs[i] is not None:
            self._logs[i].close()
            self._logs[i] = None

    def stop(self):
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                p.terminate()
        for i, p in enumerate(self.procs):
            if p is not None:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
            self.kill9(i)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
