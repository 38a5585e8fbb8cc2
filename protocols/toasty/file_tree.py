"""The Toasty file tree: directories and chunked files with generations, kept in ``store.meta``.

It lives beside the Toasty protocol (it is Toasty's data model, not the store's) but knows no wire
format: callers pass paths as tuples of name components (already validated) and get
plain values or ``FsError`` back. Every mutation is one ``store.meta.transact`` (atomic and durable
under the node's fsync policy), so a crash leaves each file at its old or its new content, and
CREATE_IF_MISSING and TRUNCATE_AFTER are part of the same transaction as the write they belong to.

Layout (tables in store.meta):
- ``toasty.root`` key ``b"/"``: the root directory entity.
- ``toasty.ent`` key ``u64be(parent inode) + name``: an entity ``[inode, gen, is_dir, chunk_size, size]``.
  Keys sort by name within a directory, which gives LIST its order and continuation.
- ``toasty.chk`` key ``u64be(inode) + u32be(chunk index)``: the chunk's 32-byte address. A missing
  key is a hole (reads as zeros; reported as the all-zero hash).
Generations come from one node-wide counter (``toasty.gen``); the root takes its first value, 1.
Every file chunk reference holds one chunk refcount (``txn.chunk_incref``), released on overwrite,
truncation and delete, so the store's sweep reclaims chunks no file points at.
"""

import struct

from twisted.internet import defer

from protocols.toasty.errors import ErrorCode
from storage import errors

ROOT_TABLE = "toasty.root"
ENT_TABLE = "toasty.ent"
CHK_TABLE = "toasty.chk"
GEN_COUNTER = "toasty.gen"
ROOT_KEY = b"/"
ROOT_INODE = 0
ROOT_GEN = 1

NO_GENERATION = 0
MISSING_GENERATION = 2**64 - 1
DEFAULT_CHUNK_SIZE = 4096  # spec §2.1: CREATE_IF_MISSING makes a file with 4096-byte chunks
MAX_CHUNK_SIZE = 16 * 1024 * 1024 - 64 * 1024  # a whole chunk must fit in one 16 MiB message
MAX_FILE_SIZE = 2**32 - 1  # offsets and lengths are u32 on the wire
MAX_CHUNKS_PER_OP = 1024  # CONTRACT §5
MAX_LIST = 128  # CONTRACT §5
ZERO_HASH = b"\x00" * 32

CREATE_IF_MISSING = 0x01
TRUNCATE_AFTER = 0x02

_U64 = struct.Struct(">Q")
_CHK = struct.Struct(">QI")

# Entity fields (a short list keeps msgpack small).
_INODE, _GEN, _IS_DIR, _CHUNK_SIZE, _SIZE = range(5)

class FsError(Exception):
    """A refused file-tree operation: its ``code`` (``errors.ErrorCode``, one per subclass) and a
    detail; ``str(e)`` is the text for the *_ERROR reply."""

    code = ErrorCode.INVALID_OPERATION

    def __init__(self, detail=None):
        self.detail = detail
        super().__init__(self.code.message(detail))

    @property
    def message(self) -> str:
        return self.code.value


class NotFound(FsError):
    code = ErrorCode.NOT_FOUND


class NotADirectory(FsError):
    code = ErrorCode.NOT_A_DIRECTORY


class IsADirectory(FsError):
    code = ErrorCode.IS_A_DIRECTORY


class AlreadyExists(FsError):
    code = ErrorCode.ALREADY_EXISTS


class BadGeneration(FsError):
    code = ErrorCode.BAD_GENERATION


class InvalidOperation(FsError):
    code = ErrorCode.INVALID_OPERATION


class ChunkNotFound(FsError):
    code = ErrorCode.CHUNK_NOT_FOUND


class ChunkUnreadable(FsError):
    code = ErrorCode.IO_ERROR


class Entity:
    __slots__ = ("inode", "gen", "is_dir", "chunk_size", "size")

    def __init__(self, value):
        self.inode, self.gen, self.is_dir, self.chunk_size, self.size = value[:5]

    def value(self):
        return [self.inode, self.gen, self.is_dir, self.chunk_size, self.size]


def _ent_key(parent_inode: int, name: bytes) -> bytes:
    return _U64.pack(parent_inode) + name


def _chk_key(inode: int, index: int) -> bytes:
    return _CHK.pack(inode, index)


def _show(components) -> str:
    return "/" + "/".join(c.decode("utf-8", "replace") for c in components)


def span(offset: int, length: int, chunk_size: int):
    """CONTRACT §5 (override): the chunk indexes [first, first + count) a byte range touches."""
    if length == 0:
        return offset // chunk_size, 0
    first = offset // chunk_size
    return first, (offset + length - 1) // chunk_size - first + 1


def check_gen(entity, expect_gen: int, what: str) -> None:
    """CONTRACT §5: 0 skips, 2^64-1 means "must not exist", anything else must match."""
    if expect_gen == NO_GENERATION:
        return
    if expect_gen == MISSING_GENERATION:
        raise AlreadyExists("%s exists (expect_gen says it must not)" % what)
    if entity.gen != expect_gen:
        raise BadGeneration("%s has generation %d, not %d" % (what, entity.gen, expect_gen))


# -- the checks of a request's path and entity, shared with the cluster's tree ------------------
# (node/cluster/toasty_tree.py): both trees look the entity up their own way, then refuse the
# same requests with the same replies (CONTRACT §5).


def check_create_args(components, is_dir, chunk_size) -> None:
    if not components:
        raise AlreadyExists("the root directory always exists")
    if not is_dir and not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise InvalidOperation("chunk_size must be 1..%d, not %d" % (MAX_CHUNK_SIZE, chunk_size))


def check_delete_args(components) -> None:
    if not components:
        raise InvalidOperation("the root directory cannot be deleted")


def check_new_entry(components, entity, parent) -> None:
    """A CREATE (or WRITE with CREATE_IF_MISSING) of ``components``: ``entity`` (None if missing)
    must not exist and ``parent`` (None if missing) must be a directory."""
    if entity is not None:
        raise AlreadyExists("%s exists" % _show(components))
    check_parent(components, parent)


def check_parent(components, parent) -> None:
    if parent is None:
        raise NotFound("%s does not exist" % _show(components[:-1]))
    if not parent.is_dir:
        raise NotADirectory("%s is a file" % _show(components[:-1]))


def check_list(components, entity, expect_gen) -> None:
    """LIST: ``entity`` (None if missing) must be a directory of the expected generation."""
    if entity is None:
        raise NotFound("%s does not exist" % _show(components))
    if not entity.is_dir:
        raise NotADirectory("%s is a file" % _show(components))
    check_gen(entity, expect_gen, _show(components))


def check_file(components, entity, expect_gen) -> None:
    """READ and WRITE: ``entity`` (None if missing) must be a file of the expected generation."""
    if entity is None:
        raise NotFound("%s does not exist" % _show(components))
    if entity.is_dir:
        raise IsADirectory("%s is a directory" % _show(components))
    check_gen(entity, expect_gen, _show(components))


def read_span(entity, offset, length, max_chunks):
    """READ of a checked file: (readable bytes, first chunk index, chunk count); CONTRACT §5:
    at most ``max_chunks`` chunks, nothing readable past the end of file."""
    end = min(entity.size, offset + length)
    readable = max(0, end - offset)
    first, count = span(offset, readable, entity.chunk_size)
    if count > max_chunks:
        raise InvalidOperation("a READ may span at most %d chunks (this one spans %d)" % (max_chunks, count))
    return readable, first, count


def write_span(offset, length, chunk_size, num_chunks):
    """WRITE: (first chunk index, count); num_chunks must be the count the range spans
    (CONTRACT §5 override)."""
    first, count = span(offset, length, chunk_size)
    if count != num_chunks:
        raise InvalidOperation(
            "num_chunks is %d but [%d, %d) spans %d chunks of %d bytes" % (num_chunks, offset, offset + length, count, chunk_size)
        )
    return first, count


def check_write_args(components, expect_gen, offset, length, hashes):
    """A WRITE's own fields -> its hashes as bytes."""
    if expect_gen == NO_GENERATION:
        # CONTRACT §5: WRITE refuses expect_gen 0 (the chunk size must be the one the writer saw).
        raise BadGeneration("WRITE needs an expect_gen (0 is refused)")
    if not components:
        raise IsADirectory("/ is a directory")
    if offset + length > MAX_FILE_SIZE:
        raise InvalidOperation("a file may not grow past %d bytes" % MAX_FILE_SIZE)
    hashes = [bytes(h) for h in hashes]
    if len(hashes) > MAX_CHUNKS_PER_OP:
        raise InvalidOperation("a WRITE may carry at most %d chunks, not %d" % (MAX_CHUNKS_PER_OP, len(hashes)))
    for h in hashes:
        if h == ZERO_HASH:
            raise InvalidOperation("the all-zero hash names no chunk")
    return hashes


class ReadResult:
    __slots__ = ("gen", "chunk_size", "file_length", "first_index", "hashes", "size")

    def __init__(self, gen, chunk_size, file_length, first_index, hashes, size):
        self.gen = gen
        self.chunk_size = chunk_size
        self.file_length = file_length  # readable bytes in the requested range (CONTRACT §5)
        self.first_index = first_index
        self.hashes = hashes  # one per chunk the readable range touches; ZERO_HASH for holes
        self.size = size


_ROOT_PLACEHOLDER = Entity([ROOT_INODE, ROOT_GEN, True, 0, 0])


class FileTree:
    """The file tree over ``store.meta`` (refcounts) and ``store.chunks`` (for the zero-tail rule)."""

    def __init__(self, store, reactor=None):
        self.store = store
        self.meta = store.meta
        self._root_ready = False
        if reactor is None:
            reactor = getattr(store, "reactor", None)
        if reactor is None:
            from twisted.internet import reactor
        self._reactor = reactor
        self._batch = []
        self._gens = None  # the running batch's generation counter (writer thread)

    # -- helpers run inside a meta txn ----------------------------------------------------------

    @staticmethod
    def _root(txn, create=False) -> Entity:
        value = txn.get(ROOT_TABLE, ROOT_KEY)
        if value is None:
            if not create:
                return Entity([ROOT_INODE, ROOT_GEN, True, 0, 0])
            # The first value of the node-wide counter is 1: CONTRACT §5 "the root has 1".
            gen = txn.next_id(GEN_COUNTER)
            value = [ROOT_INODE, gen, True, 0, 0]
            txn.put(ROOT_TABLE, ROOT_KEY, value)
        return Entity(value)

    def _new_gen(self, txn) -> int:
        gens = self._gens
        # inside a batch: its counter, written back once at its end
        take = gens.next if gens is not None else (lambda: txn.next_id(GEN_COUNTER))
        gen = take()
        while gen in (NO_GENERATION, MISSING_GENERATION):  # CONTRACT §5: never 0 or 2^64-1
            gen = take()
        return gen

    def _lookup_parent(self, txn, components, create_root=False) -> Entity:
        """The directory holding ``components[-1]``; NotFound / NotADirectory on the way."""
        # Once the root exists only its inode (0) is needed on the way down.
        entity = _ROOT_PLACEHOLDER if self._root_ready else self._root(txn, create_root)
        for i, name in enumerate(components[:-1]):
            value = txn.get(ENT_TABLE, _ent_key(entity.inode, name))
            if value is None:
                raise NotFound("%s does not exist" % _show(components[: i + 1]))
            entity = Entity(value)
            if not entity.is_dir:
                raise NotADirectory("%s is a file" % _show(components[: i + 1]))
        return entity

    def _lookup(self, txn, components, create_root=False):
        """(parent, entity or None). The root has no parent (None)."""
        if not components:
            return None, self._root(txn, create_root)
        parent = self._lookup_parent(txn, components, create_root)
        value = txn.get(ENT_TABLE, _ent_key(parent.inode, components[-1]))
        return parent, (Entity(value) if value is not None else None)

    @staticmethod
    def _chunk_refs(txn, inode, from_index=0):
        prefix = _U64.pack(inode)
        return txn.scan(CHK_TABLE, start=_chk_key(inode, from_index), prefix=prefix)

    # -- operations ---------------------------------------------------------------------------

    def ensure_root(self):
        def ready(gen):
            self._root_ready = True
            return gen

        return self.meta.transact(lambda txn: self._root(txn, create=True).gen).addCallback(ready)

    def create(self, components, is_dir: bool, chunk_size: int = 0):
        """-> Deferred[gen of the new entity]."""
        try:
            check_create_args(components, is_dir, chunk_size)
        except FsError:
            return defer.fail()

        def fn(txn):
            parent, entity = self._lookup(txn, components, create_root=True)
            check_new_entry(components, entity, parent)
            gen = self._new_gen(txn)
            inode = gen  # generations are node-unique, so the creation generation names the inode
            txn.put(ENT_TABLE, _ent_key(parent.inode, components[-1]), [inode, gen, bool(is_dir), 0 if is_dir else chunk_size, 0])
            return gen

        return self._batched(fn)

    def delete(self, components, expect_gen: int):
        """-> Deferred[None]. DELETE of a missing path succeeds only with expect_gen 2^64-1."""
        try:
            check_delete_args(components)
        except FsError:
            return defer.fail()

        def fn(txn):
            parent, entity = self._lookup_missing_ok(txn, components, expect_gen)
            if entity is None:
                return None
            check_gen(entity, expect_gen, _show(components))
            if entity.is_dir:
                if txn.scan(ENT_TABLE, start=_U64.pack(entity.inode), prefix=_U64.pack(entity.inode), limit=1):
                    raise InvalidOperation("directory %s is not empty" % _show(components))
            else:
                refs = self._chunk_refs(txn, entity.inode)
                for key, _ in refs:
                    txn.delete(CHK_TABLE, key)
                if refs:
                    txn.chunk_decref([addr for _, addr in refs])
            txn.delete(ENT_TABLE, _ent_key(parent.inode, components[-1]))
            return None

        return self._batched(fn)

    def _lookup_missing_ok(self, txn, components, expect_gen):
        try:
            parent, entity = self._lookup(txn, components, create_root=True)
        except NotFound:
            if expect_gen == MISSING_GENERATION:
                return None, None
            raise
        if entity is None and expect_gen != MISSING_GENERATION:
            raise NotFound("%s does not exist" % _show(components))
        return parent, entity

    def list(self, components, expect_gen: int, after=None, limit: int = MAX_LIST):
        """-> (dir gen, truncated, [(name, gen, is_dir)]) sorted by name, names > ``after`` only
        (sync, on the committed state)."""
        return self.meta.read(lambda txn: self._list_in(txn, components, expect_gen, after, limit))

    def list_queued(self, components, expect_gen: int, after=None, limit: int = MAX_LIST):
        """-> Deferred[the same as ``list``], answered at its place among the mutations queued
        before it (see ``_batched``)."""
        return self._batched(lambda txn: self._list_in(txn, components, expect_gen, after, limit))

    def _list_in(self, txn, components, expect_gen, after, limit):
        _, entity = self._lookup(txn, components)
        check_list(components, entity, expect_gen)
        prefix = _U64.pack(entity.inode)
        start = prefix + after + b"\x00" if after is not None else prefix
        rows = txn.scan(ENT_TABLE, start=start, prefix=prefix, limit=limit + 1)
        items = [(bytes(k[8:]), v[_GEN], bool(v[_IS_DIR])) for k, v in rows[:limit]]
        return entity.gen, len(rows) > limit, items

    def stat(self, components):
        """-> Entity (sync); raises NotFound/NotADirectory."""

        def fn(txn):
            _, entity = self._lookup(txn, components)
            if entity is None:
                raise NotFound("%s does not exist" % _show(components))
            return entity

        return self.meta.read(fn)

    def read(self, components, expect_gen: int, offset: int, length: int, max_chunks: int = MAX_CHUNKS_PER_OP):
        """-> ReadResult for the readable part of [offset, offset+length) (sync, on the committed
        state)."""
        return self.meta.read(lambda txn: self._read_in(txn, components, expect_gen, offset, length, max_chunks))

    def read_queued(self, components, expect_gen: int, offset: int, length: int, max_chunks: int = MAX_CHUNKS_PER_OP):
        """-> Deferred[the same as ``read``], answered at its place among the mutations queued
        before it (see ``_batched``)."""
        return self._batched(lambda txn: self._read_in(txn, components, expect_gen, offset, length, max_chunks))

    def _read_in(self, txn, components, expect_gen, offset, length, max_chunks):
        _, entity = self._lookup(txn, components)
        check_file(components, entity, expect_gen)
        readable, first, count = read_span(entity, offset, length, max_chunks)
        hashes = [ZERO_HASH] * count
        if count:
            rows = txn.scan(CHK_TABLE, start=_chk_key(entity.inode, first), prefix=_U64.pack(entity.inode), limit=count)
            for key, addr in rows:
                index = _CHK.unpack(key)[1] - first
                if index >= count:
                    break
                hashes[index] = bytes(addr)
        return ReadResult(entity.gen, entity.chunk_size, readable, first, hashes, entity.size)

    def write(self, components, expect_gen: int, flags: int, offset: int, length: int, hashes):
        """-> Deferred[new gen]. ``hashes`` are the new addresses of the chunks the range spans."""
        try:
            hashes = check_write_args(components, expect_gen, offset, length, hashes)
        except FsError:
            return defer.fail()
        return self._batched(lambda txn: self._write_txn(txn, components, expect_gen, flags, offset, length, hashes))

    def _batched(self, fn):
        """Run ``fn(txn)`` in the next shared mutation transaction: the CREATEs, DELETEs and WRITEs
        that arrive in one reactor turn (from any connection) go to the store as one transaction,
        so each costs one entry in it, not a transaction of its own. Every mutation goes this one
        way and runs to its end inside it (no retry later), in the order asked for, so mutations
        pipelined on one connection apply in arrival order. A queued read (``list_queued``,
        ``read_queued``) is an entry too: it sees the entries before it and none after it, and
        is answered when the transaction has committed, together with them and in their order.
        ``fn`` must raise FsError only before it changes anything (every operation checks
        everything first), so a refused one leaves no trace; any other exception aborts (and
        fails) the whole batch."""
        d = defer.Deferred()
        self._batch.append((fn, d))
        if len(self._batch) == 1:
            self._reactor.callLater(0, self._flush_batch)
        return d

    def _flush_batch(self):
        batch, self._batch = self._batch, []

        def run(txn):
            # The root is made before any entry runs, so no entry changes anything before its
            # checks (CONTRACT §5: the root takes the counter's first value).
            if not self._root_ready:
                self._root(txn, create=True)
            results = []
            self._gens = gens = txn.counter(GEN_COUNTER)
            try:
                for fn, _ in batch:
                    try:
                        results.append((True, fn(txn)))
                    except FsError as e:
                        results.append((False, e))
            finally:
                self._gens = None
            gens.store()
            return results

        def done(results):
            for (ok, value), (_, d) in zip(results, batch):
                if ok:
                    d.callback(value)
                else:
                    d.errback(value)

        def failed(failure):
            for _, d in batch:
                d.errback(failure)

        self.meta.transact(run).addCallbacks(done, failed)

    def _write_txn(self, txn, components, expect_gen, flags, offset, length, hashes):
        parent, entity = self._lookup(txn, components, create_root=True)
        if entity is None:
            if expect_gen == MISSING_GENERATION and flags & CREATE_IF_MISSING:
                # Created in the same transaction as the write (research §B.9 bug 3 avoided).
                entity = Entity([None, 0, False, DEFAULT_CHUNK_SIZE, 0])
            else:
                raise NotFound("%s does not exist" % _show(components))
        else:
            check_file(components, entity, expect_gen)
        cs = entity.chunk_size
        first, _ = write_span(offset, length, cs, len(hashes))
        missing = [h.hex() for h in set(hashes) if not txn.chunk_has(h)]
        if missing:
            raise ChunkNotFound("the chunk store does not hold %s" % ", ".join(sorted(missing)[:4]))
        end = offset + length
        size = end if flags & TRUNCATE_AFTER else max(entity.size, end)
        # CONTRACT §5: bytes past the end of file read as zeros if the file grows again, so the
        # chunk that ends up holding the new end (when the end moved and is not chunk-aligned) must
        # be zero past it. Clients pad with zeros; a chunk that is not gets a zero-tailed copy in
        # this same transaction (read and stored by the store's writer thread, which runs it).
        tail_index = tail_fixed = None
        if size % cs and size == end and (length or flags & TRUNCATE_AFTER):
            tail_index = (size - 1) // cs
            tail_hash = None
            if length:
                tail_hash = hashes[-1]
            elif entity.inode is not None:
                value = txn.get(CHK_TABLE, _chk_key(entity.inode, tail_index))
                tail_hash = bytes(value) if value is not None else None
            if tail_hash is not None:
                tail_fixed = self._zero_tailed(txn, tail_hash, size - tail_index * cs)
        # Everything is checked: from here on the transaction changes things.
        if tail_fixed is not None:
            tail_hash = txn.chunk_put(tail_fixed)
        else:
            tail_index = None
        gen = self._new_gen(txn)
        if entity.inode is None:
            entity.inode = gen  # created by CREATE_IF_MISSING: the creation generation names it
        inode = entity.inode
        new = list(hashes)
        if tail_index is not None and length:
            new[-1] = tail_hash
            tail_index = None
        released = []
        if new:
            txn.chunk_incref(new)
        fresh = entity.size == 0  # empty (new, or truncated to 0): it holds no chunk references
        for i, h in enumerate(new):
            key = _chk_key(inode, first + i)
            old = None if fresh else txn.get(CHK_TABLE, key)
            if old is not None:
                released.append(bytes(old))
            txn.put(CHK_TABLE, key, h)
        if flags & TRUNCATE_AFTER:
            keep = -(-size // cs)  # chunks [0, keep) stay
            for key, old in self._chunk_refs(txn, inode, keep):
                released.append(bytes(old))
                txn.delete(CHK_TABLE, key)
        if tail_index is not None:  # a truncation (length 0) ending inside an existing chunk
            key = _chk_key(inode, tail_index)
            old = txn.get(CHK_TABLE, key)
            txn.chunk_incref([tail_hash])
            released.append(bytes(old))
            txn.put(CHK_TABLE, key, tail_hash)
        if released:
            txn.chunk_decref(released)
        entity.gen = gen
        entity.size = size
        txn.put(ENT_TABLE, _ent_key(parent.inode, components[-1]), entity.value())
        return gen

    @staticmethod
    def _zero_tailed(txn, addr, keep):
        """Chunk ``addr`` with its bytes from ``keep`` on zeroed, or None if they already are zero.
        Raises FsError (before the transaction changes anything) if it cannot be read."""
        try:
            data = txn.chunk_get(addr)
        except errors.StoreError as e:  # DataCorrupted, or its pack is gone
            raise ChunkUnreadable(str(e))
        if data is None:
            raise ChunkNotFound("the chunk store does not hold %s" % bytes(addr).hex())
        tail = data[keep:]
        if not tail or tail == bytes(len(tail)):
            return None
        return b"".join((data[:keep], bytes(len(tail))))
