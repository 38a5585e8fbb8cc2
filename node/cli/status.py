"""sbpctl status: is the node up, what does it serve, and the metrics it keeps."""

import json

from node.cli import node_status


def register(sub):
    p = sub.add_parser("status", help="show a node's identity, listeners and metrics")
    p.add_argument("--endpoint", default="127.0.0.1:7700", help="the node's SBP listener HOST:PORT (default 127.0.0.1:7700)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=run)


def run(args):
    info = node_status(args)
    # CONTRACT §9: say whether this node runs in a cluster
    cl = info.get("cluster")
    info["mode"] = ("cluster: %d live member(s), leader %s, etcd %s%s" % (
        len(cl.get("live_members", [])), cl.get("leader"), cl.get("etcd"), "" if cl.get("etcd_reachable", True) else " (UNREACHABLE)")
        if cl else "single node")
    if args.json:
        print(json.dumps(info, sort_keys=True))
    else:
        for key in sorted(info):
            print("%-20s %s" % (key, json.dumps(info[key]) if isinstance(info[key], (dict, list)) else info[key]))
    return 0
