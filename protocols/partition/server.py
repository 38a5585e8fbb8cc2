"""The Primary_Partition key-value server (CONTRACT §4) over the node's store (``store.kv``).

One ``KvServerProtocol`` per connection. It frames with ``protocols/framing.Framer``, decodes
each message with the codec, runs it against the store and queues the encoded reply. Replies leave
in request order even though SET and REMOVE complete later (when durable): every executed request
owns a slot in an ordered queue and the head of the queue is written as soon as it is ready.

The hot commands skip the codec's request objects: a run of consecutive GETs in one read is one
``store.kv.get_many``, and a run of consecutive SETs/REMOVEs is one ``store.kv.write_many`` (one
group commit, one Deferred, one slot for the whole run). Everything written in one pass over the
buffer leaves in one ``send``. A read that starts with whole writes, or with whole GETs while the
connection has nothing waiting, skips the framer and the general loop for that run
(``_writes_from_read``, ``_gets_from_read``: one loop per read of GETs, looking each up through
``store.kv.point_reader``).

Per-connection sequential consistency without waiting for the disk (issue 19): the writes of one
processing pass (every SET/REMOVE of the bytes read, whatever GETs lie between them) are one
``write_many`` (one group commit), and each is entered in the connection's *pending* table until
durable. A GET reads that table first, so a pipelined ``SET k; GET k`` sees its own write at once;
its reply waits in the ordered queue behind the SET's. Another connection never reads the table:
it sees a write only once acknowledged. A scan reads the store merged with the table
(``with_pending``). So no request waits for the disk; only the replies of writes do.
"""

import struct
import time
import weakref
from collections import deque
from itertools import repeat

import msgpack
import numpy
from twisted.internet import defer
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from protocols import tcp_internals
from protocols.direct_send import send_now
from protocols.framing import Framer
from protocols.partition import codec, gets_compiled, sets_compiled
from protocols.read_gate import BUDGET, CLOSING, ReadGate
from protocols.partition.codec import (
    CREATE_CURSOR,
    DATA_NOT_FOUND,
    DELETE_CURSOR,
    E_CURSOR_NOT_FOUND,
    E_MSG_TOO_SHORT,
    E_UNKNOWN,
    GET,
    GET_FB,
    GET_FF,
    GET_KEYS_PREFIX,
    HEADER_LEN,
    INVALID_COMMAND,
    MAX_MESSAGE,
    OK,
    REMOVE,
    SET,
)
from storage import errors, kv_cache
from storage.index import KEY_KEEP, PackedOp
from storage.kv import PackedRun

_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_HEADER = codec.HEADER
_HEADER_KEYLEN = struct.Struct(">QQQHH").unpack_from
# GET reply heads by key length: ">QQQHH{klen}sI".pack (CONTRACT §4: OK, num_elems 1, then
# u16 key_len, key, u32 value_len, value); the keys of one workload have few distinct lengths.
_GET_REPLY_HEADS = {}


def _get_reply_head(klen):
    head = struct.Struct(">QQQHH%dsI" % klen).pack
    if len(_GET_REPLY_HEADS) < 1024:
        _GET_REPLY_HEADS[klen] = head
    return head

_U32_FROM = struct.Struct(">I").unpack_from
_KEYS_OF_FRAMES = {}  # (key_len, count) -> the unpack of the keys of count GETs of that key_len
KEYS_OF_FRAMES_MAX = 256  # reads of more GETs take their keys by a slicing comprehension


# Scratch of the row cache's kernel calls (reactor thread; one read at a time): per GET of a read
# its entry's arena position or -1, the indices of the GETs missed, the replies (grown as needed;
# copied out with one tobytes).
_WHERE = numpy.empty(65536, numpy.int64)
_MISSED = numpy.empty(65536, numpy.int64)
_REPLIES = [numpy.empty(1 << 20, numpy.uint8)]


def _replies_scratch(size):
    out = _REPLIES[0]
    if size > len(out):
        out = _REPLIES[0] = numpy.empty(max(size, 2 * len(out)), numpy.uint8)
    return out


_LENGTHS = {}  # count -> the pack of count lengths as little-endian u32 (gets_kernel.get_replies)


def _lengths_packer(count):
    pack = _LENGTHS.get(count)
    if pack is None:
        pack = struct.Struct("<%dI" % count).pack
        if len(_LENGTHS) < 1024:
            _LENGTHS[count] = pack
    return pack


def _keys_of_frames(klen, count):
    """The ``unpack_from`` giving the keys of ``count`` back-to-back GET frames of exactly 28 +
    ``klen`` bytes each (one C call: no Python bytecode per key), or None for larger ``count``."""
    unpack = _KEYS_OF_FRAMES.get((klen, count))
    if unpack is None and count <= KEYS_OF_FRAMES_MAX:
        unpack = struct.Struct("28x%ds" % klen * count).unpack_from
        if len(_KEYS_OF_FRAMES) < 1024:
            _KEYS_OF_FRAMES[(klen, count)] = unpack
    return unpack

MAX_VALUE = codec.MAX_VALUE

# sbpnode_responses_total (node/metrics.py): replies counted by command << 8 | status, the status
# being the reply's OK / DATA_NOT_FOUND / INVALID_COMMAND or ERR_STATUS + its ERR code; command 0:
# not known (a message too short or not decodable). Int keys: node.metrics is dumped as JSON.
ERR_STATUS = 128
_GET_OK = GET << 8 | OK
_GET_NOT_FOUND = GET << 8 | DATA_NOT_FOUND
_SET_OK = SET << 8 | OK
_REMOVE_OK = REMOVE << 8 | OK
_NO_WRITE = object()  # no pending write of the key (a pending remove is None)
_unpackb = msgpack.unpackb
# The compiled SET pass's output buffers, reused by every read (the reactor thread's; what a run
# keeps is copied out of them): its WAL op (up to the read's length + 16), its replies (grown when
# a run's GET replies need more) and the frames' positions (2 per frame).
_SCRATCH = [bytearray(1 << 16), bytearray(1 << 16), numpy.empty(2 * 2341 + 2, numpy.int64)]
# After a read the pass could not take whole (writes mixed with other frames), the next this many
# reads of the connection that start with a write go to the loop without trying it (the same
# replies either way: only the wasted call is saved)
SETS_SKIP_READS = 16
# The largest the pass's replies scratch grows to (a read's GET replies past it: the loop answers)
REPLIES_SCRATCH_MAX = 4 << 20
_TOTAL_FROM = _U64.unpack_from


class _OkReplies(bytes):
    """The replies of a compiled run (``sets_kernel.set_run``), one after another: its SETs' OK
    replies (26 bytes each) and the ready replies of its GETs (longer: each holds a value). The
    segment's reply as is once the run is stored; ``cids`` for any other answer."""

    __slots__ = ()

    def cids(self):
        """The run's items as ``_write_run`` keeps them: a SET's client id, a GET's reply."""
        out = []
        pos = 0
        end = len(self)
        while pos < end:
            total = _U64.unpack_from(self, pos)[0]
            out.append(_U64.unpack_from(self, pos + 8)[0] if total == HEADER_LEN else self[pos : pos + total])
            pos += total
        return out


def _expanded(items):
    """A segment's items with each ``_OkReplies`` replaced by its items (client ids, GET replies)."""
    out = []
    for item in items:
        if item.__class__ is _OkReplies:
            out += item.cids()
        else:
            out.append(item)
    return out


class _Position:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


# CONTRACT §4: a cursor's position is BEGIN, a key, or END.
BEGIN = _Position("BEGIN")
END = _Position("END")

# Elements of one scan reply stay under this many bytes so a reply is never larger than the
# largest request (32 MiB); the first element always fits (a key <= 64 KiB, a value <= 16 MiB).
SCAN_REPLY_BUDGET = MAX_MESSAGE - 70 * 1024
SEND_BIG_REPLY_AT = 256 * 1024
# The first store fetch of a value scan is small so a page of huge values is not materialised
# 1025 at a time; the following fetch is sized from the bytes seen.
FIRST_VALUE_FETCH = 16
MAX_CURSORS = 4096


def _pair_key(e):
    return e[0]


def _pair_size(e):
    return len(e[0]) + len(e[1]) + 6


def _key_key(e):
    return e


def _key_size(e):
    return len(e) + 2


def collect_page(fetch, start, count, key_of, size_of, prefix=None, first_fetch=None, descending=False):
    """Gather one scan page from ``fetch(start, limit)`` (store order, ``start`` inclusive, None =
    from the open end).

    Returns ``(entries, next_entry)``: at most ``count`` entries whose sizes fit the reply budget
    (the first always), and the first entry not returned (None when the scan ran out). With
    ``prefix``, the page ends at the first key without it, which is then the next entry.

    Keys are taken strictly monotonic (an entry out of order is dropped), so whatever the store
    returns, a page never repeats a key and the cursor always moves past it: a full scan ends.
    """
    out = []
    nbytes = 0
    limit = count + 1 if first_fetch is None else min(count + 1, first_fetch)
    skip = None
    last = None
    while True:
        batch = fetch(start, limit)
        for e in batch:
            k = key_of(e)
            if skip is not None:
                matched = k == skip
                skip = None
                if matched:
                    continue
            if last is not None and (k >= last if descending else k <= last):
                continue
            last = k
            if prefix is not None and not k.startswith(prefix):
                return out, e
            if len(out) == count:
                return out, e
            size = size_of(e)
            if out and nbytes + size > SCAN_REPLY_BUDGET:
                return out, e
            out.append(e)
            nbytes += size
        if len(batch) < limit:
            return out, None
        if last is None or last == start:
            return out, None  # no progress: only possible if the store's order is broken
        # The fetch was full: continue from its last key (inclusive, so skip it once).
        start = skip = last
        remaining = count - len(out)
        avg = max(1, nbytes // max(1, len(out)))
        limit = max(2, min(remaining + 2, (SCAN_REPLY_BUDGET - nbytes) // avg + 2))


def scan_page(cmd, position, count, prefix, scan_forward, scan_backward, scan_keys):
    """One page of the scan ``cmd`` (CONTRACT §4) from ``position`` (BEGIN, END or a key) over the
    given store scans (``fetch(start, limit)``, ``start`` inclusive, None = from the open end):
    ``(items, new_position)``, items [(key, value or None for key scans)] in ascending order,
    the new position BEGIN / END when the scan ran out."""
    if cmd == GET_FB:
        if position is BEGIN:
            return [], BEGIN
        entries, nxt = collect_page(scan_backward, None if position is END else position, count,
                                    _pair_key, _pair_size, first_fetch=FIRST_VALUE_FETCH, descending=True)
        entries.reverse()  # each page is returned in ascending order
        return entries, BEGIN if nxt is None else nxt[0]
    if position is END:
        return [], END
    start = None if position is BEGIN else position
    if cmd == GET_FF:
        items, nxt = collect_page(scan_forward, start, count, _pair_key, _pair_size, first_fetch=FIRST_VALUE_FETCH)
        return items, END if nxt is None else nxt[0]
    if cmd == GET_KEYS_PREFIX:
        prefix = prefix or None
        # CONTRACT §4: forward from max(position, prefix).
        if prefix is not None and (start is None or start < prefix):
            start = prefix
    else:
        prefix = None
    keys, nxt = collect_page(scan_keys, start, count, _key_key, _key_size, prefix=prefix)
    return [(k, None) for k in keys], END if nxt is None else nxt


def with_pending(fetch, pending, descending=False, keys_only=False):
    """``fetch(start, limit)`` (a store scan: ``start`` inclusive, None = from the open end) as
    this connection sees it: merged with ``pending`` ({key: value, or None for a remove}: its own
    writes not yet durable), in the same order and with the same signature.

    Each call asks the store for ``limit`` plus the number of pending removes, so after the removes
    at least ``limit`` entries remain unless the store ran out; the pending writes inside the range
    that store answer covers are merged in, and the first ``limit`` are returned (a prefix of the
    merged order, so ``collect_page`` goes on from its last key as it does over the store)."""
    removes = sum(1 for v in pending.values() if v is None)
    keys = sorted(pending, reverse=descending)

    def fetch_merged(start, limit):
        batch = fetch(start, limit + removes)
        exhausted = len(batch) < limit + removes
        merged = {}
        for e in batch:
            if keys_only:
                merged[e] = None
            else:
                merged[e[0]] = e[1]
        bound = None if exhausted or not batch else (batch[-1] if keys_only else batch[-1][0])
        for k in keys:
            if start is not None and (k > start if descending else k < start):
                continue
            if bound is not None and (k < bound if descending else k > bound):
                break
            v = pending[k]
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        out = sorted(merged, reverse=descending)[:limit]
        return out if keys_only else [(k, merged[k]) for k in out]

    return fetch_merged


# Per store (its CommitCore): the connections whose write replies became ready during the store's
# delivery of a group, sent once the whole group is delivered (_run_done).
_DUE_AFTER_DELIVERY = weakref.WeakKeyDictionary()
_log = Logger()


def _due_after_delivery(store):
    """The list of connections to drain once the store's current delivery ends (None: a store
    without the ``after_deliver`` hook, e.g. a test double)."""
    core = getattr(store, "core", None)
    hooks = getattr(core, "after_deliver", None)
    if hooks is None:
        return None
    due = _DUE_AFTER_DELIVERY.get(core)
    if due is None:
        due = _DUE_AFTER_DELIVERY[core] = []

        def drain_due():
            while due:
                protos = due[:]
                del due[:]
                for proto in protos:
                    proto._drain_due = False
                    try:
                        proto._drain()
                    except Exception:
                        _log.failure("kv connection from {peer}: sending write replies failed", peer=proto.peer)

        hooks.append(drain_due)
    return due


def _ignore_latency(operation, seconds):
    """A node without the latency hook (--metrics off, test doubles)."""


class _Run:
    """The writes of one processing pass: one ``write_many`` (one group commit), answered in
    ``segments`` (a reply slot and its items each) split by the replies queued between them; an
    item is a write's client id (its reply made when the run is durable) or the ready reply of a
    GET answered in the same pass from this run's writes (``_write_run``).
    ``pending`` is its entry in the connection's pending table: {key: value or None}, its last
    write of each key."""

    __slots__ = ("keys", "values", "segments", "nbytes", "removes", "pending", "packed")

    def __init__(self):
        self.keys = []
        self.values = []  # value, or None for a remove (a packed run: the stored values)
        self.segments = []  # [(slot, [client_id (int), reply (bytes) or _OkReplies])]
        self.nbytes = 0
        self.removes = 0
        self.pending = {}
        # (PackedOp, key and value bytes) of a run the compiled SET pass took whole from a read
        # (``_sets_compiled``): written by ``kv.write_packed``; None for any other run
        self.packed = None


class KvServerProtocol(Protocol):
    log = Logger()
    observe_latency = staticmethod(_ignore_latency)  # the factory's, i.e. the node's (node/metrics.py)
    # Backpressure: stop reading once this many requests wait for execution or for their reply,
    # or once this many bytes of written values wait to be durable.
    max_pending = 1024
    max_inflight_bytes = 64 * 1024 * 1024

    def __init__(self, kv, metrics=None, store=None):
        self.kv = kv
        self.store = store  # for its congestion signal (None: not checked)
        self.metrics = metrics if metrics is not None else {}
        self.responses = self.metrics.setdefault("responses", {})
        self._frames = Framer(self.layout())
        self._cursors = {}
        self._slots = deque()  # executed requests whose replies are not yet written: [bytes|None, count]
        self._waiting = 0  # requests those slots answer (a segment of writes is one slot)
        self._unacked = 0  # writes taken (in the open run or issued) and not yet durable
        self._inflight_bytes = 0  # value bytes of those writes
        # This connection's writes not yet durable: one {key: value or None} per run, oldest first
        # (the open run's included); a read looks them up newest first.
        self._pending = deque()
        self._run = None  # the open _Run of this pass, issued at its end
        self._out = []  # replies ready to write at the end of this turn
        self._busy = False  # inside _process/_drain: writes are batched until it ends
        self._closing = False  # stop reading; close once every queued reply is written
        self._lost = False
        self.gate = None  # the ReadGate, once connected
        self._idle_waiters = []
        self._peer_errors = 0
        self.peer = "?"
        # Write replies made ready by the store's delivery of a group are sent once the whole group
        # is delivered: one send for every run of this connection in it (_run_done).
        self._after_delivery = _due_after_delivery(store)
        self._drain_due = False
        self._issuing = False  # inside _issue_run: a run failing at once is answered at once
        # the store takes runs packed by the compiled SET pass (sets_compiled; not a test double)
        self._packed_writes = getattr(kv, "write_packed", None) is not None
        self._sets_skip = 0  # reads left to take with the loop before trying the pass again

    @staticmethod
    def layout():
        return codec.Layout()

    # -- connection --------------------------------------------------------------------------

    def connectionMade(self):
        tcp_internals.set_no_delay(self.transport)
        peer = self.transport.getPeer()
        self.peer = "%s:%s" % (getattr(peer, "host", "?"), getattr(peer, "port", "?"))
        self.gate = ReadGate(self.transport, self._process)
        self.transport.registerProducer(self.gate, True)
        self.metrics["connections"] = self.metrics.get("connections", 0) + 1

    def connectionLost(self, reason=None):
        self._lost = True
        if self.gate is not None:
            self.gate.stop()
        # CONTRACT §4: cursors belong to the connection and vanish with it.
        self._cursors.clear()
        self._frames.clear()
        self.metrics["connections"] = self.metrics.get("connections", 1) - 1
        if self._peer_errors > 1:
            self.log.warn("kv peer {peer} sent {n} bad requests in all", peer=self.peer, n=self._peer_errors)
        if self._unacked == 0:
            self._fire_idle()

    def _count(self, cmd, status, n=1):
        key = cmd << 8 | status
        self.responses[key] = self.responses.get(key, 0) + n

    def _peer_error(self, fmt, **fields):
        """Log a peer's protocol error at warn: the first per connection, then only a count."""
        self._peer_errors += 1
        if self._peer_errors == 1:
            self.log.warn(fmt, peer=self.peer, **fields)

    def _fire_idle(self):
        waiters, self._idle_waiters = self._idle_waiters, []
        for d in waiters:
            d.callback(None)
        factory = getattr(self, "factory", None)
        if self._lost and factory is not None:
            factory.forget(self)

    # -- framing -----------------------------------------------------------------------------

    def dataReceived(self, data):
        if self._closing or self._lost:
            return
        metrics = self.metrics
        metrics["bytes_in"] = metrics.get("bytes_in", 0) + len(data)
        if (not self._busy and not self._out and self._run is None and self._frames.buffered() == 0
                and not self.gate.reasons and data.__class__ is bytes and len(data) >= 28):
            # A read that starts with whole GETs, SETs or REMOVEs, no partial frame held: that
            # run is taken straight from the read, without the framer and the general loop's
            # layers (per read, not per request: a third of a GET's CPU at reads of 16,
            # docs/benchmarks.md). GETs so only while nothing of this connection waits (no reply
            # slot, no write in flight); the rest of the read goes the general way.
            cmd = _U16.unpack_from(data, 24)[0]
            if cmd == GET:
                pos = self._gets_from_read(data) if not self._slots and not self._pending else 0
            elif (cmd == SET or cmd == REMOVE) and self._waiting < self.max_pending \
                    and self._inflight_bytes < self.max_inflight_bytes:
                pos = self._writes_from_read(data)
            else:
                pos = 0
            if pos == len(data):
                return
            if pos:
                data = data[pos:]
        self._frames.feed(data)
        self._process()

    def _writes_from_read(self, data):
        """Take the run of whole, well-formed writes at the start of ``data`` (``_write_run``: a
        GET of a key the run wrote is answered in it); the position after the run (0: none). If
        that is the whole read the run is issued as ``_process`` does; else it stays open for the
        rest of the read (``_process`` issues it): one store write per read, as before."""
        n = len(data)
        self._busy = True
        self._handled = 1
        try:
            pos = 0
            if sets_compiled.run is not None and self._packed_writes:
                if self._sets_skip:
                    self._sets_skip -= 1
                else:
                    pos = self._sets_compiled(data, n)
            if not pos:
                pos = self._write_run(data, 0, n)
            if pos:
                self.metrics["requests"] = self.metrics.get("requests", 0) + self._handled
        except Exception:
            self._drop_on_bug()
            self._issue_run()  # as _process: whatever the run took is still written
            return n
        finally:
            self._busy = False
        if pos != n:
            return pos
        self._issue_run()
        self._flush()
        if self._unacked and not self._lost:
            self.gate.watch_store(self.store)
        return pos

    def _sets_compiled(self, data, n):
        """``_write_run`` over a read that starts with SETs, with no Python bytecode per request
        (sets_compiled): one compiled pass finds the run's frames (SETs, and GETs of keys the run
        set: ``SET k; GET k`` pipelined) and writes the SETs' WAL op (a ``PackedOp``) and the
        replies of all, in order (a GET's answered from the read, as ``_write_run``'s ``batch``
        answers it, and held behind the SETs' until the run is durable); the op is the run's
        pending table and the store's run at once (``kv.PackedRun.of_op``, ``kv.write_packed``),
        unpacked into keys and stored values only if something reads them. Only where the
        result is exactly
        ``_write_run``'s: the run must end the read's whole frames (or stop at the budget), else
        0 (nothing done: the Python loop takes the read, GETs of other keys, REMOVEs and refusals
        among the writes). Returns the position after the run."""
        room = self.max_pending - self._waiting
        payload, replies, where = _SCRATCH
        if len(payload) < n + 16:
            payload = _SCRATCH[0] = bytearray(max(n + 16, 1 << 16))
        if len(where) < 2 * (n // 28 + 1):
            where = _SCRATCH[2] = numpy.empty(2 * (n // 28 + 1), numpy.int64)
        while True:
            count, end, plen, kbytes, vbytes, budget, items, rlen, full = sets_compiled.run(
                data, room, self.max_inflight_bytes - self._inflight_bytes, payload, replies, where)
            if not full:
                break
            # a GET's reply did not fit (the replies of a read's GETs can outgrow the read): grow
            # the scratch, up to REPLIES_SCRATCH_MAX (then the loop takes the read: a read that
            # GETs a big value it set many times, kept out of a scratch that never shrinks)
            if len(replies) >= REPLIES_SCRATCH_MAX:
                return 0
            replies = _SCRATCH[1] = bytearray(min(2 * len(replies) + n, REPLIES_SCRATCH_MAX))
        if not count or (not budget and n - end >= 28 and _TOTAL_FROM(data, end)[0] <= n - end):
            # this connection mixes its writes with other frames (GETs of other keys, REMOVEs):
            # the loop takes its next reads without trying the pass first
            self._sets_skip = SETS_SKIP_READS
            return 0
        op = PackedOp(memoryview(payload)[:plen])
        run = self._run = _Run()
        # the pending table: the store's run itself, its keys and stored values unpacked from the
        # op only if something reads them (a GET looking in it, the memtable's fold: kv.PackedRun)
        run.pending = table = PackedRun.of_op(op, count)
        run.keys = None  # (a packed run is unpacked before more writes join it: _unpack_run)
        run.values = table  # its len() and stored values
        run.nbytes = vbytes
        run.packed = (op, kbytes + vbytes)
        self._pending.append(table)
        slot = [None, items]
        self._slots.append(slot)
        run.segments.append((slot, [_OkReplies(memoryview(replies)[:rlen])]))
        self._waiting += items
        self._unacked += count
        self._inflight_bytes += vbytes
        self._handled += items - 1
        if items != count:
            self._gets_answered(items - count, 0)
        return end

    def _unpack_run(self, run):
        """Make a packed run (``_sets_compiled``) a plain one, values and pending table as
        ``_write_run`` has them, so more writes can join it (none does now: such a run ends its
        read's whole frames)."""
        packed = run.pending
        plain = {key: stored[1:] for key, stored in packed.items()}
        pending = self._pending
        for i, table in enumerate(pending):
            if table is packed:
                pending[i] = plain
                break
        run.pending = plain
        run.keys = list(packed.keys)
        run.values = [stored[1:] for stored in packed.stored]
        run.packed = None

    def _gets_from_read(self, data):
        """Answer the run of whole, well-formed GETs at the start of ``data`` (the connection idle,
        see dataReceived) and send their replies; the position after the run (0: none)."""
        n = len(data)
        if n < 28:
            return 0
        total, cid, _n, cmd, klen = _HEADER_KEYLEN(data, 0)
        if cmd != GET or not klen or 28 + klen > total or total > n or total > MAX_MESSAGE:
            return 0
        self._busy = True
        self._handled = 1
        try:
            reader = getattr(self.kv, "point_reader", None)
            if reader is None:
                pos = self._get_run(data, 0, n, total, cid, klen)
            else:
                pos = self._answer_read_gets_compiled(data, reader) if gets_compiled.frames is not None else 0
                if pos and n - pos >= 28:
                    # GETs of another length may follow: the Python loop takes the rest of the run
                    total, cid, _n, cmd, klen = _HEADER_KEYLEN(data, pos)
                    if cmd == GET and klen and 28 + klen <= total <= n - pos and total <= MAX_MESSAGE:
                        self._handled += 1
                        data = data[pos:]
                        pos += self._answer_read_gets(data, n - pos, total, cid, klen, reader)
                elif not pos:
                    pos = self._answer_read_gets(data, n, total, cid, klen, reader)
        except Exception:
            self._drop_on_bug()
            return n
        finally:
            self._busy = False
        metrics = self.metrics
        metrics["requests"] = metrics.get("requests", 0) + self._handled
        self._send_out()
        return pos

    def _drop_on_bug(self):
        """In an ``except`` of a bug (never an exception out of dataReceived): log it with its
        traceback, write nothing more, and drop the connection."""
        self.log.failure("kv connection from {peer} failed; closing", peer=self.peer)
        self._closing = True
        self._out.clear()
        self.transport.abortConnection()

    def _process(self):
        if self._busy:
            return
        self._busy = True
        try:
            self._process_frames()
        except Exception:
            self._drop_on_bug()
            return
        finally:
            self._issue_run()
            self._busy = False
        self._flush()
        if self._unacked and not self._lost:
            # The store's write queue is long: stop reading until it drains.
            self.gate.watch_store(self.store)

    def _process_frames(self):
        frames = self._frames
        self._handled = handled = 0
        gate = self.gate
        while not self._closing:
            if not gate.reading:
                break
            if self._waiting >= self.max_pending or self._inflight_bytes >= self.max_inflight_bytes:
                gate.hold(BUDGET)
                break
            try:
                span = frames.next()
            except codec.TotalRefused as e:
                if e.client_id is not None:
                    # CONTRACT §4: refuse at once, echoing client_id, and close without the body.
                    self._peer_error("kv peer {peer} sent total_len {total} over 32 MiB; closing", total=e.length)
                    self._count(0, ERR_STATUS + E_MSG_TOO_SHORT)
                    self._execute(codec.encode_error(e.client_id, E_MSG_TOO_SHORT))
                else:
                    # CONTRACT §4: total_len < 8 gets ERR 3 (client_id 0), then the close.
                    self._peer_error("kv peer {peer} sent total_len {total} < 8; closing", total=e.length)
                    self._count(0, ERR_STATUS + E_MSG_TOO_SHORT)
                    self._execute(codec.encode_error(0, E_MSG_TOO_SHORT))
                self._close_when_flushed()
                frames.clear()
                break
            if span is None:
                break
            buf, pos, end = span
            total = end - pos
            handled += 1
            if total >= 28:
                # Fast paths for the hot commands (same rules as the codec, no request object).
                # A run goes on in place over the whole frames after this one in the same read.
                _t, cid, _n, cmd, klen = _HEADER_KEYLEN(buf, pos)
                if cmd == GET and klen and 28 + klen <= total:
                    after = self._get_run(buf, pos, len(buf), total, cid, klen)
                    if after > end:
                        frames.skip_to(after)
                    continue
                if cmd == SET or cmd == REMOVE:
                    after = self._write_run(buf, pos, len(buf))
                    if after != pos:
                        if after > end:
                            frames.skip_to(after)
                        continue
            if total < HEADER_LEN:
                cid = _U64.unpack_from(buf, pos + 8)[0] if total >= 16 else 0
                self._peer_error("kv peer {peer} sent a {total}-byte message (header is 26)", total=total)
                self._count(0, ERR_STATUS + E_MSG_TOO_SHORT)
                self._execute(codec.encode_error(cid, E_MSG_TOO_SHORT))
            else:
                try:
                    req = codec.decode_request(buf, pos)
                except codec.DecodeError as e:
                    cid = _U64.unpack_from(buf, pos + 8)[0]
                    self._peer_error("kv peer {peer}: {reason}; ERR {code}", reason=e.reason, code=e.code)
                    cmd = _U16.unpack_from(buf, pos + 24)[0]
                    self._count(cmd if cmd in codec.COMMAND_NAMES else 0, ERR_STATUS + e.code)
                    self._execute(codec.encode_error(cid, e.code))
                else:
                    self._execute(req)
        self.metrics["requests"] = self.metrics.get("requests", 0) + handled + self._handled

    def _answer_read_gets(self, buf, n, total, cid, klen, reader):
        """``_get_run`` for ``_gets_from_read``, in one loop: frame, look up (``reader``:
        ``store.kv.point_reader``) and reply per GET, no list of keys or values in between. A
        key over KEY_KEEP bytes is looked up with ``kv.get``. Store errors and one latency
        observation as ``_answer_gets``; returns the position after the run."""
        t0 = time.perf_counter()
        heads = _GET_REPLY_HEADS
        pack = _HEADER.pack
        unpack = _HEADER_KEYLEN
        out = self._out
        append = out.append
        kv_get = self.kv.get
        stored_of = self._stored
        pos = found = missing = 0
        first = len(out)
        try:
            active, flushing, get, db = reader()
            while True:
                key = buf[pos + 28 : pos + 28 + klen]
                if klen > KEY_KEEP:
                    value = kv_get(key)
                else:
                    stored = stored_of(key, active, flushing, get, db)
                    value = None if stored is None else stored[1:]
                if value is None:
                    append(pack(HEADER_LEN, cid, 0, DATA_NOT_FOUND))
                    missing += 1
                else:
                    vlen = len(value)
                    head = heads.get(klen)
                    if head is None:
                        head = _get_reply_head(klen)
                    append(head(32 + klen + vlen, cid, 1, OK, klen, key, vlen))
                    append(value)
                    found += 1
                pos += total
                if n - pos < 28:
                    break
                total, cid, _n, cmd, klen = unpack(buf, pos)
                if cmd != GET or not klen or 28 + klen > total or total > n - pos or total > MAX_MESSAGE:
                    break
        except Exception as e:
            # as _answer_gets: every GET of the run gets ERR 0 (parsed again, the same way)
            del out[first:]
            cids = []
            p, t, c, k = 0, None, None, None
            while n - p >= 28:
                t, c, _n, cm, k = unpack(buf, p)
                if cm != GET or not k or 28 + k > t or t > n - p or t > MAX_MESSAGE:
                    break
                cids.append(c)
                p += t
            self._gets_failed(cids, e, out)
            self._handled += len(cids) - 1
            return p
        self._handled += found + missing - 1
        self._gets_answered(found, missing, t0)
        return pos

    def _answer_read_gets_compiled(self, data, reader):
        """``_answer_read_gets`` with no Python bytecode per GET (gets_compiled): one compiled pass
        finds the run's frames, one ``struct`` unpack makes its keys, one ``map`` looks them up in
        LMDB (only if a memtable holds some of them, found by two set operations, a loop reads
        those through the memtables and the others from LMDB), and, every key found, one
        compiled pass writes every reply into one buffer. For the run's frames of the first one's
        length, exactly 28 + key_len with a key of at most KEY_KEEP bytes (the rest of the read
        goes on as any read's); 0 (nothing done: the Python loop takes the read) if the first
        frame is not such a GET. Returns the position after the frames answered."""
        kv = self.kv
        cache = getattr(kv, "row_cache", None)
        if cache is None:
            cache = start_row_cache(kv)
        if cache is not None and cache.bypass:
            cache.reads += 1
            if cache.reads % kv_cache.SAMPLE:
                cache = None  # its hit rate is low: this read straight to LMDB (kv_cache.judge)
        if cache is not None and not cache.busy and not kv.unmerged():
            # no memtable holds anything: the row cache stands for LMDB (storage/kv_cache.py)
            pos = self._answer_read_gets_cached(data, cache, reader)
            if pos is not None:
                return pos
            cache = None
        t0 = time.perf_counter()
        count, end, frame_len = gets_compiled.frames(data)
        klen = frame_len - 28
        if not frame_len or klen > KEY_KEEP:
            return 0
        unpack = _keys_of_frames(klen, count)
        if unpack is not None:
            keys = unpack(data)
        else:
            keys = [data[p : p + klen] for p in range(28, end, frame_len)]
        out = self._out
        try:
            active, flushing, get, db = reader()
            newer = None  # the keys a memtable holds (newer than LMDB's)
            if active is not None and not active.keys().isdisjoint(keys):
                newer = active.keys() & keys
            if flushing is not None and not flushing.keys().isdisjoint(keys):
                newer = flushing.keys() & keys if newer is None else newer | (flushing.keys() & keys)
            if newer is None and cache is not None and not cache.busy:
                # none of the read's keys is in a memtable: the row cache stands for LMDB
                pos = self._answer_read_gets_cached(data, cache, reader)
                if pos is not None:
                    return pos
            if newer is None:
                stored = list(map(get, keys, repeat(None, count), repeat(db, count)))
            else:
                stored = [get(key, None, db) if key not in newer else self._stored(key, active, flushing, get, db)
                          for key in keys]
        except Exception as e:
            self._gets_failed(self._cids(data, count, frame_len), e, out)
            self._handled += count - 1
            return end
        try:
            values = b"".join(stored)
        except TypeError:  # a key not found (None): the replies one by one
            found = missing = 0
            pack = _HEADER.pack
            heads = _GET_REPLY_HEADS
            append = out.append
            head = heads.get(klen) or _get_reply_head(klen)
            for cid, key, value in zip(self._cids(data, count, frame_len), keys, stored):
                if value is None:
                    append(pack(HEADER_LEN, cid, 0, DATA_NOT_FOUND))
                    missing += 1
                else:
                    vlen = len(value) - 1
                    append(head(32 + klen + vlen, cid, 1, OK, klen, key, vlen))
                    append(value[1:])
                    found += 1
        else:
            lens = _lengths_packer(count)(*map(len, stored))
            replies = bytearray(count * (frame_len + 3) + len(values))
            gets_compiled.replies(data, count, frame_len, values, lens, replies)
            out.append(bytes(replies))
            found, missing = count, 0
        self._handled += count - 1
        self._gets_answered(found, missing, t0)
        return end

    def _answer_read_gets_cached(self, data, cache, reader):
        """``_answer_read_gets_compiled`` from the row cache (storage/kv_cache.py), for a read none
        of whose keys a memtable holds: one compiled call looks every GET of the run up in the
        cache and, all found, writes their replies; else the keys missed (only they) are looked up
        in LMDB by one ``map`` and a second call writes every reply in order and caches the values
        found. None (nothing done) if the keys are longer than KEY_KEEP; else the position after
        the frames answered."""
        t0 = time.perf_counter()
        out = _REPLIES[0]
        slots, arena, meta = cache.slots, cache.arena, cache.meta
        count, end, frame_len, misses, size = gets_compiled.cached(data, slots, arena, meta, KEY_KEEP, _WHERE, _MISSED, out)
        if not count or misses < 0:
            return None
        if not misses:
            if size > len(out):
                out = _replies_scratch(size)
                count, end, frame_len, misses, size = gets_compiled.cached(data, slots, arena, meta, KEY_KEEP, _WHERE, _MISSED, out)
            self._out.append(out[:size].tobytes())
            cache.hits += count
            cache.window -= count
            if cache.window <= 0:
                cache.judge()
            self._handled += count - 1
            self._gets_answered(count, 0, t0)
            return end
        klen = frame_len - 28
        keys = [data[p : p + klen] for p in (_MISSED[:misses] * frame_len + 28).tolist()]
        try:
            get, db = reader()[2:]
            stored = list(map(get, keys, repeat(None, misses), repeat(db, misses)))
        except Exception as e:
            self._gets_failed(self._cids(data, count, frame_len), e, self._out)
            self._handled += count - 1
            return end
        values, vlens = kv_cache.joined_values(stored)
        size, found = gets_compiled.mixed(data, count, frame_len, _WHERE, slots, arena, meta, values, vlens, out)
        if size < 0:
            out = _replies_scratch(-size)
            size, found = gets_compiled.mixed(data, count, frame_len, _WHERE, slots, arena, meta, values, vlens, out)
        self._out.append(out[:size].tobytes())
        cache.hits += count - misses
        cache.misses += misses
        cache.window -= count
        if cache.window <= 0:
            cache.judge()
        self._handled += count - 1
        self._gets_answered(found, count - found, t0)
        return end

    @staticmethod
    def _stored(key, active, flushing, get, db):
        """The stored value of ``key`` (at most KEY_KEEP bytes) as ``point_reader`` has it read:
        the active memtable, the merging one, LMDB; None if absent or removed."""
        stored = _NO_WRITE
        if active is not None:
            stored = active.get(key, _NO_WRITE)
        if stored is _NO_WRITE and flushing is not None:
            stored = flushing.get(key, _NO_WRITE)
        if stored is _NO_WRITE:
            stored = get(key, None, db)
        return stored

    @staticmethod
    def _cids(data, count, frame_len):
        """The client ids of ``count`` frames of ``frame_len`` bytes from the start of ``data``."""
        return [_U64.unpack_from(data, i * frame_len + 8)[0] for i in range(count)]

    def _gets_failed(self, cids, e, out):
        """A run of GETs (``cids``) whose store read raised ``e``: logged, counted, and ERR 0 for
        each, appended to ``out``."""
        self._store_error(cids[0], e)
        self._count(GET, ERR_STATUS + E_UNKNOWN, len(cids))
        out.extend(codec.encode_error(c, E_UNKNOWN) for c in cids)

    def _gets_answered(self, found, missing, t0=None):
        """Count a run's GET replies by status; one latency observation since ``t0`` (if given)."""
        responses = self.responses
        if found:
            responses[_GET_OK] = responses.get(_GET_OK, 0) + found
        if missing:
            responses[_GET_NOT_FOUND] = responses.get(_GET_NOT_FOUND, 0) + missing
        if t0 is not None:
            self.observe_latency("kv.get", time.perf_counter() - t0)

    def _get_run(self, buf, pos, n, total, cid, klen):
        """Answer the run of complete GETs starting at ``pos`` (the first already checked) with one
        store read (and the pending table); returns the position after the run. The replies go
        straight out, or into one slot behind the writes still waiting. One latency observation
        per run."""
        t0 = time.perf_counter()
        keys = []
        cids = []
        add_key = keys.append
        add_cid = cids.append
        unpack = _HEADER_KEYLEN
        while True:
            add_key(buf[pos + 28 : pos + 28 + klen])
            add_cid(cid)
            pos += total
            if n - pos < 28:
                break
            total, cid, _n, cmd, klen = unpack(buf, pos)
            if cmd != GET or not klen or 28 + klen > total or total > n - pos or total > MAX_MESSAGE:
                break
        self._handled += len(keys) - 1
        self._answer_gets(keys, cids, t0)
        return pos

    def _answer_gets(self, keys, cids, t0):
        """The replies of a run of GETs (``keys``, non-empty, and their client ids): one store read
        (and the pending table); straight out, or into one slot behind the writes still waiting."""
        slots = self._slots
        out = [] if slots else self._out
        try:
            values = self._get_many(keys)
        except Exception as e:
            self._gets_failed(cids, e, out)
        else:
            heads = _GET_REPLY_HEADS
            append = out.append
            missing = 0
            for cid, key, value in zip(cids, keys, values):
                if value is None:
                    append(_HEADER.pack(HEADER_LEN, cid, 0, DATA_NOT_FOUND))
                    missing += 1
                    continue
                klen = len(key)
                vlen = len(value)
                head = heads.get(klen)
                if head is None:
                    head = _get_reply_head(klen)
                # the reply up to the value in one pack: header, u16 key_len, key, u32 value_len
                append(head(32 + klen + vlen, cid, 1, OK, klen, key, vlen))
                append(value)
            self._gets_answered(len(keys) - missing, missing, t0)
        if slots:
            slots.append([b"".join(out), len(cids)])
            self._waiting += len(cids)

    def _write_run(self, buf, pos, n):
        """Take the run of complete, well-formed SETs and REMOVEs with non-empty keys starting at
        ``pos`` into this pass's write run; returns the position after the run (``pos`` itself if
        the first message is not such a write, for the general path). A GET in the run of a key
        the run wrote (``SET k; GET k`` pipelined) is answered here, its reply kept in order
        among the writes' (one slot for the whole run); any other message ends the run."""
        room = self.max_pending - self._waiting
        room_bytes = self.max_inflight_bytes - self._inflight_bytes
        unpack = _HEADER_KEYLEN
        u32 = _U32_FROM
        keys = []
        values = []
        items = []
        batch = {}  # key -> value or None: this call's writes, for the GETs among them
        add_key = keys.append
        add_value = values.append
        add_item = items.append
        nbytes = 0
        removes = 0
        found = missing = 0
        heads = _GET_REPLY_HEADS
        while n - pos >= 28:
            total, cid, _n, cmd, klen = unpack(buf, pos)
            if not klen or total > n - pos or total > MAX_MESSAGE:
                break
            kstart = pos + 28
            kend = kstart + klen
            if cmd == SET:
                if kend + 4 > pos + total:
                    break
                (vlen,) = u32(buf, kend)
                if vlen > MAX_VALUE or kend + 4 + vlen > pos + total:
                    break
                key = buf[kstart:kend]
                batch[key] = value = buf[kend + 4 : kend + 4 + vlen]
                add_value(value)
                nbytes += vlen
            elif cmd == REMOVE and kend <= pos + total:
                key = buf[kstart:kend]
                batch[key] = None
                add_value(None)
                removes += 1
            elif cmd == GET and kend <= pos + total:
                value = batch.get(buf[kstart:kend], _NO_WRITE)
                if value is _NO_WRITE:
                    break  # not this run's key: the general path reads the store
                if value is None:
                    add_item(_HEADER.pack(HEADER_LEN, cid, 0, DATA_NOT_FOUND))
                    missing += 1
                else:
                    vlen = len(value)
                    head = heads.get(klen)
                    if head is None:
                        head = _get_reply_head(klen)
                    add_item(head(32 + klen + vlen, cid, 1, OK, klen, buf[kstart:kend], vlen) + value)
                    found += 1
                pos += total
                if len(items) >= room:
                    break
                continue
            else:
                break
            add_key(key)
            add_item(cid)
            pos += total
            if len(items) >= room or nbytes >= room_bytes:
                break
        if items:
            self._handled += len(items) - 1
            self._add_writes(items, keys, values, nbytes, removes, batch)
            if found or missing:
                self._gets_answered(found, missing)
        return pos

    def _add_writes(self, items, keys, values, nbytes, removes, batch=None):
        """Take writes (keys non-empty, values within the limit or None to remove) into this
        pass's run, enter them in the pending table, and give them (and the ready replies among
        ``items``) their place in the replies."""
        run = self._run
        if run is None:
            run = self._run = _Run()
            self._pending.append(run.pending)
        elif run.packed is not None:
            self._unpack_run(run)
        run.keys += keys
        run.values += values
        if batch is None:
            run.pending.update(zip(keys, values))
        else:
            run.pending.update(batch)
        run.removes += removes
        run.nbytes += nbytes
        count = len(items)
        slots = self._slots
        segments = run.segments
        if segments and slots and slots[-1] is segments[-1][0]:
            slot, seg_items = segments[-1]
            slot[1] += count
            seg_items += items
        else:
            slot = [None, count]
            slots.append(slot)
            segments.append((slot, items))
        self._waiting += count
        self._unacked += len(keys)
        self._inflight_bytes += nbytes

    def _pending_value(self, key):
        """This connection's newest write of ``key`` not yet durable: value, None (a remove), or
        _NO_WRITE."""
        for table in reversed(self._pending):
            value = table.get(key, _NO_WRITE)
            if value is not _NO_WRITE:
                return value[1:] if table.__class__ is PackedRun else value
        return _NO_WRITE

    def _issue_run(self):
        """Hand this pass's writes to the store as one write (one Deferred, one group commit)."""
        run = self._run
        if run is None:
            return
        self._run = None
        self._issuing = True
        try:
            try:
                write_sets = getattr(self.kv, "write_sets", None) if not run.removes else None
                if run.packed is not None:
                    op, nbytes = run.packed
                    d = self.kv.write_packed(run.pending, op, nbytes)
                elif write_sets is not None:
                    d = write_sets(run.keys, run.values, run.nbytes)  # SETs alone: no step per SET (storage/kv.py)
                else:
                    d = self._write_many(zip(run.keys, run.values))
            except Exception:
                d = defer.fail()
            d.addBoth(self._run_done, run, time.perf_counter())
        finally:
            self._issuing = False

    def _write_many(self, ops):
        write_many = getattr(self.kv, "write_many", None)
        if write_many is not None:
            return write_many(ops)
        # A kv without batched writes (a test double): one call per op, one result per op.
        ops = list(ops)
        ds = []
        for key, value in ops:
            try:
                ds.append(self.kv.delete(bytes(key)) if value is None else self.kv.put(bytes(key), bytes(value)))
            except Exception:
                ds.append(defer.fail())
        return defer.DeferredList(ds, consumeErrors=True).addCallback(
            lambda rs: [(bool(r) if op[1] is None else True) if ok else r for (ok, r), op in zip(rs, ops)]
        )

    def _run_done(self, result, run, t0):
        self.observe_latency("kv.set", time.perf_counter() - t0)  # one observation per run
        self._inflight_bytes -= run.nbytes
        pending = self._pending
        if pending and pending[0] is run.pending:  # runs are durable in the order issued
            pending.popleft()
        else:
            try:
                pending.remove(run.pending)
            except ValueError:
                pass
        values = run.values
        count = len(values)
        removes = run.removes
        pack = _HEADER.pack
        failed = isinstance(result, Failure)
        responses = self.responses
        if failed:
            self._store_error(0, result.value)
            if count - removes:
                self._count(SET, ERR_STATUS + E_UNKNOWN, count - removes)
            if removes:
                self._count(REMOVE, ERR_STATUS + E_UNKNOWN, removes)
            for slot, items in run.segments:
                items = _expanded(items)
                slot[0] = b"".join([codec.encode_error(cid, E_UNKNOWN) if cid.__class__ is int else cid for cid in items])
        elif not removes and result.count(True) == count:
            # SETs only, all stored (the common case): OK each
            responses[_SET_OK] = responses.get(_SET_OK, 0) + count
            for slot, items in run.segments:
                if items[0].__class__ is _OkReplies and len(items) == 1:
                    slot[0] = items[0]
                    continue
                slot[0] = b"".join([pack(HEADER_LEN, cid, 0, OK) if cid.__class__ is int else cid for cid in items])
        else:
            i = 0
            for slot, items in run.segments:
                parts = []
                for cid in _expanded(items):
                    if cid.__class__ is not int:
                        parts.append(cid)  # a GET's reply, ready since the pass
                        continue
                    r = result[i]
                    cmd = SET if values[i] is not None else REMOVE
                    i += 1
                    if r is True or r is False:
                        # CONTRACT §4 (override): REMOVE of a missing key -> DATA_NOT_FOUND.
                        key = cmd << 8 | (OK if r else DATA_NOT_FOUND)
                        responses[key] = responses.get(key, 0) + 1
                        parts.append(pack(HEADER_LEN, cid, 0, OK if r else DATA_NOT_FOUND))
                    else:
                        parts.append(self._store_error(cid, r.value, cmd))
                slot[0] = b"".join(parts)
        self._unacked -= count
        due = self._after_delivery
        if due is None or self._issuing:
            self._drain()
        elif not self._drain_due:
            # the store is delivering a group: other runs of this connection may be in it too, so
            # the replies leave in one send once it is delivered (its after_deliver hook)
            self._drain_due = True
            due.append(self)

    def _get_many(self, keys):
        pending = self._pending
        get_many = getattr(self.kv, "get_many", None)
        if get_many is not None:
            values = get_many(keys)
        else:
            get = self.kv.get
            values = [get(bytes(k)) for k in keys]
        if pending:
            lookup = self._pending_value
            for i, key in enumerate(keys):
                value = lookup(key)
                if value is not _NO_WRITE:
                    values[i] = value
        return values

    # -- ordering ----------------------------------------------------------------------------

    def _push(self, reply: bytes):
        if self._slots:
            self._slots.append([reply, 1])
            self._waiting += 1
        else:
            self._out.append(reply)

    def _execute(self, req):
        if req.__class__ is bytes:
            self._push(req)
            return
        cmd = req.cmd
        if cmd == GET:
            self._push(self._get(req))
        elif cmd == SET or cmd == REMOVE:
            self._write(req)
        elif cmd in codec.SCAN_COMMANDS:
            reply = self._scan(req)
            self._push(reply)
            if len(reply) >= SEND_BIG_REPLY_AT and not self._slots:
                # A page of values (up to 32 MiB) goes out now rather than with the read's other
                # replies: a client not reading it pauses this connection (we are the transport's
                # producer) before its next request runs, so it holds one such page, not eight.
                self._send_out()
        elif cmd == CREATE_CURSOR:
            self._push(self._create_cursor(req))
        elif cmd == DELETE_CURSOR:
            if self._cursors.pop(req.name, None) is None:
                self._count(cmd, ERR_STATUS + E_CURSOR_NOT_FOUND)
                self._push(self.cursor_not_found(req.client_id))
            else:
                self._count(cmd, OK)
                self._push(codec.encode_status(req.client_id, OK))
        else:
            self._peer_error("kv peer {peer} sent unknown cmd {cmd}", cmd=cmd)
            self._count(cmd if cmd in codec.COMMAND_NAMES else 0, INVALID_COMMAND)
            self._push(codec.encode_status(req.client_id, INVALID_COMMAND))

    @staticmethod
    def cursor_not_found(cid):
        return codec.encode_error(cid, E_CURSOR_NOT_FOUND)

    def _write(self, req):
        cid = req.client_id
        if not req.key:
            if req.cmd == SET:
                # CONTRACT §4: SET with an empty key -> ERR 0.
                self._count(SET, ERR_STATUS + E_UNKNOWN)
                self._push(codec.encode_error(cid, E_UNKNOWN))
            else:
                # Keys are 1..65535 bytes (CONTRACT §2): an empty key is never stored.
                self._count(REMOVE, DATA_NOT_FOUND)
                self._push(codec.encode_status(cid, DATA_NOT_FOUND))
            return
        if req.cmd == SET:
            self._add_writes([cid], [bytes(req.key)], [req.value], len(req.value), 0)
        else:
            self._add_writes([cid], [bytes(req.key)], [None], 0, 1)

    def _store_error(self, cid, exc, cmd=0):
        if not isinstance(exc, errors.DiskFault):  # a disk fault is logged once, by the store
            self.log.warn("kv store error for {peer}: {error!r}", peer=self.peer, error=exc)
        if cmd:
            self._count(cmd, ERR_STATUS + E_UNKNOWN)
        return codec.encode_error(cid, E_UNKNOWN)

    def _drain(self):
        if self._lost:
            if self._unacked == 0:
                self._fire_idle()
            return
        was_busy = self._busy
        self._busy = True
        try:
            slots = self._slots
            while slots and slots[0][0] is not None:
                reply, count = slots.popleft()
                self._out.append(reply)
                self._waiting -= count
        finally:
            self._busy = was_busy
        if self._unacked == 0:
            self._fire_idle()
        if not was_busy:
            self._flush()
            if (
                BUDGET in self.gate.reasons
                and self._waiting < self.max_pending // 2
                and self._inflight_bytes < self.max_inflight_bytes // 2
            ):
                self.gate.release(BUDGET)

    def _send_out(self):
        out = self._out
        if out and not self._lost:
            data = self.outgoing(out[0] if len(out) == 1 else b"".join(out))
            self.metrics["bytes_out"] = self.metrics.get("bytes_out", 0) + len(data)
            send_now(self.transport, data)
        out.clear()

    def _flush(self):
        self._send_out()
        if self._closing and not self._slots and not self._lost:
            self.transport.unregisterProducer()
            self.transport.loseConnection()

    @staticmethod
    def outgoing(data):
        """The bytes to send for ``data`` (whole replies): the listener's framing of them."""
        return data

    def _close_when_flushed(self):
        self._closing = True
        self.gate.hold(CLOSING)

    def whenIdle(self):
        """A Deferred that fires once no write of this connection is waiting to be durable."""
        if self._unacked == 0:
            return defer.succeed(None)
        d = defer.Deferred()
        self._idle_waiters.append(d)
        return d

    # -- commands ----------------------------------------------------------------------------

    def _get(self, req):
        cid = req.client_id
        if not req.key:
            self._count(GET, DATA_NOT_FOUND)
            return codec.encode_status(cid, DATA_NOT_FOUND)
        value = self._pending_value(req.key) if self._pending else _NO_WRITE
        if value is _NO_WRITE:
            try:
                value = self.kv.get(req.key)
            except Exception as e:
                return self._store_error(cid, e, GET)
        if value is None:
            self._count(GET, DATA_NOT_FOUND)
            return codec.encode_status(cid, DATA_NOT_FOUND)
        self._count(GET, OK)
        return codec.encode_get_reply(cid, req.key, value)

    def _create_cursor(self, req):
        if req.name not in self._cursors and len(self._cursors) >= MAX_CURSORS:
            self._peer_error("kv peer {peer} has {n} cursors; refusing another", n=len(self._cursors))
            self._count(CREATE_CURSOR, ERR_STATUS + E_UNKNOWN)
            return codec.encode_error(req.client_id, E_UNKNOWN)
        # CONTRACT §4: empty start key = BEGIN; creating an existing name resets it.
        self._cursors[req.name] = req.start_key or BEGIN
        self._count(CREATE_CURSOR, OK)
        return codec.encode_status(req.client_id, OK)

    def _scan(self, req):
        cid = req.client_id
        name = req.name
        position = self._cursors.get(name)
        if position is None:
            self._count(req.cmd, ERR_STATUS + E_CURSOR_NOT_FOUND)
            return self.cursor_not_found(cid)
        if req.next_key:
            position = req.next_key  # CONTRACT §4: a non-empty NextKey says where to start
        cmd = req.cmd
        scan_forward, scan_backward, scan_keys = self.kv.scan_forward, self.kv.scan_backward, self.kv.scan_keys
        if self._pending:
            # this connection's writes not yet durable are part of what it reads (issue 19)
            pending = {}
            for table in self._pending:
                if table.__class__ is PackedRun:
                    pending.update((key, stored[1:]) for key, stored in table.items())
                else:
                    pending.update(table)
            scan_forward = with_pending(scan_forward, pending)
            scan_backward = with_pending(scan_backward, pending, descending=True)
            scan_keys = with_pending(scan_keys, pending, keys_only=True)
        try:
            items, new_position = scan_page(cmd, position, req.count, req.prefix, scan_forward, scan_backward, scan_keys)
        except Exception as e:
            return self._store_error(cid, e, cmd)
        self._cursors[name] = new_position
        self._count(cmd, OK)
        next_key = new_position if new_position.__class__ is bytes else b""
        return codec.encode_scan_reply(cid, items, cmd in codec.VALUE_SCANS, next_key, name)


def response_labels(key):
    """(operation, status, ok) of a key of the ``responses`` counts (node/metrics.py); a
    DATA_NOT_FOUND is a request answered (the key is absent), so it counts as ok."""
    cmd, status = key >> 8, key & 0xFF
    name = codec.COMMAND_NAMES[cmd].lower() if cmd else "unknown"
    if status >= ERR_STATUS:
        return name, "ERR_" + codec.ERROR_NAMES.get(status - ERR_STATUS, str(status - ERR_STATUS)), False
    return name, codec.COMMAND_NAMES.get(status, str(status)), status == OK or status == DATA_NOT_FOUND


class KvServerFactory(Factory):
    protocol = KvServerProtocol
    log = Logger()
    observe_latency = staticmethod(_ignore_latency)  # the node's hook (node/metrics.py), set by build_factory

    def __init__(self, kv, metrics=None, store=None):
        self.kv = kv
        self.store = store
        self.metrics = metrics if metrics is not None else {}
        self.connections = set()

    def buildProtocol(self, addr):
        if gets_compiled.cached is not None:
            start_row_cache(self.kv)
        p = KvServerProtocol(self.kv, self.metrics, self.store)
        p.factory = self
        p.observe_latency = self.observe_latency
        self.connections.add(p)
        return p

    def forget(self, p):
        self.connections.discard(p)

    def when_idle(self):
        """Fires once every connection's in-flight writes are durable (the shutdown hook)."""
        return defer.DeferredList([p.whenIdle() for p in list(self.connections)])


def start_row_cache(kv):
    """Make the store's row cache (storage/kv_cache.py) once the compiled passes that read it are
    loaded: from then on every merge landing fills it, before any GET asks for a key."""
    start = getattr(kv, "start_row_cache", None)
    return start() if start is not None else None


def start_compiled_gets(node):
    """Load the compiled GET passes (gets_compiled) on a thread; the node's ready file waits for
    them; then the store's row cache is made."""
    reactor = getattr(node, "reactor", None)
    if reactor is not None and hasattr(node, "before_ready"):
        d = gets_compiled.start_loading(reactor)

        def loaded(state):
            if gets_compiled.cached is not None:
                start_row_cache(node.store.kv)
            return state

        node.before_ready(d.addCallback(loaded), "compiled kv GETs")
    else:
        gets_compiled.start_loading()


def start_compiled_sets(node):
    """Load the compiled SET pass (sets_compiled) on a thread; the node's ready file waits for it."""
    reactor = getattr(node, "reactor", None)
    if reactor is not None and hasattr(node, "before_ready"):
        node.before_ready(sets_compiled.start_loading(reactor), "compiled kv SETs")
    else:
        sets_compiled.start_loading()


def build_factory(node):
    if getattr(node, "cluster", None) is not None:
        # cluster mode (issue 20): every key, whichever node leads its partition
        from protocols.partition import cluster_server

        return cluster_server.build_factory(node)
    metrics = node.metrics.setdefault("kv", {})
    factory = KvServerFactory(node.store.kv, metrics, node.store)
    factory.observe_latency = getattr(node, "observe_latency", _ignore_latency)
    start_compiled_gets(node)
    start_compiled_sets(node)
    node.on_shutdown(factory.when_idle)
    return factory
