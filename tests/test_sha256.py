"""The multi-buffer SHA-256 (storage/sha256_kernel.py, storage/sha256.py) against hashlib."""

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import sha256
from storage.jit import import_compiled

kernel_mod, _why = import_compiled("storage.sha256_kernel")
needs_kernel = pytest.mark.skipif(kernel_mod is None, reason="numba kernel not importable: %s" % _why)

EDGES = [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 1000, 4096, 65536]


def kernel_digests(bufs, length):
    arrays = [np.frombuffer(b, np.uint8) for b in bufs]
    addrs = np.array([a.ctypes.data for a in arrays], np.uint64)
    out = np.empty((len(bufs), 32), np.uint8)
    kernel_mod.sha256_lanes(addrs, length, out)
    return [bytes(r) for r in out]


@needs_kernel
def test_kernel_known_vectors():
    # FIPS 180-4 examples
    assert kernel_digests([b"abc"], 3)[0].hex() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    two = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
    assert kernel_digests([two], len(two))[0].hex() == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
    assert kernel_digests([b""], 0)[0].hex() == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    million = b"a" * 1000000
    assert kernel_digests([million] * 9, len(million)) == [hashlib.sha256(million).digest()] * 9


@needs_kernel
@pytest.mark.parametrize("length", EDGES)
@pytest.mark.parametrize("lanes", [1, 7, 8, 9, 16, 17, 24, 31, 32, 33, 65])
def test_kernel_lengths_and_lane_counts(length, lanes):
    bufs = [os.urandom(length) for _ in range(lanes)]
    assert kernel_digests(bufs, length) == [hashlib.sha256(b).digest() for b in bufs]


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(st.sampled_from(EDGES) | st.integers(0, 3000), st.integers(1, 40), st.randoms(use_true_random=False))
def test_kernel_equals_hashlib(length, lanes, rnd):
    bufs = [bytes(rnd.getrandbits(8) for _ in range(length)) for _ in range(lanes)]
    assert kernel_digests(bufs, length) == [hashlib.sha256(b).digest() for b in bufs]


@needs_kernel
def test_kernel_reads_views_at_any_offset():
    # chunks are views into a received read or a source block: unaligned starts, a shared buffer
    block = os.urandom(33 * 1000 + 5)
    view = memoryview(block)
    bufs = [view[5 + 1000 * i : 5 + 1000 * i + 997] for i in range(33)]
    assert kernel_digests(bufs, 997) == [hashlib.sha256(b).digest() for b in bufs]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0, 55, 56, 64, 65, 300, 4096]) | st.integers(0, 200), max_size=50), st.randoms(use_true_random=False))
def test_digests_mixed_lengths_equal_hashlib(lengths, rnd):
    sha256.start_loading()
    assert sha256.wait_loaded(120)
    datas = []
    for n in lengths:
        b = bytes(rnd.getrandbits(8) for _ in range(n))
        datas.append(b if rnd.random() < 0.5 else memoryview(bytearray(b)))
    assert sha256.digests(datas) == [hashlib.sha256(d).digest() for d in datas]


def test_digests_uses_the_kernel_on_this_machine_when_it_pays():
    sha256.start_loading()
    assert sha256.wait_loaded(120)
    if kernel_mod is not None and sha256.state != "multi-buffer":
        # only a CPU with SHA extensions, without AVX2, or a measured loss keeps hashlib
        assert sha256.why
    datas = [os.urandom(65536) for _ in range(20)] + [os.urandom(100)]
    assert sha256.digests(datas) == [hashlib.sha256(d).digest() for d in datas]


@pytest.mark.parametrize("more", [False, True])
def test_gatherer_answers_every_batch_with_its_own_digests(more):
    from twisted.internet import defer

    sha256.start_loading()
    assert sha256.wait_loaded(120)
    jobs = []
    g = sha256.Gatherer(lambda fn: jobs.append(fn) or defer.maybeDeferred(fn), max_jobs=2, wait=0.005)
    batches = [[os.urandom(n) for _ in range(k)] for n, k in ((65536, 3), (100, 1), (65536, 20), (0, 2), (4096, 40))]
    results = []
    for b in batches:
        g.submit(b, more=more).addCallback(results.append)
    assert results == [[hashlib.sha256(x).digest() for x in b] for b in batches]
    assert g.queue == [] and g.queued == 0 and g.jobs == 0


def test_digests_of_views_with_wide_items():
    sha256.start_loading()
    assert sha256.wait_loaded(120)
    raw = os.urandom(4096 * 10)
    wide = [memoryview(raw[k * 4096 : (k + 1) * 4096]).cast("I") for k in range(10)]  # len() counts items
    datas = wide + [raw[:100]]
    assert sha256.digests(datas) == [hashlib.sha256(d).digest() for d in datas]
