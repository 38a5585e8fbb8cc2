"""The Toasty file tree of a cluster, kept in etcd (CONTRACT §5, §9: one tree served by every node).

Why etcd: generation checks must be linearizable across nodes, and etcd already is the cluster's
one linearizable store (CONTRACT §9: nothing else is home-made consensus). Every mutation is one
etcd transaction whose compares are the generation check itself (a compare-and-swap on the
entity's ``mod_revision``), so two WRITEs with the same expect_gen through two nodes cannot both
commit; reads are etcd's linearizable range requests.

Generations are etcd revisions: an entity's generation is its key's ``mod_revision`` (the revision
of the transaction that created it, or of the WRITE that last changed it). Revisions are
cluster-wide, increasing, never 0 (the first write is revision 2) and never 2^64-1; the root has
no key and generation 1 (CONTRACT §5). A directory's key is written once, so its generation
stays when children change.

Keys (under ``P toasty/``, P = --cluster-prefix):
- ``e/<parent path> NUL <name>``: an entity, msgpack ``[is_dir, chunk_size, size]``; the children
  of a directory are one key range, sorted by name (LIST's order and continuation). Paths are the
  components joined by ``/`` (no component holds ``/`` or NUL, paths.py).
- ``c/<path> NUL <u32be page>``: a file's chunk references, PAGE chunk indexes per key, msgpack
  ``{slot: [hash, [holder node ids]]}``; a missing slot is a hole. Holders are the nodes that
  held the chunk when the WRITE was checked, or that copied it since (toasty_chunks.py).
A WRITE touches at most a handful of page keys (1024 chunks = 4 pages), well under etcd's default
128 operations per transaction.

Known gap against the single-node tree: a truncation carrying no data (length 0) to a size inside
a chunk is refused here, because zeroing that chunk's tail would mean rewriting a chunk on
remote holders inside the transaction; a WRITE with data and TRUNCATE_AFTER (what the clients
send) is accepted as it comes (the clients zero-pad the last chunk).
"""

import struct

import msgpack
from twisted.internet import defer

from node.cluster import etcd
from protocols.toasty import file_tree
from protocols.toasty.file_tree import (
    CREATE_IF_MISSING,
    MISSING_GENERATION,
    ROOT_GEN,
    TRUNCATE_AFTER,
    ZERO_HASH,
    AlreadyExists,
    BadGeneration,
    InvalidOperation,
    IsADirectory,
    NotFound,
    ReadResult,
    check_gen,
    span,
)

PAGE = 256  # chunk references per etcd key
SHAPES = 100_000  # chunk sizes remembered (cleared when full)
ATTEMPTS = 20  # re-reads when a transaction's compare lost to a concurrent change of another kind
_PAGE_NO = struct.Struct(">I")


class Entity:
    __slots__ = ("gen", "is_dir", "chunk_size", "size")

    def __init__(self, gen, is_dir, chunk_size=0, size=0):
        self.gen, self.is_dir, self.chunk_size, self.size = gen, bool(is_dir), chunk_size, size

    @classmethod
    def of(cls, kv):
        is_dir, chunk_size, size = msgpack.unpackb(kv.value)
        return cls(kv.mod_revision, is_dir, chunk_size, size)

    def value(self):
        return msgpack.packb([self.is_dir, self.chunk_size, self.size])


ROOT = Entity(ROOT_GEN, True)


class ClusterReadResult(ReadResult):
    """ReadResult plus ``holders``: the node ids recorded for each chunk."""

    __slots__ = ("holders",)


def decode_page(value):
    """{slot: (hash, [node ids])} of a page value."""
    return {int(k): (bytes(v[0]), list(v[1])) for k, v in msgpack.unpackb(value, strict_map_key=False).items()}


def encode_page(slots):
    return msgpack.packb({k: [h, list(ids)] for k, (h, ids) in sorted(slots.items())})


def _range(key, end=None, limit=0):
    body = {"key": etcd.b64(key)}
    if end is not None:
        body["range_end"] = etcd.b64(end)
    if limit:
        body["limit"] = str(limit)
    return {"request_range": body}


def _delete_range(key, end):
    return {"request_delete_range": {"key": etcd.b64(key), "range_end": etcd.b64(end)}}


def _none_in_range(key, end):
    """A compare that holds iff no key in [key, end) exists (etcd compares every key in the range;
    an empty range compares as one missing key, version 0)."""
    return {"key": etcd.b64(key), "range_end": etcd.b64(end), "target": "VERSION", "result": "EQUAL", "version": "0"}


def _show(components):
    return file_tree._show(components)


class ClusterFileTree:
    """The file tree's operations (as ``protocols.toasty.file_tree.FileTree``'s, every one a
    Deferred) over etcd. Each is linearizable: it takes effect at its etcd transaction."""

    remote = True

    def __init__(self, client, prefix):
        self.client = client
        base = (prefix + "toasty/").encode()
        self.ent_prefix = base + b"e/"
        self.chk_prefix = base + b"c/"
        self._shapes = {}  # file key -> (create_revision, chunk_size), for one-read READs

    # -- keys -------------------------------------------------------------------------------------

    def ent_key(self, components):
        return self.ent_prefix + b"/".join(components[:-1]) + b"\x00" + components[-1]

    def children_prefix(self, components):
        return self.ent_prefix + b"/".join(components) + b"\x00"

    def pages_prefix(self, components):
        return self.chk_prefix + b"/".join(components) + b"\x00"

    def page_key(self, components, page):
        return self.pages_prefix(components) + _PAGE_NO.pack(page)

    # -- reads ------------------------------------------------------------------------------------

    def _entity(self, components, with_parent=False):
        """(entity or None, its kv, parent entity or None, parent kv) in one etcd read."""
        return self._entity_and(components, with_parent).addCallback(lambda r: r[:4])

    @defer.inlineCallbacks
    def _entity_and(self, components, with_parent=False, extra=()):
        """``_entity``'s four, plus the kvs of each range in ``extra``, all in one etcd read."""
        if not components:
            return ROOT, None, None, None, []
        ops = [_range(self.ent_key(components))]
        parent_key = self.ent_key(components[:-1]) if len(components) > 1 and with_parent else None
        if parent_key is not None:
            ops.append(_range(parent_key))
        ops.extend(extra)
        r = yield self.client.txn([], ops)
        kvs = r.kvs(0)
        entity = Entity.of(kvs[0]) if kvs else None
        parent = parent_kv = None
        if with_parent:
            if parent_key is None:
                parent = ROOT
            else:
                pk = r.kvs(1)
                if pk:
                    parent_kv, parent = pk[0], Entity.of(pk[0])
        skip = len(ops) - len(extra)
        return entity, (kvs[0] if kvs else None), parent, parent_kv, [r.kvs(skip + i) for i in range(len(extra))]

    @defer.inlineCallbacks
    def list(self, components, expect_gen, after=None, limit=file_tree.MAX_LIST):
        """-> (dir gen, truncated, [(name, gen, is_dir)]) sorted by name, names > ``after``."""
        prefix = self.children_prefix(components)
        start = prefix + after + b"\x00" if after is not None else prefix
        ops = [_range(start, etcd.prefix_end(prefix), limit + 1)]
        if components:
            ops.insert(0, _range(self.ent_key(components)))
        r = yield self.client.txn([], ops)
        if components:
            kvs = r.kvs(0)
            entity = Entity.of(kvs[0]) if kvs else None
            rows = r.kvs(1)
        else:
            entity, rows = ROOT, r.kvs(0)
        file_tree.check_list(components, entity, expect_gen)
        items = [(kv.key[len(prefix):], kv.mod_revision, Entity.of(kv).is_dir) for kv in rows[:limit]]
        return entity.gen, len(rows) > limit, items

    list_queued = list

    @defer.inlineCallbacks
    def read(self, components, expect_gen, offset, length, max_chunks=file_tree.MAX_CHUNKS_PER_OP):
        """-> ReadResult with ``holders`` (node ids per chunk) for the readable part of the range.
        One etcd read when the file's chunk size is known from an earlier request (the entity
        and the pages it would need, in one snapshot), else two."""
        if not components:
            raise IsADirectory("/ is a directory")
        key = self.ent_key(components)
        shape = self._shapes.get(key)
        if shape is not None:
            lo, hi = self._page_span(offset, length, shape[1], max_chunks)
            r = yield self.client.txn([], [_range(key), _range(self.page_key(components, lo), self.page_key(components, hi + 1))])
            kvs = r.kvs(0)
            if kvs and kvs[0].create_revision == shape[0]:
                return self._read_result(components, Entity.of(kvs[0]), expect_gen, offset, length, max_chunks, r.kvs(1))
            self._shapes.pop(key, None)  # deleted or made anew since: read it afresh
        for _ in range(ATTEMPTS):
            entity, kv, _, _ = yield self._entity(components)
            if kv is not None:
                self._remember(kv, entity)
            result = self._read_result(components, entity, expect_gen, offset, length, max_chunks, None)
            if result is not None:
                return result
            # the pages, read only if the entity is still the one just read (one snapshot)
            lo, hi = self._page_span(offset, length, entity.chunk_size, max_chunks)
            r = yield self.client.txn([etcd.compare_mod_revision(kv.key, kv.mod_revision)],
                                      [_range(self.page_key(components, lo), self.page_key(components, hi + 1))])
            if r.succeeded:
                return self._read_result(components, entity, expect_gen, offset, length, max_chunks, r.kvs(0))
        raise BadGeneration("%s kept changing while being read" % _show(components))

    def _remember(self, kv, entity):
        """A file's chunk size never changes while its key lives (same create_revision)."""
        if not entity.is_dir:
            if len(self._shapes) >= SHAPES:
                self._shapes.clear()
            self._shapes[kv.key] = (kv.create_revision, entity.chunk_size)

    @staticmethod
    def _page_span(offset, length, chunk_size, max_chunks):
        """The pages a READ of [offset, offset+length) may need (at most max_chunks chunks)."""
        first = offset // chunk_size
        last = first if length <= 0 else min((offset + length - 1) // chunk_size, first + max_chunks - 1)
        return first // PAGE, last // PAGE

    @staticmethod
    def _wanted_pages(first, count, keep):
        """The pages a WRITE rewrites: those of its chunks, and the one the new end falls in."""
        wanted = set(range(first // PAGE, (first + count - 1) // PAGE + 1)) if count else set()
        if keep is not None and keep % PAGE:
            wanted.add(keep // PAGE)
        return sorted(wanted)

    def _read_result(self, components, entity, expect_gen, offset, length, max_chunks, page_kvs):
        """The ReadResult, or None if it needs pages and ``page_kvs`` is None (not read yet)."""
        file_tree.check_file(components, entity, expect_gen)
        readable, first, count = file_tree.read_span(entity, offset, length, max_chunks)
        result = ClusterReadResult(entity.gen, entity.chunk_size, readable, first, [ZERO_HASH] * count, entity.size)
        result.holders = [[] for _ in range(count)]
        if not count:
            return result
        if page_kvs is None:
            return None
        for page_kv in page_kvs:
            page = _PAGE_NO.unpack(page_kv.key[-4:])[0]
            for slot, (h, ids) in decode_page(page_kv.value).items():
                i = page * PAGE + slot - first
                if 0 <= i < count:
                    result.hashes[i] = h
                    result.holders[i] = ids
        return result

    read_queued = read

    # -- mutations --------------------------------------------------------------------------------

    @defer.inlineCallbacks
    def create(self, components, is_dir, chunk_size=0):
        """-> gen of the new entity (the revision of the transaction that made it)."""
        file_tree.check_create_args(components, is_dir, chunk_size)
        key = self.ent_key(components)
        for _ in range(ATTEMPTS):
            entity, _, parent, parent_kv = yield self._entity(components, with_parent=True)
            file_tree.check_new_entry(components, entity, parent)
            compares = [etcd.compare_version(key, 0)]
            self._parent_stays(parent_kv, compares)
            value = Entity(0, is_dir, 0 if is_dir else chunk_size).value()
            r = yield self.client.txn(compares, [etcd.op_put(key, value)])
            if r.succeeded:
                if not is_dir:
                    self._shapes[key] = (r.revision, chunk_size)
                return r.revision
        raise AlreadyExists("%s kept changing while being created" % _show(components))

    @staticmethod
    def _parent_stays(parent_kv, compares):
        if parent_kv is not None:  # still that directory when the transaction runs
            compares.append(etcd.compare_mod_revision(parent_kv.key, parent_kv.mod_revision))

    @defer.inlineCallbacks
    def delete(self, components, expect_gen):
        file_tree.check_delete_args(components)
        key = self.ent_key(components)
        for _ in range(ATTEMPTS):
            entity, kv, _, _ = yield self._entity(components)
            if entity is None:
                if expect_gen == MISSING_GENERATION:
                    return None
                raise NotFound("%s does not exist" % _show(components))
            check_gen(entity, expect_gen, _show(components))
            compares = [etcd.compare_mod_revision(key, kv.mod_revision)]
            ops = [etcd.op_delete(key)]
            if entity.is_dir:
                children = self.children_prefix(components)
                compares.append(_none_in_range(children, etcd.prefix_end(children)))
            else:
                pages = self.pages_prefix(components)
                ops.append(_delete_range(pages, etcd.prefix_end(pages)))
            r = yield self.client.txn(compares, ops)
            if r.succeeded:
                return None
            if entity.is_dir:
                children = self.children_prefix(components)
                rows = yield self.client.txn([], [_range(children, etcd.prefix_end(children), 1)])
                if rows.kvs(0):
                    raise InvalidOperation("directory %s is not empty" % _show(components))
        raise BadGeneration("%s kept changing while being deleted" % _show(components))

    @defer.inlineCallbacks
    def write(self, components, expect_gen, flags, offset, length, hashes, holders=None):
        """-> new gen. ``holders[i]``: the node ids holding ``hashes[i]`` (checked by the caller)."""
        hashes = file_tree.check_write_args(components, expect_gen, offset, length, hashes)
        holders = holders if holders is not None else [[] for _ in hashes]
        key = self.ent_key(components)
        for _ in range(ATTEMPTS):
            # with the chunk size known from an earlier request, the pages come in the same read
            shape = self._shapes.get(key)
            guess = []
            if shape is not None:
                f, c = span(offset, length, shape[1])
                guess = self._wanted_pages(f, c, -(-(offset + length) // shape[1]) if flags & TRUNCATE_AFTER else None)
            extra = [_range(self.page_key(components, p)) for p in guess]
            entity, kv, parent, parent_kv, guessed = yield self._entity_and(components, True, extra)
            if kv is not None:
                self._remember(kv, entity)
            compares = []
            if entity is None:
                if not (expect_gen == MISSING_GENERATION and flags & CREATE_IF_MISSING):
                    raise NotFound("%s does not exist" % _show(components))
                file_tree.check_parent(components, parent)
                self._parent_stays(parent_kv, compares)
                entity = Entity(0, False, file_tree.DEFAULT_CHUNK_SIZE, 0)
                compares.append(etcd.compare_version(key, 0))
            else:
                file_tree.check_file(components, entity, expect_gen)
                compares.append(etcd.compare_mod_revision(key, kv.mod_revision))
            cs = entity.chunk_size
            first, count = file_tree.write_span(offset, length, cs, len(hashes))
            end = offset + length
            size = end if flags & TRUNCATE_AFTER else max(entity.size, end)
            if flags & TRUNCATE_AFTER and not length and size % cs:
                raise InvalidOperation("in a cluster, a truncation inside a chunk needs the chunk's new bytes "
                                       "(write them with TRUNCATE_AFTER)")
            keep = -(-size // cs) if flags & TRUNCATE_AFTER else None  # chunks [0, keep) stay
            wanted = self._wanted_pages(first, count, keep)
            pages = {}
            if wanted and kv is not None and shape is not None and kv.create_revision == shape[0] and wanted == guess:
                for p, got in zip(wanted, guessed):
                    pages[p] = (got[0].mod_revision, decode_page(got[0].value)) if got else (0, {})
            elif wanted and kv is not None:
                ops = [_range(self.page_key(components, p)) for p in sorted(wanted)]
                r = yield self.client.txn([etcd.compare_mod_revision(key, kv.mod_revision)], ops)
                if not r.succeeded:
                    continue
                for i, p in enumerate(sorted(wanted)):
                    got = r.kvs(i)
                    pages[p] = (got[0].mod_revision, decode_page(got[0].value)) if got else (0, {})
            for p in wanted:
                pages.setdefault(p, (0, {}))
            for i, h in enumerate(hashes):
                p, slot = divmod(first + i, PAGE)
                pages[p][1][slot] = (h, list(holders[i]))
            ops = []
            for p in sorted(pages):
                rev, slots = pages[p]
                pk = self.page_key(components, p)
                compares.append(etcd.compare_mod_revision(pk, rev) if rev else etcd.compare_version(pk, 0))
                if keep is not None and p == keep // PAGE:
                    slots = {s: v for s, v in slots.items() if p * PAGE + s < keep}
                if slots:
                    ops.append(etcd.op_put(pk, encode_page(slots)))
                elif rev:
                    ops.append(etcd.op_delete(pk))
            if keep is not None and kv is not None:
                beyond = -(-keep // PAGE)  # pages wholly past the new end
                ops.append(_delete_range(self.page_key(components, beyond), etcd.prefix_end(self.pages_prefix(components))))
            entity.size = size
            ops.append(etcd.op_put(key, entity.value()))
            r = yield self.client.txn(compares, ops)
            if r.succeeded:
                if kv is None:  # made by CREATE_IF_MISSING in this transaction
                    self._shapes[key] = (r.revision, cs)
                return r.revision
            # lost a race: the next pass re-reads and (if the generation moved) fails check_gen
        raise BadGeneration("%s kept changing while being written" % _show(components))
