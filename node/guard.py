"""What connections may cost the node, whatever their protocol: a cap on open connections
(``--max-connections``), an idle-connection timeout per listener (``--idle-timeout``) and a cap
on reply bytes held for clients that do not read them (``--max-unsent-bytes``).

Every listener's factory is wrapped in a :class:`GuardedFactory` (node/service.py). The wrapper
neither wraps the transport nor sees a byte: protocols keep their plain TCP transport (sendfile and
direct sends need it), and the reactor calls them as before.

- Past ``--max-connections`` (all listeners together) a new connection is accepted and closed at
  once (a FIN, not a reset and not a wait in the listen backlog), and a warning is logged, at most
  one line per ``REFUSAL_LOG_EVERY`` seconds with the count refused meanwhile.
- Idle means no data moved either way for the listener's timeout: neither a byte from the peer nor
  one to it. The kernel keeps both times per TCP socket (``TCP_INFO``'s ``last_data_recv`` and
  ``last_data_sent``), so a sweep reads them instead of every protocol stamping its reads and
  writes. A peer that sends nothing but is being answered (an S2 read session's heartbeats, swarm
  updates) is not idle; one that stopped reading its replies is (nothing can be sent to it), as is
  one that sent half a frame and went silent. An idle connection is closed (FIN), and aborted
  ``ABORT_AFTER`` seconds later if its close could not finish (a peer not reading holds the
  unsent bytes), which frees its buffers. Sockets without ``TCP_INFO`` (UNIX sockets, other
  kernels) are never idle.
- Each protocol stops reading a connection whose replies pile up (it is its transport's producer),
  so a client that never reads costs at most the replies to what it had sent by then: for a large
  GET_FF up to a 32 MiB reply. Over many such clients that adds up, so the sweep also sums the bytes
  Twisted holds unsent for all connections; over ``--max-unsent-bytes`` it aborts the connections
  holding the most that have not taken a byte for ``STALLED_MS``, largest first, until the sum is
  back under three quarters of the cap, and logs one line per sweep that did.
"""

import resource
import socket
import struct
import time
from collections import deque

from twisted.internet import task
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger

from protocols import tcp_internals

# tcp_info (linux/tcp.h): last_data_sent at byte 44, last_data_recv at byte 52, both in ms.
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_LAST_DATA = struct.Struct("<I4xI")
_TCP_INFO_LEN = 104

# Connections a listening port accepts per reactor pass (Twisted's own grows without bound under a
# flood; each accept builds a protocol, 60-130 us): a small cap interleaves established connections.
ACCEPTS_PER_PASS = 4
REFUSAL_LOG_EVERY = 10.0
ABORT_AFTER = 2.0
SWEEP_EVERY = 0.1
SWEEP_SLICE = 256
STALLED_MS = 1000
# File descriptors kept for the store (WAL segments, packs, LMDB), logs and peer connections when
# --max-connections is derived from RLIMIT_NOFILE.
FD_RESERVE = 256


def raise_fd_limit(target: int = 65536) -> int:
    """Raise the soft RLIMIT_NOFILE toward the hard one (at most ``target``); returns the soft
    limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft


def limit_accepts(port, most: int = ACCEPTS_PER_PASS) -> None:
    """Cap a listening port's accepts per reactor pass (``tcp_internals.cap_accepts``)."""
    tcp_internals.cap_accepts(port, most)


def default_max_connections(nofile: int) -> int:
    """Connections the fd limit leaves room for after the store's own files."""
    return max(16, nofile - FD_RESERVE)


def last_data_ms(sock):
    """(ms since data was last sent, ms since data was last received) on ``sock``; None if
    unknown."""
    if _TCP_INFO is None or sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
        return _LAST_DATA.unpack_from(info, 44)
    except (OSError, struct.error):
        return None


def tcp_transport(transport):
    """The Twisted TCP transport under a transport (through a TLS layer), or None."""
    for _ in range(4):
        if transport is None:
            return None
        if isinstance(getattr(transport, "socket", None), socket.socket):
            return transport
        transport = getattr(transport, "transport", None)
    return None


class RefusedProtocol(Protocol):
    """A connection past --max-connections: closed as soon as it is made."""

    def connectionMade(self):
        self.transport.loseConnection()


class _Conn:
    """What the guard keeps per connection."""

    __slots__ = ("protocol", "name", "limit", "tcp", "unsent", "idle_due", "gone")

    def __init__(self, protocol, name, limit, now):
        self.protocol = protocol
        self.name = name
        self.limit = limit  # idle timeout in seconds, or None
        self.tcp = None  # the TCP transport under the protocol, found at the first look
        self.unsent = 0  # bytes Twisted held for it at the last look
        # when it could first be idle: its socket is not read before (one getsockopt per timeout)
        self.idle_due = now + limit if limit else float("inf")
        self.gone = False


class ConnectionGuard:
    """The node's live connections across listeners, the cap and the sweep.

    The sweep runs every ``SWEEP_EVERY`` seconds and looks at ``SWEEP_SLICE`` connections per pass,
    round-robin, plus every connection last seen holding unsent bytes, so a pass costs the reactor
    a fraction of a millisecond however many connections are open. A connection's socket is asked
    for its idle time only when it could first be idle (its timeout after the last data)."""

    log = Logger()

    def __init__(self, reactor, max_connections: int, idle_timeouts: dict, metrics=None, max_unsent_bytes: int = 0):
        self.reactor = reactor
        # node.metrics["connections"] (sbpctl status)
        self.metrics = metrics if metrics is not None else {}
        self.metrics.update(open=0, max=max_connections, refused=0, closed_idle=0, closed_stalled=0, unsent_bytes=0)
        self.max_unsent_bytes = max_unsent_bytes
        self.max_connections = max_connections
        self.idle_timeouts = {k: v for k, v in idle_timeouts.items() if v and v > 0}
        if _TCP_INFO is None:
            self.idle_timeouts = {}
        self.live = {}  # protocol -> _Conn
        self.refused = 0  # since start
        self.closed_idle = 0
        self.closed_stalled = 0
        self.unsent_total = 0
        self._ring = deque()  # _Conn, in sweep order
        self._holders = set()  # _Conn seen holding unsent bytes
        self._refused_unlogged = 0
        self._last_refusal_log = None
        self._sweeper = None

    def start(self):
        if self.idle_timeouts or self.max_unsent_bytes:
            self._sweeper = task.LoopingCall(self.sweep)
            self._sweeper.clock = self.reactor
            self._sweeper.start(SWEEP_EVERY, now=False)

    def stop(self):
        if self._sweeper is not None and self._sweeper.running:
            self._sweeper.stop()

    def wrap(self, name: str, factory: Factory) -> "GuardedFactory":
        return GuardedFactory(self, name, factory)

    def admit(self, name, protocol):
        conn = _Conn(protocol, name, self.idle_timeouts.get(name), self.reactor.seconds())
        self.live[protocol] = conn
        self._ring.append(conn)
        self.metrics["open"] = len(self.live)
        lost = protocol.connectionLost

        def connection_lost(reason=None):
            self._forget(conn)
            # This closure, stored on the protocol, holds the protocol through ``lost`` and
            # ``conn``: a reference cycle that only the cycle collector frees, a full collection
            # in a connect flood (docs/operations.md "Floods"). Unhooked, nothing of the guard's
            # keeps a closed connection's objects alive.
            protocol.__dict__.pop("connectionLost", None)
            conn.protocol = None
            return lost(reason)

        protocol.connectionLost = connection_lost  # the reactor calls the instance attribute

    @property
    def full(self) -> bool:
        return len(self.live) >= self.max_connections

    def refuse(self, name):
        self.refused += 1
        self.metrics["refused"] = self.refused
        self._refused_unlogged += 1
        now = time.monotonic()
        if self._last_refusal_log is None or now - self._last_refusal_log >= REFUSAL_LOG_EVERY:
            self.log.warn(
                "refusing connections on {listener}: {open} open, --max-connections {max} "
                "({n} refused since the last such line)",
                listener=name, open=len(self.live), max=self.max_connections, n=self._refused_unlogged,
            )
            self._last_refusal_log = now
            self._refused_unlogged = 0
        return RefusedProtocol()

    def sweep(self):
        now = self.reactor.seconds()
        for conn in list(self._holders):
            self._look(conn)
        ring = self._ring
        for _ in range(min(SWEEP_SLICE, len(ring))):
            conn = ring.popleft()
            if conn.gone:
                continue
            self._look(conn)
            if now >= conn.idle_due:
                self._check_idle(conn, now)
            if not conn.gone:
                ring.append(conn)
        self.metrics["unsent_bytes"] = self.unsent_total
        if self.max_unsent_bytes and self.unsent_total > self.max_unsent_bytes:
            self._shed()

    def _look(self, conn):
        """Update what Twisted holds unsent for ``conn``."""
        tcp = conn.tcp
        if tcp is None:
            tcp = conn.tcp = tcp_transport(getattr(conn.protocol, "transport", None))
            if tcp is None:
                return
        unsent = tcp_internals.unsent_bytes(tcp)
        self.unsent_total += unsent - conn.unsent
        conn.unsent = unsent
        if unsent:
            self._holders.add(conn)
        else:
            self._holders.discard(conn)

    def _check_idle(self, conn, now):
        last = last_data_ms(conn.tcp.socket) if conn.tcp is not None else None
        if last is None:
            conn.idle_due = float("inf")
            return
        quiet = min(last) / 1000.0
        if quiet < conn.limit:
            conn.idle_due = now + conn.limit - quiet
            return
        self.closed_idle += 1
        self.metrics["closed_idle"] = self.closed_idle
        transport = conn.protocol.transport
        self.log.info(
            "closing idle {listener} connection from {peer} ({s:.0f}s without data either way)",
            listener=conn.name, peer=_peer(transport), s=quiet,
        )
        self._forget(conn)
        transport.loseConnection()
        self.reactor.callLater(ABORT_AFTER, _abort_if_open, transport)

    def _shed(self):
        """Abort stalled readers, largest first, until the unsent bytes are under 3/4 of the cap."""
        total = self.unsent_total
        target = self.max_unsent_bytes * 3 // 4
        closed, freed = 0, 0
        for conn in sorted(self._holders, key=lambda c: c.unsent, reverse=True):
            if total - freed <= target:
                break
            last = last_data_ms(conn.tcp.socket)
            if last is None or last[0] < STALLED_MS:
                continue  # still taking data: slow, not stalled
            unsent = conn.unsent
            self._forget(conn)
            conn.tcp.abortConnection()
            closed += 1
            freed += unsent
        self.closed_stalled += closed
        self.metrics["closed_stalled"] = self.closed_stalled
        self.metrics["unsent_bytes"] = self.unsent_total
        self.log.warn(
            "{unsent} bytes of replies held for clients not reading them (--max-unsent-bytes {cap}): "
            "aborted {n} connections stalled for over {ms} ms, freeing {freed} bytes",
            unsent=total, cap=self.max_unsent_bytes, n=closed, ms=STALLED_MS, freed=freed,
        )

    def _forget(self, conn):
        if conn.gone:
            return
        conn.gone = True
        self.live.pop(conn.protocol, None)
        self._holders.discard(conn)
        self.unsent_total -= conn.unsent
        conn.unsent = 0
        self.metrics["open"] = len(self.live)


def _abort_if_open(transport):
    if getattr(transport, "connected", False) and not getattr(transport, "disconnected", False):
        transport.abortConnection()


def _peer(transport):
    try:
        p = transport.getPeer()
        return "%s:%s" % (p.host, p.port)
    except Exception:
        return "?"


class GuardedFactory(Factory):
    """One listener's factory behind the guard: counts, refuses past the cap, and hands everything
    else to the protocol's own factory."""

    def __init__(self, guard: ConnectionGuard, name: str, wrapped: Factory):
        self.guard = guard
        self.name = name
        self.wrapped = wrapped

    def __getattr__(self, attr):  # the protocol's factory keeps its own surface (metrics, tests)
        return getattr(self.wrapped, attr)

    def logPrefix(self):
        return self.wrapped.logPrefix()

    def doStart(self):
        self.wrapped.doStart()

    def doStop(self):
        self.wrapped.doStop()

    def buildProtocol(self, addr):
        if self.guard.full:
            return self.guard.refuse(self.name)
        protocol = self.wrapped.buildProtocol(addr)
        if protocol is not None:
            self.guard.admit(self.name, protocol)
        return protocol
