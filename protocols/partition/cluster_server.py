"""The key-value listeners in cluster mode (CONTRACT §4, §4.1, §9; issue 20).

Every request may wait on another node (its partition's leader), so this server is the general
asynchronous form of ``server.KvServerProtocol``: each request owns a slot in an ordered queue,
filled when its answer arrives, and the head of the queue leaves as soon as it is filled, so
pipelined requests are answered in order. Where a request goes is the partition service's
business (``node/cluster/kv_partitions.KvPartitions``): ``get``, ``write`` (one call per
partition per read of the socket: one replicated record), ``scan`` (one cursor page across
partitions).

Per connection, as on a single node (issue 19): a GET of a key this connection wrote and has not
had acknowledged yet answers that write's value; a scan or cursor command waits until every
earlier write of the connection is acknowledged, and cursor commands run one after another.
Cursors live here, on the client's node (CONTRACT §4: they belong to the connection).

``ClusterKvPeerProtocol`` serves the kv peer port: the same framing for partitions this node
leads only (ERR 1 PARTITION_DIED, nothing done, for the others); a scan there pages one partition
from NextKey (or the cursor's position) and its NextKey is empty when the partition ran out. A
snapshot cursor (``kv_partitions.SNAPSHOT_CURSOR``) pages a partition held here, led or not, for a
replica that takes a snapshot of it.
"""

from collections import deque

from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from protocols import tcp_internals
from protocols.framing import Framer
from protocols.partition import client_framing, codec
from protocols.partition.codec import (CREATE_CURSOR, DATA_NOT_FOUND, DELETE_CURSOR, E_CURSOR_NOT_FOUND,
                                       E_MSG_TOO_SHORT, E_PARTITION_DIED, E_UNKNOWN, GET,
                                       HEADER_LEN, INVALID_COMMAND, OK, REMOVE, SET)
from protocols.partition.server import BEGIN, ERR_STATUS, MAX_CURSORS, KvServerFactory

PARTITION_DIED_ERRORS = ("NotLeader", "Unavailable")  # the partition service's "no leader here/now"


class ClusterKvProtocol(Protocol):
    log = Logger()
    max_pending = 1024  # stop reading with this many requests unanswered
    local_only = False

    def __init__(self, service, metrics=None):
        self.service = service  # () -> the partition service, None until the cluster has started
        self.metrics = metrics if metrics is not None else {}
        self.responses = self.metrics.setdefault("responses", {})
        self._frames = Framer(codec.Layout())
        self._cursors = {}
        self._slots = deque()  # [reply bytes or None] in request order
        self._own = {}  # key -> (value or None, seq): this connection's writes not yet acknowledged
        self._seq = 0
        self._run = {}  # partition -> [(slot, cid, key, value, seq)]: this read's writes
        self._inflight = set()  # Deferreds of this connection's writes not answered yet
        self._chain = defer.succeed(None)  # cursor commands, one after another
        self._busy = False
        self._paused = False
        self._closing = False
        self._lost = False
        self._idle_waiters = []
        self.peer = "?"

    # -- connection --------------------------------------------------------------------------

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        peer = self.transport.getPeer()
        self.peer = "%s:%s" % (getattr(peer, "host", "?"), getattr(peer, "port", "?"))
        self.metrics["connections"] = self.metrics.get("connections", 0) + 1

    def connectionLost(self, reason=None):
        self._lost = True
        self._cursors.clear()
        self._frames.clear()
        self.metrics["connections"] = self.metrics.get("connections", 1) - 1
        self._check_idle()

    def _count(self, cmd, status):
        key = cmd << 8 | status
        self.responses[key] = self.responses.get(key, 0) + 1

    def dataReceived(self, data):
        self._feed(data)

    def _feed(self, data):
        if self._closing or self._lost:
            return
        self.metrics["bytes_in"] = self.metrics.get("bytes_in", 0) + len(data)
        self._frames.feed(data)
        # the appends of one read (one record per partition led here) go to the store's writer
        # together: one wake-up, one group commit, not one per partition
        core = getattr(self.service(), "core", None)
        if core is not None:
            core.hold_wakeups()
        try:
            self._busy = True
            try:
                self._process()
            except Exception:
                self.log.failure("kv connection from {peer} failed; closing", peer=self.peer)
                self._closing = True
                self.transport.abortConnection()
                return
            finally:
                self._busy = False
            self._issue_writes()
        finally:
            if core is not None:
                core.release_wakeups()
        self._drain()

    def _process(self):
        frames = self._frames
        n = 0
        while not self._closing:
            try:
                span = frames.next()
            except codec.TotalRefused as e:
                # CONTRACT §4: ERR 3 (client_id echoed, or 0 under 8 bytes), then close
                self._count(0, ERR_STATUS + E_MSG_TOO_SHORT)
                self._reply_now(codec.encode_error(e.client_id or 0, E_MSG_TOO_SHORT))
                self._closing = True
                frames.clear()
                break
            if span is None:
                break
            n += 1
            buf, pos, end = span
            total = end - pos
            if total < HEADER_LEN:
                cid = int.from_bytes(buf[pos + 8:pos + 16], "big") if total >= 16 else 0
                self._count(0, ERR_STATUS + E_MSG_TOO_SHORT)
                self._reply_now(codec.encode_error(cid, E_MSG_TOO_SHORT))
                continue
            try:
                req = codec.decode_request(buf, pos)
            except codec.DecodeError as e:
                cid = int.from_bytes(buf[pos + 8:pos + 16], "big")
                cmd = int.from_bytes(buf[pos + 24:pos + 26], "big")
                self._count(cmd if cmd in codec.COMMAND_NAMES else 0, ERR_STATUS + e.code)
                self._reply_now(codec.encode_error(cid, e.code))
                continue
            self._execute(req)
            if len(self._slots) >= self.max_pending and not self._paused:
                self._paused = True
                self.transport.pauseProducing()
                break
        self.metrics["requests"] = self.metrics.get("requests", 0) + n

    # -- ordering ----------------------------------------------------------------------------

    def _slot(self):
        slot = [None]
        self._slots.append(slot)
        return slot

    def _reply_now(self, reply):
        self._slots.append([reply])

    def _fill(self, slot, reply):
        slot[0] = reply
        if not self._busy:
            self._drain()

    def _drain(self):
        slots = self._slots
        out = []
        while slots and slots[0][0] is not None:
            out.append(slots.popleft()[0])
        if out and not self._lost:
            data = self.outgoing(b"".join(out))
            self.metrics["bytes_out"] = self.metrics.get("bytes_out", 0) + len(data)
            self.transport.write(data)
        if self._paused and len(slots) < self.max_pending // 2 and not self._lost:
            self._paused = False
            self.transport.resumeProducing()
            if self._frames.buffered():
                self._feed(b"")
        if self._closing and not slots and not self._lost:
            self.transport.loseConnection()

    @staticmethod
    def outgoing(data):
        return data

    @staticmethod
    def cursor_not_found(cid):
        return codec.encode_error(cid, E_CURSOR_NOT_FOUND)

    def _error(self, cid, cmd, failure):
        if type(failure.value).__name__ in PARTITION_DIED_ERRORS:
            code = E_PARTITION_DIED
        else:
            code = E_UNKNOWN
            self.log.warn("kv request from {peer} failed: {error!r}", peer=self.peer, error=failure.value)
        self._count(cmd, ERR_STATUS + code)
        return codec.encode_error(cid, code)

    def _svc(self):
        svc = self.service()
        if svc is None:
            from node.cluster.kv_partitions import Unavailable

            raise Unavailable("the node has not joined the cluster yet")
        return svc

    # -- requests ----------------------------------------------------------------------------

    def _execute(self, req):
        cmd = req.cmd
        cid = req.client_id
        if cmd == GET:
            self._get(req)
        elif cmd == SET or cmd == REMOVE:
            if not req.key:
                if cmd == SET:  # CONTRACT §4: SET with an empty key -> ERR 0
                    self._count(SET, ERR_STATUS + E_UNKNOWN)
                    self._reply_now(codec.encode_error(cid, E_UNKNOWN))
                else:
                    self._count(REMOVE, DATA_NOT_FOUND)
                    self._reply_now(codec.encode_status(cid, DATA_NOT_FOUND))
                return
            self._seq += 1
            value = req.value if cmd == SET else None
            if not self.local_only:
                self._own[req.key] = (value, self._seq)
            self._run.setdefault(codec.partition_of(req.key), []).append((self._slot(), cid, req.key, value, self._seq))
        elif cmd in codec.SCAN_COMMANDS or cmd in (CREATE_CURSOR, DELETE_CURSOR):
            slot = self._slot()
            self._issue_writes()  # what the connection wrote before the cursor command, first
            barrier = None
            if self._inflight and not self.local_only:
                barrier = defer.DeferredList(list(self._inflight), consumeErrors=True)
            self._chain.addBoth(lambda _: self._cursor_command(req, slot, barrier))
        else:
            self._count(cmd if cmd in codec.COMMAND_NAMES else 0, INVALID_COMMAND)
            self._reply_now(codec.encode_status(cid, INVALID_COMMAND))

    def _get(self, req):
        cid, key = req.client_id, req.key
        if not key:
            self._count(GET, DATA_NOT_FOUND)
            self._reply_now(codec.encode_status(cid, DATA_NOT_FOUND))
            return
        entry = self._own.get(key)
        if entry is not None:
            self._answer_get(entry[0], cid, key, self._slot())
            return
        svc = self.service()
        if svc is not None:
            try:
                value = svc.get_here(key, self.local_only)
            except Exception:  # (the routed path answers it with the error)
                value = svc.NOT_HERE
            if value is not svc.NOT_HERE:  # (no Deferred: led and served here, or a replica read)
                self._answer_get(value, cid, key, self._slot())
                return
        slot = self._slot()
        if svc is not None and not self.local_only and \
                svc.relay_get(key, cid.to_bytes(8, "big"), self._relayed, (cid, key, slot)):
            return
        self._get_routed(cid, key, slot)

    def _get_routed(self, cid, key, slot):
        try:
            svc = self._svc()
            d = svc.get_local(key) if self.local_only else svc.get(key)
        except Exception:
            d = defer.fail()
        d.addCallbacks(self._answer_get, self._failed, callbackArgs=(cid, key, slot), errbackArgs=(cid, GET, slot))

    def _relayed(self, reply, status, ctx):
        """A GET relayed to its partition's leader (``KvPartitions.relay_get``) answered: its
        reply as the leader framed it, the client_id already this connection's; None: route it
        again (the leader changed, the connection was lost)."""
        cid, key, slot = ctx
        if reply is None:
            if not self._lost:
                self._get_routed(cid, key, slot)
            return
        self._count(GET, ERR_STATUS + int.from_bytes(reply[26:28], "big") if status == codec.ERR else status)
        self._fill(slot, reply)

    def _answer_get(self, value, cid, key, slot):
        if value is None:
            self._count(GET, DATA_NOT_FOUND)
            self._fill(slot, codec.encode_status(cid, DATA_NOT_FOUND))
        else:
            self._count(GET, OK)
            self._fill(slot, codec.encode_get_reply(cid, key, value))

    def _failed(self, f, cid, cmd, slot):
        self._fill(slot, self._error(cid, cmd, f))

    def _issue_writes(self):
        run, self._run = self._run, {}
        for p, entries in run.items():
            ops = [(key, value) for _slot, _cid, key, value, _seq in entries]
            try:
                svc = self._svc()
                d = svc.write_local(p, ops) if self.local_only else svc.write(p, ops)
            except Exception:
                d = defer.fail()
            self._inflight.add(d)
            d.addBoth(self._written, entries, d)

    def _written(self, result, entries, d):
        self._inflight.discard(d)
        own = self._own
        for i, (slot, cid, key, value, seq) in enumerate(entries):
            cmd = SET if value is not None else REMOVE
            entry = own.get(key)
            if entry is not None and entry[1] == seq:
                del own[key]
            if isinstance(result, Failure):
                slot[0] = self._error(cid, cmd, result)
            else:
                status = OK if result[i] else DATA_NOT_FOUND
                self._count(cmd, status)
                slot[0] = codec.encode_status(cid, status)
        self._drain()
        self._check_idle()

    # -- cursors -------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def _cursor_command(self, req, slot, barrier):
        if barrier is not None:
            yield barrier
        cid, cmd = req.client_id, req.cmd
        try:
            if cmd == CREATE_CURSOR:
                if req.name not in self._cursors and len(self._cursors) >= MAX_CURSORS:
                    self._count(cmd, ERR_STATUS + E_UNKNOWN)
                    reply = codec.encode_error(cid, E_UNKNOWN)
                else:
                    self._cursors[req.name] = req.start_key or BEGIN  # CONTRACT §4: empty = BEGIN
                    self._count(cmd, OK)
                    reply = codec.encode_status(cid, OK)
            elif cmd == DELETE_CURSOR:
                if self._cursors.pop(req.name, None) is None:
                    self._count(cmd, ERR_STATUS + E_CURSOR_NOT_FOUND)
                    reply = self.cursor_not_found(cid)
                else:
                    self._count(cmd, OK)
                    reply = codec.encode_status(cid, OK)
            else:
                position = self._cursors.get(req.name)
                if position is None:
                    self._count(cmd, ERR_STATUS + E_CURSOR_NOT_FOUND)
                    reply = self.cursor_not_found(cid)
                else:
                    if req.next_key:
                        position = req.next_key  # CONTRACT §4: a non-empty NextKey says where to start
                    items, new_position, jumped = yield self._scan(req, position)
                    self._cursors[req.name] = new_position
                    self._count(cmd, OK)
                    next_key = new_position if isinstance(new_position, bytes) else b""
                    reply = codec.encode_scan_reply(cid, items, cmd in codec.VALUE_SCANS, next_key, req.name, jumped)
        except Exception:
            reply = self._error(cid, cmd, Failure())
        self._fill(slot, reply)

    def _scan(self, req, position):
        return self._svc().scan(req.cmd, position, req.count, req.prefix)

    # -- shutdown ------------------------------------------------------------------------------

    def _check_idle(self):
        if not self._inflight:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)
            if self._lost and getattr(self, "factory", None) is not None:
                self.factory.forget(self)

    def whenIdle(self):
        if not self._inflight:
            return defer.succeed(None)
        d = defer.Deferred()
        self._idle_waiters.append(d)
        return d


class ClusterKvPeerProtocol(ClusterKvProtocol):
    """The kv peer port: partitions led here only; a scan pages one partition."""

    local_only = True

    @defer.inlineCallbacks
    def _scan(self, req, position):
        items, new_position = yield self._svc().scan_peer(req.cmd, req.name, position, req.count, req.prefix)
        return items, new_position, False


class ClusterKvClientProtocol(ClusterKvProtocol):
    """``--kv-client`` (CONTRACT §4.1) in cluster mode: yesSQL's client framing translated to and
    from the §4 framing, as ``client_server.KvClientServerProtocol`` does on a single node."""

    def __init__(self, service, metrics=None):
        super().__init__(service, metrics)
        self._client_frames = Framer(client_framing.Layout())
        self._refused = False

    def dataReceived(self, data):
        if self._closing or self._lost or self._refused:
            return
        translated, self._refused = client_framing.translate(self._client_frames, data)
        self._feed(translated)

    def connectionLost(self, reason=None):
        self._client_frames.clear()
        super().connectionLost(reason)

    @staticmethod
    def cursor_not_found(cid):
        return codec.encode_error(cid, E_UNKNOWN)  # CONTRACT §4.1

    @staticmethod
    def outgoing(data):
        return client_framing.from_partition(data)


class ClusterKvFactory(KvServerFactory):
    """The single-node factory's connection bookkeeping (``forget``, ``when_idle``) over the
    cluster's partition service instead of one store."""

    protocol = ClusterKvProtocol

    def __init__(self, service, metrics=None):
        self.service = service
        self.metrics = metrics if metrics is not None else {}
        self.connections = set()

    def buildProtocol(self, addr):
        p = self.protocol(self.service, self.metrics)
        p.factory = self
        self.connections.add(p)
        return p


def build_factory(node, kind=ClusterKvProtocol):
    """The factory of a cluster node's ``kv`` (or, with ClusterKvClientProtocol, ``kv_client``)
    listener: the partition service is the cluster's once it has started."""
    factory = ClusterKvFactory(lambda: getattr(node.cluster, "kv", None), node.metrics.setdefault("kv", {}))
    factory.protocol = kind
    node.on_shutdown(factory.when_idle)
    return factory
