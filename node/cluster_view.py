"""What the metrics, the status page and ``sbpctl top`` read of the cluster: one snapshot dict.

Cluster mode (membership and placement on etcd) sets ``node.cluster`` to an object with a
``status()`` method returning the dict below; without one (``node.cluster`` missing or None) the
node is a single-node "cluster" of itself. The cluster code also reports each etcd round trip with
``node.observe_latency("etcd", seconds)`` (the ``sbpnode_etcd_request_duration_seconds``
histogram). ``status()`` is called on the reactor thread at every scrape and status poll, so it
returns what the cluster code already holds in memory (no etcd request).

The snapshot (docs/observability.md "Cluster view"):

    {
      "mode": "cluster" | "single node",
      "leader": node id of the placement-driver leader, or None when unknown,
      "members": [{"node_id": int, "sbp": "host:port", "http": "host:port" or None,
                   "alive": bool}, ...],
      "ranges": [{"stream_id": int, "index": int, "start": int, "end": int (-1: open),
                  "leader": node id, "replicas": [node id, ...],
                  "confirm_offset": int or None,
                  "replica_ends": {node id: end offset that replica holds}}, ...],
      "failovers": int (range-leader changes after a failure, since start),
    }
"""

SINGLE_NODE = "single node"


def snapshot(node) -> dict:
    """The cluster as this node sees it; a one-member view of itself without cluster mode."""
    cluster = getattr(node, "cluster", None)
    if cluster is not None:
        view = dict(cluster.status())
        view.setdefault("mode", "cluster")
        view.setdefault("members", [])
        view.setdefault("ranges", [])
        view.setdefault("failovers", 0)
        view.setdefault("leader", None)
        return view
    advertised = getattr(node, "advertised", None)
    me = {
        "node_id": node.node_id,
        "sbp": advertised("sbp") if advertised else None,
        "http": advertised("http") if advertised else None,
        "alive": True,
    }
    store = getattr(node, "store", None)
    if store is not None and not store.closed:
        # single node: it leads, and is the only replica of, every open range of its streams
        me["streams"] = len(store.log.offsets())
    return {"mode": SINGLE_NODE, "leader": node.node_id, "members": [me], "ranges": [], "failovers": 0}


def ranges_per_node(view: dict) -> dict:
    """{node id: {"leads": n, "replicas": n}} over the snapshot's ranges."""
    out = {m["node_id"]: {"leads": m.get("streams", 0), "replicas": m.get("streams", 0)} for m in view["members"]}
    for r in view["ranges"]:
        if r.get("leader") is not None:
            out.setdefault(r["leader"], {"leads": 0, "replicas": 0})["leads"] += 1
        for replica in r.get("replicas") or ():
            out.setdefault(replica, {"leads": 0, "replicas": 0})["replicas"] += 1
    return out
