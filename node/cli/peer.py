"""sbpctl peer list|status: the node's swarm peers, their streams, lag and transfer rate.

The node keeps per-peer sync stats in ``node.metrics["peers"]`` and writes them, at most once a
second, to ``<data dir>/swarm-peers.json``; these commands read that file (``--data-dir``), or ask
the node's status over SBP (``--endpoint``) when that is available.
"""

import json
import os
import time

from node.cli import CliError, node_status

SNAPSHOT_NAME = "swarm-peers.json"


def register(sub):
    p = sub.add_parser("peer", help="swarm peer sync: peers, streams, lag, transfer rate")
    psub = p.add_subparsers(dest="peer_command", metavar="SUBCOMMAND")
    for name, help_text, func in (
        ("list", "one line per peer: connection, streams, lag, rate", run_list),
        ("status", "every peer with each of its streams (cursor, synced index, lag)", run_status),
    ):
        q = psub.add_parser(name, help=help_text)
        q.add_argument("--data-dir", default=None, help="the node's data dir (default ./sbpnode-data)")
        q.add_argument("--endpoint", default=None, help="ask a running node's SBP listener HOST:PORT instead")
        q.add_argument("--json", action="store_true", help="print one JSON object")
        q.add_argument("--timeout", type=float, default=5.0)
        q.set_defaults(func=func)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def load(args) -> dict:
    if args.endpoint:
        return _from_endpoint(args)
    data_dir = args.data_dir or "./sbpnode-data"
    path = os.path.join(data_dir, SNAPSHOT_NAME)
    try:
        with open(path) as f:
            snap = json.load(f)
    except FileNotFoundError:
        raise CliError("no peer stats in %s (is the node running with --peer?)" % data_dir)
    except ValueError as e:
        raise CliError("unreadable %s: %s" % (path, e))
    snap["age_s"] = round(max(0.0, time.time() - snap.get("time", 0)), 1)
    return snap


def _from_endpoint(args) -> dict:
    info = node_status(args)
    peers = info.get("peers")
    if peers is None:
        peers = (info.get("metrics") or {}).get("peers", {})
    return {"node_id": info.get("node_id"), "peers": peers}


def _rate(stats) -> str:
    mb = stats.get("rate_bytes_s", 0.0) / 1e6
    return "%.1f items/s %.2f MB/s" % (stats.get("rate_items_s", 0.0), mb)


def run_list(args):
    snap = load(args)
    if args.json:
        print(json.dumps(snap, sort_keys=True))
        return 0
    peers = snap.get("peers", {})
    if not peers:
        print("no peers")
        return 0
    print("%-24s %-6s %7s %10s %10s  %s" % ("PEER", "UP", "STREAMS", "LAG", "ITEMS", "RATE"))
    for addr in sorted(peers):
        s = peers[addr]
        print("%-24s %-6s %7d %10d %10d  %s" % (
            addr, "yes" if s.get("connected") else "no", len(s.get("streams", {})), s.get("lag", 0), s.get("items", 0), _rate(s),
        ))
    return 0


def run_status(args):
    snap = load(args)
    if args.json:
        print(json.dumps(snap, sort_keys=True))
        return 0
    peers = snap.get("peers", {})
    if not peers:
        print("no peers")
        return 0
    for addr in sorted(peers):
        s = peers[addr]
        print("peer %s (%s)" % (addr, s.get("endpoint", addr)))
        print("  connected  %s (connects: %d)" % ("yes" if s.get("connected") else "no", s.get("connects", 0)))
        print("  received   %d items, %d bytes" % (s.get("items", 0), s.get("bytes", 0)))
        print("  rate       %s" % _rate(s))
        print("  lag        %d indexes" % s.get("lag", 0))
        if s.get("last_error"):
            print("  last error %s" % s["last_error"])
        streams = s.get("streams", {})
        if streams:
            print("  %-28s %12s %12s %10s" % ("STREAM", "CURSOR", "SYNCED", "LAG"))
            for name in sorted(streams):
                st = streams[name]
                print("  %-28s %12d %12d %10d" % (name, st.get("cursor", 0), st.get("synced", 0), st.get("lag", 0)))
    return 0
