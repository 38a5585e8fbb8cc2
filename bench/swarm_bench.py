"""Swarm peer-sync benchmark: an empty node pulls everything from a full one over loopback.

    python bench/swarm_bench.py                      # 10,000 chunks of 4 KiB, then 100 MiB of log
    python bench/swarm_bench.py --chunks 2000 --log-mib 10

Node A is filled offline (the store opened directly on its data dir, before A starts), then A
starts, then B starts with ``--peer`` A. Timed: from B's start (process spawn included: "end to
end") and from B's ready file, until B's swarm listener reports A's cursors (CHUNKS cursor, and
each LOG stream's cursor). Prints chunks/s and MB/s.

Also a helper for tests: ``python bench/swarm_bench.py preload DATA_DIR NODE_ID --chunks N
--streams S --batches B --records R --body BYTES`` fills a data dir (JSON summary on stdout).
"""

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


# ---------------------------------------------------------------------------------------------
# filling a data dir offline


def preload_subprocess(data_dir, node_id, **kw):
    """Run preload in a child interpreter (task.react owns its reactor); returns the summary."""
    import subprocess

    args = [sys.executable, os.path.abspath(__file__), "preload", data_dir, str(node_id)]
    for k, v in kw.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(args, check=True, capture_output=True, env=env, timeout=600)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def _preload_main(argv):
    p = argparse.ArgumentParser(prog="swarm_bench.py preload")
    p.add_argument("data_dir")
    p.add_argument("node_id", type=int)
    p.add_argument("--chunks", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--streams", type=int, default=0)
    p.add_argument("--batches", type=int, default=0)
    p.add_argument("--records", type=int, default=1)
    p.add_argument("--body", type=int, default=100)
    p.add_argument("--seed", default="x")
    a = p.parse_args(argv)
    result = {}
    kw = dict(chunks=a.chunks, chunk_size=a.chunk_size, streams=a.streams, batches=a.batches, records=a.records, body=a.body, seed=a.seed)
    import atexit

    atexit.register(lambda: print(json.dumps(result)))  # task.react exits the process
    _preload_into(result, a.data_dir, a.node_id, **kw)


def _preload_into(result, data_dir, node_id, **kw):
    from twisted.internet import defer, task

    from node.identity import load_or_create_node_id
    from storage import FsyncPolicy, Store, record_batch

    os.makedirs(data_dir, exist_ok=True)
    load_or_create_node_id(data_dir, node_id)
    result.update({"chunks": 0, "streams": {}})

    @defer.inlineCallbacks
    def fill(reactor):
        store = Store.open(os.path.join(data_dir, "store"), fsync=FsyncPolicy.parse("never"), reactor=reactor, node_id=node_id)
        try:
            n = kw.get("chunks", 0)
            size = kw.get("chunk_size", 4096)
            for start in range(0, n, 512):
                ds = [store.chunks.put(os.urandom(size)) for _ in range(start, min(n, start + 512))]
                yield defer.gatherResults(ds)
                result["chunks"] += len(ds)
            for _ in range(kw.get("streams", 0)):
                meta = yield store.log.create_stream()
                sid = meta.stream_id
                now = int(time.time() * 1000)
                seed = kw.get("seed", "x").encode()
                for b in range(kw.get("batches", 0)):
                    batch = record_batch.encode(
                        [(now + b, [(b"seed", seed)], os.urandom(kw.get("body", 100))) for _ in range(kw.get("records", 1))]
                    )
                    yield store.log.append(sid, batch)
                    result["log_bytes"] = result.get("log_bytes", 0) + len(batch)
                result["streams"][str(sid)] = store.log.stream(sid).next_offset
            result["chunk_seq"] = store.chunks.last_seq()
        finally:
            yield store.close()

    task.react(lambda reactor: fill(reactor))


# ---------------------------------------------------------------------------------------------
# the benchmark


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_synced(port, want_chunks, want_logs, timeout=300.0):
    """Poll a node's swarm listener until its CHUNKS cursor and LOG cursors reach the targets."""
    from protocols.swarm import codec
    from protocols.swarm.client import BlockingSwarmClient

    deadline = time.monotonic() + timeout
    with BlockingSwarmClient("127.0.0.1", port) as c:
        while True:
            info = c.stream_info()
            ok = info.get(codec.CHUNKS_ID, 0) >= want_chunks
            for sid, cursor in want_logs.items():
                ok = ok and info.get(codec.log_id(int(sid)), 0) >= cursor
            if ok:
                return time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError("not synced after %ss: %r" % (timeout, info))
            time.sleep(0.005)


def proc_cpu(pid):
    """User + system CPU seconds a live process has used so far (/proc/PID/stat)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_case(base, label, chunks=0, streams=0, batches=0, records=1, body=100, fsync="never"):
    from protocols.swarm import codec
    from protocols.swarm.client import BlockingSwarmClient
    from tests.nodeproc import NodeProcess

    a_dir = os.path.join(base, label)
    os.makedirs(a_dir, exist_ok=True)
    t = time.monotonic()
    summary = preload_subprocess(
        os.path.join(a_dir, "a-data"), 101, chunks=chunks, streams=streams, batches=batches, records=records, body=body
    )
    print("  preloaded node A in %.1fs: %s" % (time.monotonic() - t, json.dumps({k: v for k, v in summary.items() if k != "streams"})))
    off = dict(sbp="none", kv="none", meta="none", chunks="none", http="none")
    a = NodeProcess(a_dir, name="a", node_id=101, fsync=fsync, **off).start()
    b = None
    try:
        with BlockingSwarmClient("127.0.0.1", a.ports["swarm"]) as c:
            info = c.stream_info()
        want_chunks = info.get(codec.CHUNKS_ID, 0)
        want_logs = {k.key: v for k, v in info.items() if k.name == codec.LOG}
        total_bytes = chunks * 4096 + summary.get("log_bytes", 0)
        b = NodeProcess(a_dir, name="b", node_id=102, fsync=fsync, peer=a.peer_endpoint(), **off)
        a_cpu0 = proc_cpu(a.proc.pid)
        t0 = time.monotonic()
        b.start()
        t_ready = time.monotonic()
        b_cpu_ready = proc_cpu(b.proc.pid)
        t_done = wait_synced(b.ports["swarm"], want_chunks, want_logs)
        a_cpu = proc_cpu(a.proc.pid) - a_cpu0
        b_cpu = proc_cpu(b.proc.pid)
        e2e = t_done - t0
        sync = t_done - t_ready
        return {
            "label": label,
            "items": want_chunks + sum(batches for _ in range(streams)),
            "bytes": total_bytes,
            "end_to_end_s": e2e,
            "sync_s": sync,
            "b_start_s": t_ready - t0,
            # CPU seconds (less noisy than wall clock on a shared machine): A while serving, B in
            # all (start-up included) and B's start-up alone (until its ready file)
            "a_cpu_s": a_cpu,
            "b_cpu_s": b_cpu,
            "b_start_cpu_s": b_cpu_ready,
        }
    finally:
        if b is not None:
            b.terminate()
        a.terminate()


def compile_repo():
    """Byte-compile the repo's packages, untimed, as installing them does (pip writes .pyc files).
    The nodes run from the source tree, and where PYTHONDONTWRITEBYTECODE is set (as on the team's
    machine) they would otherwise compile every module from source at each start: ~50-90 ms of
    B's start-up that no installed node pays. Python checks each .pyc against its source."""
    import compileall

    for pkg in ("node", "storage", "protocols", os.path.join("twisted", "plugins")):
        compileall.compile_dir(os.path.join(REPO, pkg), quiet=1)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "preload":
        return _preload_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=10000)
    p.add_argument("--log-mib", type=int, default=100)
    p.add_argument("--batch-kib", type=int, default=256, help="record batch size for the log case")
    p.add_argument("--fsync", default="never", help="both nodes' --fsync policy (default never)")
    p.add_argument("--runs", type=int, default=3, help="repeat each case; report the median (default 3)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--no-compile", action="store_true", help="do not byte-compile the repo first (nodes then compile from source at start-up when PYTHONDONTWRITEBYTECODE is set)")
    a = p.parse_args(argv)
    if not a.no_compile:
        compile_repo()
    print("repo byte-compiled first: %s; PYTHONDONTWRITEBYTECODE=%s" % (not a.no_compile, os.environ.get("PYTHONDONTWRITEBYTECODE", "")))
    base = tempfile.mkdtemp(prefix="swarm-bench-")
    try:
        results = []
        if a.chunks:
            print("case 1: %d chunks of 4 KiB, node A -> empty node B (loopback, fsync %s, %d runs)" % (a.chunks, a.fsync, a.runs))
            runs = [run_case(os.path.join(base, "c%d" % i), "chunks", chunks=a.chunks, fsync=a.fsync) for i in range(a.runs)]
            results.append(report(runs, a.chunks, "chunks"))
        if a.log_mib:
            body = 4096
            records = max(1, a.batch_kib * 1024 // (body + 40))
            batch_bytes = records * (body + 40)
            batches = max(1, a.log_mib * 1024 * 1024 // batch_bytes)
            print("case 2: %d MiB of stream log (%d batches of %d records x %d B) in one stream (fsync %s, %d runs)" % (a.log_mib, batches, records, body, a.fsync, a.runs))
            runs = [run_case(os.path.join(base, "l%d" % i), "log", streams=1, batches=batches, records=records, body=body, fsync=a.fsync) for i in range(a.runs)]
            results.append(report(runs, batches, "batches"))
        print(json.dumps(results))
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


def report(runs, items, unit):
    nbytes = runs[0]["bytes"]
    out = {"label": runs[0]["label"], "items": items, "bytes": nbytes, "runs": runs}
    for key, text in (("end_to_end_s", "end to end (B process start -> synced)"), ("sync_s", "sync only  (B ready -> synced)        ")):
        times = sorted(r[key] for r in runs)
        med = times[len(times) // 2]
        best = times[0]
        out[key + "_median"] = med
        out[key + "_best"] = best
        print("  %s: median %.3f s = %.0f %s/s, %.1f MB/s   (best %.3f s, all %s)" % (
            text, med, items / med, unit, nbytes / med / 1e6, best, " ".join("%.3f" % t for t in times)))
    def median(key):
        return sorted(r[key] for r in runs)[len(runs) // 2]

    print("  (B's own start-up, median: %.3f s)" % median("b_start_s"))
    print("  CPU, median: node A serving %.3f s; node B %.3f s in all, of which start-up %.3f s" % (
        median("a_cpu_s"), median("b_cpu_s"), median("b_start_cpu_s")))
    return out


if __name__ == "__main__":
    sys.exit(main())
