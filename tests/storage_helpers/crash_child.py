"""Crash-test child: appends with fsync always and reports every ack on stdout, until killed.

Besides appends (one by one, and runs of several through ``append_many``) it puts kv pairs
(``K key``), chunks (``C addr``), metadata transactions (``M key``), trims (``T sid point``), seals
(``S sid end_offset``) and runs segment collection.

usage: python -m tests.storage_helpers.crash_child STORE_DIR SEED, or through ``serve()``: a fork
server that imports everything once and forks one child per line ``STORE_DIR SEED FIFO`` read on
stdin (answering the child's pid), so 50+ kills fit in a few seconds of start-up.

Batch number i of a run has deterministic content (``expected_batch(seed, i)``); appends are kept
``INFLIGHT`` deep so group commit coalesces them. Each acked append prints ``B sid base i``; each
acked kv put prints ``K key`` (the kv memtable is merged every few puts); each acked chunk put prints ``C addrhex``. The parent SIGKILLs the
child at a random moment and checks the store after reopening.
"""

import random
import sys
import zlib

import os
import signal

from storage import Store
from storage import record_batch as rb

INFLIGHT = 6
RUN_INDEX = 1 << 30  # batch numbers of the appends made as runs (``append_many``)


def expected_batch(seed: int, i: int) -> bytes:
    rnd = random.Random(seed * 1000003 + i)
    n = 1 + rnd.randrange(4)
    size = rnd.choice([10, 300, 3000, 16000])
    return rb.encode([(1000 + j, [(b"i", b"%d" % i)], bytes([rnd.randrange(256)]) * size) for j in range(n)])


def kv_value(seed: int, key: bytes) -> bytes:
    return b"%d:%s" % (seed, key) * 3


def main(path, seed, out=None):
    from twisted.internet import reactor

    import storage.kv

    # the kv memtable is merged into LMDB all the time (issue 19): kills land during merges
    storage.kv.FLUSH_BYTES = 2048
    storage.kv.FLUSH_IDLE_S = 0.002
    storage.kv.FLUSH_MAX_AGE_S = 0.01
    seed = int(seed)
    out = out or sys.stdout
    store = Store.open(path, fsync="always", reactor=reactor, node_id=1, segment_bytes=256 << 10,
                       pack_bytes=64 << 10, retention_check_s=0)
    streams = [m.stream_id for m in store.log.streams() if m.attrs.get("crash")]
    state = {"i": 0}

    def report(line):
        out.write(line + "\n")
        out.flush()

    def start():
        if len(streams) < 2:
            d = store.log.create_stream(attrs={"crash": True})
            d.addCallback(lambda m: (streams.append(m.stream_id), start()))
            return
        report("READY")
        for _ in range(INFLIGHT):
            pump()

    def pump():
        i = state["i"]
        state["i"] += 1
        sid = streams[i % 2]
        kind = i % 20
        if kind in (7, 17):
            key = b"k%d-%d" % (seed, i)
            store.kv.put(key, kv_value(seed, key)).addCallback(lambda _: (report("K %s" % key.decode()), pump()))
        elif kind == 8:
            data = b"chunk %d %d " % (seed, i) * 50
            store.chunks.put(data).addCallback(lambda a: (report("C %s" % a.hex()), pump()))
        elif kind == 18:
            key = b"m%d-%d" % (seed, i)

            def txn(t):
                t.put("crash", key, {"seed": seed, "i": i})
                t.put("crash", b"last", i)
                return key

            store.meta.transact(txn).addCallback(lambda k: (report("M %s" % k.decode()), pump()))
        elif kind == 9 and (i // 20) % 4 != 1:
            # stream 0 keeps only its last few offsets, stream 1 its last 50: old segments end up
            # mostly dead with a few live batches for the cleaner to move
            sid = streams[0] if (i // 20) % 2 == 0 else streams[1]
            point = max(0, store.log.stream(sid).next_offset - (3 if sid == streams[0] else 50))
            store.log.trim(sid, point).addCallback(lambda m: (report("T %d %d" % (sid, point)), pump()))
        elif kind == 9:
            store.log.gc_now().addCallback(lambda _: pump())  # moves live batches, deletes segments
        elif i % 100 == 19:
            sid = streams[(i // 100) % 2]
            store.log.seal_range(sid, store.log.stream(sid).ranges[-1].range_index).addCallback(
                lambda r: (report("S %d %d" % (sid, r[0].end_offset)), pump()))
        elif kind in (5, 15):
            # a run (RecordLog.append_many, as the SBP server hands over the APPENDs of a read):
            # batches of both streams and a refused one among them, one commit-core operation
            idx = [RUN_INDEX + 4 * i + j for j in range(3)]
            batches = [expected_batch(seed, idx[0]), expected_batch(seed, idx[1]), b"\x22" * 5, expected_batch(seed, idx[2])]
            sids = [sid, streams[(i + 1) % 2], sid, sid]
            crcs = [zlib.crc32(memoryview(batches[0])[rb.HEADER_SIZE:]), None, None,
                    zlib.crc32(memoryview(batches[3])[rb.HEADER_SIZE:])]
            d, outcome = store.log.append_many(sids, batches, crcs)
            assert isinstance(outcome[2], Exception), "a batch shorter than its header is refused"

            def acked(_, outcome=outcome, sids=sids):
                for s_, base, k in zip((sids[0], sids[1], sids[3]), (outcome[0], outcome[1], outcome[3]), idx):
                    report("B %d %d %d" % (s_, base, k))
                pump()

            d.addCallback(acked)
        else:
            b = expected_batch(seed, i)
            store.log.append(sid, b).addCallback(lambda base: (report("B %d %d %d" % (sid, base, i)), pump()))

    reactor.callWhenRunning(start)
    reactor.run()


def serve():
    import storage.chunks  # noqa: F401  (import everything before forking)
    import storage.kv  # noqa: F401
    import storage.log  # noqa: F401
    import storage.meta  # noqa: F401
    import twisted.internet.task  # noqa: F401
    import twisted.internet.threads  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    for line in sys.stdin:
        path, seed, fifo = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                out = open(fifo, "w", buffering=1)
                main(path, seed, out)
            finally:
                os._exit(0)
        sys.stdout.write("%d\n" % pid)
        sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(*sys.argv[1:])
