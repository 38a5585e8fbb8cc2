"""SBP clients: ``SbpClient`` (Twisted: Deferreds, multiplexed frame stream ids, reconnect with
backoff, FETCH follow as a callback or an async iterator) and ``BlockingSbpClient`` (a plain socket,
no reactor: for Spark workers and scripts). Both share the request builders and reply readers below.

Errors are ``SbpError(code, message)`` with the contract's status codes (``codec.STATUS_NAMES``).
"""

import itertools
import json
import select
import socket
import time

from protocols import client_socket
from protocols.sbp import codec
from protocols.sbp.codec import T


class SbpError(Exception):
    """A non-zero SBP status (CONTRACT §3), or a transport failure (code UNKNOWN)."""

    def __init__(self, code, message=None):
        self.code = code
        self.message = message or ""
        name = codec.STATUS_NAMES.get(code, str(code))
        super().__init__("%s (%d)%s" % (name, code, ": " + self.message if self.message else ""))

    def __reduce__(self):
        return (SbpError, (self.code, self.message))


class SbpConnectionError(SbpError, ConnectionError):
    def __init__(self, message):
        SbpError.__init__(self, codec.UNKNOWN, message)

    def __reduce__(self):
        return (SbpConnectionError, (self.message,))


# -- requests and replies shared by both clients --------------------------------------------------


def _check(st):
    if st is not None and st.code != codec.OK:
        raise SbpError(st.code, st.message)


def stream_dict(s):
    return {"stream_id": s.stream_id, "replica_nums": s.replica_nums, "retention_period_ms": s.retention_period_ms}


def range_dict(r):
    return {
        "stream_id": r.stream_id,
        "range_index": r.range_index,
        "start_offset": r.start_offset,
        "next_offset": r.next_offset,
        "end_offset": r.end_offset,
        "servers": [
            {"server_id": rep.server.server_id if rep.server else 0,
             "advertise_addr": rep.server.advertise_addr if rep.server else None,
             "is_primary": rep.is_primary}
            for rep in r.servers
        ],
    }


class Call:
    """One request: opcode, header table, payload parts, and how to turn the reply into a result."""

    __slots__ = ("opcode", "header", "payload", "parse", "stream_id")

    def __init__(self, opcode, table_name, obj, parse, payload=(), stream_id=None):
        self.opcode = opcode
        self.stream_id = stream_id  # the one stream a data call is about (cluster routing)
        self.header = codec.encode_table(table_name, obj) if table_name else b""
        self.payload = tuple(payload)
        self.parse = parse  # (reply header, [(result, payload bytes)] | payload) -> value


def _results(resp, field):
    _check(resp.status)
    return getattr(resp, field)


def call_create_stream(replica_nums=1, retention_period_ms=0):
    def parse(resp, payload):
        r = _results(resp, "create_responses")[0]
        _check(r.status)
        return stream_dict(r.stream)

    return Call(codec.CREATE_STREAMS, "CreateStreamsRequest",
                T.CreateStreamsRequest(0, [T.Stream(0, replica_nums, retention_period_ms)]), parse)


def call_describe_streams(stream_ids):
    def parse(resp, payload):
        out = []
        for r in _results(resp, "describe_responses"):
            _check(r.status)
            out.append(stream_dict(r.stream))
        return out

    return Call(codec.DESCRIBE_STREAMS, "DescribeStreamsRequest", T.DescribeStreamsRequest(0, list(stream_ids)), parse)


def call_delete_stream(stream_id):
    def parse(resp, payload):
        r = _results(resp, "responses")[0]
        _check(r.status)
        return stream_dict(r.deleted_stream)

    return Call(codec.DELETE_STREAMS, "DeleteStreamsRequest", T.DeleteStreamsRequest(0, [T.Stream(stream_id, 0, 0)]), parse)


def call_update_stream(stream_id, replica_nums=0, retention_period_ms=0):
    def parse(resp, payload):
        r = _results(resp, "update_responses")[0]
        _check(r.status)
        return stream_dict(r.updated_stream)

    return Call(codec.UPDATE_STREAMS, "UpdateStreamsRequest",
                T.UpdateStreamsRequest(0, [T.Stream(stream_id, replica_nums, retention_period_ms)]), parse)


def call_list_ranges(stream_id):
    def parse(resp, payload):
        r = _results(resp, "list_responses")[0]
        _check(r.status)
        return [range_dict(x) for x in r.ranges]

    return Call(codec.LIST_RANGES, "ListRangesRequest", T.ListRangesRequest(0, [T.RangeOwner(stream_id, None)]), parse)


def call_list_all_ranges(server_id=0):
    """LIST_RANGES by range server: the streams with a range on ``server_id`` (0: the answering
    node), or on any of several ids given as a list."""
    ids = list(server_id) if isinstance(server_id, (list, tuple, set)) else [server_id]

    def parse(resp, payload):
        out = {}
        for r in _results(resp, "list_responses"):
            _check(r.status)
            out[r.stream_id] = [range_dict(x) for x in r.ranges]
        return out

    return Call(codec.LIST_RANGES, "ListRangesRequest",
                T.ListRangesRequest(0, [T.RangeOwner(-1, T.RangeServer(i, None)) for i in ids]), parse)


def call_append_many(entries):
    entries = list(entries)

    def parse(resp, payload):
        _check(resp.status)
        by_index = {r.request_index: r for r in resp.append_responses}
        out = []
        for i in range(len(entries)):
            r = by_index.get(i)
            if r is None:
                raise SbpError(codec.UNKNOWN, "no result for append entry %d" % i)
            _check(r.status)
            out.append(r.base_offset)
        return out

    infos = [T.AppendInfo(sid, i, len(b)) for i, (sid, b) in enumerate(entries)]
    return Call(codec.APPEND, "AppendRequest", T.AppendRequest(0, infos), parse, [bytes(b) for _, b in entries])


def call_append(stream_id, batch):
    c = call_append_many([(stream_id, batch)])
    c.stream_id = stream_id
    many = c.parse
    c.parse = lambda resp, payload: many(resp, payload)[0]
    return c


def call_fetch_many(requests, max_wait_ms=0, min_bytes=1):
    """``requests``: [(stream_id, offset, batch_max_bytes)]. Result: a list, per request, of
    ``bytes`` (b"" on NO_NEW_RECORD) in request order."""
    requests = list(requests)

    def parse(resp, results):
        out = [None] * len(requests)
        for r, data in results:
            if r.status.code == codec.NO_NEW_RECORD:
                data = b""
            else:
                _check(r.status)
            if 0 <= r.request_index < len(out):
                out[r.request_index] = data
        for i, v in enumerate(out):
            if v is None:
                raise SbpError(codec.UNKNOWN, "no result for fetch entry %d" % i)
        return out

    infos = [T.FetchInfo(sid, i, off, mb) for i, (sid, off, mb) in enumerate(requests)]
    return Call(codec.FETCH, "FetchRequest", T.FetchRequest(max_wait_ms, min_bytes, infos), parse)


def call_fetch(stream_id, offset, batch_max_bytes=1 << 20, max_wait_ms=0, min_bytes=1):
    c = call_fetch_many([(stream_id, offset, batch_max_bytes)], max_wait_ms, min_bytes)
    c.stream_id = stream_id
    many = c.parse
    c.parse = lambda resp, results: many(resp, results)[0]
    return c


def call_trim(stream_id, offset):
    def parse(resp, payload):
        r = _results(resp, "streams")[0]
        _check(r.status)
        return range_dict(r.range) if r.range is not None else None

    return Call(codec.TRIM_STREAMS, "TrimStreamsRequest", T.TrimStreamsRequest(0, [T.TrimmedStream(stream_id, offset)]), parse,
                stream_id=stream_id)


def call_seal(stream_id, range_index):
    def parse(resp, payload):
        r = _results(resp, "seal_responses")[0]
        _check(r.status)
        return range_dict(r.range) if r.range is not None else None

    return Call(codec.SEAL_RANGES, "SealRangesRequest", T.SealRangesRequest(0, [T.RangeId(stream_id, range_index)]), parse,
                stream_id=stream_id)


def call_create_range(stream_id):
    def parse(resp, payload):
        _check(resp.status)
        return range_dict(resp.range)

    return Call(codec.CREATE_RANGE, "CreateRangeRequest", T.CreateRangeRequest(0, T.Range(stream_id, 0, 0, 0, -1, [])), parse)


def call_describe_range(stream_id, range_index):
    def parse(resp, payload):
        r = _results(resp, "describe_responses")[0]
        _check(r.status)
        out = range_dict(r.range)
        if r.status.detail:
            # cluster mode: the replicas' progress as the answering node knows it (docs/cluster.md)
            try:
                out["progress"] = json.loads(bytes(r.status.detail))
            except ValueError:
                pass
        return out

    return Call(codec.DESCRIBE_RANGES, "DescribeRangesRequest", T.DescribeRangesRequest(0, [T.RangeId(stream_id, range_index)]), parse)


def call_allocate_id(host=""):
    def parse(resp, payload):
        _check(resp.status)
        return resp.id

    return Call(codec.ALLOCATE_ID, "IdAllocationRequest", T.IdAllocationRequest(0, host), parse)


def call_describe_cluster():
    def parse(resp, payload):
        _check(resp.status)
        return [{"name": n.name, "advertise_addr": n.advertise_addr, "is_leader": n.is_leader}
                for n in (resp.cluster.nodes if resp.cluster else [])]

    return Call(codec.DESCRIBE_PD_CLUSTER, "DescribePdClusterRequest", T.DescribePdClusterRequest(None, 0), parse)


def call_status():
    """The node's metrics view: DESCRIBE_PD_CLUSTER's status.detail (JSON) plus the cluster."""

    def parse(resp, payload):
        _check(resp.status)
        import json

        try:
            info = json.loads(resp.status.detail.decode()) if resp.status.detail else {}
        except ValueError:
            info = {}
        info["placement_drivers"] = [{"name": n.name, "advertise_addr": n.advertise_addr, "is_leader": n.is_leader}
                                     for n in (resp.cluster.nodes if resp.cluster else [])]
        return info

    return Call(codec.DESCRIBE_PD_CLUSTER, "DescribePdClusterRequest", T.DescribePdClusterRequest(None, 0), parse)


def call_ping(data=b""):
    return Call(codec.PING, None, None, lambda resp, payload: payload, [data] if data else [])


MAX_HOPS = 3  # PD_NOT_LEADER redirects followed per call


def _split_address(address):
    host, sep, port = (address or "").rpartition(":")
    if not sep or not port.isdigit():
        raise SbpError(codec.PD_NOT_LEADER, address)
    return host.strip("[]"), int(port)


# Requests that change nothing: the blocking client retries them once after a connection failure.
_IDEMPOTENT = frozenset([codec.PING, codec.FETCH, codec.LIST_RANGES, codec.DESCRIBE_RANGES, codec.DESCRIBE_STREAMS,
                         codec.DESCRIBE_PD_CLUSTER, codec.HEARTBEAT])


class ReplyAssembler:
    """Collects the frames of one response (several for FETCH) until the end flag."""

    __slots__ = ("opcode", "header", "results", "payload")

    def __init__(self, opcode):
        self.opcode = opcode
        self.header = None
        self.results = []  # FETCH: (FetchResult, bytes)
        self.payload = b""

    def add(self, frame):
        """Returns True when the response is complete. Raises SbpError for a system error."""
        if frame.is_system_error:
            st = codec.decode_table("SystemErrorResponse", frame.header).status
            raise SbpError(st.code if st else codec.UNKNOWN, st.message if st else "system error")
        if frame.opcode == codec.PING:
            self.payload = frame.payload
            return frame.is_end
        hdr = codec.decode_header(frame)
        if frame.opcode == codec.FETCH:
            pos = 0
            for r in hdr.fetch_responses:
                self.results.append((r, frame.payload[pos:pos + r.batch_length]))
                pos += r.batch_length
            if self.header is None or hdr.status.code:
                self.header = hdr
        elif frame.opcode == codec.APPEND and self.header is not None:
            # a reply split over several frames: gather every frame's results
            self.header.append_responses.extend(hdr.append_responses)
        else:
            self.header = hdr
        return frame.is_end

    def value(self, call):
        if call.opcode == codec.PING:
            return call.parse(None, self.payload)
        if call.opcode == codec.FETCH:
            if self.header is not None:
                _check(self.header.status)
            return call.parse(self.header, self.results)
        return call.parse(self.header, self.payload)


# -- blocking client ------------------------------------------------------------------------------


class BlockingSbpClient:
    """A small synchronous SBP client over one socket; one request at a time (except
    ``append_pipelined``). Pickles as its configuration only; connects on first use."""

    def __init__(self, host, port, timeout=30.0, follow_cluster=False, tls_ca=None):
        self.host = host
        self.port = int(port)
        self.timeout = timeout
        self.tls_ca = tls_ca  # PEM CA file: the listener is TLS (protocols.client_socket)
        # follow_cluster=True: a data call on one stream answered PD_NOT_LEADER naming another node of
        # the cluster goes there (CONTRACT §9), at most MAX_HOPS times; the stream's node is
        # remembered for the next calls
        self.follow_cluster = follow_cluster
        self._routes = {}  # stream_id -> "host:port"
        self._peers = {}  # "host:port" -> BlockingSbpClient
        self._members = set()
        self._sock = None
        self._frames = None
        self._goaway = False
        self._ids = itertools.count(1)

    def __getstate__(self):
        return {"host": self.host, "port": self.port, "timeout": self.timeout, "follow_cluster": self.follow_cluster,
                "tls_ca": self.tls_ca}

    def __setstate__(self, state):
        self.__init__(state["host"], state["port"], state["timeout"], state.get("follow_cluster", False), state.get("tls_ca"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def connect(self):
        if self._sock is None:
            try:
                sock = client_socket.connect(self.host, self.port, self.timeout, self.tls_ca)
            except OSError as e:
                raise SbpConnectionError("cannot connect to %s:%d: %s" % (self.host, self.port, e.strerror or e)) from None
            self._sock = sock
            self._frames = codec.FrameBuffer()
            self._goaway = False
        return self

    def close(self):
        for peer in self._peers.values():
            peer.close()
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._frames = None

    def _next_id(self):
        return next(self._ids) & 0x7FFFFFFF

    def _send(self, call, sid):
        self.connect()
        parts = codec.encode_frame_parts(call.opcode, 0, sid, call.header, call.payload)
        try:
            self._sock.sendall(b"".join(parts))
        except OSError as e:
            self.close()
            raise SbpConnectionError("send to %s:%d failed: %s" % (self.host, self.port, e)) from None

    def _read_frame(self, deadline=None, sid=None):
        while True:
            try:
                f = self._frames.next()
            except codec.BadCrc as e:
                # a whole frame whose payload fails its CRC (stored data corrupted): that reply
                # fails, the connection goes on
                if sid is not None and e.stream_id == sid:
                    raise SbpError(codec.DATA_CORRUPTED, "reply failed its CRC: %s" % e) from None
                continue
            except codec.FrameError as e:
                self.close()
                raise SbpConnectionError("bad frame from server: %s" % e) from None
            if f is not None:
                return f
            try:
                if deadline is not None:
                    self._sock.settimeout(max(0.001, deadline - time.monotonic()))
                data = self._sock.recv(codec.READ_SIZE)
            except socket.timeout:
                self.close()
                raise SbpConnectionError("timed out waiting for %s:%d" % (self.host, self.port)) from None
            except OSError as e:
                self.close()
                raise SbpConnectionError("receive from %s:%d failed: %s" % (self.host, self.port, e)) from None
            if not data:
                self.close()
                raise SbpConnectionError("connection to %s:%d closed" % (self.host, self.port))
            self._frames.feed(data)

    def _await(self, sid, call, extra_wait=0.0):
        asm = ReplyAssembler(call.opcode)
        deadline = time.monotonic() + self.timeout + extra_wait
        while True:
            f = self._read_frame(deadline, sid)
            if f.opcode == codec.GOAWAY and not f.is_response:
                self._goaway = True
                continue  # the server is going away: our in-flight request still gets its reply
            if f.stream_id != sid or not f.is_response:
                continue
            try:
                done = asm.add(f)
            except codec.HeaderDecodeError as e:
                self.close()
                raise SbpConnectionError("undecodable reply: %s" % e) from None
            if done:
                return asm.value(call)

    def _drop_if_stale(self):
        """Between requests nothing is due from the server: readable bytes can only be a GOAWAY
        or the close of a node that went away. Then reconnect before sending, rather than
        losing the request."""
        if self._sock is None:
            return
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
                return
            if client_socket.is_tls(self._sock):
                data = self._sock.recv(65536)  # select said readable (a TLS record may be whole)
            else:
                data = self._sock.recv(65536, socket.MSG_DONTWAIT)
        except (OSError, ValueError):
            self.close()
            return
        if not data:
            self.close()
            return
        self._frames.feed(data)
        try:
            while (f := self._frames.next()) is not None:
                if f.opcode == codec.GOAWAY and not f.is_response:
                    self._goaway = True
        except codec.FrameError:
            self._goaway = True

    def call(self, call, extra_wait=0.0):
        sid = call.stream_id
        if not self.follow_cluster:
            return self._call_here(call, extra_wait)
        if sid is None:
            return self._call_anywhere(call, extra_wait)
        target = self._routes.get(sid)
        client = self._peer(target) if target else self
        for hop in range(MAX_HOPS + 1):
            try:
                return client._call_here(call, extra_wait)
            except SbpConnectionError:
                if client is self or call.opcode not in _IDEMPOTENT:
                    self._routes.pop(sid, None)
                    raise
                # the stream's node went away (a failover, a restart on new ports): forget it
                # and ask the node we were given, which names the stream's node now
                self._routes.pop(sid, None)
                client = self
            except SbpError as e:
                if e.code != codec.PD_NOT_LEADER or hop == MAX_HOPS or not self._is_member(e.message, client):
                    raise
                self._routes[sid] = e.message
                client = self._peer(e.message)

    def _call_anywhere(self, call, extra_wait=0.0):
        """A call any node answers (placement-driver opcodes): on this node, and if it cannot be
        reached, a request that changes nothing goes to the other members it named before."""
        try:
            return self._call_here(call, extra_wait)
        except SbpConnectionError:
            others = sorted(self._members - {self._address()})
            if call.opcode not in _IDEMPOTENT or not others:
                raise
            last = None
            for address in others:
                try:
                    return self._peer(address)._call_here(call, extra_wait)
                except SbpConnectionError as e:
                    last = e
            raise last

    def live_members(self):
        """DESCRIBE_PD_CLUSTER: ``[{"name", "advertise_addr", "is_leader"}]``; a single node lists
        itself. Remembered, so calls any node answers go elsewhere if this one is unreachable."""
        nodes = self.call(call_describe_cluster())
        self._members = {n["advertise_addr"] for n in nodes if n["advertise_addr"]}
        return nodes

    def current_ranges(self, stream_id, live=None):
        """LIST_RANGES of ``stream_id``, the open range's next offset as its replicas know it.

        Any node answers LIST_RANGES from etcd, but an open range's next offset is the answering
        node's confirm offset (its start on a node without a replica; CONTRACT §9 Reads): so the
        open range's primary is asked, else its other live replicas, else this node. ``live``: the
        live members' SBP addresses if known (else asked)."""
        ranges = self.list_ranges(stream_id)
        open_ = [r for r in ranges if r["end_offset"] < 0]
        if not open_ or not self.follow_cluster:
            return ranges
        if live is None:
            live = {n["advertise_addr"] for n in self.live_members()}
        servers = sorted(open_[-1]["servers"], key=lambda s: not s["is_primary"])
        for address in [s["advertise_addr"] for s in servers if s["advertise_addr"] in live]:
            try:
                return self._peer(address).list_ranges(stream_id)
            except SbpConnectionError:
                continue  # a node going away (its lease has not expired yet): the next one
        return ranges

    def peer(self, address):
        """A client of the node at ``address`` (``host:port``), kept and closed with this one."""
        return self._peer(address)

    def forget(self, stream_id):
        """Drop the remembered node of ``stream_id`` (the next call asks again)."""
        self._routes.pop(stream_id, None)

    def for_stream(self, stream_id):
        """The client for the node serving ``stream_id``'s open range (its primary), learnt from
        DESCRIBE_RANGES / LIST_RANGES; this client when that is this node or unknown."""
        if stream_id not in self._routes:
            ranges = self.list_ranges(stream_id)
            open_ = [r for r in ranges if r["end_offset"] < 0]
            primary = [s for r in open_[-1:] for s in r["servers"] if s["is_primary"]]
            address = primary[0]["advertise_addr"] if primary else None
            # None (remembered too): served by this node, or not a cluster member's address
            self._routes[stream_id] = address if address and self._is_member(address, self) else None
        target = self._routes.get(stream_id)
        return self._peer(target) if target else self

    def _address(self):
        return "%s:%d" % (self.host, self.port)

    def _peer(self, address):
        if address == self._address():
            return self
        peer = self._peers.get(address)
        if peer is None:
            host, port = _split_address(address)
            peer = self._peers[address] = BlockingSbpClient(host, port, self.timeout, tls_ca=self.tls_ca)
        return peer

    def _is_member(self, address, via):
        """True if ``address`` is the SBP address of a node of the cluster ``via`` belongs to (a
        single node's PD_NOT_LEADER names a swarm origin instead: never followed)."""
        if address in self._members:
            return True
        try:
            nodes = via._call_here(call_describe_cluster())
        except SbpError:
            return False
        self._members = {n["advertise_addr"] for n in nodes}
        return address in self._members

    def _call_here(self, call, extra_wait=0.0):
        self._drop_if_stale()
        if self._goaway:
            self.close()  # the server said GOAWAY: new requests go to a new connection
        fresh = self._sock is None
        sid = self._next_id()
        try:
            self._send(call, sid)
            return self._await(sid, call, extra_wait)
        except SbpConnectionError:
            # A request that cannot have changed anything is retried once on a new connection
            # (e.g. the node restarted since the last call); APPEND and other writes never are.
            if fresh or call.opcode not in _IDEMPOTENT:
                raise
        sid = self._next_id()
        self._send(call, sid)
        return self._await(sid, call, extra_wait)

    # the API
    def ping(self, data=b""):
        return self.call(call_ping(data))

    def create_stream(self, replica_nums=1, retention_period_ms=0):
        return self.call(call_create_stream(replica_nums, retention_period_ms))

    def describe_streams(self, stream_ids):
        return self.call(call_describe_streams(stream_ids))

    def delete_stream(self, stream_id):
        return self.call(call_delete_stream(stream_id))

    def update_stream(self, stream_id, replica_nums=0, retention_period_ms=0):
        return self.call(call_update_stream(stream_id, replica_nums, retention_period_ms))

    def list_ranges(self, stream_id):
        return self.call(call_list_ranges(stream_id))

    def list_all_ranges(self, server_id=0):
        return self.call(call_list_all_ranges(server_id))

    def append(self, stream_id, batch):
        return self.call(call_append(stream_id, batch))

    def append_many(self, entries):
        return self.call(call_append_many(entries))

    def append_pipelined(self, entries, window=64):
        """Append [(stream_id, batch), ...] one frame each with up to ``window`` frames in flight;
        returns the base offsets in order."""
        entries = list(entries)
        out = [None] * len(entries)
        inflight = {}
        order = iter(enumerate(entries))
        pending = True
        while pending or inflight:
            while pending and len(inflight) < window:
                try:
                    i, (sid, b) = next(order)
                except StopIteration:
                    pending = False
                    break
                c = call_append(sid, b)
                fid = self._next_id()
                self._send(c, fid)
                inflight[fid] = (i, c)
            if not inflight:
                break
            f = self._read_frame(time.monotonic() + self.timeout)
            if f.stream_id in inflight and f.is_response:
                i, c = inflight.pop(f.stream_id)
                asm = ReplyAssembler(c.opcode)
                asm.add(f)
                out[i] = asm.value(c)
        return out

    def fetch(self, stream_id, offset, batch_max_bytes=1 << 20, max_wait_ms=0, min_bytes=1):
        return self.call(call_fetch(stream_id, offset, batch_max_bytes, max_wait_ms, min_bytes), extra_wait=max_wait_ms / 1000.0)

    def fetch_many(self, requests, max_wait_ms=0, min_bytes=1):
        return self.call(call_fetch_many(requests, max_wait_ms, min_bytes), extra_wait=max_wait_ms / 1000.0)

    def trim(self, stream_id, offset):
        return self.call(call_trim(stream_id, offset))

    def seal(self, stream_id, range_index):
        return self.call(call_seal(stream_id, range_index))

    def create_range(self, stream_id):
        return self.call(call_create_range(stream_id))

    def describe_range(self, stream_id, range_index):
        return self.call(call_describe_range(stream_id, range_index))

    def allocate_id(self, host=""):
        return self.call(call_allocate_id(host))

    def describe_cluster(self):
        return self.call(call_describe_cluster())

    def status(self):
        """A dict: node_id, sbp (advertised address), streams, metrics, placement_drivers."""
        return self.call(call_status())

    def next_offset(self, stream_id):
        """The stream's next offset (the open range's next_offset)."""
        ranges = self.list_ranges(stream_id)
        return max((r["next_offset"] for r in ranges), default=0)


# -- Twisted client -------------------------------------------------------------------------------

from twisted.application.internet import ClientService, backoffPolicy  # noqa: E402
from twisted.internet import defer, endpoints  # noqa: E402
from twisted.internet.protocol import Factory, Protocol  # noqa: E402
from twisted.logger import Logger  # noqa: E402

from protocols import tcp_internals  # noqa: E402


class SbpClientProtocol(Protocol):
    """Multiplexes requests over one connection by frame stream id (afkak's shape: a dict of
    pending Deferreds, all errbacked when the connection is lost)."""

    log = Logger()

    def __init__(self):
        self.frames = codec.FrameBuffer()
        self.pending = {}  # frame stream id -> (Call, ReplyAssembler, Deferred)
        self._ids = itertools.count(1)
        self.going_away = False
        self.lost = False
        self.on_lost = None

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        tcp_internals.set_read_size(self.transport, codec.READ_SIZE)  # FETCH replies run to 16 MiB

    def request(self, call):
        if self.lost:
            return defer.fail(SbpConnectionError("connection lost"))
        sid = next(self._ids) & 0x7FFFFFFF
        d = defer.Deferred(lambda _: self.pending.pop(sid, None))
        self.pending[sid] = (call, ReplyAssembler(call.opcode), d)
        self.transport.writeSequence(codec.encode_frame_parts(call.opcode, 0, sid, call.header, call.payload))
        return d

    def dataReceived(self, data):
        self.frames.feed(data)
        while True:
            try:
                f = self.frames.next()
            except codec.FrameLengthError as e:
                self.log.warn("bad frame from server: {error}", error=str(e))
                self.transport.loseConnection()
                return
            except codec.BadCrc as e:
                # the reply's payload fails its CRC (stored data corrupted): that call fails
                entry = self.pending.pop(e.stream_id, None)
                if entry is not None:
                    entry[2].errback(SbpError(codec.DATA_CORRUPTED, "reply failed its CRC: %s" % e))
                else:
                    self.log.warn("frame discarded: {error}", error=str(e))
                continue
            except codec.FrameError as e:
                self.log.warn("frame discarded: {error}", error=str(e))
                continue
            if f is None:
                return
            if f.opcode == codec.GOAWAY and not f.is_response:
                # in-flight requests finish; new ones go to a new connection
                self.going_away = True
                continue
            entry = self.pending.get(f.stream_id)
            if entry is None or not f.is_response:
                continue
            call, asm, d = entry
            try:
                done = asm.add(f)
                if done:
                    del self.pending[f.stream_id]
                    d.callback(asm.value(call))
            except Exception as e:
                self.pending.pop(f.stream_id, None)
                d.errback(e)

    def connectionLost(self, reason=None):
        self.lost = True
        pending, self.pending = self.pending, {}
        for call, asm, d in pending.values():
            d.errback(SbpConnectionError("connection lost: %s" % (reason.getErrorMessage() if reason else "")))
        if self.on_lost is not None:
            self.on_lost(self)


class SbpClient:
    """Twisted SBP client: ``SbpClient(reactor, "127.0.0.1", 7700)``; every method returns a
    Deferred. Keeps one connection, reconnecting with exponential backoff (ClientService).
    A request that was in flight when the connection died fails with SbpConnectionError (it is
    not retried: an APPEND might have been applied)."""

    def __init__(self, reactor, host, port, connect_timeout=10.0, fail_after_failures=5, follow_cluster=False):
        self.reactor = reactor
        self.host = host
        self.port = int(port)
        self.connect_timeout = connect_timeout
        # follow_cluster=True: as BlockingSbpClient's (CONTRACT §9)
        self.follow_cluster = follow_cluster
        self._routes = {}
        self._peers = {}
        self._members = set()
        ep = endpoints.TCP4ClientEndpoint(reactor, host, self.port, timeout=connect_timeout)
        self._service = ClientService(ep, Factory.forProtocol(SbpClientProtocol),
                                      retryPolicy=backoffPolicy(initialDelay=0.1, maxDelay=5.0), clock=reactor)
        self._service.startService()
        self._closed = False
        # None: wait for the node forever; N: fail a call after N failed connection attempts
        self.fail_after_failures = fail_after_failures

    @defer.inlineCallbacks
    def _proto(self):
        while True:
            proto = yield self._service.whenConnected(failAfterFailures=self.fail_after_failures)
            if not proto.going_away and not proto.lost:
                return proto
            if proto.going_away and not proto.lost:
                proto.transport.loseConnection()
            yield _sleep(self.reactor, 0.05)

    @defer.inlineCallbacks
    def call(self, call):
        sid = call.stream_id
        if not self.follow_cluster or sid is None:
            result = yield self._call_here(call)
            return result
        target = self._routes.get(sid)
        client = self._peer(target) if target else self
        for hop in range(MAX_HOPS + 1):
            try:
                result = yield client._call_here(call)
                return result
            except SbpError as e:
                if e.code != codec.PD_NOT_LEADER or hop == MAX_HOPS:
                    raise
                member = yield self._is_member(e.message, client)
                if not member:
                    raise
                self._routes[sid] = e.message
                client = self._peer(e.message)

    @defer.inlineCallbacks
    def _call_here(self, call):
        if self._closed:
            raise SbpConnectionError("client closed")
        proto = yield self._proto()
        result = yield proto.request(call)
        return result

    def _peer(self, address):
        if address == "%s:%d" % (self.host, self.port):
            return self
        peer = self._peers.get(address)
        if peer is None:
            host, port = _split_address(address)
            peer = self._peers[address] = SbpClient(self.reactor, host, port, self.connect_timeout, self.fail_after_failures)
        return peer

    @defer.inlineCallbacks
    def _is_member(self, address, via):
        if address in self._members:
            return True
        try:
            nodes = yield via._call_here(call_describe_cluster())
        except SbpError:
            return False
        self._members = {n["advertise_addr"] for n in nodes}
        return address in self._members

    def close(self):
        self._closed = True
        ds = [peer.close() for peer in self._peers.values()]
        ds.append(self._service.stopService())
        return defer.DeferredList(ds)

    def ping(self, data=b""):
        return self.call(call_ping(data))

    def create_stream(self, replica_nums=1, retention_period_ms=0):
        return self.call(call_create_stream(replica_nums, retention_period_ms))

    def describe_streams(self, stream_ids):
        return self.call(call_describe_streams(stream_ids))

    def delete_stream(self, stream_id):
        return self.call(call_delete_stream(stream_id))

    def list_ranges(self, stream_id):
        return self.call(call_list_ranges(stream_id))

    def list_all_ranges(self):
        return self.call(call_list_all_ranges())

    def append(self, stream_id, batch):
        return self.call(call_append(stream_id, batch))

    def append_many(self, entries):
        return self.call(call_append_many(entries))

    def fetch(self, stream_id, offset, batch_max_bytes=1 << 20, max_wait_ms=0, min_bytes=1):
        return self.call(call_fetch(stream_id, offset, batch_max_bytes, max_wait_ms, min_bytes))

    def fetch_many(self, requests, max_wait_ms=0, min_bytes=1):
        return self.call(call_fetch_many(requests, max_wait_ms, min_bytes))

    def trim(self, stream_id, offset):
        return self.call(call_trim(stream_id, offset))

    def seal(self, stream_id, range_index):
        return self.call(call_seal(stream_id, range_index))

    def create_range(self, stream_id):
        return self.call(call_create_range(stream_id))

    def allocate_id(self, host=""):
        return self.call(call_allocate_id(host))

    def update_stream(self, stream_id, replica_nums=0, retention_period_ms=0):
        return self.call(call_update_stream(stream_id, replica_nums, retention_period_ms))

    def describe_range(self, stream_id, range_index):
        return self.call(call_describe_range(stream_id, range_index))

    def describe_cluster(self):
        return self.call(call_describe_cluster())

    def status(self):
        return self.call(call_status())

    def follow(self, stream_id, offset, callback=None, batch_max_bytes=1 << 20, max_wait_ms=5000):
        """Read a stream from ``offset`` on, forever (long-poll FETCH at the tail).

        With ``callback(batches_bytes, next_offset)`` (may return a Deferred: the next FETCH waits
        for it), returns a ``Follower`` whose ``stop()`` ends it and whose ``done`` Deferred fires
        then. Without a callback the Follower is an async iterator of ``(bytes, next_offset)``:
        ``async for data, nxt in client.follow(sid, 0): ...``.
        """
        f = Follower(self, stream_id, offset, callback, batch_max_bytes, max_wait_ms)
        if callback is not None:
            f.start()
        return f


def _sleep(reactor, seconds):
    d = defer.Deferred()
    reactor.callLater(seconds, d.callback, None)
    return d


def next_offset_after(data, offset):
    """The offset after the last batch in ``data`` (concatenated whole batches)."""
    from storage import record_batch

    pos = 0
    nxt = offset
    view = memoryview(data)
    while pos < len(view):
        h = record_batch.read_header(view, pos)
        nxt = h.base_offset + h.record_count
        pos += record_batch.HEADER_SIZE + h.records_len
    return nxt


class Follower:
    log = Logger()

    def __init__(self, client, stream_id, offset, callback, batch_max_bytes, max_wait_ms):
        self.client = client
        self.stream_id = stream_id
        self.offset = offset
        self.callback = callback
        self.batch_max_bytes = batch_max_bytes
        self.max_wait_ms = max_wait_ms
        self.stopped = False
        self.done = defer.Deferred()
        self._current = None

    def stop(self):
        self.stopped = True
        if self._current is not None:
            self._current.cancel()

    def _fetch_once(self):
        self._current = self.client.fetch(self.stream_id, self.offset, self.batch_max_bytes, self.max_wait_ms)
        return self._current

    def start(self):
        d = defer.ensureDeferred(self._run())
        d.addCallbacks(self._finished, self._failed)
        return d

    def _finished(self, _):
        if not self.done.called:
            self.done.callback(None)

    def _failed(self, failure):
        # an SbpError (e.g. the stream was deleted) or a callback's exception ends the follow
        if not self.done.called:
            if self.stopped:
                self.done.callback(None)
            else:
                self.done.errback(failure)

    async def _run(self):
        while not self.stopped:
            try:
                data = await self._fetch_once()
            except defer.CancelledError:
                return
            except SbpConnectionError:
                if self.stopped:
                    return
                await _sleep(self.client.reactor, 0.2)
                continue
            if data:
                nxt = next_offset_after(data, self.offset)
                self.offset = nxt
                await defer.maybeDeferred(self.callback, data, nxt)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self.stopped:
            try:
                data = await self._fetch_once()
            except defer.CancelledError:
                break
            except SbpConnectionError:
                await _sleep(self.client.reactor, 0.2)
                continue
            if data:
                self.offset = next_offset_after(data, self.offset)
                return data, self.offset
        raise StopAsyncIteration
