"""One read gate per server connection: whether it reads, and why not.

A connection stops reading while any *reason* holds, and reads again once none does:

- ``SEND_BUFFER``: the transport's send buffer is full (a slow reader);
- ``SEND_QUEUE``: a second send buffer of the protocol's own (the SBP FileSender's queue) is over
  its limit;
- ``BUDGET``: the connection's requests in flight (count or bytes) are over its budget;
- ``STORE``: the store's write queue is congested (``store.congested``) until it drains
  (``store.when_drained``): a fast writer waits instead of growing the queue;
- ``CLOSING``: the connection is closing (GOAWAY, a refused frame): it never reads again.

The gate is the transport's streaming producer (``IPushProducer``): ``pauseProducing`` and
``resumeProducing`` are the transport's word on its send buffer. It pauses and resumes the
transport only when the answer changes, and calls ``on_open`` when reading resumes, so the protocol
goes on with the bytes it already holds.
"""

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

SEND_BUFFER = "send buffer"
SEND_QUEUE = "send queue"
BUDGET = "budget"
STORE = "store congestion"
CLOSING = "closing"


@implementer(IPushProducer)
class ReadGate:
    __slots__ = ("transport", "on_open", "reasons", "paused", "stopped", "_store_wait")

    def __init__(self, transport, on_open=None):
        self.transport = transport
        self.on_open = on_open  # called (no arguments) when the gate opens again
        self.reasons = set()
        self.paused = False  # the transport is paused by us
        self.stopped = False  # the connection is gone: never touch the transport again
        self._store_wait = False

    @property
    def reading(self) -> bool:
        return not self.reasons

    def hold(self, reason) -> None:
        """Stop reading for ``reason`` (until ``release(reason)``)."""
        if reason not in self.reasons:
            self.reasons.add(reason)
            self._update()

    def release(self, reason) -> None:
        if reason in self.reasons:
            self.reasons.discard(reason)
            self._update()

    def set(self, reason, holds: bool) -> None:
        if holds:
            self.hold(reason)
        else:
            self.release(reason)

    def watch_store(self, store) -> bool:
        """Hold ``STORE`` while ``store`` is congested, until it drains; True if it holds now."""
        if self._store_wait:
            return True
        if store is None or not store.congested:
            return False
        self._store_wait = True
        self.hold(STORE)
        store.when_drained().addBoth(self._store_drained)
        return True

    def _store_drained(self, _):
        self._store_wait = False
        self.release(STORE)

    def stop(self) -> None:
        """The connection is lost: keep the reasons, stop driving the transport."""
        self.stopped = True
        # Let go of the protocol (``on_open`` is its bound method) and the transport: the gate is
        # the transport's producer, so these close a reference cycle that would leave the whole
        # closed connection to a full garbage collection (docs/operations.md "Floods").
        self.on_open = None
        self.transport = None

    def _update(self):
        if self.stopped:
            return
        want = bool(self.reasons)
        if want == self.paused:
            return
        self.paused = want
        if want:
            self.transport.pauseProducing()
            return
        self.transport.resumeProducing()
        if self.on_open is not None:
            self.on_open()

    # -- IPushProducer: the transport's send buffer ------------------------------------------------

    def pauseProducing(self):
        self.hold(SEND_BUFFER)

    def resumeProducing(self):
        self.release(SEND_BUFFER)

    def stopProducing(self):
        pass
