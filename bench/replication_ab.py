"""Interleaved A/B of the replicated APPEND path (issue 17): CPU per replicated record, per node
and per thread, of two checkouts at once.

    PYTHONPATH=$PWD python3 bench/replication_ab.py --base /work/wt/_base_repl2 [--runs 6] [--batches 1500]

Each checkout (``--base`` and this one, or ``--trees A B``) starts its own etcd and three
``--fsync always`` nodes from its own code (``--serve``, a child process run with that tree first
on ``sys.path``) and one R = 3 stream (ack 2). The runs alternate between the trees (the order
flips every round), each one ``bench/replication_bench.py``'s load (1 KiB records, 64 per APPEND,
16 in flight, this checkout's load generator for both) against that tree's primary; every
thread's utime + stime is read from /proc before and after each run. Printed per run and as
medians per tree: server CPU per record over the three nodes, the primary's reactor thread, its
writer thread, the replicas' reactor and writer threads (summed over the two), the load
generator's own CPU per record (a yardstick of the machine's speed: the server figure divided by
it moves less with the machine), records/s and p50/p99 latency, and the load average.

The machine's load moves by the minute: only interleaved runs compare code; keep runs short.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")


def serve(tree, base):
    """Child: start ``tree``'s cluster, print its description as one JSON line, wait for stdin to close."""
    sys.path[:0] = [tree, os.path.join(tree, "bench")]
    os.chdir(tree)
    import replication_bench as rb
    from protocols.sbp.client import BlockingSbpClient

    from protocols.sbp.client import SbpError

    etcd, nodes = rb.start_cluster(base)
    try:
        deadline = time.monotonic() + 30
        while True:
            # (a node is ready before every member has seen the others live: 1502 until then)
            try:
                with BlockingSbpClient("127.0.0.1", nodes[0].ports["sbp"]) as c:
                    sid = c.create_stream(replica_nums=3)["stream_id"]
                break
            except SbpError as e:
                if e.code != 1502 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for n in nodes:
            rb.wait_loaded(n.ports["sbp"])
        p = rb.primary_of(nodes, sid)
        print(json.dumps({"sid": sid, "port": p.ports["sbp"], "primary": p.proc.pid,
                          "replicas": [n.proc.pid for n in nodes if n is not p]}), flush=True)
        sys.stdin.read()
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


def threads(pid):
    """{tid: (comm, cpu seconds)} of every thread of ``pid``: its time on a CPU in nanoseconds from
    ``schedstat`` (utime + stime in ``stat`` count 10 ms ticks: at 1,000 APPENDs a run a tick is
    0.16 us per record, as much as the differences measured), else from ``stat``."""
    out = {}
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        try:
            with open("/proc/%d/task/%s/schedstat" % (pid, tid)) as f:
                cpu = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            fields = raw.rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / TICK
        out[int(tid)] = (comm, cpu)
    return out


def snapshot(desc):
    """{(role, pid, tid): cpu seconds} of every thread of the three nodes now."""
    out = {}
    for who, pids in (("p", [desc["primary"]]), ("r", desc["replicas"])):
        for pid in pids:
            for tid, (_comm, cpu) in threads(pid).items():
                out[(who, pid, tid)] = cpu
    return out


def roles(before, after):
    """{role: cpu seconds} between two snapshots: total; per side (p: the primary, r: the two
    replicas) the reactor (the main thread), the writer (Python 3.11 names no native thread: the
    busiest other thread of the node over the run, the store's writer under this load) and the rest."""
    r = dict.fromkeys(("total", "p_reactor", "p_writer", "p_other", "r_reactor", "r_writer", "r_other"), 0.0)
    per_pid = {}
    for key, cpu in after.items():
        d = cpu - before.get(key, 0.0)
        who, pid, tid = key
        r["total"] += d
        if tid == pid:
            r[who + "_reactor"] += d
        else:
            per_pid.setdefault((who, pid), []).append(d)
    for (who, _pid), ds in per_pid.items():
        ds.sort(reverse=True)
        r[who + "_writer"] += ds[0]
        r[who + "_other"] += sum(ds[1:])
    return r


def children_cpu():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(desc, batches, window):
    import replication_bench as rb
    from sbp_bench import BATCH_RECORDS, pct, run_in_process

    before, gen0 = snapshot(desc), children_cpu()
    r = run_in_process(rb.sbp_window_load, desc["port"], desc["sid"], batches, window)
    after, gen1 = snapshot(desc), children_cpu()
    recs = batches * BATCH_RECORDS
    us = {k: v / recs * 1e6 for k, v in roles(before, after).items()}
    us["gen"] = (gen1 - gen0) / recs * 1e6
    lat = [x * 1000 for x in r["latencies"]]
    us["rate"] = recs / r["seconds"]
    us["p50"], us["p99"] = pct(lat, 50), pct(lat, 99)
    us["errors"] = r["errors"]
    us["load"] = os.getloadavg()[0]
    return us


COLS = ("total", "p_reactor", "p_writer", "p_other", "r_reactor", "r_writer", "r_other", "gen")


def line(name, us):
    return ("%-6s total %6.2f | P reactor %5.2f writer %5.2f other %4.2f | R reactors %5.2f writers %5.2f other %4.2f"
            " | gen %5.2f | ratio %5.2f | %7.0f rec/s p50 %5.1f p99 %6.1f ms | err %d | load %.1f"
            % (name, us["total"], us["p_reactor"], us["p_writer"], us["p_other"], us["r_reactor"], us["r_writer"],
               us["r_other"], us["gen"], us["total"] / us["gen"] if us["gen"] else 0, us["rate"], us["p50"], us["p99"],
               us["errors"], us["load"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", nargs=2, metavar=("TREE", "DIR"), help=argparse.SUPPRESS)
    ap.add_argument("--base", help="the baseline checkout (compared with this one)")
    ap.add_argument("--trees", nargs="+", help="checkouts to compare (default: --base and this one)")
    ap.add_argument("--runs", type=int, default=6, help="runs per tree")
    ap.add_argument("--batches", type=int, default=1500)
    ap.add_argument("--window", type=int, default=16)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    sys.path[:0] = [HERE, os.path.join(HERE, "bench")]
    trees = args.trees or [args.base, HERE]
    names = ["base", "branch"] if not args.trees else [os.path.basename(t.rstrip("/")) for t in trees]
    tmp = tempfile.mkdtemp(prefix="repl-ab-")
    servers, descs = [], []
    try:
        for i, tree in enumerate(trees):
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", tree, os.path.join(tmp, "t%d" % i)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            servers.append(p)
        for tree, p in zip(trees, servers):
            first = p.stdout.readline()
            if not first:
                raise RuntimeError("the cluster of %s did not start (exit code %s)" % (tree, p.wait()))
            descs.append(json.loads(first))
        for d in descs:
            run_once(d, 200, args.window)  # warm-up
        results = {n: [] for n in names}
        for rnd in range(args.runs):
            order = list(range(len(trees)))
            if rnd % 2:
                order.reverse()
            for i in order:
                us = run_once(descs[i], args.batches, args.window)
                results[names[i]].append(us)
                print(line(names[i], us), flush=True)
        print("medians (us per record; ratio = server total / load generator)")
        for n in names:
            rs = results[n]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            med["total"] = statistics.median(r["total"] for r in rs)
            print(line(n, med) + "  ratio-median %.2f" % statistics.median(r["total"] / r["gen"] for r in rs if r["gen"]))
    finally:
        for p in servers:
            try:
                p.stdin.close()
            except Exception:
                pass
        for p in servers:
            p.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)  # three stores per tree: gigabytes after a few runs


if __name__ == "__main__":
    main()
