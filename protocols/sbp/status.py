"""Store errors as SBP statuses (CONTRACT §3): one mapping for every handler of the server."""

from twisted.internet import defer
from twisted.python.failure import Failure

from protocols.sbp import codec
from storage import errors


def status_for_failure(failure, log=None, what="request"):
    """Map a store error to the contract's status (CONTRACT §3). An error that is not the store's
    is a bug: logged (with ``log``) and answered UNKNOWN."""
    e = failure.value
    if isinstance(e, errors.StreamNotFound):
        return codec.status(codec.STREAM_NOT_FOUND, str(e) or "stream not found")
    if isinstance(e, errors.ReadOnlyStream):
        # CONTRACT §2: a replica stream answers mutations with PD_NOT_LEADER, message = origin
        return codec.status(codec.PD_NOT_LEADER, e.origin)
    if isinstance(e, errors.OffsetOutOfRange):
        return codec.status(codec.OFFSET_OUT_OF_RANGE, str(e) or "offset out of range")
    if isinstance(e, errors.RangeAlreadySealed):
        return codec.status(codec.RANGE_ALREADY_SEALED, str(e) or "range already sealed")
    if isinstance(e, errors.RangeNotFound):
        return codec.status(codec.RANGE_NOT_FOUND, str(e) or "range not found")
    if isinstance(e, errors.InvalidRequest):
        return codec.status(codec.INVALID_REQUEST, str(e) or "invalid request")
    if isinstance(e, errors.DataCorrupted):
        return codec.status(codec.DATA_CORRUPTED, str(e) or "stored data failed its CRC")
    if isinstance(e, errors.PayloadTooLarge):
        return codec.status(codec.PAYLOAD_TOO_LARGE, str(e) or "payload too large")
    if isinstance(e, errors.StoreBusy):
        return codec.status(codec.TOO_MANY_REQUESTS, str(e) or "store busy")
    if isinstance(e, defer.CancelledError):
        return codec.status(codec.UNKNOWN, "cancelled")
    if log is not None:
        log.failure("unexpected error in {what}", failure, what=what)
    return codec.status(codec.UNKNOWN, "%s: %s" % (type(e).__name__, e))


def status_for_error(e):
    """``status_for_failure`` of an exception caught in place."""
    return status_for_failure(Failure(e))
