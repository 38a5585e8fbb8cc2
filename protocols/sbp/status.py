"""Store errors as SBP statuses (CONTRACT §3): one mapping for every handler of the server."""

from twisted.internet import defer
from twisted.python.failure import Failure

from protocols.sbp import codec
from storage import errors


# store error -> (status, text when the error has none), tried in this order (first match wins)
_STORE_STATUS = (
    (errors.StreamNotFound, codec.STREAM_NOT_FOUND, "stream not found"),
    (errors.OffsetOutOfRange, codec.OFFSET_OUT_OF_RANGE, "offset out of range"),
    (errors.RangeAlreadySealed, codec.RANGE_ALREADY_SEALED, "range already sealed"),
    (errors.RangeNotFound, codec.RANGE_NOT_FOUND, "range not found"),
    (errors.InvalidRequest, codec.INVALID_REQUEST, "invalid request"),
    (errors.DataCorrupted, codec.DATA_CORRUPTED, "stored data failed its CRC"),
    (errors.PayloadTooLarge, codec.PAYLOAD_TOO_LARGE, "payload too large"),
    (errors.StoreBusy, codec.TOO_MANY_REQUESTS, "store busy"),
    # issue 21: a full disk or a read-only store after a disk error is UNKNOWN with the reason
    (errors.DiskFault, codec.UNKNOWN, "disk fault"),
    (errors.NoAvailableReplicas, codec.NO_AVAILABLE_RS, "too few live replicas"),
)


def status_for_failure(failure, log=None, what="request"):
    """Map a store error to the contract's status (CONTRACT §3). An error that is not the store's
    is a bug: logged (with ``log``) and answered UNKNOWN."""
    e = failure.value
    if isinstance(e, errors.ReadOnlyStream):
        # CONTRACT §2: a replica stream answers mutations with PD_NOT_LEADER, message = origin
        return codec.status(codec.PD_NOT_LEADER, e.origin)
    for kind, code, default in _STORE_STATUS:
        if isinstance(e, kind):
            return codec.status(code, str(e) or default)
    if isinstance(e, defer.CancelledError):
        return codec.status(codec.UNKNOWN, "cancelled")
    if log is not None:
        log.failure("unexpected error in {what}", failure, what=what)
    return codec.status(codec.UNKNOWN, "%s: %s" % (type(e).__name__, e))


def status_for_error(e):
    """``status_for_failure`` of an exception caught in place."""
    return status_for_failure(Failure(e))
