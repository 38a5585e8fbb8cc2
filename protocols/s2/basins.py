"""Where the S2 API keeps basins (docs/protocols/s2.md): one interface, two homes.

The basin handlers of protocols/s2/api.py work on ``api.basins``, an object with

- ``get(name, fresh=False)``: the record ``{"created_ms", "config"}`` or None (``fresh``: a read
  that sees every write acknowledged before it, on any node);
- ``list(prefix)``: ``{name: record}`` of the basins whose name starts with ``prefix``;
- ``create(name, record)``: True, or False if the name is taken;
- ``change(name, fn)``: ``fn(record or None) -> (result, new record or None: no write)``, applied
  atomically; returns ``(result, the record now)``;
- ``delete(name)``: the basin and every stream in it.

``LocalBasins`` is a single node's: the metadata table ``s2_basins``. In a cluster the etcd
catalog (node/cluster/s2_catalog.py) serves the same calls, adapted by protocols/s2/cluster.py.
"""

from twisted.internet import defer

BASINS_TABLE = "s2_basins"


class LocalBasins:
    def __init__(self, store, delete_streams):
        self.store = store
        self.delete_streams = delete_streams  # async fn(basin name): its streams, deleted

    def get(self, name, fresh=False):
        # one node's metadata is always fresh
        return defer.succeed(self.store.meta.read(lambda txn: txn.get(BASINS_TABLE, name.encode())))

    def list(self, prefix=""):
        rows = self.store.meta.read(lambda txn: list(txn.scan(BASINS_TABLE, prefix=prefix.encode() or None)))
        return defer.succeed({k.decode(): v for k, v in rows})

    def create(self, name, rec):
        key = name.encode()
        return self.store.meta.transact(lambda txn: txn.put_new(BASINS_TABLE, key, rec))

    def change(self, name, fn):
        key = name.encode()

        def tx(txn):
            rec = txn.get(BASINS_TABLE, key)
            result, new = fn(rec)
            if new is None:
                return result, rec
            txn.put(BASINS_TABLE, key, new)
            return result, new

        return self.store.meta.transact(tx)

    async def delete(self, name):
        await self.delete_streams(name)
        await self.store.meta.transact(lambda txn: txn.delete(BASINS_TABLE, name.encode()))
