"""Seeded fault campaign for replicated streams (CONTRACT §9; issue 17).

Three nodes and one etcd on loopback; W writers, each appending distinct batches to its own R=3
stream on whichever node is the open range's primary (retrying on any error); every ~KILL_EVERY
seconds (seeded) one node is killed with SIGKILL and restarted after a short pause, never more than
one down at a time (R - ack_count = 1). At the end every node runs, and the checker reads every
stream from every replica of its open range and counts:

- acked: appends acknowledged to the writers;
- lost: acknowledged batches missing, or different, at their acknowledged offset on some replica;
- duplicated: one acknowledged batch acknowledged at two offsets;
- reordered: a writer's acknowledgements with offsets not increasing;
- diverged: replicas of one stream not byte-identical up to the stream's end;
- longest stall: the longest time a writer went without an acknowledgement (failover time).

    PYTHONPATH=$PWD python3 bench/replication_campaign.py --seeds 1,2 --duration 60

Exit status 0 only if lost, duplicated, reordered and diverged are all 0 for every seed.
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protocols.sbp import codec  # noqa: E402
from protocols.sbp.client import BlockingSbpClient, SbpError  # noqa: E402
from storage import record_batch  # noqa: E402
from tests.etcdproc import EtcdCluster  # noqa: E402
from tests.nodeproc import NodeProcess  # noqa: E402


def batch(n, tag):
    return record_batch.encode([(1000 + i, [], tag + b"%d" % i) for i in range(n)])


def alive(n):
    return n.proc is not None and n.proc.poll() is None


def client(n, timeout=5):
    return BlockingSbpClient("127.0.0.1", n.ports["sbp"], timeout=timeout)


def open_range(nodes, sid):
    for n in nodes:
        if not alive(n):
            continue
        try:
            with client(n, 3) as c:
                return c.list_ranges(sid)[-1]
        except Exception:
            continue
    return None


class Writer(threading.Thread):
    def __init__(self, nodes, sid, wid):
        super().__init__(daemon=True)
        self.nodes, self.sid, self.wid = nodes, sid, wid
        self.acked = []  # (offset, batch, time)
        self.stop = threading.Event()
        self.errors = 0

    def run(self):
        c = None
        n = 0
        while not self.stop.is_set():
            b = batch(1 + n % 4, b"w%d-%d-" % (self.wid, n))
            try:
                if c is None:
                    r = open_range(self.nodes, self.sid)
                    pid = next(s["server_id"] for s in r["servers"] if s["is_primary"]) if r else None
                    p = next((x for x in self.nodes if x.node_id == pid), None)
                    if p is None or not alive(p):
                        time.sleep(0.05)
                        continue
                    c = client(p)
                off = c.append(self.sid, b)
            except (SbpError, OSError, Exception):
                self.errors += 1
                try:
                    if c is not None:
                        c.close()
                except Exception:
                    pass
                c = None
                time.sleep(0.02)
                continue
            self.acked.append((off, b, time.monotonic()))
            n += 1
        if c is not None:
            c.close()


def fetch_all(n, sid, upto):
    out = {}
    offset = 0
    with client(n, 10) as c:
        while offset < upto:
            try:
                data = c.fetch(sid, offset)
            except SbpError as e:
                if e.code != codec.PD_NOT_LEADER:  # a copy still catching up names the primary
                    raise
                break
            if not data:
                break
            for b in record_batch.split(data):
                base = int.from_bytes(b[1:9], "big", signed=True)
                out[base] = bytes(b)
                offset = base + int.from_bytes(b[9:13], "big", signed=True)
    return offset, out


def run_seed(seed, args):
    rnd = random.Random(seed)
    base = tempfile.mkdtemp(prefix="sbp-campaign-%d-" % seed)
    etcd = EtcdCluster(base, members=1).start()
    nodes = [NodeProcess(base, name="n%d" % i, cluster=etcd.client_urls, fsync=args.fsync, node_id=i) for i in (1, 2, 3)]
    counts = {"seed": seed, "kills": 0}
    try:
        for n in nodes:
            n.start(timeout=60)
        with client(nodes[0]) as c:
            sids = [c.create_stream(replica_nums=3)["stream_id"] for _ in range(args.writers)]
        writers = [Writer(nodes, sid, i) for i, sid in enumerate(sids)]
        for w in writers:
            w.start()
        t_end = time.monotonic() + args.duration
        while time.monotonic() < t_end:
            time.sleep(args.kill_every * rnd.uniform(0.5, 1.5))
            victim = rnd.choice(nodes)
            victim.kill9()
            counts["kills"] += 1
            time.sleep(rnd.uniform(0.2, 2.0))
            victim.start(timeout=60)
        # let the last failover finish and the writers make progress on every stream
        settle = time.monotonic() + 30
        marks = [len(w.acked) for w in writers]
        while time.monotonic() < settle and any(len(w.acked) < m + 20 for w, m in zip(writers, marks)):
            time.sleep(0.1)
        for w in writers:
            w.stop.set()
        for w in writers:
            w.join(30)
        lost = dup = reordered = diverged = 0
        acked = sum(len(w.acked) for w in writers)
        stall = 0.0
        for w in writers:
            offs = [o for o, _, _ in w.acked]
            reordered += sum(1 for a, b in zip(offs, offs[1:]) if b <= a)
            bodies = {}
            for o, b, _ in w.acked:
                bodies.setdefault(b, set()).add(o)
            dup += sum(1 for v in bodies.values() if len(v) > 1)
            times = [t for _, _, t in w.acked]
            stall = max([stall] + [b - a for a, b in zip(times, times[1:])])
            if not w.acked:
                continue
            end = max(o + int.from_bytes(b[9:13], "big") for o, b, _ in w.acked)
            r = open_range(nodes, w.sid)
            replicas = [x for x in nodes if x.node_id in {s["server_id"] for s in r["servers"]}]
            views = []
            for x in replicas:
                deadline = time.monotonic() + 60
                upto, got = fetch_all(x, w.sid, end)
                while upto < end and time.monotonic() < deadline:
                    time.sleep(0.2)
                    upto, got = fetch_all(x, w.sid, end)
                views.append(got)
                for o, b, _ in w.acked:
                    if got.get(o) != b[:1] + o.to_bytes(8, "big", signed=True) + b[9:]:
                        lost += 1
            if any(v != views[0] for v in views[1:]):
                diverged += 1
            counts.setdefault("replicas", []).append(len(replicas))
        counts.update(acked=acked, lost=lost, duplicated=dup, reordered=reordered, diverged=diverged,
                      longest_stall_s=round(stall, 2), writer_errors=sum(w.errors for w in writers))
        return counts
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of faults per seed")
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=2.0)
    ap.add_argument("--fsync", default="never", help="the nodes' --fsync (a kill -9 keeps the page cache)")
    ap.add_argument("--keep", action="store_true", help="keep the data dirs and logs")
    args = ap.parse_args()
    bad = False
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        t0 = time.monotonic()
        c = run_seed(seed, args)
        c["seconds"] = round(time.monotonic() - t0, 1)
        print("seed %(seed)d: %(kills)d kills, %(acked)d acked, lost %(lost)d, duplicated %(duplicated)d, "
              "reordered %(reordered)d, diverged %(diverged)d, longest stall %(longest_stall_s)ss, "
              "writer retries %(writer_errors)d, open-range replicas %(replicas)s, %(seconds)ss" % c, flush=True)
        bad |= bool(c["lost"] or c["duplicated"] or c["reordered"] or c["diverged"])
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
