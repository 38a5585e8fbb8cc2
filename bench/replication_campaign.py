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

import os
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protocols.sbp import codec  # noqa: E402
from protocols.sbp.client import BlockingSbpClient, SbpError  # noqa: E402
from storage import record_batch  # noqa: E402
from bench import campaign  # noqa: E402


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
    counts = {"seed": seed}
    with campaign.three_nodes(seed, "sbp-campaign", args) as (rnd, nodes):
        with client(nodes[0]) as c:
            sids = [c.create_stream(replica_nums=3)["stream_id"] for _ in range(args.writers)]
        writers = [Writer(nodes, sid, i) for i, sid in enumerate(sids)]
        for w in writers:
            w.start()
        counts["kills"] = campaign.kill_loop(rnd, nodes, args.duration, args.kill_every)
        # let the last failover finish and the writers make progress on every stream
        campaign.settle(lambda: [len(w.acked) for w in writers], 20)
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


def main():
    campaign.main(__doc__, run_seed,
                  "seed %(seed)d: %(kills)d kills, %(acked)d acked, lost %(lost)d, duplicated %(duplicated)d, "
                  "reordered %(reordered)d, diverged %(diverged)d, longest stall %(longest_stall_s)ss, "
                  "writer retries %(writer_errors)d, open-range replicas %(replicas)s, %(seconds)ss",
                  lambda c: c["lost"] or c["duplicated"] or c["reordered"] or c["diverged"],
                  duration=60.0, kill_every=2.0)


if __name__ == "__main__":
    main()
