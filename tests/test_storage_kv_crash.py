"""kill -9 of a store under key-value load with ``--fsync always`` (issue 19): every acknowledged
SET and REMOVE survives, across merges of the memtable into LMDB (several transactions each) and
the kv floor (CONTRACT §4's durability; docs/storage.md, "Recovery of the memtable").

The child (tests/storage_helpers/kv_crash_child.py) writes a small key space over and over, so
REMOVE-then-SET and SET-then-REMOVE of one key land on both sides of the floor; the test kills it
at random moments (mid-run, mid-merge), and the next child reports what the reopened store holds.
"""

import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLS = 12


class Child:
    def __init__(self, path, seed, verify=False, kill_worker=False):
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        argv = [sys.executable, "-m", "tests.storage_helpers.kv_crash_child", path, str(seed)] + (
            ["verify"] if verify else ["kill-worker"] if kill_worker else [])
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
        self.buf = b""

    def lines(self, until=None, timeout=60.0):
        """Lines read until one equals ``until`` (or, with None, until EOF)."""
        deadline = time.monotonic() + timeout
        out = []
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                out.append(line.decode())
                if until is not None and out[-1] == until:
                    return out
            left = deadline - time.monotonic()
            assert left > 0, "child silent: %r" % self.proc.stderr.read1() if self.proc.poll() is not None else "child too slow"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 1 << 16)
                if not data:
                    assert until is None, "child exited early: %s" % self.proc.stderr.read().decode()[-3000:]
                    return out
                self.buf += data

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        rest = self.buf + self.proc.stdout.read()  # what the kernel holds of the pipe survives
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rest


def check_state(lines, acked, inflight):
    """The reopened store's ``S`` lines against the model: each key holds its last acknowledged
    value, or the value of the write to it that was in flight at the kill."""
    got = {}
    for line in lines:
        assert not line.startswith("BAD"), line
        if line.startswith("S "):
            _, key, value = line.split()
            got[bytes.fromhex(key)] = None if value == "-" else bytes.fromhex(value)
    for key, value in got.items():
        allowed = [acked.get(key)]
        if key in inflight:
            allowed.append(inflight[key])
        assert value in allowed, "key %s: %r, acknowledged %r" % (key.hex(), value, allowed)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("kill_worker", [False, True], ids=["node", "node-and-worker-alone"])
def test_kill9_under_kv_load_keeps_every_acked_set_and_remove(tmp_path, kill_worker):
    """kill -9 of the store's process, at random moments: some land while the merge worker
    process is merging (counted: at least one must). ``node-and-worker-alone``: besides, the child
    SIGKILLs its merge worker alone, mostly mid-merge (counted: at least 3 must land mid-merge), so the
    writer thread merges those memtables and a new worker the next ones."""
    rnd = random.Random(1919)
    path = str(tmp_path / "store")
    acked = {}  # key -> last acknowledged value (None: removed, or never written)
    inflight = {}
    acks = removes_acked = 0
    mid_merge = worker_kills_mid_merge = worker_merges = 0
    for kill in range(KILLS):
        child = Child(path, kill + 1, kill_worker=kill_worker)
        try:
            # a write in flight at the kill either survived or not: what the store holds is the truth
            acked.update(check_state(child.lines(until="READY"), acked, inflight))
            # once the merge worker has answered a first merge (it starts with the first write),
            # the load runs in the child and the kill lands anywhere
            seen = child.lines(until="m ok")
        except BaseException:
            child.kill9()  # a failed wait does not leave the child running
            raise
        inflight = {}
        runs = {}
        time.sleep(rnd.uniform(0.05, 0.6))
        # the last line may be cut by the kill (an ``I`` line of a run never submitted: the child
        # submits only after the whole line is written); every whole line ends with a newline
        lines = seen + child.kill9().decode().split("\n")[:-1]
        merge_lines = [line for line in lines if line in ("M", "m ok", "m err")]
        mid_merge += bool(merge_lines) and merge_lines[-1] == "M"  # the kill landed during a worker merge
        worker_merges += lines.count("m ok")
        worker_kills_mid_merge += lines.count("W")
        for line in lines:
            assert not line.startswith("BAD"), line
            if line.startswith("I "):
                parts = line.split()
                ops = []
                for op in parts[2:]:
                    key, value = op.split(":")
                    ops.append((bytes.fromhex(key), None if value == "-" else bytes.fromhex(value)))
                runs[int(parts[1])] = ops
            elif line.startswith("A "):
                for key, value in runs.pop(int(line.split()[1])):
                    acked[key] = value
                    acks += 1
                    removes_acked += value is None
        for ops in runs.values():  # issued, not acknowledged: either outcome is allowed
            for key, value in ops:
                inflight[key] = value
    final = Child(path, 0, verify=True)
    got = check_state(final.lines(), acked, inflight)
    assert final.proc.wait() == 0
    final.proc.stdout.close()
    final.proc.stderr.close()
    assert acks > KILLS * 50 and removes_acked > KILLS * 10, (acks, removes_acked)
    assert worker_merges >= KILLS, worker_merges  # (the child blocks once its stdout pipe is full)
    if kill_worker:
        assert worker_kills_mid_merge >= 3, worker_kills_mid_merge
    else:
        assert mid_merge >= 1, mid_merge
    assert any(v is not None for v in got.values()) and any(v is None for v in got.values())
