"""The record body of a key-value partition's replicated stream (issue 20): one write run's
operations, in order.

Pure functions over bytes. A body is a sequence of operations, each
``u8 op | u16 key_len | key`` and, for a SET, ``u32 value_len | value`` (big-endian, the §4
string formats). ``op`` is 1 for SET, 2 for REMOVE.
"""

import struct

SET_OP = 1
REMOVE_OP = 2
_HEAD = struct.Struct(">BH")
_U32 = struct.Struct(">I")


class BadOps(ValueError):
    """The bytes are not a well-formed operation list."""


def encode_ops(ops) -> bytes:
    """``[(key, value or None to remove)]`` -> body bytes."""
    parts = []
    head, u32 = _HEAD.pack, _U32.pack
    for key, value in ops:
        if value is None:
            parts.append(head(REMOVE_OP, len(key)))
            parts.append(key)
        else:
            parts.append(head(SET_OP, len(key)))
            parts.append(key)
            parts.append(u32(len(value)))
            parts.append(value)
    return b"".join(parts)


def decode_ops(body) -> list:
    """Body bytes -> ``[(key, value or None)]``; BadOps if they do not parse."""
    out = []
    pos, n = 0, len(body)
    head, u32 = _HEAD.unpack_from, _U32.unpack_from
    while pos < n:
        if pos + 3 > n:
            raise BadOps("operation header runs past the body at %d" % pos)
        op, klen = head(body, pos)
        pos += 3
        if pos + klen > n:
            raise BadOps("key runs past the body at %d" % pos)
        key = bytes(body[pos:pos + klen])
        pos += klen
        if op == REMOVE_OP:
            out.append((key, None))
        elif op == SET_OP:
            if pos + 4 > n:
                raise BadOps("value length runs past the body at %d" % pos)
            (vlen,) = u32(body, pos)
            pos += 4
            if pos + vlen > n:
                raise BadOps("value runs past the body at %d" % pos)
            out.append((key, bytes(body[pos:pos + vlen])))
            pos += vlen
        else:
            raise BadOps("unknown operation %d at %d" % (op, pos - 3))
    return out


def op_size(key, value) -> int:
    return 3 + len(key) + (0 if value is None else 4 + len(value))
