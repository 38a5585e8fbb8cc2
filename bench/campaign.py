"""What the cluster fault campaigns share (bench/replication_campaign.py, bench/kv_cluster_campaign.py):
three nodes and one etcd on loopback, the seeded kill -9 / restart loop (never more than one node
down at a time), and the command line that runs seeds and prints one line of counts per seed.
Each campaign brings its own writers and checker."""

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import time

from tests.etcdproc import EtcdCluster
from tests.nodeproc import NodeProcess


@contextlib.contextmanager
def three_nodes(seed, prefix, args, **options):
    """(seeded Random, [node 1, 2, 3]) started on one etcd under a fresh temporary directory; on
    exit every node is killed, etcd stopped and the directory removed (kept with ``--keep``)."""
    base = tempfile.mkdtemp(prefix="%s-%d-" % (prefix, seed))
    etcd = EtcdCluster(base, members=1).start()
    nodes = [NodeProcess(base, name="n%d" % i, cluster=etcd.client_urls, fsync=args.fsync, node_id=i, **options)
             for i in (1, 2, 3)]
    try:
        for n in nodes:
            n.start(timeout=60)
        yield random.Random(seed), nodes
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


def kill_loop(rnd, nodes, duration, kill_every):
    """For ``duration`` seconds: every ~``kill_every`` seconds (seeded) one node gets SIGKILL and
    is restarted after 0.2 to 2 s. Returns the number of kills."""
    kills = 0
    t_end = time.monotonic() + duration
    while time.monotonic() < t_end:
        time.sleep(kill_every * rnd.uniform(0.5, 1.5))
        victim = rnd.choice(nodes)
        victim.kill9()
        kills += 1
        time.sleep(rnd.uniform(0.2, 2.0))
        victim.start(timeout=60)
    return kills


def settle(progress, needed, timeout=30.0):
    """Wait (at most ``timeout`` s) until every writer has made ``needed`` more operations:
    ``progress()`` -> [operations so far per writer]; the last failover has finished."""
    marks = progress()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(now < m + needed for now, m in zip(progress(), marks)):
        time.sleep(0.1)


def main(doc, run_seed, line, failed, duration, kill_every):
    """The campaign's command line: ``run_seed(seed, args) -> counts`` for each seed, ``line % counts``
    printed per seed; exit status 1 if ``failed(counts)`` for any seed."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--duration", type=float, default=duration, help="seconds of faults per seed")
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--kill-every", type=float, default=kill_every)
    ap.add_argument("--fsync", default="never", help="the nodes' --fsync (a kill -9 keeps the page cache)")
    ap.add_argument("--keep", action="store_true", help="keep the data dirs and logs")
    args = ap.parse_args()
    bad = False
    print("load average at start: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    for seed in [int(s) for s in args.seeds.split(",") if s]:
        t0 = time.monotonic()
        counts = run_seed(seed, args)
        counts["seconds"] = round(time.monotonic() - t0, 1)
        print(line % counts, flush=True)
        bad |= bool(failed(counts))
    print("load average at end: %.2f %.2f %.2f" % os.getloadavg())
    sys.exit(1 if bad else 0)
