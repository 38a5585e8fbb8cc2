"""The ``--kv-client`` listener (CONTRACT §4.1): the key-value server in yesSQL's client framing.

The §4 server itself (``server.KvServerProtocol``: its ordering, pending writes, cursors and
limits) behind a translation of the framing (``client_framing``): whole client messages are
framed with the project's one framer, rewritten into §4 messages and handed to the §4 framer; the
§4 replies are rewritten back as they leave. The store is the node's one key-value store, so a key
set through either listener is seen through the other.
"""

from protocols.framing import Framer
from protocols.partition import client_framing, codec
from protocols.partition.server import KvServerFactory, KvServerProtocol


class KvClientServerProtocol(KvServerProtocol):
    def __init__(self, kv, metrics=None, store=None):
        super().__init__(kv, metrics, store)
        self._client_frames = Framer(client_framing.Layout())
        self._refused = False

    def dataReceived(self, data):
        if self._closing or self._lost or self._refused:
            return
        translated, self._refused = client_framing.translate(self._client_frames, data)
        if translated:
            self._frames.feed(translated)
        self._process()

    def connectionLost(self, reason=None):
        self._client_frames.clear()
        super().connectionLost(reason)

    @staticmethod
    def cursor_not_found(cid):
        # CONTRACT §4.1: a cursor command naming an unknown (or deleted) cursor -> ERR 0
        return codec.encode_error(cid, codec.E_UNKNOWN)

    @staticmethod
    def outgoing(data):
        return client_framing.from_partition(data)


class KvClientServerFactory(KvServerFactory):
    protocol = KvClientServerProtocol

    def buildProtocol(self, addr):
        p = KvClientServerProtocol(self.kv, self.metrics, self.store)
        p.factory = self
        p.observe_latency = self.observe_latency
        self.connections.add(p)
        return p


def build_factory(node):
    if getattr(node, "cluster", None) is not None:
        # cluster mode (issue 20): every key, whichever node leads its partition
        from protocols.partition import cluster_server

        return cluster_server.build_factory(node, cluster_server.ClusterKvClientProtocol)
    # the §4 listener's counters: one key-value service, whichever framing its clients speak
    metrics = node.metrics.setdefault("kv", {})
    factory = KvClientServerFactory(node.store.kv, metrics, node.store)
    observe = getattr(node, "observe_latency", None)
    if observe is not None:
        factory.observe_latency = observe
    node.on_shutdown(factory.when_idle)
    return factory
