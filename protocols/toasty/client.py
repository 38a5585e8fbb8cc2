"""Toasty clients: a Twisted one (``ToastyClient``) and a blocking one (``BlockingToastyClient``).

Both implement the file protocol on top of the two wire protocols (CONTRACT §5):

write: READ(path, offset, length) for the generation, chunk size, current hashes and their holders
  and the write locations -> per chunk the range touches: CREATE_CHUNK to every write location (a
  whole or a new chunk) or UPLOAD_CHUNK to every holder of the current chunk (a patch), several in
  flight -> WRITE(expect_gen, hashes + locations). A generation conflict (someone wrote in between),
  a file created or deleted meanwhile, or a chunk reclaimed meanwhile restarts from the READ. A
  missing file is created by WRITE with CREATE_IF_MISSING and expect_gen 2^64-1 (4096-byte chunks),
  or by CREATE first when another chunk size is asked for. Writes larger than 1024 chunks go as
  several WRITEs (each atomic).
read: READ (at most 1024 chunks at a time, the later pieces pinned to the first piece's generation)
  -> DOWNLOAD_CHUNK from a holder, checked against its SHA-256 address; holes read as zeros.

The planning (which chunk gets which message) is shared (``planning``); only the I/O differs
(``twisted_client``, ``blocking_client``). This module gathers their public names.
"""

from protocols.toasty.blocking_client import BlockingConnection, BlockingToastyClient
from protocols.toasty.errors import ErrorCode
from protocols.toasty.planning import (
    DEFAULT_CHUNK_SIZE,
    E_NOENT,
    MAX_ATTEMPTS,
    MAX_PIECE_CHUNKS,
    MISSING,
    UPLOADS_IN_FLIGHT,
    FileState,
    HashBatcher,
    NotFoundError,
    ToastyError,
    Upload,
    aligned,
    plan_uploads,
)
from protocols.toasty.twisted_client import ToastyClient, ToastyClientProtocol, open_connection

__all__ = [
    "BlockingConnection", "BlockingToastyClient", "ToastyClient", "ToastyClientProtocol", "open_connection",
    "ToastyError", "NotFoundError", "ErrorCode", "FileState", "Upload", "HashBatcher", "plan_uploads", "aligned",
    "DEFAULT_CHUNK_SIZE", "E_NOENT", "MAX_ATTEMPTS", "MAX_PIECE_CHUNKS", "MISSING", "UPLOADS_IN_FLIGHT",
]

