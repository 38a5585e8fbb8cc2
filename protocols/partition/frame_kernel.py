"""numba-compiled scan of a run of whole SET or GET messages (CONTRACT §4 framing) in one read.
Imported through ``storage.jit.import_compiled`` by ``frame_scan.py`` (numba is slow to import and
compiles once per machine), never directly by the server.
"""

from numba import njit

_GET = 2
_SET = 3
_KEY_KEEP = 440  # storage.index.KEY_KEEP: longer keys take the general write path
_MAX_VALUE = 16 * 1024 * 1024  # CONTRACT §2
_MAX_MESSAGE = 32 * 1024 * 1024  # CONTRACT §4


@njit(cache=True, nogil=True)
def scan_run(b, pos, n, cmd, max_items, max_value_bytes, out):  # pragma: no cover - compiled
    """From ``b[pos:n]``, the longest run (at most ``max_items``, and stopping once the values
    taken reach ``max_value_bytes``) of whole, well-formed messages of ``cmd`` (GET or SET) with a
    key of 1..KEY_KEEP bytes; a SET's value at most 16 MiB, inside total_len. Column i of ``out``
    (5 rows) gets (client_id, key start, key end, value start, value end) of message i (a GET's
    value span is empty, at its key's end).
    Returns (count, position after the run). Any other message (or a cut one) ends the run."""
    i = 0
    vbytes = 0
    while i < max_items and i < out.shape[1] and n - pos >= 28 and vbytes < max_value_bytes:
        if b[pos] | b[pos + 1] | b[pos + 2] | b[pos + 3]:
            break  # total_len of 4 GiB or more: the general path refuses it
        total = (b[pos + 4] << 24) | (b[pos + 5] << 16) | (b[pos + 6] << 8) | b[pos + 7]
        if total < 28 or total > n - pos or total > _MAX_MESSAGE:
            break
        c = (b[pos + 24] << 8) | b[pos + 25]
        klen = (b[pos + 26] << 8) | b[pos + 27]
        if c != cmd or klen == 0 or klen > _KEY_KEEP:
            break
        kend = pos + 28 + klen
        end = pos + total
        if c == _SET:
            if kend + 4 > end:
                break
            vlen = (b[kend] << 24) | (b[kend + 1] << 16) | (b[kend + 2] << 8) | b[kend + 3]
            if vlen > _MAX_VALUE or kend + 4 + vlen > end:
                break
            vstart = kend + 4
            vend = vstart + vlen
            vbytes += vlen
        else:
            if kend > end:
                break
            vstart = vend = kend
        hi = (b[pos + 8] << 24) | (b[pos + 9] << 16) | (b[pos + 10] << 8) | b[pos + 11]
        lo = (b[pos + 12] << 24) | (b[pos + 13] << 16) | (b[pos + 14] << 8) | b[pos + 15]
        out[0, i] = (hi << 32) | lo  # out is uint64: the u64 client_id's bits as they are
        out[1, i] = pos + 28
        out[2, i] = kend
        out[3, i] = vstart
        out[4, i] = vend
        i += 1
        pos = end
    return i, pos
