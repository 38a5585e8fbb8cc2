"""The node's numeric id: random on first start, then persisted in the data dir (CONTRACT §1)."""

import json
import os
import secrets

ID_FILE = "node.json"


class NodeIdMismatch(Exception):
    pass


def load_or_create_node_id(data_dir: str, requested=None) -> int:
    path = os.path.join(data_dir, ID_FILE)
    try:
        with open(path) as f:
            stored = int(json.load(f)["node_id"])
    except FileNotFoundError:
        stored = None
    if stored is not None:
        if requested is not None and requested != stored:
            # Stream ids embed the owner's node id (CONTRACT §2): silently renumbering would
            # orphan every stream this node owns.
            raise NodeIdMismatch(
                "data dir %s belongs to node %d, not --node-id %d" % (data_dir, stored, requested)
            )
        return stored
    node_id = requested if requested is not None else secrets.randbelow(2**31 - 1) + 1
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"node_id": node_id}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(data_dir)
    return node_id


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
