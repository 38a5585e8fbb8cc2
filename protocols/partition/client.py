"""Primary_Partition key-value clients: ``KvClientProtocol`` (Twisted) and ``BlockingKvClient``.

Both pipeline freely: replies come back in request order (CONTRACT §4) and echo the client_id,
which each client checks. A reply that does not parse, or echoes the wrong client_id, drops the
connection (every pending request then fails).
"""

import itertools
import os
from collections import deque
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger

from protocols import client_socket, framing, tcp_internals
from protocols.framing import Framer, read_frame
from protocols.partition import codec
from protocols.partition.codec import (
    CREATE_CURSOR,
    DATA_NOT_FOUND,
    DELETE_CURSOR,
    ERR,
    GET,
    GET_FB,
    GET_FF,
    GET_KEYS,
    GET_KEYS_PREFIX,
    OK,
    REMOVE,
    SET,
)

# A scan reply is at most 32 MiB (the server's budget); allow headroom.
MAX_REPLY = 2 * codec.MAX_MESSAGE
REPLY_LAYOUT = codec.Layout(codec.HEADER_LEN, MAX_REPLY, echo_client_id=False)
MAX_KEY = b"\xff" * codec.MAX_KEY


class KvError(Exception):
    """The server answered ERR (``code``) or INVALID_COMMAND (``code`` None)."""

    def __init__(self, code: Optional[int], cmd: int = ERR):
        self.code = code
        self.cmd = cmd
        if cmd == ERR:
            name = codec.ERROR_NAMES.get(code, "code %s" % code)
            super().__init__("server error %s (%s)" % (code, name))
        else:
            super().__init__("server answered %s" % codec.COMMAND_NAMES.get(cmd, cmd))


class KvProtocolError(Exception):
    """The server's reply does not parse or does not match the request: the connection is dropped."""


@dataclass
class ScanPage:
    items: List[Tuple[bytes, Optional[bytes]]] = field(default_factory=list)  # values None for key scans
    next_key: bytes = b""  # the cursor's new position (empty at BEGIN or END)
    jumped: bool = False  # CONTRACT §4: the elements span two or more partitions

    @property
    def keys(self):
        return [k for k, _ in self.items]


def interpret(reply: codec.Reply, request_cmd: int):
    """The value a request's reply stands for; raises KvError for ERR/INVALID_COMMAND."""
    cmd = reply.cmd
    if cmd == ERR:
        raise KvError(reply.error_code)
    if cmd == codec.INVALID_COMMAND:
        raise KvError(None, cmd)
    if request_cmd == GET:
        if cmd == DATA_NOT_FOUND:
            return None
        if cmd == OK and reply.items:
            return reply.items[0][1]
    elif request_cmd == REMOVE:
        if cmd in (OK, DATA_NOT_FOUND):
            return cmd == OK
    elif request_cmd in codec.SCAN_COMMANDS:
        if cmd == OK:
            return ScanPage(reply.items, reply.next_key or b"", reply.jumped)
    elif cmd == OK:
        return None
    raise KvProtocolError("unexpected %s reply to %s" % (codec.COMMAND_NAMES.get(cmd, cmd), codec.COMMAND_NAMES.get(request_cmd, request_cmd)))


class KvClientProtocol(Protocol):
    """Twisted client. Every method returns a Deferred; requests may be issued without waiting."""

    log = Logger()

    def __init__(self):
        self._frames = Framer(REPLY_LAYOUT)
        self._pending = deque()  # (client_id, request_cmd, Deferred)
        self._ids = itertools.count(1)
        self._lost = None
        self.connected_d = defer.Deferred()

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        d, self.connected_d = self.connected_d, None
        if d is not None:
            d.callback(self)

    def connectionLost(self, reason=None):
        self._lost = reason
        pending, self._pending = self._pending, deque()
        for _cid, _cmd, d in pending:
            d.errback(ConnectionError("connection to the kv server lost"))

    def _request(self, cmd, encode):
        if self._lost is not None:
            return defer.fail(ConnectionError("connection to the kv server lost"))
        cid = next(self._ids)
        d = defer.Deferred()
        self._pending.append((cid, cmd, d))
        self.transport.write(encode(cid))
        return d

    peer = "kv server"  # who sent a bad reply, in the log

    def dataReceived(self, data):
        frames = self._frames
        frames.feed(data)
        try:
            for buf, pos, end in frames.spans():
                if not self._pending:
                    raise KvProtocolError("reply without a request")
                cid, cmd, d = self._pending.popleft()
                self._answer(buf, pos, end, cid, cmd, d)
        except (KvProtocolError, codec.ReplyError, framing.FrameRefused) as e:
            self.log.warn("{peer} sent a bad reply ({error}); closing", peer=self.peer, error=str(e))
            frames.clear()
            self.transport.abortConnection()

    def _answer(self, buf, pos, end, cid, cmd, d):
        """The reply frame ``buf[pos:end]`` to the request (``cid``, ``cmd``) waiting on ``d``."""
        reply = codec.decode_reply(buf, cmd, pos)
        if reply.client_id != cid:
            raise KvProtocolError("reply for client_id %d, expected %d" % (reply.client_id, cid))
        try:
            result = interpret(reply, cmd)
        except KvError as e:
            d.errback(e)
        else:
            d.callback(result)

    def get(self, key: bytes):
        return self._request(GET, lambda cid: codec.encode_get(cid, key))

    def set(self, key: bytes, value: bytes):
        return self._request(SET, lambda cid: codec.encode_set(cid, key, value))

    def remove(self, key: bytes):
        """Fires with True if the key existed."""
        return self._request(REMOVE, lambda cid: codec.encode_remove(cid, key))

    def create_cursor(self, name: bytes, start_key: bytes = b""):
        return self._request(CREATE_CURSOR, lambda cid: codec.encode_create_cursor(cid, name, start_key))

    def delete_cursor(self, name: bytes):
        return self._request(DELETE_CURSOR, lambda cid: codec.encode_delete_cursor(cid, name))

    def scan(self, cmd: int, name: bytes, count: int, next_key: bytes = b"", prefix: bytes = b""):
        """One page (GET_FF, GET_FB, GET_KEYS or GET_KEYS_PREFIX): fires with a ScanPage."""
        return self._request(cmd, lambda cid: codec.encode_scan(cmd, cid, count, name, next_key, prefix))

    def get_ff(self, name, count, next_key=b""):
        return self.scan(GET_FF, name, count, next_key)

    def get_fb(self, name, count, next_key=b""):
        return self.scan(GET_FB, name, count, next_key)

    def get_keys(self, name, count, next_key=b""):
        return self.scan(GET_KEYS, name, count, next_key)

    def get_keys_prefix(self, name, count, prefix, next_key=b""):
        return self.scan(GET_KEYS_PREFIX, name, count, next_key, prefix)


def connect(reactor, host: str, port: int):
    """Connect a KvClientProtocol: fires with the connected protocol."""
    from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

    return connectProtocol(TCP4ClientEndpoint(reactor, host, port), KvClientProtocol())


class BlockingKvClient:
    """A plain-socket client for scripts and the CLI: one request at a time, or ``pipeline``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 7701, timeout: Optional[float] = 30.0, tls_ca=None):
        self.sock = client_socket.connect(host, port, timeout, tls_ca)
        self._frames = Framer(REPLY_LAYOUT)
        self._ids = itertools.count(1)

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _recv_reply(self, cid: int, cmd: int):
        try:
            buf, pos, _end = read_frame(self._frames, self.sock.recv, 65536)
            reply = codec.decode_reply(buf, cmd, pos)
        except (framing.FrameRefused, codec.ReplyError) as e:
            self.close()
            raise KvProtocolError(str(e))
        except ConnectionError:
            self.close()
            raise ConnectionError("the kv server closed the connection")
        if reply.client_id != cid:
            self.close()
            raise KvProtocolError("reply for client_id %d, expected %d" % (reply.client_id, cid))
        return reply

    def _call(self, cmd, encode):
        if self.sock is None:
            raise ConnectionError("the kv client is closed")
        cid = next(self._ids)
        self.sock.sendall(encode(cid))
        return interpret(self._recv_reply(cid, cmd), cmd)

    def pipeline(self, requests):
        """Send ``[(cmd, encode(cid) -> bytes), ...]`` at once; return results (KvError instances
        in place for errors) in order."""
        ids = []
        out = []
        for cmd, encode in requests:
            cid = next(self._ids)
            ids.append((cid, cmd))
            out.append(encode(cid))
        self.sock.sendall(b"".join(out))
        results = []
        for cid, cmd in ids:
            try:
                results.append(interpret(self._recv_reply(cid, cmd), cmd))
            except KvError as e:
                results.append(e)
        return results

    def get(self, key: bytes) -> Optional[bytes]:
        return self._call(GET, lambda cid: codec.encode_get(cid, key))

    def set(self, key: bytes, value: bytes) -> None:
        return self._call(SET, lambda cid: codec.encode_set(cid, key, value))

    def remove(self, key: bytes) -> bool:
        return self._call(REMOVE, lambda cid: codec.encode_remove(cid, key))

    def create_cursor(self, name: bytes, start_key: bytes = b"") -> None:
        return self._call(CREATE_CURSOR, lambda cid: codec.encode_create_cursor(cid, name, start_key))

    def delete_cursor(self, name: bytes) -> None:
        return self._call(DELETE_CURSOR, lambda cid: codec.encode_delete_cursor(cid, name))

    def scan(self, cmd: int, name: bytes, count: int, next_key: bytes = b"", prefix: bytes = b"") -> ScanPage:
        return self._call(cmd, lambda cid: codec.encode_scan(cmd, cid, count, name, next_key, prefix))

    def iter_scan(self, cmd: int = GET_FF, start: bytes = b"", page: int = 1024, prefix: bytes = b""):
        """Yield the non-empty pages of a full scan through a fresh cursor (deleted at the end).

        Forward scans start at ``start`` (empty = BEGIN); GET_FB goes down from ``start`` (empty =
        from the last key).
        """
        name = b"scan-" + os.urandom(6).hex().encode()
        self.create_cursor(name, start)
        next_key = b""
        if cmd == GET_FB and not start:
            # A new cursor sits at BEGIN, where FB finds nothing; the largest possible key (65535
            # bytes of 0xff) is at or above every key, so FB from there starts at the last key.
            next_key = MAX_KEY
        try:
            while True:
                p = self.scan(cmd, name, page, next_key, prefix)
                next_key = b""
                if p.items:
                    yield p
                if not p.items or not p.next_key:
                    return
                if cmd == GET_KEYS_PREFIX and not p.next_key.startswith(prefix):
                    return  # the page ran out at the first key without the prefix
        finally:
            if self.sock is not None:
                try:
                    self.delete_cursor(name)
                except (KvError, OSError):
                    pass
