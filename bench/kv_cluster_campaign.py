"""Seeded fault campaign for the cluster's key-value partitions (issue 20; CONTRACT §9).

Three nodes (R=3) and one etcd on loopback; W writers, each on its own keys (spread over all 8
partitions) through a node it picks at random (another one after any connection error): pipelined
windows of SETs and REMOVEs, each key's operations in order. Every ~KILL_EVERY seconds (seeded) one
node is killed with SIGKILL and restarted after a short pause, never more than one down at a time.
At the end the checker, through every node:

- lost: a key whose value is neither its last acknowledged operation's nor that of an operation
  sent after it without an answer (an unanswered write may or may not have happened);
- diverged: full GET_FF scans through the three nodes that differ;
- scan/get mismatches: a key whose scanned value differs from its GET.

    PYTHONPATH=$PWD python3 bench/kv_cluster_campaign.py --seeds 1,2 --duration 30

Exit status 0 only if lost and diverged are 0 for every seed.
"""

import os
import random
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from protocols.partition import codec  # noqa: E402
from protocols.partition.client import BlockingKvClient, KvError  # noqa: E402
from bench import campaign  # noqa: E402

WINDOW = 16
KEYS_PER_WRITER = 400


def alive(n):
    return n.proc is not None and n.proc.poll() is None and n.ready is not None


class Writer(threading.Thread):
    def __init__(self, nodes, wid, seed):
        super().__init__(daemon=True)
        self.nodes = nodes
        self.wid = wid
        self.rnd = random.Random(seed * 1000 + wid)
        self.keys = [bytes([(i * 7 + wid * 31) % 256]) + b"w%d-%04d" % (wid, i) for i in range(KEYS_PER_WRITER)]
        self.acked = {}  # key -> value (None: removed) of its last acknowledged operation
        self.after = {}  # key -> [values sent after it without an answer]
        self.stop = threading.Event()
        self.ops = self.errors = 0

    def run(self):
        version = 0
        c = None
        while not self.stop.is_set():
            if c is None:
                live = [n for n in self.nodes if alive(n)]
                if not live:
                    time.sleep(0.05)
                    continue
                try:
                    c = BlockingKvClient("127.0.0.1", self.rnd.choice(live).ports["kv"], timeout=30)
                except (OSError, TypeError, KeyError):
                    time.sleep(0.05)
                    continue
            window = []
            for key in self.rnd.sample(self.keys, WINDOW):
                version += 1
                value = None if self.rnd.random() < 0.1 else b"v%d" % version
                window.append((key, value, version))
                self.after.setdefault(key, []).append((version, value))
            reqs = [(codec.REMOVE, lambda cid, k=k: codec.encode_remove(cid, k)) if v is None
                    else (codec.SET, lambda cid, k=k, v=v: codec.encode_set(cid, k, v)) for k, v, _ in window]
            try:
                results = c.pipeline(reqs)
            except (OSError, ConnectionError, Exception):
                self.errors += 1
                try:
                    c.close()
                except Exception:
                    pass
                c = None
                continue
            for (k, v, op), r in zip(window, results):
                if isinstance(r, KvError):
                    self.errors += 1
                    continue
                self.ops += 1
                self.acked[k] = v
                # what was sent after this op stays possible; this op and what came before are settled
                self.after[k] = [(i, x) for i, x in self.after.get(k, []) if i > op]
        if c is not None:
            c.close()


def full_scan(node):
    with BlockingKvClient("127.0.0.1", node.ports["kv"], timeout=60) as c:
        out = []
        for p in c.iter_scan(codec.GET_FF, page=512):
            out.extend(p.items)
        return out


def run_seed(seed, args):
    counts = {"seed": seed}
    with campaign.three_nodes(seed, "kv-campaign", args, replication_factor=3) as (rnd, nodes):
        with BlockingKvClient("127.0.0.1", nodes[0].ports["kv"], timeout=60) as c:
            c.set(b"\x00campaign", b"1")  # places the partitions
        writers = [Writer(nodes, i, seed) for i in range(args.writers)]
        for w in writers:
            w.start()
        counts["kills"] = campaign.kill_loop(rnd, nodes, args.duration, args.kill_every)
        campaign.settle(lambda: [w.ops for w in writers], 50)
        for w in writers:
            w.stop.set()
        for w in writers:
            w.join(60)
        scans = [dict(full_scan(n)) for n in nodes]
        diverged = sum(1 for s in scans[1:] if s != scans[0])
        lost = mismatched = 0
        for w in writers:
            with BlockingKvClient("127.0.0.1", nodes[rnd.randrange(3)].ports["kv"], timeout=60) as c:
                keys = list(w.acked)
                got = c.pipeline([(codec.GET, lambda cid, k=k: codec.encode_get(cid, k)) for k in keys])
            for k, v in zip(keys, got):
                possible = [w.acked[k]] + [x for _i, x in w.after.get(k, [])]
                if v not in possible:
                    lost += 1
                if scans[0].get(k) != v:
                    mismatched += 1
        counts.update(acked=sum(w.ops for w in writers), errors=sum(w.errors for w in writers),
                      keys=len(scans[0]), lost=lost, diverged=diverged, mismatched=mismatched)
        return counts


def main():
    campaign.main(__doc__, run_seed,
                  "seed %(seed)d: %(kills)d kills, %(acked)d acked writes, %(errors)d errors/retries, %(keys)d keys, "
                  "lost %(lost)d, diverged %(diverged)d, scan/get mismatches %(mismatched)d, %(seconds)ss",
                  lambda c: c["lost"] or c["diverged"] or c["mismatched"],
                  duration=30.0, kill_every=3.0)


if __name__ == "__main__":
    main()
