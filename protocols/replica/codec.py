"""The replica channel's messages (CONTRACT §9 Appends): pure functions over bytes.

A message is one msgpack array, carried in a 4-byte big-endian length prefix (the channel,
protocols/replica/channel.py). Primary -> replica:

- ``["S", stream_id]``: where are you? (answered with ``K``)
- ``["A", stream_id, epoch, batch]``: store this record batch; its base offset is in its bytes 1..8
  (storage/record_batch.py), assigned by the primary, the range's only sequencer
- ``["B", stream_id, epoch, [batch, ...]]``: store these consecutive batches, each as ``A`` does
  (what the primary sends: the batches of one reactor turn in one message, answered by one ``K``)
- ``["C", stream_id, confirm_offset]``: every offset below this is acknowledged: readers may see it
- ``["T", stream_id, offset]``: the primary's copy starts at ``offset`` (trimmed below it): a
  replica holding less starts its copy there (a new copy of a trimmed stream, re-replication)

Placement-driver leader -> replica (failover, CONTRACT §9):

- ``["X", stream_id, epoch]``: seal the stream's open range of ``epoch``: refuse appends of that
  epoch or older from now on, and answer ``Z`` once everything received is durable

Replica -> primary:

- ``["K", stream_id, durable_end, assigned_end]``: batches below ``durable_end`` are durable here
  (under this node's ``--fsync``: in its WAL, synced under ``always``, and brought back by a
  restart; perhaps not yet in its index, so not yet readable here: ``log.synced_end``);
  ``assigned_end`` is where the next batch must start
- ``["G", stream_id, assigned_end]``: a batch did not start at ``assigned_end``: resend from there
- ``["Z", stream_id, epoch, durable_end]``: sealed; this replica's end
- ``["E", stream_id, code, message]``: the stream's appends are refused (1460: sealed range or stale
  epoch; 1404: no such stream here)
"""

import functools
import struct

import msgpack

SYNC, APPEND, CONFIRM, ACK, GAP, ERROR = "S", "A", "C", "K", "G", "E"
BATCHES = "B"
SEAL, SEALED = "X", "Z"
START = "T"
MAX_MESSAGE = 32 << 20  # a batch is at most 16 MiB (CONTRACT §3)

_ARITY = {SYNC: 2, APPEND: 4, BATCHES: 4, CONFIRM: 3, ACK: 4, GAP: 3, ERROR: 4, SEAL: 3, SEALED: 4, START: 3}


class BadMessage(ValueError):
    pass


def encode(*fields) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)


def _bin_head(n: int) -> bytes:
    # msgpack's shortest bin header, as packb writes it
    if n < 0x100:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def array_head(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 0x10000:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


@functools.lru_cache(maxsize=4096)
def batches_prefix(stream_id: int, epoch: int) -> bytes:
    """``["B", stream_id, epoch, `` of a ``B`` message (its array of batches follows)."""
    return b"\x94\xa1B" + msgpack.packb(stream_id) + msgpack.packb(epoch)


def batch_parts(batch, base=None) -> tuple:
    """One batch of a ``B`` message as (msgpack bin head, the batch's bytes), not copied; with
    ``base``, the batch goes as if its base offset (bytes 1..8) were ``base``: the head carries
    its first byte and ``base``, and the rest follows as a view (the primary's sequenced batch:
    the client's bytes are not copied to write the offset in)."""
    n = len(batch)
    if base is None:
        return _bin_head(n), batch
    if n >= 0x10000:  # (the usual batch of the load: one pack, no joins)
        return _BIN32_AT.pack(0xc6, n, batch[0], base), memoryview(batch)[9:]
    return _bin_head(n) + batch[:1] + base.to_bytes(8, "big", signed=True), memoryview(batch)[9:]


_BIN32_AT = struct.Struct(">BIBq")  # a bin 32 head, then a batch's magic byte and its base offset


def encode_batches(stream_id: int, epoch: int, batches) -> list:
    """``["B", stream_id, epoch, batches]`` as a list of byte strings whose concatenation is the
    message (the batches themselves are not copied: the channel writes the parts in sequence)."""
    parts = [batches_prefix(stream_id, epoch) + array_head(len(batches))]
    for b in batches:
        parts.extend(batch_parts(b))
    return parts


_INTS = {0xcc: (1, False), 0xcd: (2, False), 0xce: (4, False), 0xcf: (8, False),
         0xd0: (1, True), 0xd1: (2, True), 0xd2: (4, True), 0xd3: (8, True)}
_BINS = {0xc4: 1, 0xc5: 2, 0xc6: 4}


class _NotPlain(Exception):
    """A ``B`` message in a form ``_batches_in_place`` does not read (msgpack decides)."""


def _int_at(view, pos):
    t = view[pos]
    if t < 0x80:
        return t, pos + 1
    if t >= 0xe0:
        return t - 0x100, pos + 1
    size = _INTS.get(t)
    if size is None:
        raise _NotPlain()
    end = pos + 1 + size[0]
    if end > len(view):
        raise _NotPlain()
    return int.from_bytes(view[pos + 1:end], "big", signed=size[1]), end


def _b_head(view):
    """``(stream_id, epoch, batch count, position of the first batch)`` of a ``B`` message's head
    in its plain form (``encode_batches``); _NotPlain for anything else."""
    sid, pos = _int_at(view, 3)
    epoch, pos = _int_at(view, pos)
    t = view[pos]
    if 0x91 <= t <= 0x9f:
        return sid, epoch, t & 0x0f, pos + 1
    if t == 0xdc or t == 0xdd:
        n = 2 if t == 0xdc else 4
        return sid, epoch, int.from_bytes(view[pos + 1:pos + 1 + n], "big"), pos + 1 + n
    raise _NotPlain()


def _batches_in_place(view) -> list:
    """A ``B`` message as ``decode`` returns it, its batches views of ``view`` (not copied: a
    replica stores them as they lie in the received bytes). Raises _NotPlain for anything but the
    plain form ``encode_batches`` writes."""
    sid, epoch, count, pos = _b_head(view)
    size = len(view)
    batches = []
    for _ in range(count):
        if pos >= size:
            raise _NotPlain()
        n = _BINS.get(view[pos])
        if n is None:
            raise _NotPlain()
        start = pos + 1 + n
        end = start + int.from_bytes(view[pos + 1:start], "big")
        if end > size:
            raise _NotPlain()
        batches.append(view[start:end])
        pos = end
    if pos != size or not batches:
        raise _NotPlain()
    return [BATCHES, sid, epoch, batches]


class _Cursor:
    """Reads consecutive pieces (memoryviews of bytes) as one byte string."""

    __slots__ = ("pieces", "k", "cur", "pos")

    def __init__(self, pieces, k, pos):
        self.pieces = pieces
        self.k = k
        self.cur = pieces[k]
        self.pos = pos

    def take(self, n):
        """The next ``n`` bytes: a view where they lie in one piece, else joined (bytes)."""
        cur, pos = self.cur, self.pos
        if pos == len(cur) and self.k + 1 < len(self.pieces):
            self.k += 1
            cur = self.cur = self.pieces[self.k]
            pos = 0
        end = pos + n
        if end <= len(cur):
            self.pos = end
            return cur[pos:end]
        parts = []
        while n:
            if pos == len(cur):
                self.k += 1
                if self.k >= len(self.pieces):
                    raise _NotPlain()
                cur = self.cur = self.pieces[self.k]
                pos = 0
            m = min(n, len(cur) - pos)
            parts.append(cur[pos:pos + m])
            pos += m
            n -= m
        self.pos = pos
        return b"".join(parts)

    def at_end(self) -> bool:
        return self.k == len(self.pieces) - 1 and self.pos == len(self.cur)


# a B message's head (["B", stream_id, epoch, then its array's head) is at most this long
_B_HEAD_MAX = 3 + 9 + 9 + 5


def _batches_in_pieces(pieces) -> list:
    """``_batches_in_place`` of a message given in pieces: each batch a view of the piece it lies
    in; a batch cut between two pieces is joined (one batch copied, not the message)."""
    first = pieces[0]
    if len(first) < _B_HEAD_MAX:
        raise _NotPlain()
    sid, epoch, count, pos = _b_head(first)
    cursor = _Cursor(pieces, 0, pos)
    take = cursor.take
    batches = []
    for _ in range(count):
        n = _BINS.get(take(1)[0])
        if n is None:
            raise _NotPlain()
        batches.append(take(int.from_bytes(take(n), "big")))
    if not cursor.at_end() or not batches:
        raise _NotPlain()
    return [BATCHES, sid, epoch, batches]


def decode_pieces(pieces) -> list:
    """``decode`` of a message given as consecutive pieces (memoryviews of bytes, as
    ``framing.Framer.next_pieces`` gives a message cut by a read's end): a ``B`` message's batches
    are views of the pieces, and only a batch cut between two pieces is copied (joined); anything
    else is joined and decoded as ``decode`` does."""
    if not pieces:
        return decode(b"")
    if len(pieces[0]) >= 3 and pieces[0][:3] == b"\x94\xa1B":
        try:
            return _batches_in_pieces(pieces)
        except (_NotPlain, IndexError):
            pass
    return decode(b"".join(pieces))


def decode(data) -> list:
    """One message. A ``B`` message's batches are views of ``data`` (keep ``data`` unchanged
    while they are used); every other field, and an ``A`` message's batch, is its own object."""
    if data[:3] == b"\x94\xa1B":
        try:
            return _batches_in_place(memoryview(data))
        except (_NotPlain, IndexError):
            pass  # msgpack says what it is
    try:
        msg = msgpack.unpackb(data, raw=False, use_list=True)
    except Exception as e:
        raise BadMessage("undecodable replica message (%s)" % type(e).__name__)
    if not isinstance(msg, list) or not msg or msg[0] not in _ARITY or len(msg) != _ARITY[msg[0]]:
        raise BadMessage("malformed replica message")
    if not isinstance(msg[1], int):
        raise BadMessage("replica message without a stream id")
    if msg[0] == APPEND and not isinstance(msg[3], bytes):
        raise BadMessage("replica append without a batch")
    if msg[0] == BATCHES and (not isinstance(msg[3], list) or not msg[3]
                              or not all(isinstance(b, bytes) for b in msg[3])):
        raise BadMessage("replica batches message without batches")
    return msg
