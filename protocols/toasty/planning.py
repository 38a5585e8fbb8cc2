"""Toasty request planning, shared by the Twisted and the blocking client (CONTRACT §5): which
chunk of a write gets which message, retries and their backoff, the error a reply means, and the
chunk hashing. No I/O here; ``twisted_client`` and ``blocking_client`` send what this plans.
"""

import hashlib
import random

from protocols.toasty import codec, paths
from protocols.toasty.errors import RETRYABLE, ErrorCode
from storage import sha256 as multi_sha256

MISSING = codec.MISSING_GENERATION
DEFAULT_CHUNK_SIZE = 4096
UPLOADS_IN_FLIGHT = 16
MAX_ATTEMPTS = 30
MAX_PIECE_CHUNKS = 1024
# Chunks per helper-thread hashing job when the multi-buffer SHA-256 is on (storage/sha256.py):
# its lanes are what make it fast, so a job holds this many chunks whatever their size.
LANES_PER_JOB = 16

E_NOENT = ErrorCode.NOT_FOUND.value  # the name clients had for it


class ToastyError(Exception):
    """The server refused a request (``message`` is its text, ``code`` the ErrorCode it names,
    if any) or a check failed."""

    def __init__(self, message, reply=None):
        super().__init__(message)
        self.message = message
        self.reply = reply
        self.code = ErrorCode.of(message)


class NotFoundError(ToastyError):
    pass


def error_of(reply):
    if isinstance(reply, (codec.ErrorReply, codec.ReadError)):
        cls = NotFoundError if ErrorCode.of(reply.message) is ErrorCode.NOT_FOUND else ToastyError
        return cls(reply.message, reply)
    return None


def raise_for(reply):
    err = error_of(reply)
    if err is not None:
        raise err
    return reply


def path_bytes(path) -> bytes:
    if isinstance(path, str):
        path = path.encode("utf-8")
    paths.normalize(path)  # the one rule; raises InvalidPath before anything is sent
    return bytes(path)


def server_address(addr_list):
    addresses = addr_list.addresses()
    return addresses[0] if addresses else None


# -- planning (shared by both clients) ----------------------------------------------------------


class Upload:
    __slots__ = ("index", "msg", "targets", "expected", "hash", "locations")

    def __init__(self, index, msg, targets, expected):
        self.index = index
        self.msg = msg
        self.targets = targets  # [(host, port)]
        self.expected = expected  # sha256 of the whole new chunk when we know it
        self.hash = None
        self.locations = []


class FileState:
    """What a READ told us (or what a fresh CREATE implies)."""

    __slots__ = ("gen", "chunk_size", "first", "hashes", "holders", "write_locations", "exists")

    def __init__(self, gen, chunk_size, first=0, hashes=(), holders=(), write_locations=(), exists=True):
        self.gen = gen
        self.chunk_size = chunk_size
        self.first = first
        self.hashes = list(hashes)
        self.holders = list(holders)
        self.write_locations = list(write_locations)
        self.exists = exists

    @classmethod
    def from_read(cls, offset, rs):
        first = offset // rs.chunk_size if rs.chunk_size else 0
        return cls(
            rs.gen,
            rs.chunk_size,
            first,
            [c.hash for c in rs.chunks],
            [[a for a in (server_address(h) for h in c.holders) if a] for c in rs.chunks],
            [a for a in (server_address(w) for w in rs.write_locations) if a],
        )


def chunk_digest(in_off, piece, tail):
    h = hashlib.sha256()
    if in_off:
        h.update(bytes(in_off))
    h.update(piece)
    if tail:
        h.update(bytes(tail))
    return h.digest()


def plan_uploads(state, offset, length, read, truncate, submit=None):
    """Yield the chunk messages that write ``length`` bytes at ``offset`` (CONTRACT §5), lazily;
    ``read(lo, hi)`` returns the new bytes for the absolute range [lo, hi), called in order."""
    cs = state.chunk_size
    first, count = codec.chunk_span(offset, length, cs)
    end = offset + length
    for index in range(first, first + count):
        start = index * cs
        lo, hi = max(offset, start), min(end, start + cs)
        piece = read(lo, hi)
        in_off = lo - start
        k = index - state.first
        old = state.hashes[k] if 0 <= k < len(state.hashes) else codec.ZERO_HASH
        whole = in_off == 0 and hi - lo == cs
        # The new chunk's bytes are fully known (so we can check the returned address) when it is
        # written whole, replaces a hole, or starts at 0 and is the truncated end of the file.
        known = whole or old == codec.ZERO_HASH or (in_off == 0 and truncate and hi == end)
        if known:
            if not state.write_locations:
                raise ToastyError("the metadata server offered no chunk server to write to")
            tail = cs - in_off - len(piece)
            # ``submit`` hashes on a helper thread (a Future); record_upload waits for it.
            expected = submit(chunk_digest, in_off, piece, tail) if submit else chunk_digest(in_off, piece, tail)
            yield Upload(index, codec.CreateChunk(cs, in_off, piece), state.write_locations, expected)
        else:
            patch = bytes(piece)
            if truncate and hi == end:
                # Bytes past the new end must read as zeros later (CONTRACT §5).
                patch += bytes(cs - in_off - len(piece))
            holders = state.holders[k] if 0 <= k < len(state.holders) else []
            if not holders:
                raise ToastyError("chunk %d has no holder to patch" % index)
            yield Upload(index, codec.UploadChunk(old, in_off, patch), holders, None)


def bytes_reader(data, offset):
    view = memoryview(data)
    return lambda lo, hi: view[lo - offset : hi - offset]


def record_upload(up, target, reply):
    """Check one upload's reply; remember the hash and the location."""
    err = error_of(reply)
    if err is not None:
        raise ToastyError("chunk server %s:%d refused chunk %d: %s" % (target[0], target[1], up.index, err.message), reply)
    h = reply.hash
    if up.expected is not None and not isinstance(up.expected, bytes):
        up.expected = up.expected.result()
    if up.expected is not None and h != up.expected:
        raise ToastyError("chunk server %s:%d returned hash %s for chunk %d, expected %s" % (target[0], target[1], h.hex(), up.index, up.expected.hex()))
    if up.hash is not None and up.hash != h:
        raise ToastyError("replicas of chunk %d disagree on its hash" % up.index)
    up.hash = h
    up.locations.append(target)


def write_message(state, path, offset, length, flags, uploads):
    return codec.Write(state.gen, flags, path, offset, length, [codec.WriteChunk(u.hash, u.locations) for u in uploads])


def should_retry(reply) -> bool:
    return isinstance(reply, (codec.ErrorReply, codec.ReadError)) and ErrorCode.of(reply.message) in RETRYABLE


def pieces(offset, length, chunk_size):
    """Split [offset, offset+length) at chunk boundaries into ranges of <= 1024 chunks."""
    span_bytes = MAX_PIECE_CHUNKS * chunk_size
    pos, end = offset, offset + length
    while pos < end:
        piece_end = min(end, (pos // chunk_size) * chunk_size + span_bytes)
        yield pos, piece_end - pos
        pos = piece_end


def aligned(offset, length, chunk_size):
    """The chunk-aligned range around [offset, offset+length): a write's READ must return the
    current hash of every chunk it touches, including one that holds data only before ``offset``
    or the end of file before ``offset+length`` (READ reports only readable bytes)."""
    if not chunk_size:
        return offset, length
    lo = offset // chunk_size * chunk_size
    hi = -(-(offset + length) // chunk_size) * chunk_size
    return lo, hi - lo


def backoff(attempt):
    """Randomised, growing pause before retrying a conflicting WRITE (so racing writers spread out)."""
    return random.uniform(0, 0.002 * 2 ** min(attempt, 8)) if attempt else 0.0


def sha256(data):
    return hashlib.sha256(data).digest()


def run_batch(jobs):
    """A helper thread's job: the whole-chunk SHA-256s of a batch are hashed together
    (``storage.sha256.digests``: equal-length chunks in lock-step on the multi-buffer kernel where
    it pays), any other job one by one."""
    out = [None] * len(jobs)
    datas, where = [], []
    for i, (fn, args) in enumerate(jobs):
        if fn is sha256:
            datas.append(args[0])
            where.append(i)
        elif fn is chunk_digest and not args[0] and not args[2]:
            datas.append(args[1])  # a whole chunk: no zeros before or after its bytes
            where.append(i)
        else:
            out[i] = fn(*args)
    if datas:
        for i, digest in zip(where, multi_sha256.digests(datas)):
            out[i] = digest
    return out


class Digest:
    """A digest being computed in a batch: ``result()`` waits for it (flushing the batch first)."""

    __slots__ = ("batcher", "future", "index")

    def __init__(self, batcher):
        self.batcher = batcher
        self.future = None
        self.index = 0

    def done(self):
        """True once the digest is computed (False while its batch has not been sent)."""
        return self.future is not None and self.future.done()

    def result(self):
        if self.future is None:
            self.batcher.flush()
        return self.future.result()[self.index]


class HashBatcher:
    """``submit(fn, *args)`` like an executor's, but jobs go to the helper threads several at a
    time: one thread hop per batch, not per chunk (SHA-256 releases the GIL, so the helpers hash
    while the caller keeps sending and receiving). A batch goes when it holds ``per_job`` jobs or
    ``job_bytes`` of data (the bytes-like arguments' lengths), so big chunks are hashed one per
    job and several helpers hash them side by side (on a CPU without SHA extensions SHA-256 is
    most of a transfer's work: one helper thread would cap it at one core's hashing rate)."""

    def __init__(self, pool, per_job=None, job_bytes=None):
        self.pool = pool
        # With the multi-buffer kernel a batch is LANES_PER_JOB chunks whatever their size (its
        # lanes are what makes it fast); with hashlib alone, 8 chunks or 512 KiB.
        kernel = multi_sha256.enabled()
        self.per_job = per_job or (LANES_PER_JOB if kernel else 8)
        self.job_bytes = job_bytes or (LANES_PER_JOB << 20 if kernel else 512 * 1024)
        self.open = []
        self.open_bytes = 0

    def submit(self, fn, *args):
        digest = Digest(self)
        self.open.append((fn, args, digest))
        n = self.open_bytes
        for a in args:
            if type(a) is not int:
                n += len(a)
        self.open_bytes = n
        if n >= self.job_bytes or len(self.open) >= self.per_job:
            self.flush()
        return digest

    def flush(self):
        if self.open:
            batch, self.open, self.open_bytes = self.open, [], 0
            future = self.pool.submit(run_batch, [(fn, args) for fn, args, _ in batch])
            for i, (_, _, digest) in enumerate(batch):
                digest.future, digest.index = future, i


def verify_chunk(h, data):
    if hashlib.sha256(data).digest() != h:
        raise ToastyError("chunk %s failed its hash check" % h.hex())


# -- the file state a write starts from (the same steps for both clients) --------------------------


def file_state_steps(path, offset, length, create, chunk_size, cs_hint=None, probe=None):
    """READ -> FileState, as a generator: it yields each metadata request to send and is sent its
    reply (``run_steps`` drives it on a blocking connection, the Twisted client with
    ``inlineCallbacks``); it returns the FileState, or None to start again. A missing file (with
    ``create``) is created by CREATE when a chunk size other than the default is asked for, else
    left to WRITE's CREATE_IF_MISSING. ``probe``: the reply of a first READ already sent."""
    lo, n = aligned(offset, length, cs_hint)
    reply = probe if probe is not None else (yield codec.Read(0, path, lo, n))
    if isinstance(reply, codec.ReadSuccess):
        if aligned(offset, length, reply.chunk_size) != (lo, n):
            lo, n = aligned(offset, length, reply.chunk_size)
            reply = yield codec.Read(reply.gen, path, lo, n)
            if not isinstance(reply, codec.ReadSuccess):
                return None  # changed meanwhile: start again
        return FileState.from_read(lo, reply)
    if not (create and ErrorCode.of(reply.message) is ErrorCode.NOT_FOUND):
        raise error_of(reply)
    locations = [a for a in (server_address(w) for w in reply.write_locations) if a]
    if chunk_size is None or chunk_size == DEFAULT_CHUNK_SIZE:
        return FileState(MISSING, DEFAULT_CHUNK_SIZE, write_locations=locations, exists=False)
    created = yield codec.Create(path, False, chunk_size)
    if isinstance(created, codec.ErrorReply):
        if should_retry(created):
            return None  # created by someone else meanwhile: READ again
        raise error_of(created)
    return FileState(created.gen, chunk_size, write_locations=locations)


def run_steps(steps, call):
    """Drive a steps generator with a blocking ``call(request) -> reply``; its result."""
    try:
        request = next(steps)
        while True:
            request = steps.send(call(request))
    except StopIteration as done:
        return done.value

