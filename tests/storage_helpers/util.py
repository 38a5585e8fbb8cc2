"""Helpers shared by the storage tests."""

from storage import record_batch as rb


def batch(n_records=1, size=10, tag=0, ts=1000):
    """A valid record batch of ``n_records`` records with ``size``-byte bodies (base_offset 0)."""
    body = (b"%d:" % tag).ljust(size, b"x")[:max(size, 1)]
    return rb.encode([(ts + i, [(b"k", b"%d" % i)], body) for i in range(n_records)])


def base_of(stored: bytes) -> int:
    return rb.read_header(stored).base_offset


def same_except_base(stored: bytes, original: bytes) -> bool:
    return stored[:1] == original[:1] and stored[9:] == original[9:]


def entry_positions(st, sid):
    """(position, entry length) of every batch of ``sid``, from the store's index."""
    from storage.index import INDEX, INDEX_KEY, INDEX_VAL

    out = []
    with st.env.begin() as txn:
        cur = txn.cursor(db=st.dbs[INDEX])
        cur.set_range(INDEX_KEY.pack(sid, 0))
        for k, v in cur:
            if INDEX_KEY.unpack(k)[0] != sid:
                break
            out.append(INDEX_VAL.unpack(v)[:2])
    return out
