"""Errors the store raises (the protocol layers map them to their own status codes)."""


class StoreError(Exception):
    """Base of every store error."""


class StreamNotFound(StoreError):
    pass


class OffsetOutOfRange(StoreError):
    pass


class RangeAlreadySealed(StoreError):
    pass


class RangeNotFound(StoreError):
    pass


class InvalidRequest(StoreError):
    pass


class ReadOnlyStream(StoreError):
    """A replica stream (swarm follower copy): mutations belong to ``origin`` ("host:port")."""

    def __init__(self, origin):
        super().__init__(origin)
        self.origin = origin


class DataCorrupted(StoreError):
    """Stored bytes failed their CRC; they are never served as data."""


class ChunkNotFound(StoreError):
    pass


class PayloadTooLarge(StoreError):
    pass


class ExpectationFailed(StoreError):
    """A conditional write's expectation (e.g. the expected next offset) did not hold."""


class NoAvailableReplicas(StoreError):
    """A replicated write cannot be acknowledged: fewer live replicas than its ack_count
    (CONTRACT §9, 1502 NO_AVAILABLE_RS)."""


class StoreBusy(StoreError):
    """The write queue is over its hard limit; the caller should back off and retry."""


class StoreClosed(StoreError):
    pass


class DiskFault(StoreError):
    """The disk refused a write or a sync: the write was not stored (docs/operations.md)."""


class DiskFull(DiskFault):
    """ENOSPC (or the quota): writes are refused until the file system has room again."""


class StoreReadOnly(DiskFault):
    """A write or fdatasync failed with an I/O error: the store takes no write until the node is
    restarted (a failed fsync is never retried, as PostgreSQL learned); reads go on."""
