"""The ``--fsync`` policy: when the store makes written data durable."""

ALLOWED = "allowed: always, interval:MS (MS a positive integer), never"


class FsyncPolicy:
    """``always``: every acknowledged write is on disk (one fdatasync per group commit).
    ``interval:MS``: acknowledged once written to the OS; synced at most MS ms later (2 x MS while
    the disk is slow: commit.interval_sync_wait).
    ``never``: synced only on clean close."""

    __slots__ = ("mode", "interval_ms")

    def __init__(self, mode: str, interval_ms: int = 0):
        self.mode = mode
        self.interval_ms = interval_ms

    @classmethod
    def parse(cls, text) -> "FsyncPolicy":
        if isinstance(text, FsyncPolicy):
            return text
        value = str(text).strip().lower()
        if value in ("always", "never"):
            return cls(value)
        if value.startswith("interval:"):
            ms = value[len("interval:"):]
            if ms.isdigit() and int(ms) > 0:
                return cls("interval", int(ms))
        raise ValueError("fsync policy %r is not valid; %s" % (text, ALLOWED))

    @property
    def always(self) -> bool:
        return self.mode == "always"

    def __str__(self):
        return "interval:%d" % self.interval_ms if self.mode == "interval" else self.mode

    def __repr__(self):
        return "FsyncPolicy(%s)" % self

    def __eq__(self, other):
        return isinstance(other, FsyncPolicy) and (self.mode, self.interval_ms) == (other.mode, other.interval_ms)

    def __hash__(self):
        return hash((self.mode, self.interval_ms))
