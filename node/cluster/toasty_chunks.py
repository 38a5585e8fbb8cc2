"""Toasty chunks across the cluster (CONTRACT §9): where chunks are written, who holds them, the
copies that keep R of them live, and the collection of chunks no file references.

- **Write locations**: R distinct live members' chunk listeners (this node first, then the others
  in node-id order after it, so writers through different nodes spread).
- **WRITE check**: each chunk must name at least min(R, live chunk servers) locations, and at least
  a majority of the locations it names must hold it: this node looks in its own store, and asks
  the others with a zero-length DOWNLOAD_CHUNK over their chunk listener. Only the nodes that
  answered "held" become the chunk's holders in the tree (toasty_tree.py).
- **Holders on READ**: every live holder, in the recorded order.
- **Repair**: every node keeps the tree's chunk pages in memory (read, then watched). A chunk
  with fewer than R live holders (and at least one) is copied by the first R - live non-holders
  in a per-chunk rendezvous order of the live members; each of them notices on its own (no
  coordinator), downloads the chunk from a live holder (SHA-256 checked), stores it and adds
  itself to the page's holder list by compare-and-swap on the page's revision.
- **Trimming** (what a returning node finds): once a chunk has at least R live holders, its list
  is cut to the first R live ones in list order, dropping dead nodes and extra copies (a node that
  came back after its chunks were copied elsewhere, or a WRITE that named more than R holding
  locations). The first live holder in the list writes the cut (compare-and-swap on the page's
  revision), so one node does it. A node listed for a chunk its store does not hold (it came back
  without its data) takes itself off the list, and the repair copies the chunk elsewhere. A node
  taken off a list drops its reference and its copy is collected as below.
- **Collection**: a node holds one local reference (table ``toasty.cpin`` + the chunk refcount in
  ``store.meta``) for every chunk some page lists it as a holder of, and drops it when none does;
  the store's sweep then reclaims the chunk after its grace period (``chunk_grace_s``, 60 s). The
  grace period is the safety margin: a chunk uploaded for a WRITE not yet committed (or never
  committed) is unreferenced until the watch shows the committed page (milliseconds), and a
  chunk dropped by one file and named again by another within the grace period is kept.
"""

import hashlib

import msgpack
from twisted.internet import defer, task, threads
from twisted.logger import Logger

from node.cluster import etcd
from node.cluster.toasty_tree import PAGE, ClusterFileTree, decode_page, encode_page
from protocols.toasty import codec
from protocols.toasty.file_tree import ChunkNotFound, InvalidOperation
from protocols.toasty.twisted_client import open_connection

PIN_TABLE = "toasty.cpin"
REPAIR_EVERY = 1.0  # seconds between passes over the chunk index
REPAIR_BATCH = 256  # chunks fetched per pass at most
COPIES_IN_FLIGHT = 16  # downloads of one pass at a time
PROBES_IN_FLIGHT = 512
PEER_TIMEOUT = 10.0  # seconds a peer's chunk listener may take to answer one request


def trimmed(ids, live, rf):
    """A holder list cut to its first ``rf`` live holders when it has that many; else as it is
    (a dead holder stays listed while it may be needed: it may come back with its copy)."""
    alive = [i for i in ids if i in live]
    return alive[:rf] if len(alive) >= rf else ids


def _rank(h, node_id):
    return hashlib.sha256(h + node_id.to_bytes(8, "big")).digest()


class PeerChunks:
    """Connections to other members' chunk listeners, one per address, made on first use. A
    request not answered within ``timeout`` seconds aborts its connection (every request pending
    on it fails): a hung peer fails a holder check or a copy instead of holding it forever."""

    def __init__(self, reactor, timeout=PEER_TIMEOUT):
        self.reactor = reactor
        self.timeout = timeout
        self._conns = {}

    @defer.inlineCallbacks
    def request(self, address, msg):
        conn = self._conns.get(address)
        if conn is None or (not isinstance(conn, defer.Deferred) and conn._lost is not None):
            conn = self._conns[address] = open_connection(self.reactor, *address)
        if isinstance(conn, defer.Deferred):
            d = defer.Deferred()
            conn.addBoth(lambda r: (d.callback(r), r)[1])
            try:
                proto = yield d
            except Exception:
                self._conns.pop(address, None)
                raise
            self._conns[address] = conn = proto
        timer = self.reactor.callLater(self.timeout, self._expire, address, conn)
        try:
            reply = yield conn.request(msg)
        finally:
            if timer.active():
                timer.cancel()
        return reply

    def _expire(self, address, conn):
        if self._conns.get(address) is conn:
            del self._conns[address]
        conn.transport.abortConnection()

    def close(self):
        for conn in self._conns.values():
            if not isinstance(conn, defer.Deferred):
                conn.transport.loseConnection()
        self._conns.clear()


class ToastyCluster:
    log = Logger()
    unavailable = (etcd.EtcdError,)  # failures the server answers with an I/O error

    def __init__(self, node, client, prefix, membership, replication_factor, reactor):
        self.node = node
        self.store = node.store
        self.client = client
        self.membership = membership
        self.rf = replication_factor
        self.reactor = reactor
        self.node_id = node.node_id
        self.tree = ClusterFileTree(client, prefix)
        self.peers = PeerChunks(reactor)
        self.pages = {}  # page key -> (mod_revision, {slot: (hash, [ids])})
        self.pinned = set()
        self.loaded = False
        self._watch = None
        self._loop = None
        self._running = None
        self._again = False
        self._dirty = True  # pages or members changed, or the last pass left work: scan again
        self.copied = 0  # chunks this node copied for repair (status, tests)
        self.under = 0  # chunks with fewer than R live holders, as of the last pass (status)

    # -- start / stop ---------------------------------------------------------------------------

    @defer.inlineCallbacks
    def start(self):
        rows = yield self.store.meta.read(lambda txn: txn.scan(PIN_TABLE, start=b"", prefix=b""))
        self.pinned = {bytes(k) for k, _ in rows}
        yield self._load()
        self._loop = task.LoopingCall(self.tick)
        self._loop.clock = self.reactor
        self._loop.start(REPAIR_EVERY, now=True)
        self.membership.on_change(lambda _: self._changed())

    @defer.inlineCallbacks
    def _load(self):
        kvs, revision = yield self.client.get_prefix(self.tree.chk_prefix)
        pages = {}
        for kv in kvs:
            try:
                pages[kv.key] = (kv.mod_revision, decode_page(kv.value))
            except (ValueError, TypeError, msgpack.UnpackException):
                self.log.warn("ignoring an unreadable toasty page at {key!r}", key=kv.key)
        self.pages = pages
        self.loaded = True
        self._dirty = True
        if self._watch is not None:
            self._watch.stop()
        self._watch = self.client.watch_prefix(self.tree.chk_prefix, revision + 1, self._events, on_reset=self._reset)

    def _reset(self):
        self.loaded = False
        self._load().addErrback(lambda f: self.log.warn("toasty page reload failed: {e}", e=f.value))

    def _events(self, events):
        for kind, kv in events:
            if kind == "DELETE":
                self.pages.pop(kv.key, None)
                continue
            try:
                self.pages[kv.key] = (kv.mod_revision, decode_page(kv.value))
            except (ValueError, TypeError, msgpack.UnpackException):
                self.log.warn("ignoring an unreadable toasty page at {key!r}", key=kv.key)
        self._changed()

    def _changed(self):
        self._dirty = True
        self.reactor.callLater(0, self.tick)

    def stop(self):
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        if self._watch is not None:
            self._watch.stop()
        self.peers.close()

    # -- addresses ------------------------------------------------------------------------------

    def _chunk_servers(self):
        """node id -> (host, port) of every live member with a chunk listener."""
        out = {}
        for nid, rec in self.membership.members.items():
            addr = rec.get("chunks")
            if addr:
                out[nid] = codec.parse_host_port(addr)
        return out

    def write_locations(self):
        servers = self._chunk_servers()
        ids = sorted(servers)
        ids = [i for i in ids if i >= self.node_id] + [i for i in ids if i < self.node_id]
        return [servers[i] for i in ids[: self.rf]]

    def holder_addresses(self, ids):
        servers = self._chunk_servers()
        return [servers[i] for i in ids if i in servers]

    # -- WRITE check ----------------------------------------------------------------------------

    @defer.inlineCallbacks
    def confirm_holders(self, chunks):
        """[[node ids holding chunk i]] for a WRITE's chunks, or FsError if a chunk names too
        few locations or is held by fewer than a majority of them."""
        servers = self._chunk_servers()
        by_address = {a: nid for nid, a in servers.items()}
        need = min(self.rf, len(servers))
        named = []
        for i, c in enumerate(chunks):
            addrs = list(dict.fromkeys((host, port) for host, port in c.locations))
            if len(addrs) < need:
                raise InvalidOperation("chunk %d lists %d locations; the replication factor needs %d"
                                       % (i, len(addrs), need))
            named.append(addrs)
        asks = {}  # (node id, hash) -> Deferred[bool]
        local = [c.hash for c, addrs in zip(chunks, named) if self.node_id in (by_address.get(a) for a in addrs)]
        held_here = dict(zip(local, self.store.chunks.has_many(local))) if local else {}
        sem = defer.DeferredSemaphore(PROBES_IN_FLIGHT)
        for c, addrs in zip(chunks, named):
            for a in addrs:
                nid = by_address.get(a)
                if nid is None or nid == self.node_id or (nid, c.hash) in asks:
                    continue
                asks[(nid, c.hash)] = sem.run(self._probe, a, c.hash)
        keys = list(asks)
        answers = yield defer.gatherResults([asks[k] for k in keys])
        held = dict(zip(keys, answers))
        out = []
        for i, (c, addrs) in enumerate(zip(chunks, named)):
            ids = []
            for a in addrs:
                nid = by_address.get(a)
                if nid is None:
                    continue
                if nid == self.node_id:
                    ok = held_here.get(c.hash, False)
                else:
                    ok = held[(nid, c.hash)]
                if ok and nid not in ids:
                    ids.append(nid)
            if len(ids) < len(addrs) // 2 + 1:
                raise ChunkNotFound("chunk %d (%s) is held by %d of the %d locations named (a majority is needed)"
                                    % (i, c.hash.hex(), len(ids), len(addrs)))
            out.append(ids)
        return out

    @defer.inlineCallbacks
    def _probe(self, address, h):
        try:
            reply = yield self.peers.request(address, codec.DownloadChunk(h, False, 0, 0))
        except Exception:
            return False
        return isinstance(reply, codec.DownloadChunkSuccess)

    # -- repair and collection ------------------------------------------------------------------

    def tick(self):
        """One pass, when something changed since the last: pins follow the index, then
        under-replicated chunks this node should copy are copied. Passes never overlap; a
        request during one runs another after it."""
        if not self.loaded or not self._dirty:
            return None
        if self._running is not None:
            self._again = True
            return self._running
        self._dirty = False
        d = self._running = self._pass()

        def done(result):
            self._running = None
            if self._again:
                self._again = False
                self.reactor.callLater(0, self.tick)
            return None

        def failed(f):
            self._dirty = True  # try again at the next period
            self.log.warn("toasty repair pass failed: {e}", e=f.value)

        d.addErrback(failed)
        d.addBoth(done)
        return d

    @defer.inlineCallbacks
    def _pass(self):
        yield self._reconcile_pins()
        yield self._repair()
        yield self._trim()
        self.under = len(self.under_replicated())

    def _wanted_pins(self):
        me = self.node_id
        return {h for _, slots in self.pages.values() for h, ids in slots.values() if me in ids}

    @defer.inlineCallbacks
    def _reconcile_pins(self):
        want = self._wanted_pins()
        add, drop = want - self.pinned, self.pinned - want
        if add:
            # newly listed here (or all of them, after a restart that lost the pin table with the
            # data): a chunk the store does not hold is not ours to keep; leave its lists
            listed = sorted(add)
            lost = {h for h, held in zip(listed, self.store.chunks.has_many(listed)) if not held}
            if lost:
                self.log.warn("listed as a holder of {n} chunks this store does not hold; leaving their holder lists", n=len(lost))
                add -= lost
                me = self.node_id
                # (the only holder listed stays: an empty list would read as no chunk at all)
                yield self._rewrite(lambda h, ids: [i for i in ids if i != me] if h in lost and len(ids) > 1 else ids)
        if not add and not drop:
            return

        def fn(txn):
            for h in add:
                txn.put(PIN_TABLE, h, 1)
            for h in drop:
                txn.delete(PIN_TABLE, h)
            if add:
                txn.chunk_incref(sorted(add))
            if drop:
                txn.chunk_decref(sorted(drop))

        yield self.store.meta.transact(fn)
        self.pinned = (self.pinned | add) - drop

    def under_replicated(self):
        """[(page key, slot, hash, live holder ids)] of chunks with 0 < live holders < R."""
        live = set(self._chunk_servers())
        out = []
        for key, (_, slots) in self.pages.items():
            for slot, (h, ids) in slots.items():
                alive = [i for i in ids if i in live]
                if alive and len(alive) < self.rf:
                    out.append((key, slot, h, alive))
        return out

    @defer.inlineCallbacks
    def _repair(self):
        servers = self._chunk_servers()
        if self.node_id not in servers:
            return
        live = set(servers)
        mine = {}  # hash -> live holder ids to copy it from
        for key, (_, slots) in self.pages.items():
            if len(mine) >= REPAIR_BATCH:
                break
            for slot, (h, ids) in slots.items():
                alive = [i for i in ids if i in live]
                if not alive or len(alive) >= self.rf or self.node_id in ids or h in mine:
                    continue
                candidates = sorted(live - set(ids), key=lambda n: _rank(h, n))
                if self.node_id in candidates[: self.rf - len(alive)]:
                    mine[h] = alive
        if not mine:
            return
        self._dirty = True  # look again next period: a copy may fail, or more may be due
        sem = defer.DeferredSemaphore(COPIES_IN_FLIGHT)
        hashes = list(mine)
        datas = yield defer.gatherResults([sem.run(self._download, servers, h, mine[h]) for h in hashes])
        fetched = [(h, data) for h, data in zip(hashes, datas) if data is not None]
        # SHA-256 off the reactor, as swarm checks every delivered item before storing it
        digests = yield threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(),
                                                  lambda: [hashlib.sha256(data).digest() for _, data in fetched])
        got = [(h, data) for (h, data), digest in zip(fetched, digests) if digest == h]
        if len(got) < len(fetched):
            self.log.warn("{n} copied chunks failed their hash check", n=len(fetched) - len(got))
        if not got:
            return
        yield self.store.chunks.put_many([data for _, data in got], addrs=[h for h, _ in got])
        self.copied += len(got)
        yield self._add_holder({h for h, _ in got})

    @defer.inlineCallbacks
    def _download(self, servers, h, sources):
        """Chunk ``h`` from the first of its live holders that serves it, or None."""
        for nid in sources:
            try:
                reply = yield self.peers.request(servers[nid], codec.DownloadChunk(h, True))
            except Exception:
                continue
            if isinstance(reply, codec.DownloadChunkSuccess):
                return bytes(reply.data)
        return None

    def _add_holder(self, hashes):
        """Add this node to the holder list of every slot naming one of ``hashes``."""
        me = self.node_id
        return self._rewrite(lambda h, ids: ids + [me] if h in hashes and me not in ids else ids)

    def _trim(self):
        """Cut the holder lists this node keeps (it is their first live holder) to R live
        holders (``trimmed``)."""
        live = set(self._chunk_servers())
        if self.node_id not in live:
            return defer.succeed(None)
        me, rf = self.node_id, self.rf

        def cut(h, ids):
            if len(ids) <= rf and all(i in live for i in ids):
                return ids
            first = next((i for i in ids if i in live), None)
            return trimmed(ids, live, rf) if first == me else ids

        return self._rewrite(cut)

    @defer.inlineCallbacks
    def _rewrite(self, change):
        """Apply ``change(hash, ids) -> ids`` to every slot, writing the pages it changes by
        compare-and-swap on their revision (a page changed meanwhile is left to the next pass)."""
        for key, (rev, slots) in list(self.pages.items()):
            changed = False
            new = {}
            for slot, (h, ids) in slots.items():
                out = change(h, ids)
                if out != ids:
                    changed = True
                new[slot] = (h, out)
            if not changed:
                continue
            r = yield self.client.txn([etcd.compare_mod_revision(key, rev)], [etcd.op_put(key, encode_page(new))])
            if r.succeeded:
                self.pages[key] = (r.revision, new)
            else:
                self._dirty = True

    # -- status ---------------------------------------------------------------------------------

    def status(self):
        return {"pages": len(self.pages), "pinned": len(self.pinned), "copied": self.copied,
                "under_replicated": self.under, "page_size": PAGE}
