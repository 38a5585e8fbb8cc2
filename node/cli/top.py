"""sbpctl top: the status page's numbers in a terminal, refreshing, for a node or its whole cluster.

It reads the node's ``GET /ui/status.json`` on the ``--http`` listener (node/status_page.py), the
same document the browser page draws; ``--cluster`` also reads every member's (their ``http``
addresses come from the cluster view) and shows one line per node.
"""

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from node.cli import CliError, split_endpoint

CLEAR = "\x1b[H\x1b[2J"
OPERATIONS = ("sbp.append", "sbp.fetch", "kv.get", "kv.set", "toasty.read", "toasty.write")


def register(sub):
    p = sub.add_parser("top", help="a refreshing terminal view of a node's (or its cluster's) throughput, latency and streams")
    p.add_argument("--endpoint", default="127.0.0.1:7780", help="the node's HTTP listener HOST:PORT (default 127.0.0.1:7780)")
    p.add_argument("--token", default=None, help="the node's --metrics-token, if it has one")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--once", action="store_true", help="print one screen and exit")
    p.add_argument("--cluster", action="store_true", help="one line per cluster member (each member's HTTP listener)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=run)


def fetch_status(endpoint: str, token=None, timeout=5.0) -> dict:
    host, port = split_endpoint(endpoint, 7780)
    url = "http://%s:%d/ui/status.json" % (host, port)
    headers = {"authorization": "Bearer " + token} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise CliError("node at %s:%d wants its metrics token (--token)" % (host, port))
        if e.code == 404:
            raise CliError("node at %s:%d has no status page (started with --metrics off?)" % (host, port))
        raise CliError("node at %s:%d answered HTTP %d" % (host, port, e.code))
    except (OSError, ValueError) as e:
        raise CliError("node at %s:%d is not reachable: %s" % (host, port, getattr(e, "reason", None) or e))


def _last(values):
    for v in reversed(values or ()):
        if v is not None:
            return v
    return None


def _num(v, fmt="%.1f"):
    return "-" if v is None else fmt % v


def _mb(v):
    return None if v is None else v / 1e6


def render(status: dict) -> str:
    """One screen for one node (pure: the status document in, text out)."""
    n = status["node"]
    c = status["cluster"]
    s = status["series"]
    lines = [
        "sbpnode %s  v%s  up %ss  fsync %s  %s" % (n["node_id"], n["version"], int(n["uptime_s"]), n["fsync"],
                                                    time.strftime("%H:%M:%S", time.localtime(status["time"]))),
        "cluster: %s, %d member(s), leader %s, failovers %s" % (c["mode"], len(c["members"]), c["leader"], c["failovers"]),
        "",
        "throughput (last %ss)  append %s rec/s %s MB/s (%s req/s)  fetch %s req/s %s MB/s  kv %s req/s  s2 %s req/s" % (
            _num(s["interval_s"], "%g"), _num(_last(s["append_records_s"])), _num(_mb(_last(s["append_bytes_s"])), "%.2f"),
            _num(_last(s["appends_s"])), _num(_last(s["fetches_s"])), _num(_mb(_last(s["fetch_bytes_s"])), "%.2f"),
            _num(_last(s["kv_requests_s"])), _num(_last(s["s2_requests_s"]))),
        "",
        "%-14s %10s %10s %10s" % ("latency (ms)", "p50", "p90", "p99"),
    ]
    for op in OPERATIONS + ("store.fsync",):
        q = s["latency_ms"].get(op)
        if q is None:
            continue
        lines.append("%-14s %10s %10s %10s" % (op, _num(_last(q["p50"]), "%.3f"), _num(_last(q["p90"]), "%.3f"), _num(_last(q["p99"]), "%.3f")))
    lines += ["", "busiest streams (of %d)   records/s   next offset" % status["streams"]["count"]]
    for b in status["streams"]["busiest"]:
        lines.append("  %-22s %11s %13d" % (b["stream_id"], _num(b["records_s"]), b["next_offset"]))
    if status["peers"]:
        lines += ["", "peer sync                 connected   lag   items/s"]
        for p in status["peers"]:
            lines.append("  %-24s %5s %8s %9s" % (p["peer"], "yes" if p["connected"] else "no", p["lag"], _num(p["rate_items_s"])))
    st = status["store"]
    lines += ["", "store: %s streams, WAL %s B in %s segments, %s chunks, %s kv keys, queue %s B%s" % (
        st.get("streams"), st.get("wal_bytes"), st.get("wal_segments"), st.get("chunks"), st.get("kv_keys"),
        st.get("queued_bytes"), ", FAILED: %s" % st["failed"] if st.get("failed") else "")]
    return "\n".join(lines) + "\n"


def render_cluster(rows) -> str:
    """One line per member: [(member dict, status dict or an error string)]."""
    lines = ["%-12s %-22s %10s %9s %10s %9s %10s %8s" % (
        "node", "http", "append/s", "MB/s", "fetch/s", "MB/s", "p99 ms", "streams")]
    for member, st in rows:
        if isinstance(st, str):
            lines.append("%-12s %-22s %s" % (member["node_id"], member.get("http") or "-", st))
            continue
        s = st["series"]
        p99 = _last((s["latency_ms"].get("sbp.append") or {}).get("p99"))
        lines.append("%-12s %-22s %10s %9s %10s %9s %10s %8d" % (
            member["node_id"], member.get("http") or "-", _num(_last(s["append_records_s"])),
            _num(_mb(_last(s["append_bytes_s"])), "%.2f"), _num(_last(s["fetches_s"])),
            _num(_mb(_last(s["fetch_bytes_s"])), "%.2f"), _num(p99, "%.3f"), st["streams"]["count"]))
    return "\n".join(lines) + "\n"


def screen(args) -> str:
    status = fetch_status(args.endpoint, args.token, args.timeout)
    if not args.cluster:
        return render(status)
    c = status["cluster"]
    rows = []
    for member in c["members"]:
        if member["node_id"] == status["node"]["node_id"]:
            rows.append((member, status))
        elif not member.get("http"):
            rows.append((member, "no HTTP listener known"))
        else:
            try:
                rows.append((member, fetch_status(member["http"], args.token, args.timeout)))
            except CliError as e:
                rows.append((member, str(e)))
    head = "cluster: %s, %d member(s), leader %s, failovers %s\n" % (c["mode"], len(c["members"]), c["leader"], c["failovers"])
    return head + render_cluster(rows)


def run(args):
    if args.once:
        sys.stdout.write(screen(args))
        return 0
    try:
        while True:
            text = screen(args)
            sys.stdout.write(CLEAR + text)
            sys.stdout.flush()
            time.sleep(max(0.2, args.interval))
    except KeyboardInterrupt:
        return 0
