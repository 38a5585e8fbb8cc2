"""Synced intervals of one (peer, stream): closed index ranges, merged when they overlap or touch.

Pure (no I/O): the syncer persists ``to_list()`` in the node's metadata store (CONTRACT §6: the
client keeps, per (peer, stream), the synced intervals and resumes from them after a restart).
"""

from typing import List, Optional, Tuple


class Intervals:
    def __init__(self, pairs=None):
        self._iv: List[List[int]] = []
        for a, b in pairs or ():
            self.add(a, b)

    def add(self, start: int, end: int) -> None:
        """Add the closed interval [start, end] (ignored if end < start)."""
        if end < start:
            return
        out = []
        placed = False
        for a, b in self._iv:
            if b + 1 < start:
                out.append([a, b])
            elif end + 1 < a:
                if not placed:
                    out.append([start, end])
                    placed = True
                out.append([a, b])
            else:
                start, end = min(a, start), max(b, end)
        if not placed:
            out.append([start, end])
        out.sort()
        self._iv = out

    def next_gap(self, start: int = 1) -> Tuple[int, Optional[int]]:
        """The first missing range at or after ``start``: (first, last) with last None when open."""
        pos = start
        for a, b in self._iv:
            if b < pos:
                continue
            if a > pos:
                return pos, a - 1
            pos = b + 1
        return pos, None

    def top(self) -> int:
        """The highest index covered (0 when empty)."""
        return self._iv[-1][1] if self._iv else 0

    def covers(self, index: int) -> bool:
        return any(a <= index <= b for a, b in self._iv)

    def to_list(self) -> List[List[int]]:
        return [list(p) for p in self._iv]

    def __eq__(self, other):
        return isinstance(other, Intervals) and self._iv == other._iv

    def __repr__(self):
        return "Intervals(%r)" % (self._iv,)
