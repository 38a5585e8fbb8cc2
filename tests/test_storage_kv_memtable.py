"""The kv memtable (issue 19) against a plain dict: a hypothesis state machine of SET/REMOVE/GET
and scans with merges (waited for or still running, done by the merge worker process, which is
also killed now and then) and restarts in between, GETs also through the key-value server's
compiled pass and a tiny row cache (storage/kv_cache.py: generations dropped every few entries,
cleared, bypassed); then kill -9 of a real node while merges run."""

import os
import random
import shutil
import signal
import tempfile

import pytest
import pytest_twisted
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from twisted.internet import reactor, task
from twisted.internet.testing import StringTransport

import storage.kv as kvmod
from protocols.partition import codec, gets_compiled
from protocols.partition.server import KvServerFactory
from storage import Store

LONG = b"p" * 436
keys = st.one_of(
    st.sampled_from([b"a", b"b", b"c", b"\x00", b"\x7f", b"\xe0z", b"\xff"]),
    st.builds(lambda t: LONG + t, st.sampled_from([b"x", b"y", b"x" * 10, b"y" * 10])),  # past LMDB's key limit
)


def wait(d):
    return pytest_twisted.blockon(d)


class MemtableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="storage-memtable-")
        self.store = self._open()
        self.model = {}
        self.running = []  # merges started and not waited for

    def _open(self):
        store = Store.open(self.dir, fsync="never", reactor=reactor, node_id=1, retention_check_s=0)
        store.kv.row_cache_bytes = 4096  # a few dozen entries per generation: dropped all the time
        assert store.kv.start_row_cache() is not None
        return store

    @rule(ks=st.one_of(st.lists(st.sampled_from([b"a", b"b", b"c", b"\x00", b"\x7f", b"\xff"]), min_size=1, max_size=8),
                       st.lists(keys, min_size=1, max_size=8)))
    def server_gets(self, ks):
        """GETs in one read on an idle connection of the key-value server: the compiled pass, through
        the row cache when no memtable holds anything (and the cache is not updating)."""
        proto = KvServerFactory(self.store.kv, store=self.store).buildProtocol(None)
        tr = StringTransport()
        proto.makeConnection(tr)
        proto.dataReceived(b"".join(codec.encode_get(i, k) for i, k in enumerate(ks)))
        data, pos = tr.value(), 0
        for i, k in enumerate(ks):
            r = codec.decode_reply(data, codec.GET, pos)
            assert r.client_id == i
            want = self.model.get(k)
            if want is None:
                assert r.cmd == codec.DATA_NOT_FOUND and not r.items, (k, r)
            else:
                assert r.items == [(k, want)], (k, r.items, want)
            pos += int.from_bytes(data[pos : pos + 8], "big")
        assert pos == len(data)
        proto.connectionLost(None)

    @rule(ks=st.lists(st.sampled_from([b"a", b"b", b"c", b"\x00", b"\x7f", b"\xff"]), min_size=1, max_size=8))
    def merge_all_then_server_gets_twice(self, ks):
        """Every write merged and the cache's updates done: GETs answered from the merge's
        entries in the cache, or missed, looked up and cached, then hits."""
        wait(self.store.kv.flush())
        wait(self.store.kv.flush())
        self.settle_the_cache()
        self.server_gets(ks)
        self.server_gets(ks)

    @rule()
    def settle_the_cache(self):
        """Wait for the row cache's updates (merges landed): the next GETs may read it."""
        cache = self.store.kv.row_cache
        for _ in range(2000):
            if cache is None or not cache.busy:
                return
            wait(task.deferLater(reactor, 0.001, lambda: None))
        raise AssertionError("the row cache stayed busy")

    @rule()
    def clear_the_cache(self):
        cache = self.store.kv.row_cache
        if cache is not None and not cache.busy:
            cache.clear()

    @rule()
    def bypass_the_cache(self):
        cache = self.store.kv.row_cache
        if cache is not None:
            cache.bypass = not cache.bypass

    @rule(ops=st.lists(st.tuples(keys, st.one_of(st.none(), st.binary(max_size=4))), min_size=1, max_size=6))
    def write_run(self, ops):
        want = []
        for k, v in ops:
            if v is None:
                want.append(k in self.model)
                self.model.pop(k, None)
            else:
                want.append(True)
                self.model[k] = v
        assert wait(self.store.kv.write_many(ops)) == want

    @rule(ops=st.lists(st.tuples(keys, st.binary(max_size=4)), min_size=1, max_size=6))
    def set_run(self, ops):
        """A run of SETs alone as the key-value server issues it (``write_sets``: one OP_PUTS WAL
        op, or ``write_many`` for keys past LMDB's limit); a key twice in a run ends at its last."""
        for k, v in ops:
            self.model[k] = v
        assert wait(self.store.kv.write_sets([k for k, _ in ops], [v for _, v in ops])) == [True] * len(ops)

    @rule(k=keys, v=st.binary(max_size=4), k2=keys)
    def writes_while_a_merge_runs(self, k, v, k2):
        """A merge queued between two un-acked writes: the one before it may or may not be in the
        frozen memtable; both must survive the merge and every restart."""
        d1 = self.store.kv.put(k, v)
        self.running.append(self.store.kv.flush())
        d2 = self.store.kv.delete(k2)
        self.model[k] = v
        existed = k2 in self.model
        self.model.pop(k2, None)
        wait(d1)
        assert wait(d2) is existed

    @rule()
    def flush(self):
        wait(self.store.kv.flush())

    @rule()
    def start_flush(self):
        self.running.append(self.store.kv.flush())

    @rule()
    def kill_the_merge_worker(self):
        """SIGKILL of the merge worker process alone (idle, or in a merge started and not waited
        for): the writer thread merges that memtable, a new worker the next one."""
        pid = self.store.kv.merge_worker_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it has just ended and been reaped (its pid is read before the reap is seen)

    @rule()
    def restart(self):
        wait(self.store.close())
        self.running = []
        self.store = self._open()

    @rule()
    def restart_without_merging(self):
        """The core closed under the store (as a crash leaves it, but with the WAL whole): the
        unmerged writes come back from the WAL replay alone."""
        wait(self.store.core.close())
        self.running = []
        self.store = self._open()

    @rule(k=keys)
    def get(self, k):
        assert self.store.kv.get(k) == self.model.get(k)

    @rule(start=st.one_of(st.none(), keys), limit=st.integers(1, 12), prefix=st.one_of(st.none(), st.sampled_from([b"p", b"\xe0", b"a"])))
    def scans(self, start, limit, prefix):
        ordered = sorted(self.model)
        kv = self.store.kv
        fw = [k for k in ordered if start is None or k >= start][:limit]
        assert kv.scan_forward(start, limit) == [(k, self.model[k]) for k in fw]
        bw = [k for k in reversed(ordered) if start is None or k <= start][:limit]
        assert kv.scan_backward(start, limit) == [(k, self.model[k]) for k in bw]
        lo = start if prefix is None or (start is not None and start > prefix) else prefix
        ks = [k for k in ordered if (lo is None or k >= lo) and (prefix is None or k.startswith(prefix))][:limit]
        assert kv.scan_keys(start, limit, prefix=prefix) == ks

    @invariant()
    def every_key_reads_back(self):
        kv = self.store.kv
        ks = sorted(self.model)
        assert kv.get_many(ks) == [self.model[k] for k in ks]

    def teardown(self):
        wait(self.store.close())
        shutil.rmtree(self.dir, ignore_errors=True)


class TestMemtableModel(MemtableMachine.TestCase):
    """Hypothesis' TestCase for the machine (a stdlib TestCase: pytest-twisted runs plain test
    functions in the reactor's greenlet, where ``blockon`` cannot wait)."""

    settings = settings(max_examples=80, stateful_step_count=40, deadline=None)

    def setUp(self):
        gets_compiled.start_loading()  # the compiled GET passes and the row cache's kernels
        assert gets_compiled.wait(120) and gets_compiled.state == "compiled", gets_compiled.state
        # tiny memtables: size-triggered merges happen every few writes, each merge a few
        # LMDB transactions of 3 keys (reads and scans run between them)
        self._saved = kvmod.FLUSH_BYTES, kvmod.MERGE_CHUNK_KEYS, kvmod.MAX_WORKER_FAILURES
        kvmod.FLUSH_BYTES = 600
        kvmod.MERGE_CHUNK_KEYS = 3
        kvmod.MAX_WORKER_FAILURES = 1 << 30  # the worker is killed over and over: always a new one

    def tearDown(self):
        kvmod.FLUSH_BYTES, kvmod.MERGE_CHUNK_KEYS, kvmod.MAX_WORKER_FAILURES = self._saved


# -- kill -9 during merges ------------------------------------------------------------------------


@pytest.mark.slow
def test_kill9_during_merges_loses_no_acked_write(node_factory):
    """A node under --fsync always with kv writes flowing (so merges run all the time) killed
    with SIGKILL at random moments: every acknowledged write is there after the restart, with
    its last acknowledged value."""
    from protocols.partition import codec as c
    from protocols.partition.client import BlockingKvClient

    rnd = random.Random(19)
    node = node_factory(fsync="always", sbp="none", meta="none", chunks="none", swarm="none", http="none")
    acked = {}
    for round_ in range(4):
        with BlockingKvClient(*node.address("kv")) as kv:
            for burst in range(rnd.randint(3, 8)):
                batch = {}
                for _ in range(400):
                    k = b"%c-%d" % (rnd.choice(b"aq\xe0"), rnd.randrange(3000))
                    batch[k] = b"r%d-b%d-" % (round_, burst) + k
                items = list(batch.items())
                results = kv.pipeline([(c.SET, lambda cid, k=k, v=v: c.encode_set(cid, k, v)) for k, v in items])
                assert results == [None] * len(items)
                acked.update(batch)
                if rnd.random() < 0.3:
                    gone = rnd.sample(sorted(acked), 50)
                    kv.pipeline([(c.REMOVE, lambda cid, k=k: c.encode_remove(cid, k)) for k in gone])
                    for k in gone:
                        acked.pop(k)
        node.kill9()
        node.start()
        with BlockingKvClient(*node.address("kv")) as kv:
            ks = sorted(acked)
            got = kv.pipeline([(c.GET, lambda cid, k=k: c.encode_get(cid, k)) for k in ks])
            assert got == [acked[k] for k in ks]
            assert [k for p in kv.iter_scan(c.GET_KEYS, page=1024) for k in p.keys] == ks
