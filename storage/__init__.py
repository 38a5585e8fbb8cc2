"""The shared store under every protocol: record log, chunk store, key-value, metadata.

``from storage import Store, FsyncPolicy, errors``; see docs/storage.md for the design and API.
"""

from storage import errors
from storage.policy import FsyncPolicy
from storage.store import RangeMeta, Store, StreamMeta

__all__ = ["Store", "FsyncPolicy", "errors", "StreamMeta", "RangeMeta"]
