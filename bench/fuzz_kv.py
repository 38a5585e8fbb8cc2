"""A longer fuzz campaign for the kv server than the test suite runs.

    python bench/fuzz_kv.py [--seconds 60] [--seed N]

Feeds the server protocol (over a StringTransport, on the real store: LMDB, WAL and memtable in a
temporary directory, written by the inline writer of tests/storage_helpers/inline.py, as the kv
protocol tests do) mutated streams of valid requests and pure garbage, split at random points, and
checks after each case: no exception escaped, everything written parses as whole replies, and a
connection left open with no half-received message still answers a fresh SET and GET correctly.
"""

import argparse
import os
import random
import shutil
import struct
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from protocols.partition import codec as c  # noqa: E402
from protocols.partition import gets_compiled  # noqa: E402
from tests.storage_helpers.inline import close, open_inline  # noqa: E402
from tests.test_kv_protocol import connect  # noqa: E402
from twisted.internet import task  # noqa: E402


def valid_request(rnd, cid):
    key = bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 6)))
    name = rnd.choice([b"", b"a", b"cur"])
    kind = rnd.randrange(7)
    if kind == 0:
        return c.encode_get(cid, key)
    if kind == 1:
        return c.encode_set(cid, key, os.urandom(rnd.randint(0, 40)))
    if kind == 2:
        return c.encode_remove(cid, key)
    if kind == 3:
        return c.encode_create_cursor(cid, name, key)
    if kind == 4:
        return c.encode_delete_cursor(cid, name)
    cmd = rnd.choice([c.GET_FF, c.GET_FB, c.GET_KEYS, c.GET_KEYS_PREFIX])
    return c.encode_scan(cmd, cid, rnd.choice([0, 1, 3, 1024, 1025]), name, key, key[:1])


def mutate(rnd, data):
    data = bytearray(data)
    for _ in range(rnd.randint(0, 4)):
        op = rnd.randrange(4)
        if not data:
            break
        i = rnd.randrange(len(data))
        if op == 0:
            data[i] = rnd.randrange(256)
        elif op == 1:
            del data[i : i + rnd.randint(1, 8)]
        elif op == 2:
            data[i:i] = os.urandom(rnd.randint(1, 8))
        else:
            # a plausible but wrong length prefix
            data[i : i + 8] = struct.pack(">Q", rnd.choice([0, 7, 8, 25, 26, 27, 40, 2**25, 2**25 + 1, 2**63]))
    return bytes(data)


def one_case(rnd, store):
    proto, tr = connect(store)
    stream = b"".join(valid_request(rnd, rnd.randrange(1000)) for _ in range(rnd.randint(1, 30)))
    if rnd.random() < 0.2:
        stream = os.urandom(rnd.randint(1, 300))
    stream = mutate(rnd, stream)
    pos = 0
    while pos < len(stream):
        step = rnd.randint(1, 64)
        proto.dataReceived(stream[pos : pos + step])
        pos += step
    out = tr.value()
    p = 0
    while p < len(out):
        (total,) = struct.unpack_from(">Q", out, p)
        assert 26 <= total <= len(out) - p, (total, p, len(out))
        p += total
    if not tr.disconnecting and not proto._closing:
        if proto._frames.buffered() == 0 and not proto._slots and not proto._pending and proto._run is None:
            # nothing half-received: the connection must still be in sync
            tr.clear()
            value = os.urandom(8)
            proto.dataReceived(c.encode_set(424241, b"probe", value) + c.encode_get(424242, b"probe"))
            want = c.encode_status(424241, c.OK) + c.encode_get_reply(424242, b"probe", value)
            assert tr.value() == want, (tr.value(), want)
        return "open"
    return "closed"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--python-gets", action="store_true",
                    help="without the compiled GET passes (protocols/partition/gets_compiled.py) a node loads")
    args = ap.parse_args()
    if not args.python_gets:
        gets_compiled.start_loading()
        gets_compiled.wait()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rnd = random.Random(seed)
    deadline = time.monotonic() + args.seconds
    counts = {"open": 0, "closed": 0}
    n = 0
    tmp = tempfile.mkdtemp(prefix="fuzz_kv.")
    store = open_inline(os.path.join(tmp, "store"), task.Clock())
    try:
        while time.monotonic() < deadline:
            counts[one_case(rnd, store)] += 1
            n += 1
    finally:
        close(store)
        shutil.rmtree(tmp, ignore_errors=True)
    print("fuzz_kv: seed %d, GETs %s, %d cases, %d left open, %d closed by the server, no failures"
          % (seed, gets_compiled.state if not args.python_gets else "python", n, counts["open"], counts["closed"]))


if __name__ == "__main__":
    main()
