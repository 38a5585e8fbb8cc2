"""Crash tests: a child process appends with fsync always and reports each ack over a pipe; it is
SIGKILLed at random (seeded) moments, and after every kill the reopened store must hold every acked
batch byte-identical, every acked kv pair and chunk, and nothing half-present."""

import os
import random
import select
import signal
import subprocess
import sys
import time

import pytest
import pytest_twisted
from twisted.internet import reactor

from storage import Store
from storage import record_batch as rb
from tests.storage_helpers.crash_child import expected_batch, kv_value

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILLS = int(os.environ.get("STORAGE_CRASH_KILLS", "60"))


class ForkServer:
    """One helper process that imported the store once and forks a fresh child per run."""

    def __init__(self, tmp):
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.storage_helpers.crash_child", "serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env)
        self.tmp = tmp
        self.n = 0

    def run(self, path, seed, run_for):
        """Start a child, read its acks for ``run_for`` s after it is ready, SIGKILL it."""
        self.n += 1
        fifo = os.path.join(self.tmp, "acks-%d" % self.n)
        os.mkfifo(fifo)
        self.proc.stdin.write(("%s %d %s\n" % (path, seed, fifo)).encode())
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        fd = os.open(fifo, os.O_RDONLY)
        lines, buf = [], b""
        deadline = time.monotonic() + 20.0
        ready = False
        try:
            while time.monotonic() < deadline:
                r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
                if not r:
                    break
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError("child %d exited early" % pid)
                buf += chunk
                *done, buf = buf.split(b"\n")
                for line in done:
                    if line == b"READY":
                        ready = True
                        deadline = time.monotonic() + run_for
                    else:
                        lines.append(line.decode())
            assert ready, "child never became ready"
        finally:
            os.kill(pid, signal.SIGKILL)
            while True:  # the fork server ignores SIGCHLD, so the pid vanishes once it is dead
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.002)
            os.close(fd)
            os.unlink(fifo)
        # acks written after our last read are lost to us: that only weakens the check
        return lines

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(10)
        self.proc.stdout.close()


async def verify(path, acked, trims, seals):
    store = Store.open(path, fsync="always", reactor=reactor, node_id=1, segment_bytes=256 << 10,
                       pack_bytes=64 << 10, retention_check_s=0)
    try:
        stored = {}
        for meta in store.log.streams():
            sid = meta.stream_id
            assert meta.trim_offset >= trims.get(sid, 0), "an acked trim was lost"
            # every stored batch is whole, valid and contiguous: nothing half-present
            got = await store.log.read(sid, meta.trim_offset, 1 << 40)
            pos = None
            for b in got:
                h = rb.validate(b)
                assert pos is None or h.base_offset == pos
                assert h.base_offset <= meta.trim_offset if pos is None else True
                pos = h.next_offset
                stored[(sid, h.base_offset)] = b
            assert (pos if pos is not None else meta.trim_offset) == meta.next_offset
            # ranges: contiguous, only the last open, at least the acked seals
            rs = meta.ranges
            assert rs[-1].end_offset == -1 and all(r.end_offset >= 0 for r in rs[:-1])
            assert all(rs[k].start_offset == rs[k - 1].end_offset for k in range(1, len(rs)))
            assert rs[-1].range_index >= seals.get(sid, 0)
        for (sid, base), (seed, i) in acked.items():
            want = rb.with_base_offset(expected_batch(seed, i), base)
            if base + rb.read_header(want).record_count <= store.log.stream(sid).trim_offset:
                continue  # trimmed since
            assert stored.get((sid, base)) == want, "acked batch %d of stream %d lost or changed" % (base, sid)
        return store
    except BaseException:
        await store.close()
        raise


@pytest.mark.slow
@pytest_twisted.ensureDeferred
async def test_sigkill_during_appends_loses_no_acked_write(tmp_path):
    rnd = random.Random(20261122)
    path = str(tmp_path / "store")
    acked = {}
    kv_acked, chunks_acked = [], []
    trims, seals, metas = {}, {}, []
    server = ForkServer(str(tmp_path))
    try:
        await _kill_loop(server, rnd, path, acked, kv_acked, chunks_acked, trims, seals, metas)
    finally:
        server.close()


async def _kill_loop(server, rnd, path, acked, kv_acked, chunks_acked, trims, seals, metas):
    total_acks = 0
    replays = []
    for kill in range(KILLS):
        seed = kill + 1
        lines = server.run(path, seed, rnd.uniform(0.01, 0.25))
        for line in lines:
            kind, *rest = line.split()
            if kind == "B":
                sid, base, i = map(int, rest)
                acked[(sid, base)] = (seed, i)
            elif kind == "K":
                kv_acked.append((seed, rest[0].encode()))
            elif kind == "C":
                chunks_acked.append(bytes.fromhex(rest[0]))
            elif kind == "M":
                metas.append((seed, rest[0].encode()))
            elif kind == "T":
                sid, point = map(int, rest)
                trims[sid] = max(trims.get(sid, 0), point)
            elif kind == "S":
                sid = int(rest[0])
                seals[sid] = seals.get(sid, 0) + 1
        total_acks += len(lines)
        t0 = time.monotonic()
        # the child runs while this test blocks the reactor: the store is closed meanwhile
        store = await verify(path, acked, trims, seals)
        replays.append(store.replayed)
        try:
            for seed, key in kv_acked:
                assert store.kv.get(key) == kv_value(seed, key)
            assert all(store.chunks.has_many(chunks_acked))
            for addr in chunks_acked[-5:]:
                await store.chunks.get(addr)
            for seed, key in metas:
                value = store.meta.read(lambda txn: txn.get("crash", key))
                assert value is not None and value["seed"] == seed and b"m%d-%d" % (seed, value["i"]) == key
        finally:
            await store.close()
        if os.environ.get("STORAGE_CRASH_DEBUG"):
            print(kill, len(lines), "verify %.3f" % (time.monotonic() - t0))
    if os.environ.get("STORAGE_CRASH_DEBUG"):
        print("reopens that replayed a WAL tail:", sum(1 for r in replays if r), "of", len(replays))
        print("acks", total_acks, "batches", len(acked), "kv", len(kv_acked), "chunks", len(chunks_acked),
              "meta", len(metas), "trims", trims, "seals", seals, "segments", len(os.listdir(os.path.join(path, "wal"))))
    # most kills land while a group is between its WAL write and its index commit: recovery
    # replays that tail (34 of 60 reopens in a typical run); make sure the path was exercised
    assert sum(1 for r in replays if r) >= KILLS // 10
    assert total_acks > KILLS * 5, "the children acked too little to test anything (%d)" % total_acks
