"""sbpctl cluster: the cluster as one node sees it (CONTRACT §9): members, the placement-driver
leader, ranges per node."""

import json

from node.cli import node_status


def register(sub):
    p = sub.add_parser("cluster", help="show the cluster's members, leader and ranges per node")
    p.add_argument("--endpoint", default="127.0.0.1:7700", help="any node's SBP listener HOST:PORT (default 127.0.0.1:7700)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=run)


def run(args):
    info = node_status(args)
    cluster = info.get("cluster")
    if cluster is None:
        # a node without --cluster is a cluster of one (CONTRACT §9)
        cluster = {"mode": "single node", "leader": info.get("node_id"),
                   "members": [{"node_id": info.get("node_id"), "sbp": info.get("sbp")}], "ranges_per_node": {}}
    else:
        cluster = dict(cluster, mode="cluster")
    if args.json:
        print(json.dumps(cluster, sort_keys=True))
        return 0
    print("mode      %s" % cluster["mode"])
    if cluster["mode"] == "cluster":
        print("etcd      %s (%s)" % (cluster["etcd"], "reachable" if cluster.get("etcd_reachable") else "UNREACHABLE"))
        print("prefix    %s" % cluster["prefix"])
    print("leader    %s" % cluster.get("leader"))
    print("%-12s %-22s %-7s %-7s %-9s %s" % ("node", "sbp", "leader", "ranges", "primary", "lag"))
    per_node = cluster.get("ranges_per_node", {})
    for m in sorted(cluster["members"], key=lambda m: m["node_id"]):
        nid = str(m["node_id"])
        counts = per_node.get(nid, {"ranges": 0, "primaries": 0})
        # lag: replication progress comes with issue 17; no replica lags yet
        print("%-12s %-22s %-7s %-7d %-9d %s" % (nid, m.get("sbp"), "*" if str(cluster.get("leader")) == nid else "",
                                                counts["ranges"], counts["primaries"], "-"))
    parts = (cluster.get("kv") or {}).get("partitions")
    if parts:
        # issue 20: the key-value partitions, each a replicated stream led by its open range's primary
        print("%-10s %-22s %-7s %s" % ("partition", "stream", "leader", "replicas"))
        for part in parts:
            print("%-10d %-22d %-7s %s" % (part["partition"], part["stream_id"], part["leader"],
                                          ",".join(str(r) for r in part["replicas"])))
    return 0
