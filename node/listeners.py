"""Which protocol serves which listener (CONTRACT §1), and a placeholder for ones not built yet."""

import importlib

from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

# listener name -> "module:factory builder"; each builder takes the NodeContext.
FACTORY_BUILDERS = {
    "sbp": "protocols.sbp.server:build_factory",
    "kv": "protocols.partition.server:build_factory",
    "meta": "protocols.toasty.server:build_meta_factory",
    "chunks": "protocols.toasty.server:build_chunk_factory",
    "swarm": "protocols.swarm.server:build_factory",
    "http": "protocols.s2.server:build_factory",
}

PEER_SERVICE_BUILDER = "protocols.swarm.syncer:build_peer_service"


class ClosingProtocol(Protocol):
    """Serves a listener whose protocol is not available: accept, then close."""

    def connectionMade(self):
        self.transport.loseConnection()


def _resolve(spec: str):
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return None
    return getattr(module, attr, None)


def build_factory(name: str, node) -> Factory:
    builder = _resolve(FACTORY_BUILDERS[name])
    if builder is None:
        Logger().warn("no protocol for listener {listener}; connections will be closed", listener=name)
        return Factory.forProtocol(ClosingProtocol)
    return builder(node)


def build_peer_service(node, endpoint: str):
    builder = _resolve(PEER_SERVICE_BUILDER)
    if builder is None:
        Logger().warn("peer sync not available; ignoring --peer {peer}", peer=endpoint)
        return None
    return builder(node, endpoint)
