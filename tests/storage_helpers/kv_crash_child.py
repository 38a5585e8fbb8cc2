"""Crash-test child for the key-value memtable (issue 19): SETs and REMOVEs of a small key space
under ``--fsync always``, with merges into LMDB running all the time, until SIGKILLed.

usage: python -m tests.storage_helpers.kv_crash_child STORE_DIR SEED [verify | kill-worker]

At start it reports the store's state of every key (``S key_hex value_hex`` or ``S key_hex -``,
from ``get_many`` and a full ``scan_forward``, which must agree), so the parent checks what
survived the previous kill; with ``verify`` it stops there. Then it keeps ``INFLIGHT`` runs of
writes in flight (``write_many``, or ``write_sets`` for half the runs of SETs alone, as the
key-value server issues them), each key in at most one
run at a time, so a key's state after a kill is its last acknowledged write or the one in flight.
Before a run is submitted it prints ``I`` and the run's ops; once durable, ``A`` and the run's
number. A REMOVE's answer (did the key exist) is checked against the acknowledged state here
(``BAD`` if wrong). The memtable is tiny and merged a few keys per LMDB transaction, so kills
land before, between and after merge chunks, and a key's SET and REMOVE fall on both sides of the
kv floor. Merges run in the merge worker process (storage/kv_merge.py): the child prints ``M``
when it hands one to the worker and ``m ok`` / ``m err`` when the answer is in, so the parent
knows whether its kill landed during a worker merge; with ``kill-worker`` it also SIGKILLs its
merge worker alone, 0-2 ms into half of the merges and every 0.1-0.5 s (``W`` when that landed
during a worker merge): the writer thread
then merges that memtable, a new worker the next one, and no acknowledged write may be lost.
"""

import os
import random
import signal
import sys

from storage import Store

INFLIGHT = 8
KEYS = [b"%c%03d" % (c, i) for c in b"a\x10\x90\xf0" for i in range(60)] + [b"L" * 445 + b"%02d" % i for i in range(12)]


def main(path, seed, verify=False, kill_worker=False):
    from twisted.internet import reactor

    import storage.kv as kvmod

    kvmod.FLUSH_BYTES = 6000
    kvmod.FLUSH_IDLE_S = 0.002
    kvmod.FLUSH_MAX_AGE_S = 0.01
    kvmod.MERGE_CHUNK_KEYS = 7
    kvmod.MAX_WORKER_FAILURES = 1 << 30  # killed over and over: a new worker for every next merge
    seed = int(seed)
    rnd = random.Random(seed)
    store = Store.open(path, fsync="always", reactor=reactor, node_id=1, retention_check_s=0)
    kv = store.kv
    out = sys.stdout

    def report(line):
        out.write(line + "\n")
        out.flush()

    values = kv.get_many(KEYS)
    scanned = dict(kv.scan_forward(None, 1 << 20))
    state = {}
    for key, value in zip(KEYS, values):
        if scanned.get(key) != value:
            report("BAD scan and get disagree on %s" % key.hex())
        report("S %s %s" % (key.hex(), value.hex() if value is not None else "-"))
        state[key] = value
    if set(scanned) - set(KEYS):
        report("BAD scan found keys never written")
    report("READY")
    if verify:
        reactor.callWhenRunning(lambda: store.close().addBoth(lambda _: reactor.stop()))
        reactor.run()
        return
    worker = kv.merge_worker()
    to_worker = worker.merge
    merging = []

    def merge(start, end, chunk_keys, chunk_bytes, done):
        merging.append(True)
        report("M")

        def answered(answer):
            merging.pop()
            report("m %s" % answer[0])
            done(answer)

        to_worker(start, end, chunk_keys, chunk_bytes, answered)
        if kill_worker and rnd.random() < 0.5:
            reactor.callLater(rnd.uniform(0.0, 0.002), kill_the_worker)

    worker.merge = merge

    def kill_the_worker():
        pid = kv.merge_worker_pid()
        if pid is not None:
            if merging:
                report("W")
            os.kill(pid, signal.SIGKILL)

    def kill_the_worker_now_and_then():  # idle or not
        kill_the_worker()
        reactor.callLater(rnd.uniform(0.1, 0.5), kill_the_worker_now_and_then)

    if kill_worker:
        reactor.callWhenRunning(reactor.callLater, 0.3, kill_the_worker_now_and_then)
    busy = set()
    counter = {"run": 0, "op": 0}

    def pump():
        free = [k for k in KEYS if k not in busy]
        ops = []
        for key in rnd.sample(free, min(len(free), rnd.randint(1, 12))):
            counter["op"] += 1
            if rnd.random() < 0.35:
                ops.append((key, None))
            else:
                ops.append((key, b"%d-%d-" % (seed, counter["op"]) + bytes([rnd.randrange(256)]) * rnd.randrange(0, 300)))
            busy.add(key)
        counter["run"] += 1
        run = counter["run"]
        report("I %d %s" % (run, " ".join("%s:%s" % (k.hex(), "-" if v is None else v.hex()) for k, v in ops)))
        if all(v is not None for _, v in ops) and rnd.random() < 0.5:
            d = kv.write_sets([k for k, _ in ops], [v for _, v in ops])  # the server's run of SETs alone
        else:
            d = kv.write_many(ops)

        def acked(results):
            for (key, value), result in zip(ops, results):
                if value is None and result != (state[key] is not None):
                    report("BAD remove of %s answered %s" % (key.hex(), result))
                state[key] = value
                busy.discard(key)
            report("A %d" % run)
            pump()

        d.addCallback(acked)
        d.addErrback(lambda f: report("BAD %s" % f.getErrorMessage()))

    def start():
        for _ in range(INFLIGHT):
            pump()

    reactor.callWhenRunning(start)
    reactor.run()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], verify=sys.argv[3:] == ["verify"], kill_worker=sys.argv[3:] == ["kill-worker"])
