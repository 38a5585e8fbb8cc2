"""SHA-256 of many chunks at once: ``digests(datas)`` -> their 32-byte digests, in order.

Chunks of one length, when there are enough of them (``MIN_LANES``), are hashed together by the
multi-buffer kernel in ``storage/sha256_kernel.py`` (numba: up to 32 chunks in lock-step, one per
vector lane); everything else (odd lengths, small groups, no kernel) by hashlib, exactly as before.
Both give the same bytes: the kernel is checked against hashlib by tests/test_sha256.py and by
``load()`` itself before it is used.

Why: on a CPU without SHA extensions (this project's machine: Cascade Lake, AVX-512) OpenSSL's
single-buffer SHA-256 runs at ~390 MB per CPU-second and is ~85% of a Toasty put's or get's CPU;
the kernel runs at ~1,200-1,400 (docs/benchmarks.md, issue 18). No maintained library offers a
multi-buffer SHA-256 to Python: Debian's intel-ipsec-mb (libipsec-mb1) has one, 2.7 GB per
CPU-second here, but its job API refuses messages over 65,534 bytes, and our chunks are 64 KiB
and 1 MiB (docs/storage.md). On a CPU with SHA extensions, or without AVX2, hashlib stays (it is
faster there): ``load()`` checks the CPU and measures both before switching.

numba takes about half a second to import and compiles once per machine (then cached, see
``storage/jit.py``): ``start_loading()`` does it on a thread; until it is done, hashlib.
"""

import hashlib
import threading
import time

from storage.jit import BackgroundLoad, import_compiled

MIN_LANES = 6  # fewer chunks of one length than this: hashlib (the kernel computes >= 8 lanes)
LANES = 32  # chunks per kernel pass (storage/sha256_kernel.LANES)
WARM_MIN_SPEEDUP = 1.5  # the kernel is used only if it measured at least this much faster

# What chunk hashing runs on: "hashlib", "loading" (hashlib meanwhile), "multi-buffer"; why, after
# loading, when it is not the kernel.
state = "hashlib"
why = None

_kernel = None  # (addresses, length, out) -> None, once loaded and checked
_np = None


def enabled() -> bool:
    return _kernel is not None


def digests(datas):
    """SHA-256 digests (bytes) of ``datas`` (bytes-likes), in order. Releases the GIL while hashing
    (both the kernel and hashlib do for big buffers), so pool threads hash side by side."""
    kernel = _kernel
    n = len(datas)
    if kernel is None or n < MIN_LANES:
        sha = hashlib.sha256
        return [sha(d).digest() for d in datas]
    np = _np
    sha = hashlib.sha256
    out = [None] * n
    by_len = {}  # byte length -> [(index, uint8 array over the chunk's own buffer)]
    for i, d in enumerate(datas):
        try:
            a = np.frombuffer(d, np.uint8)  # no copy; kept alive until the kernel returns
        except (TypeError, ValueError):  # not one contiguous buffer: hashlib takes anything
            out[i] = sha(d).digest()
            continue
        by_len.setdefault(a.shape[0], []).append((i, a))
    for length, group in by_len.items():
        if len(group) < MIN_LANES or length == 0:
            for i, _ in group:
                out[i] = sha(datas[i]).digest()
            continue
        addrs = np.fromiter((a.ctypes.data for _, a in group), np.uint64, len(group))
        res = np.empty((len(group), 32), np.uint8)
        kernel(addrs, length, res)
        flat = res.tobytes()
        for k, (i, _) in enumerate(group):
            out[i] = flat[32 * k : 32 * k + 32]
    return out


def start_loading(reactor=None):
    """Load (or compile) and check the kernel on a thread, once per process. With a reactor,
    returns a Deferred fired (with ``state``) on that reactor's thread once loading has finished,
    whatever the outcome (a node holds its ready file for it: the loading thread holds the GIL for
    most of a second); None without one."""
    return _loader.start(reactor)


def wait_loaded(timeout=None) -> bool:
    """For benchmarks and tests: block until loading has finished (whatever the outcome)."""
    return _loader.wait(timeout)


def _loading():
    global state
    state = "loading"


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _load():
    global _kernel, _np, state, why
    try:
        flags = _cpu_flags()
        if "sha_ni" in flags:
            state, why = "hashlib", "the CPU has SHA extensions (OpenSSL uses them)"
            return
        if "avx2" not in flags:
            state, why = "hashlib", "the CPU has no AVX2"
            return
        mod, err = import_compiled("storage.sha256_kernel")
        if mod is None:
            state, why = "hashlib", err
            return
        import numpy as np

        kernel = mod.sha256_lanes
        # the kernel against hashlib on lengths around the padding's edges, then a speed check
        for length in (0, 1, 55, 56, 63, 64, 65, 1000):
            bufs = [bytes((i * 7 + k) & 255 for i in range(length)) for k in range(9)]
            arrays = [np.frombuffer(b, np.uint8) for b in bufs]
            addrs = np.array([a.ctypes.data for a in arrays], np.uint64)
            res = np.empty((len(bufs), 32), np.uint8)
            kernel(addrs, length, res)
            if [bytes(r) for r in res] != [hashlib.sha256(b).digest() for b in bufs]:
                state, why = "hashlib", "the kernel's digests differ from hashlib's"
                return
        bufs = [bytes([k]) * 65536 for k in range(16)]
        arrays = [np.frombuffer(b, np.uint8) for b in bufs]
        addrs = np.array([a.ctypes.data for a in arrays], np.uint64)
        res = np.empty((16, 32), np.uint8)
        best_k = best_h = float("inf")
        for _ in range(3):
            t = time.thread_time()
            kernel(addrs, 65536, res)
            best_k = min(best_k, time.thread_time() - t)
            t = time.thread_time()
            for b in bufs:
                hashlib.sha256(b).digest()
            best_h = min(best_h, time.thread_time() - t)
        if best_k * WARM_MIN_SPEEDUP > best_h:
            state, why = "hashlib", "the kernel measured no faster (%.2f ms vs hashlib %.2f ms)" % (best_k * 1e3, best_h * 1e3)
            return
        _np = np
        _kernel = kernel
        state, why = "multi-buffer", None
    except Exception as e:  # a broken numba/llvmlite install must not stop anything
        state, why = "hashlib", "the kernel failed to load: %r" % (e,)


_loader = BackgroundLoad("sha256-kernel", _load, _loading, lambda: state)


class Gatherer:
    """Hashes the chunk batches of many callers together: ``submit(datas)`` -> Deferred[digests].

    A node receives a 1 MiB chunk per 1 MiB read, so the batch of one read pass is one chunk: too
    few for the kernel's lanes. Here every batch joins a shared queue, and a hashing job (at most
    ``max_jobs`` at once, in ``in_pool``: the store's read pool) takes everything queued when it
    starts (up to ``LANES`` chunks). With the kernel on, and while the latest caller said more
    chunks were on their way (``more``: the rest of a pipelined upload is already being received),
    it first waits until ``fill`` chunks are queued or the oldest has waited ``wait`` seconds. While
    the jobs are busy the queue fills, so the busier the node, the fuller the lanes; a batch with
    nothing known to follow it is hashed at once.
    ``submit`` and the Deferreds run on the reactor thread; the queue is shared with the jobs."""

    def __init__(self, in_pool, max_jobs, fill=16, wait=0.05):
        self.in_pool = in_pool
        self.max_jobs = max_jobs
        self.fill = fill  # a job waits for this many queued chunks ...
        self.wait = wait  # ... at most this long (s) after the oldest queued batch arrived,
        self.more = False  # ... and only while the latest caller said more chunks were coming
        self.jobs = 0  # reactor thread only
        self.queue = []  # [(datas, Deferred)], under self.lock
        self.queued = 0  # chunks in self.queue
        self.since = 0.0  # when the oldest queued batch arrived (time.monotonic)
        self.lock = threading.Lock()
        self.filled = threading.Condition(self.lock)

    def submit(self, datas, more=False):
        """``more``: the caller has already received part of its next chunks (a pipelined
        upload), so a job may wait a little for them to fill its lanes."""
        from twisted.internet import defer

        d = defer.Deferred()
        with self.lock:
            if not self.queue:
                self.since = time.monotonic()
            self.queue.append((datas, d))
            self.queued += len(datas)
            self.more = more
            if self.queued >= self.fill or not more:
                self.filled.notify()
        if self.jobs < self.max_jobs:
            self._start()
        return d

    def _start(self):
        self.jobs += 1
        self.in_pool(self._hash).addBoth(self._done)

    def _hash(self):
        """Pool thread: take what is queued now (at least one batch, up to LANES chunks), hash it
        in one call -> [(Deferred, digests)]."""
        with self.lock:
            # With the kernel, wait (briefly) for enough chunks to fill its lanes: while the
            # other job hashes, the reactor reads the next chunks of the pipelined requests.
            if _kernel is not None:
                while self.queue and self.queued < self.fill and self.more:
                    left = self.since + self.wait - time.monotonic()
                    if left <= 0:
                        break
                    self.filled.wait(left)
            taken, n = 0, 0
            for datas, _ in self.queue:
                if taken and n + len(datas) > LANES:
                    break
                taken += 1
                n += len(datas)
            batch, self.queue = self.queue[:taken], self.queue[taken:]
            self.queued -= n
            if self.queue:
                self.since = time.monotonic()
        if not batch:
            return []
        flat = [x for datas, _ in batch for x in datas]
        try:
            hashed = digests(flat)
        except Exception as e:  # every caller hears of it
            return [(d, e) for _, d in batch]
        out, k = [], 0
        for datas, d in batch:
            out.append((d, hashed[k : k + len(datas)]))
            k += len(datas)
        return out

    def _done(self, result):
        self.jobs -= 1
        with self.lock:
            more = bool(self.queue)
        if more and self.jobs < self.max_jobs:
            self._start()
        if isinstance(result, list):
            for d, value in result:
                if isinstance(value, Exception):
                    d.errback(value)
                else:
                    d.callback(value)
        else:  # the pool refused the job (the store is closing): fail what is queued
            with self.lock:
                failed, self.queue = self.queue, []
            for _, d in failed:
                d.errback(result)
        return None
