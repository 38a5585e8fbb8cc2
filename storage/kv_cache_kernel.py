"""Compiled (numba) kernels of the key-value row cache (``storage/kv_cache.py``): an open-addressing
hash table over a byte arena, in two generations, for keys of at most KEY_KEEP bytes. Imported
lazily through ``storage.jit.import_compiled``; the caller keeps its Python path for when this is
absent or still loading.

Layout (all numpy arrays, owned by ``RowCache``):

- ``slots`` (int64, ``2 * S``): generation ``g`` uses ``slots[g * S : (g + 1) * S]``, linear
  probing from ``hash & (S - 1)``. 0 = empty (ends a probe), 1 = removed (a probe goes past it),
  else ``tag << 40 | (offset + 2)``: ``tag`` 23 bits of the key's hash (most probes of another
  key end without touching the arena), ``offset`` the entry's position in the generation's arena.
- ``arena`` (uint8, ``2 * A``): generation ``g`` uses ``arena[g * A : (g + 1) * A]``, filled from
  its start; an entry is u16 key_len, u32 value_len (little-endian), the key, the value (the user
  value: the stored value without its first byte). An entry replaced or removed stays where it is
  until its generation is dropped.
- ``meta`` (int64): see the ``M_*`` indices.

The newer generation takes every insert; when its arena or its slots (at the load limit) are full,
the older one is dropped (its slots zeroed, its arena reused) and becomes the newer: the cache
keeps between one and two generations' worth of the latest entries, and an insert never moves an
entry (no rehash). A lookup probes the newer generation, then the older; a removal marks the key
removed in both.

Arrays are indexed with unsigned integers where numba would otherwise add a negative-index
wraparound.
"""

import numpy as np
from numba import njit

JIT = dict(cache=True, nogil=True)

# meta indices
M_NEW = 0  # the newer generation (0 or 1)
M_POS = 1  # arena fill of generation 0; M_POS + 1: of generation 1
M_USED = 3  # slots used (entries and removal marks) of generation 0; M_USED + 1: of generation 1
M_SLOTS = 5  # S (a power of two)
M_ARENA = 6  # A (bytes per generation)
M_MAX_USED = 7  # the load limit: slots a generation may use
M_DROPS = 8  # generations dropped, ever
M_ENTRIES = 9  # entries inserted, ever
META_LEN = 16

_TAG_SHIFT = np.int64(40)
_OFF_MASK = np.int64((1 << 40) - 1)
_TAG_MASK = np.uint64((1 << 23) - 1)
_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)


@njit(**JIT)
def key_hash(buf, p, n):
    """64-bit hash of ``buf[p : p + n]``: 8 bytes at a time (little-endian words), each mixed in
    by a multiply, then the splitmix64 finaliser."""
    h = np.uint64(n) * _M1
    k = 0
    while k + 8 <= n:
        w = np.uint64(0)
        for j in range(8):
            w |= np.uint64(buf[np.uint64(p + k + j)]) << np.uint64(8 * j)
        h = (h ^ w) * _M2
        h ^= h >> np.uint64(31)
        k += 8
    if k < n:
        w = np.uint64(0)
        j = 0
        while k + j < n:
            w |= np.uint64(buf[np.uint64(p + k + j)]) << np.uint64(8 * j)
            j += 1
        h = (h ^ w) * _M2
        h ^= h >> np.uint64(31)
    h ^= h >> np.uint64(30)
    h *= _M2
    h ^= h >> np.uint64(27)
    h *= _M3
    h ^= h >> np.uint64(31)
    return h


@njit(**JIT)
def _same_key(arena, e, buf, p, n):
    if arena[np.uint64(e)] | (np.int64(arena[np.uint64(e + 1)]) << 8) != n:
        return False
    q = e + 6
    for k in range(n):
        if arena[np.uint64(q + k)] != buf[np.uint64(p + k)]:
            return False
    return True


@njit(**JIT)
def _probe(slots, arena, meta, g, buf, p, n, h):
    """The slot index of the key in generation ``g`` (-1: absent)."""
    size = meta[M_SLOTS]
    base = g * size
    abase = g * meta[M_ARENA]
    mask = np.uint64(size - 1)
    tag = np.int64((h >> np.uint64(41)) & _TAG_MASK)
    i = h & mask
    for _ in range(size):
        s = slots[np.uint64(base) + i]
        if s == 0:
            return np.int64(-1)
        if s != 1 and (s >> _TAG_SHIFT) == tag:
            e = abase + (s & _OFF_MASK) - 2
            if _same_key(arena, e, buf, p, n):
                return np.int64(base) + np.int64(i)
        i = (i + np.uint64(1)) & mask
    return np.int64(-1)


@njit(**JIT)
def lookup(slots, arena, meta, buf, p, n, h):
    """The arena position of the key ``buf[p : p + n]`` (hash ``h``)'s entry, newer generation
    first; -1 if not cached."""
    size = meta[M_SLOTS]
    g = meta[M_NEW]
    for _ in range(2):
        i = _probe(slots, arena, meta, g, buf, p, n, h)
        if i >= 0:
            return g * meta[M_ARENA] + (slots[np.uint64(i)] & _OFF_MASK) - 2
        g = 1 - g
    return np.int64(-1)


@njit(**JIT)
def find(slots, arena, meta, key):
    """``lookup`` of a whole ``key`` (bytes): its entry's arena position or -1."""
    return lookup(slots, arena, meta, key, 0, len(key), key_hash(key, 0, len(key)))


@njit(**JIT)
def value_len(arena, e):
    return (np.int64(arena[np.uint64(e + 2)]) | (np.int64(arena[np.uint64(e + 3)]) << 8)
            | (np.int64(arena[np.uint64(e + 4)]) << 16) | (np.int64(arena[np.uint64(e + 5)]) << 24))


@njit(**JIT)
def _drop_older(slots, meta):
    """The newer generation is full: zero the older one and make it the newer."""
    old = 1 - meta[M_NEW]
    size = meta[M_SLOTS]
    slots[old * size : (old + 1) * size] = 0
    meta[M_POS + old] = 0
    meta[M_USED + old] = 0
    meta[M_NEW] = old
    meta[M_DROPS] += 1


@njit(**JIT)
def remove(slots, arena, meta, buf, p, n, h):
    """Mark the key removed in both generations."""
    for g in range(2):
        i = _probe(slots, arena, meta, g, buf, p, n, h)
        if i >= 0:
            slots[np.uint64(i)] = 1


@njit(**JIT)
def insert(slots, arena, meta, buf, p, n, val, vp, vn, h):
    """Cache ``val[vp : vp + vn]`` as the value of the key ``buf[p : p + n]`` (hash ``h``) in the
    newer generation (the older one dropped first if that one is full); an entry of the key in the
    older generation is shadowed (lookups probe the newer first; the older is dropped first). An entry longer than half a generation's arena is not
    cached (the key is only removed)."""
    need = 6 + n + vn
    abytes = meta[M_ARENA]
    if need > abytes // 2:
        remove(slots, arena, meta, buf, p, n, h)
        return
    g = meta[M_NEW]
    if meta[M_POS + g] + need > abytes or meta[M_USED + g] >= meta[M_MAX_USED]:
        _drop_older(slots, meta)
        g = meta[M_NEW]
    size = meta[M_SLOTS]
    base = g * size
    mask = np.uint64(size - 1)
    tag = np.int64((h >> np.uint64(41)) & _TAG_MASK)
    off = meta[M_POS + g]
    e = g * abytes + off
    arena[np.uint64(e)] = np.uint8(n & 0xFF)
    arena[np.uint64(e + 1)] = np.uint8(n >> 8)
    for k in range(4):
        arena[np.uint64(e + 2 + k)] = np.uint8((vn >> (8 * k)) & 0xFF)
    for k in range(n):
        arena[np.uint64(e + 6 + k)] = buf[np.uint64(p + k)]
    q = e + 6 + n
    for k in range(vn):
        arena[np.uint64(q + k)] = val[np.uint64(vp + k)]
    meta[M_POS + g] = off + need
    meta[M_ENTRIES] += 1
    entry = (tag << _TAG_SHIFT) | (off + 2)
    # the key's slot if present (replaced in place), else the first removed or empty one
    i = h & mask
    free = np.int64(-1)
    for _ in range(size):
        s = slots[np.uint64(base) + i]
        if s == 0:
            break
        if s == 1:
            if free < 0:
                free = np.int64(i)
        elif (s >> _TAG_SHIFT) == tag and _same_key(arena, g * abytes + (s & _OFF_MASK) - 2, buf, p, n):
            slots[np.uint64(base) + i] = entry
            return
        i = (i + np.uint64(1)) & mask
    if free >= 0:
        slots[np.uint64(base + free)] = entry
    else:
        slots[np.uint64(base) + i] = entry
        meta[M_USED + g] += 1


@njit(**JIT)
def update(slots, arena, meta, keys, klens, values, vlens, keep):
    """A batch: the ``i``-th key (``klens[i]`` bytes, one after another in ``keys``) gets the
    ``i``-th value (``vlens[i]`` bytes in ``values``, of which the first is the store's prefix, not
    cached) or, for ``vlens[i] < 0``, is removed. Keys over ``keep`` bytes are skipped (never
    cached). Returns how many were cached."""
    p = np.int64(0)
    v = np.int64(0)
    cached = 0
    for i in range(len(klens)):
        n = klens[i]
        vn = vlens[i]
        if n <= keep:
            h = key_hash(keys, p, n)
            if vn < 0:
                remove(slots, arena, meta, keys, p, n, h)
            else:
                insert(slots, arena, meta, keys, p, n, values, v + 1, vn - 1, h)
                cached += 1
        p += n
        if vn > 0:
            v += vn
    return cached


@njit(**JIT)
def _msgpack_len(buf, p, end, array):
    """``(count or length, position after the header)`` of the msgpack array header (``array``) or
    bin header at ``p``, as msgpack packs them; ``(-1, p)`` if another type or past ``end``."""
    if p >= end:
        return np.int64(-1), p
    t = np.int64(buf[np.uint64(p)])
    if array:
        if 0x90 <= t <= 0x9F:
            return t & 0x0F, p + 1
        if t == 0xDC or t == 0xDD:
            w = 2 if t == 0xDC else 4
            if p + 1 + w > end:
                return np.int64(-1), p
            n = np.int64(0)
            for k in range(w):
                n = (n << 8) | np.int64(buf[np.uint64(p + 1 + k)])
            return n, p + 1 + w
        return np.int64(-1), p
    w = 1 if t == 0xC4 else (2 if t == 0xC5 else (4 if t == 0xC6 else 0))
    if w == 0 or p + 1 + w > end:
        return np.int64(-1), p
    n = np.int64(0)
    for k in range(w):
        n = (n << 8) | np.int64(buf[np.uint64(p + 1 + k)])
    if p + 1 + w + n > end:
        return np.int64(-1), p
    return n, p + 1 + w


@njit(**JIT)
def update_ops(slots, arena, meta, buf, starts, op_code, db, keep):
    """``update`` of runs of puts given as their WAL ops, one after another in ``buf`` (op ``j`` is
    ``buf[starts[j] : starts[j + 1]]``), each exactly ``msgpack.packb([op_code, db, [key, ...],
    [stored value, ...]])`` (the compiled SET pass's ``OP_PUTS``, storage/kv.py ``PackedRun``), in
    order: each key gets its value (the stored value without its first byte); keys over ``keep``
    bytes are skipped. Returns how many were cached, or ``-(j + 1)`` at the first op ``j`` that is
    not such an op (the ops before it applied; the caller takes the rest another way)."""
    cached = 0
    for j in range(len(starts) - 1):
        p = starts[j]
        end = starts[j + 1]
        if end - p < 5 or buf[np.uint64(p)] != 0x94 or buf[np.uint64(p + 1)] != op_code \
                or buf[np.uint64(p + 2)] != db:
            return -(j + 1)
        n, kp = _msgpack_len(buf, p + 3, end, True)
        if n < 0:
            return -(j + 1)
        q = kp
        for i in range(n):  # find the values' array: after the keys
            kn, q2 = _msgpack_len(buf, q, end, False)
            if kn < 0:
                return -(j + 1)
            q = q2 + kn
        n2, vp = _msgpack_len(buf, q, end, True)
        if n2 != n:
            return -(j + 1)
        # check every value's header before changing anything for this op
        q = vp
        for i in range(n):
            vn, q2 = _msgpack_len(buf, q, end, False)
            if vn < 1:
                return -(j + 1)
            q = q2 + vn
        if q != end:
            return -(j + 1)
        for i in range(n):
            kn, kp = _msgpack_len(buf, kp, end, False)
            vn, vp = _msgpack_len(buf, vp, end, False)
            if kn <= keep:
                insert(slots, arena, meta, buf, kp, kn, buf, vp + 1, vn - 1, key_hash(buf, kp, kn))
                cached += 1
            kp += kn
            vp += vn
    return cached
