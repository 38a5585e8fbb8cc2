"""One framer for every length-prefixed protocol (SBP, Toasty, Primary_Partition), servers and
clients alike; pure (bytes in, frame spans out; no I/O, no Twisted).

A ``Layout`` says where a frame's length lies and what it may be; a ``Framer`` keeps the received
reads as they came and hands out whole frames as spans ``(buf, start, end)`` of immutable bytes:

- a frame wholly inside one read is handed out where it lies: no copy (the decoder's copy of the
  payload, if it makes one, is the only one);
- a frame cut by the end of a read is joined once, when all of it is in (one copy of that frame,
  and of the rest of the last read when that is small, so the small frames after it stay in one
  buffer), so a big frame arriving in many reads is not copied over and over (a bytearray that is
  appended to and compacted copies it once per read: quadratic; see the SBP commit d249009);
- the declared length is checked against the layout's limits as soon as its bytes are in, before
  the body is buffered.

Readers of several frames at once (the key-value server's runs of GETs and SETs) may go on
decoding in place after a span with ``rest()`` and say how far they got with ``skip_to``.
"""

import struct
from collections import deque
from typing import Iterator, Optional, Tuple


# A frame cut by the end of a read is joined with the rest of the next read when that rest is at
# most this long (small reads: many small frames stay in one buffer); a longer rest is framed where
# it lies, so a big read is never copied for the sake of one cut frame.
JOIN_REST_MAX = 64 * 1024


class FrameRefused(ValueError):
    """A declared length outside the layout's limits: the stream cannot be resynchronised."""

    def __init__(self, message, length=None):
        super().__init__(message)
        self.length = length


class Layout:
    """A frame is ``head_size`` bytes of header holding a length field (``length``, a
    ``struct.Struct`` of one integer at ``offset``) and a body; the whole frame is ``adds`` +
    the field's value bytes. The field must lie in ``[min_length, max_length]``.

    Subclasses say what a refusal is (``refuse``) or check more of the header (``frame_size``)."""

    def __init__(self, length: struct.Struct, offset: int = 0, adds: int = 0, min_length: int = 0,
                 max_length: int = 16 << 20, head_size: Optional[int] = None):
        self.length = length
        self.offset = offset
        self.adds = adds
        self.min_length = min_length
        self.max_length = max_length
        self.head_size = head_size if head_size is not None else offset + length.size
        self._unpack = length.unpack_from

    def frame_size(self, buf, pos: int, peek) -> Optional[int]:
        """The size of the frame at ``buf[pos:]`` (at least ``head_size`` bytes of it are there);
        None to wait for more bytes. ``peek(n)`` gives up to n buffered bytes from ``pos`` on,
        across reads. Raises the protocol's error for a frame it refuses."""
        (n,) = self._unpack(buf, pos + self.offset)
        if n < self.min_length or n > self.max_length:
            return self.refuse(peek, n)
        return n + self.adds

    def refuse(self, peek, length) -> Optional[int]:
        """A length outside the limits: raise (None: wait for more of the header first)."""
        raise FrameRefused("frame length %d outside %d..%d" % (length, self.min_length, self.max_length), length)


class Framer:
    """Whole frames out of received reads, by ``layout``. ``feed`` keeps the bytes; ``next``
    returns the next frame's span ``(buf, start, end)`` or None until one is complete."""

    __slots__ = ("layout", "_buf", "_pos", "_more", "_more_len", "_head_size", "_frame_size", "_plain")

    def __init__(self, layout: Layout):
        self.layout = layout
        self._head_size = layout.head_size
        self._frame_size = layout.frame_size
        # a layout that only sets the length field and limits is checked inline in ``next`` (a
        # call less per frame: small frames come by the hundred thousand)
        plain = type(layout).frame_size is Layout.frame_size
        self._plain = (layout._unpack, layout.offset, layout.adds, layout.min_length, layout.max_length) if plain else None
        self._buf = b""  # the read being framed, from _pos on (immutable: bytes)
        self._pos = 0
        self._more = deque()  # the reads after it
        self._more_len = 0

    def feed(self, data) -> None:
        if not data:
            return
        if type(data) is not bytes:
            data = bytes(data)  # ours to keep: the caller may reuse its buffer
        if self._pos == len(self._buf) and not self._more:
            self._buf, self._pos = data, 0
        else:
            self._more.append(data)
            self._more_len += len(data)

    def buffered(self) -> int:
        return len(self._buf) - self._pos + self._more_len

    def clear(self) -> None:
        self._buf, self._pos = b"", 0
        self._more.clear()
        self._more_len = 0

    def next(self) -> Optional[Tuple[bytes, int, int]]:
        """The next whole frame as ``(buf, start, end)``, or None if it is not all in yet."""
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if not avail:
            if not self._more:
                if buf:
                    self._buf, self._pos = b"", 0  # let the consumed read go
                return None
            buf = self._buf = self._more.popleft()
            self._more_len -= len(buf)
            pos = self._pos = 0
            avail = len(buf)
        if avail >= self._head_size:
            plain = self._plain
            if plain is not None:
                (n,) = plain[0](buf, pos + plain[1])
                size = n + plain[2] if plain[3] <= n <= plain[4] else self.layout.refuse(self._peek, n)
            else:
                size = self._frame_size(buf, pos, self._peek)
            if size is not None:
                end = pos + size
                if end <= len(buf):
                    self._pos = end
                    return buf, pos, end
        if not self._more_len:
            return None
        return self._joined(avail)

    def next_pieces(self):
        """``next``, except that a frame cut by the end of a read is not joined: ``(None, pieces,
        size)``, its pieces (memoryviews of the reads, in order, ``size`` bytes in all) once all
        of it is in. A frame inside one read comes as ``next`` gives it, ``(buf, start, end)``.
        For a reader that can use the frame in pieces (a replica's ``B`` message: only a batch
        cut by a read's end is joined, not the whole message)."""
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if not avail or not self._more_len:
            return self.next()
        if avail >= self._head_size:
            size = self._frame_size(buf, pos, self._peek)
            if size is not None and pos + size <= len(buf):
                return self.next()
        have = avail + self._more_len
        if have < self._head_size:
            return None
        size = self._frame_size(self._peek(self._head_size), 0, self._peek)
        if size is None or have < size:
            return None
        whole, piece, need = self._take_more(size - avail)
        pieces = [memoryview(buf)[pos:]] + [memoryview(p) for p in whole]
        pieces.append(memoryview(piece)[:need])
        self._buf, self._pos = piece, need
        return None, pieces, size

    def spans(self) -> Iterator[Tuple[bytes, int, int]]:
        """Every whole frame buffered now, as ``next`` gives them (stop early: the rest stays)."""
        while True:
            span = self.next()
            if span is None:
                return
            yield span

    def rest(self) -> Tuple[bytes, int]:
        """``(buf, pos)``: the current read from the framing position on. A reader may decode
        whole frames of ``buf[pos:]`` in place and then ``skip_to`` past them."""
        return self._buf, self._pos

    def skip_to(self, pos: int) -> None:
        """The frames of the current read before ``pos`` were consumed (see ``rest``)."""
        self._pos = pos

    def _joined(self, avail) -> Optional[Tuple[bytes, int, int]]:
        """The frame at _pos runs past the end of its read: join it from the reads that follow once
        they hold all of it (one copy of that frame), and go on framing the last of them in place."""
        have = avail + self._more_len
        if have < self._head_size:
            return None
        head = self._peek(self._head_size)
        size = self._frame_size(head, 0, self._peek)
        if size is None:
            return None
        need = size - avail
        if have - avail < need:
            return None
        whole, piece, need = self._take_more(need)
        parts = [memoryview(self._buf)[self._pos:]] + whole
        if len(piece) - need <= JOIN_REST_MAX:
            # a small rest of the read is joined too: the frames after the cut one then lie in
            # the same buffer (a reader of runs goes on in place), at the cost of copying it once
            parts.append(piece)
            joined = b"".join(parts)
            end = len(joined) - len(piece) + need
            self._buf, self._pos = joined, end
            return joined, 0, end
        parts.append(memoryview(piece)[:need])
        self._buf, self._pos = piece, need
        frame = b"".join(parts)
        return frame, 0, len(frame)

    def _take_more(self, need):
        """Take the reads after the current one until one holds the last of ``need`` bytes (they
        are all in): ``(the reads wholly inside, that last read, the bytes of it needed)``."""
        whole = []
        more = self._more
        while True:
            piece = more.popleft()
            self._more_len -= len(piece)
            if len(piece) >= need:
                return whole, piece, need
            whole.append(piece)
            need -= len(piece)

    def _peek(self, n) -> bytes:
        """Up to ``n`` buffered bytes from the framing position (n small), across reads."""
        out = bytes(memoryview(self._buf)[self._pos:self._pos + n])
        for piece in self._more:
            if len(out) >= n:
                break
            out += piece[:n - len(out)]
        return out


def read_frame(framer: Framer, recv, read_size: int = 1 << 20) -> Tuple[bytes, int, int]:
    """A blocking client's next frame: ``recv(n)`` (a socket's) until ``framer`` holds one.
    ConnectionError if the peer closes first."""
    while True:
        span = framer.next()
        if span is not None:
            return span
        data = recv(read_size)
        if not data:
            raise ConnectionError("the server closed the connection")
        framer.feed(data)
