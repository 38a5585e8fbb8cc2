"""Which protocol serves which listener (CONTRACT §1).

Each protocol module is imported when its listener is configured (so a node without ``--http``
never loads the S2 stack); every one of them is part of the node, so a failed import is an error.
"""

import importlib

from twisted.internet.protocol import Factory

# listener name -> "module:factory builder"; each builder takes the NodeContext.
FACTORY_BUILDERS = {
    "sbp": "protocols.sbp.server:build_factory",
    "kv": "protocols.partition.server:build_factory",
    "kv_client": "protocols.partition.client_server:build_factory",
    "meta": "protocols.toasty.server:build_meta_factory",
    "chunks": "protocols.toasty.server:build_chunk_factory",
    "swarm": "protocols.swarm.server:build_factory",
    "http": "protocols.s2.server:build_factory",
}

PEER_SERVICE_BUILDER = "protocols.swarm.syncer:build_peer_service"


def _resolve(spec: str):
    module_name, attr = spec.split(":")
    return getattr(importlib.import_module(module_name), attr)


def build_factory(name: str, node) -> Factory:
    return _resolve(FACTORY_BUILDERS[name])(node)


def build_peer_service(node, endpoint: str):
    return _resolve(PEER_SERVICE_BUILDER)(node, endpoint)
