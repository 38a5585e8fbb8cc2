"""The key-value merge worker: a separate process that merges a frozen memtable into LMDB, so the
merge's CPU is not spent under the node's GIL (issue 19, seventh pass; docs/storage.md "The merge
worker").

The node (``MergeWorker``, on a helper thread of its own) hands the worker a WAL range, not the
memtable: ``merge START END CHUNK_KEYS CHUNK_BYTES``. The range holds every write of the frozen
memtable (from the kv floor to the end of the group whose delivery last landed a run,
docs/storage.md); the worker reads its ``T_OPS`` entries back (the page cache holds them), keeps
each key-value LMDB key's last write (``OP_PUT``, ``OP_PUTS``, ``OP_DEL``, in WAL order: what the
memtable holds, plus writes the range holds beyond it, harmless), sorts the keys and writes them
into LMDB in transactions of at most CHUNK_KEYS keys (or about CHUNK_BYTES of values), in key
order, then answers ``ok KEYS TXNS READ_S SORT_S WRITE_S`` (its CPU seconds by stage), or ``err
TEXT`` and exits. It never moves the WAL checkpoint: the node does, through its writer,
once the answer is in (so a kill -9 of either process at any point leaves the floor where it was,
and recovery replays the range again: idempotent, docs/storage.md "Recovery of the memtable").

The worker is a fresh interpreter (``subprocess``: fork + exec, never a fork of the node holding
its LMDB environment) opening the same LMDB environment (LMDB's lock file makes that safe across
processes: one writer at a time, the node's group commits wait for a merge transaction and the
other way round; py-lmdb lets go of the GIL while ``mdb_txn_begin`` waits). It dies with the node:
``PR_SET_PDEATHSIG`` (SIGKILL), EOF on its stdin, and, before each commit, while it holds LMDB's
writer lock, a check that its parent is still the node (a node restarted after a kill -9 replays
its WAL holding that lock, so no merge of the dead node's can commit after that replay).
"""

import bisect
import itertools
import operator
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack

from storage import index
from storage.wal import ENTRY, ENTRY_SIZE, SUFFIX, T_OPS, entry_crc

_READ = 4 << 20  # WAL bytes read per pread
SORT_FIXED_MAX = 64  # keys of one length up to this sort with numpy (else sorted())
_SORT_DTYPES = {1: ">u1", 2: ">u2", 4: ">u4", 8: ">u8"}
_NUMPY_FROM = 2048  # fewer keys: sorted() (the worker does not import numpy for small merges)
# The worker runs at a lower CPU priority than the node (as RocksDB's compaction threads can,
# Env::LowerThreadPoolCPUPriority): on a busy machine the reactor and the clients get the cores
# first and the merge takes what is left; on an idle one it has its core anyway. Alternating on
# this machine at load 3-5 (docs/benchmarks.md): SET 105-131k/s at nice 5 against 75-81k at 0.
WORKER_NICE = 5


class MergeError(Exception):
    """The worker could not merge (an I/O error, a WAL entry that fails its CRC, an operation it
    does not know): the node merges the memtable itself instead."""


# -- the worker (its own process) --------------------------------------------------------------------


def read_kv_writes(wal_dir, start, end):
    """``(keys, values)``: every key-value write logged in the WAL entries of ``[start, end)`` (both
    entry boundaries), in WAL order, as two lists of LMDB keys and stored values (None: a delete);
    a key may come several times (``last_writes`` keeps the last)."""
    names = [n for n in os.listdir(wal_dir) if n.endswith(SUFFIX) and n[: -len(SUFFIX)].isdigit()]
    bases = sorted(int(n[: -len(SUFFIX)]) for n in names)
    keys, values = [], []
    kv = index.KV
    pos = start
    fds = {}
    try:
        while pos < end:
            i = bisect.bisect_right(bases, pos) - 1
            if i < 0:
                raise MergeError("WAL position %d is before every segment" % pos)
            base = bases[i]
            fd = fds.get(base)
            if fd is None:
                fd = fds[base] = os.open(os.path.join(wal_dir, "%020d%s" % (base, SUFFIX)), os.O_RDONLY)
            stop = min(end, base + os.fstat(fd).st_size)
            if pos >= stop:
                if i + 1 < len(bases) and bases[i + 1] < end:
                    pos = bases[i + 1]  # the next segment (a gap only after a truncated segment)
                    continue
                raise MergeError("WAL position %d is past the end of segment %d" % (pos, base))
            buf, buf_at = b"", pos  # buf holds the segment's bytes [buf_at, buf_at + len(buf))
            while pos < stop:
                rel = pos - buf_at
                if len(buf) - rel < ENTRY_SIZE:
                    buf, buf_at, rel = os.pread(fd, min(_READ, stop - pos), pos - base), pos, 0
                    if len(buf) < ENTRY_SIZE:
                        raise MergeError("WAL entry at %d is torn" % pos)
                length, crc, etype = ENTRY.unpack_from(buf, rel)
                total = ENTRY_SIZE + length
                if pos + total > stop:
                    raise MergeError("WAL entry at %d runs past %d" % (pos, stop))
                if etype == T_OPS:
                    if len(buf) - rel < total:
                        buf, buf_at, rel = os.pread(fd, max(total, min(_READ, stop - pos)), pos - base), pos, 0
                    payload = memoryview(buf)[rel + ENTRY_SIZE: rel + total]
                    if entry_crc(base, etype, (payload,)) != crc:
                        raise MergeError("WAL entry at %d failed its CRC" % pos)
                    _take_kv_ops(keys, values, msgpack.unpackb(payload, raw=True, use_list=True), kv)
                    payload.release()
                pos += total  # a batch entry is skipped unread
    finally:
        for fd in fds.values():
            os.close(fd)
    return keys, values


def _take_kv_ops(keys, values, ops, kv):
    for op in ops:
        if op[1] != kv:
            continue
        code = op[0]
        if code == index.OP_PUTS:
            keys += op[2]
            values += op[3]
        elif code == index.OP_PUT:
            keys.append(op[2])
            values.append(op[3])
        elif code == index.OP_DEL:
            keys.append(op[2])
            values.append(None)
        else:
            raise MergeError("unexpected key-value operation %r in the WAL" % (code,))


def last_write_order(keys):
    """The positions in ``keys`` of each key's last write, in ascending key order (a numpy int64
    array), for keys of one length (at most SORT_FIXED_MAX bytes, at least _NUMPY_FROM of them):
    one stable numpy argsort over the keys joined into one buffer (big-endian unsigned integers or
    fixed-width byte strings: memcmp order), the last of each run of equal keys. None otherwise."""
    n = len(keys)
    if n < _NUMPY_FROM:
        return None
    first = len(keys[0])
    if first > SORT_FIXED_MAX or len(set(map(len, keys))) != 1:
        return None
    import numpy

    arr = numpy.frombuffer(b"".join(keys), dtype=_SORT_DTYPES.get(first, "S%d" % first))
    order = numpy.argsort(arr, kind="stable")
    ordered = arr[order]
    last = numpy.empty(n, dtype=bool)
    last[-1] = True
    numpy.not_equal(ordered[1:], ordered[:-1], out=last[:-1])
    return order[last]


def last_writes(keys, values):
    """(keys, values) in ascending key order, each key once with its last value in the lists'
    order: ``last_write_order`` and one C-level gather (``itemgetter``) each, ~0.95 against ~1.35
    us per key for a dict of the last writes then an argsort and object-array gathers (330k 8-byte
    keys, 2026-11-27); else a dict, then sorted(). (The worker merges through the order itself,
    ``merge_into``'s ``take``, without these lists.)"""
    take = last_write_order(keys)
    if take is not None:
        take = take.tolist()
        if len(take) == 1:
            return [keys[take[0]]], [values[take[0]]]
        gather = operator.itemgetter(*take)
        return list(gather(keys)), list(gather(values))
    writes = dict(zip(keys, values))
    ordered = sorted(writes)
    return ordered, list(map(writes.__getitem__, ordered))


def chunk_cut(stored, chunk_bytes):
    """How many of ``stored`` (a chunk's values, None for a delete) one merge transaction takes:
    all of them, or up to and including the value that crosses ``chunk_bytes`` (the worker's
    chunks and the writer thread's, ``storage/kv.py`` ``_Merge``)."""
    if None in stored:
        sizes = itertools.accumulate(len(v) if v is not None else 0 for v in stored)
    else:
        sizes = itertools.accumulate(map(len, stored))
    return min(len(stored), bisect.bisect_left(list(sizes), chunk_bytes) + 1)


def merge_into(env, db, keys, values, chunk_keys, chunk_bytes, parent, take=None):
    """Write the sorted ``keys``/``values`` (None: delete) into LMDB, one transaction per chunk of
    at most ``chunk_keys`` keys and about ``chunk_bytes`` of values; returns the transactions.
    Before each commit, holding LMDB's writer lock, the parent must still be ``parent``.
    ``take`` (``last_write_order``): write ``keys[i], values[i]`` for ``i`` in ``take`` instead."""
    if take is not None:
        return _merge_order(env, db, keys, values, take, chunk_keys, chunk_bytes, parent)
    at, txns, n = 0, 0, len(keys)
    while at < n:
        stored = values[at: at + chunk_keys]
        cut = chunk_cut(stored, chunk_bytes)
        chunk, stored = keys[at: at + cut], stored[:cut]
        _write_chunk(env, db, zip(chunk, stored), None in stored, parent)
        txns += 1
        at += cut
    return txns


def _write_chunk(env, db, pairs, deletes, parent):
    """One merge transaction: ``pairs`` (key, stored value or None: delete) into ``db``; a
    ``deletes`` False promises no None among them (one ``putmulti`` of the pairs as they come).
    Before the commit, holding LMDB's writer lock, the parent must still be ``parent``."""
    txn = env.begin(write=True)
    try:
        if deletes:
            puts = []
            for key, value in pairs:
                if value is None:
                    txn.delete(key, db=db)
                else:
                    puts.append((key, value))
        else:
            puts = pairs
        txn.cursor(db=db).putmulti(puts)
        if os.getppid() != parent:  # the node is gone: a restarted one may be replaying
            txn.abort()
            os._exit(3)
        txn.commit()
    except BaseException:
        txn.abort()
        raise


def _merge_order(env, db, keys, values, take, chunk_keys, chunk_bytes, parent):
    """``merge_into`` through the positions ``take`` (ascending key order) of the lists in WAL order:
    each object is touched once, by the put that writes it. The lists hold the objects in the order
    ``msgpack`` made them, near one another in memory; in key order they are scattered, and every
    pass over them there (the gathers into sorted lists, each chunk's slices, its ``None`` and size
    scans: ~25% of the worker's samples at 1M keys) cost a cache miss per object. The values' sizes
    and whether any is a delete are taken once, in WAL order; the chunks' cuts (as ``chunk_cut``)
    from their cumulative sums."""
    import numpy

    deletes = None in values
    lens = numpy.fromiter(map(len, values) if not deletes else (0 if v is None else len(v) for v in values),
                          numpy.int64, len(values))
    cum = numpy.cumsum(lens[take])
    at, txns, n = 0, 0, len(take)
    order = take.tolist()
    kget, vget = keys.__getitem__, values.__getitem__
    while at < n:
        stop = min(n, at + chunk_keys)
        base = cum[at - 1] if at else 0
        # up to and including the value whose running sum reaches chunk_bytes (chunk_cut)
        cut = min(stop - at, int(numpy.searchsorted(cum[at:stop], base + chunk_bytes, "left")) + 1)
        idx = order[at: at + cut]
        _write_chunk(env, db, zip(map(kget, idx), map(vget, idx)), deletes, parent)
        txns += 1
        at += cut
    return txns


def _trim():
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except Exception:  # pragma: no cover - glibc has it
        pass


def _die_with_parent(parent):
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - Linux has it; the stdin EOF and the ppid check remain
        pass
    if os.getppid() != parent:
        os._exit(3)


def main(argv=None):
    """``python -c 'from storage.kv_merge import main; main()' ENV_DIR WAL_DIR PARENT_PID SYNC``
    (SYNC 1: LMDB syncs each commit, as the node's environment does under ``--fsync always``)."""
    env_dir, wal_dir, parent, sync = (argv or sys.argv[1:])[:4]
    parent = int(parent)
    _die_with_parent(parent)
    os.nice(WORKER_NICE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to the node's group is the node's to handle
    # Synced commits under ``always``, as the node's own: without, a power cut could leave LMDB
    # damaged (its documented MDB_NOSYNC risk), which ``always`` promises against.
    env, dbs = index.open_env(env_dir, sync=sync == "1")
    db = dbs[index.KV]
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        try:
            if parts[0] != "merge" or len(parts) != 5:
                raise MergeError("unknown request %r" % line)
            start, end, chunk_keys, chunk_bytes = map(int, parts[1:])
            t0 = time.process_time()
            keys, values = read_kv_writes(wal_dir, start, end)
            t1 = time.process_time()
            take = last_write_order(keys)
            if take is None:
                keys, values = last_writes(keys, values)
            t2 = time.process_time()
            txns = merge_into(env, db, keys, values, chunk_keys, chunk_bytes, parent, take)
            t3 = time.process_time()
            n = len(keys) if take is None else len(take)
            del keys, values, take
            _trim()  # give the merge's memory back to the system: the worker idles between merges
            # keys, transactions, then CPU seconds reading the WAL, sorting, writing LMDB
            out.write("ok %d %d %.6f %.6f %.6f\n" % (n, txns, t1 - t0, t2 - t1, t3 - t2))
            out.flush()
        except Exception as e:
            out.write("err %s: %s\n" % (type(e).__name__, str(e).replace("\n", " ")))
            out.flush()
            break  # a fresh worker for the next merge
    env.close()


# -- the node's side ------------------------------------------------------------------------------------


class MergeWorker:
    """The node's handle on its merge worker: ``merge(start, end, chunk_keys, chunk_bytes, done)``
    from the reactor thread queues a merge for the helper thread, which starts the worker if
    needed, sends the request, waits for the answer (blocking on the pipe, without the GIL) and
    calls ``call_in_reactor(done, answer)``: ``("ok", keys, txns, (CPU seconds reading the WAL,
    sorting, writing LMDB))`` or ``("err", text)`` (the
    worker failed or died; it is started afresh for the next merge). One merge at a time."""

    def __init__(self, env_dir, wal_dir, sync, call_in_reactor):
        self.env_dir = env_dir
        self.wal_dir = wal_dir
        self.sync = sync  # LMDB commits synced (the node's --fsync always)
        self.call_in_reactor = call_in_reactor
        self.proc = None  # helper thread (started, killed); ``pid`` is read by observers
        self._jobs = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = None
        self.started = 0  # worker processes started (observability, tests)

    @property
    def pid(self):
        proc = self.proc
        return proc.pid if proc is not None and proc.returncode is None else None

    def merge(self, start, end, chunk_keys, chunk_bytes, done):
        self._queue((start, end, chunk_keys, chunk_bytes, done))

    def start(self):
        """Start the worker now (in the helper thread), so the first merge does not wait for it."""
        if self._thread is None:
            self._queue(None)

    def _queue(self, job):
        with self._cond:
            if self._stopping:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-merge", daemon=True)
                self._thread.start()
            self._jobs.append(job)
            self._cond.notify()

    def _spawn(self):
        # The worker imports only the modules it uses: ``storage`` is put in sys.modules as a bare
        # package first, so storage/__init__.py (the whole store, Twisted, numpy: ~0.4 s and ~30
        # MiB) is not run. It starts in ~0.1 s.
        here = os.path.dirname(os.path.abspath(__file__))
        code = ("import sys, types; pkg = types.ModuleType('storage'); pkg.__path__ = [%r]; "
                "sys.modules['storage'] = pkg; from storage.kv_merge import main; main()" % here)
        proc = subprocess.Popen([sys.executable, "-c", code, self.env_dir, self.wal_dir, str(os.getpid()),
                                 "1" if self.sync else "0"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                start_new_session=False)
        self.proc = proc
        self.started += 1
        line = proc.stdout.readline()
        if line != b"ready\n":
            raise MergeError("the merge worker did not start (%r)" % line)

    def _kill(self):
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.kill()
            except OSError:
                pass
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass

    def _run(self):  # the helper thread
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    break
                job = self._jobs.pop(0)
            if job is None:  # start()
                try:
                    if self.proc is None:
                        self._spawn()
                except Exception:
                    self._kill()  # the next merge tries again, and reports
                continue
            start, end, chunk_keys, chunk_bytes, done = job
            try:
                if self.proc is not None and self.proc.poll() is not None:
                    self._kill()  # it died while idle: a new one, rather than a failed merge
                if self.proc is None:
                    self._spawn()
                proc = self.proc
                proc.stdin.write(b"merge %d %d %d %d\n" % (start, end, chunk_keys, chunk_bytes))
                proc.stdin.flush()
                line = proc.stdout.readline().decode("utf-8", "replace")
                parts = line.split()
                if len(parts) == 6 and parts[0] == "ok":
                    answer = ("ok", int(parts[1]), int(parts[2]), tuple(map(float, parts[3:])))
                else:
                    answer = ("err", line.strip() or "the merge worker exited (status %s)" % proc.poll())
            except Exception as e:
                answer = ("err", "%s: %s" % (type(e).__name__, e))
            if answer[0] == "err":
                self._kill()
            self.call_in_reactor(done, answer)
        self._end()

    def _end(self):
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # EOF: an idle worker exits
            proc.wait(5.0)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def stop(self, kill=False):
        """Stop the worker (``kill``: at once, even in the middle of a merge; else once the
        queued merges are done) and the helper thread; blocks until both have ended."""
        with self._cond:
            self._stopping = True
            if kill:
                self._jobs = []  # (their done calls are dropped: the store is closing)
            self._cond.notify()
            thread = self._thread
        if kill:
            proc = self.proc
            if proc is not None:
                try:
                    proc.kill()
                except OSError:
                    pass
        if thread is not None:
            thread.join()
        else:
            self._end()
