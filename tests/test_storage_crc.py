"""storage/crc: crc32 and crc32_held equal zlib.crc32; crc32_combine (zlib-ng's, libz's through ctypes and the pure-Python fallback) equals zlib.crc32 of A + B."""

import zlib

import pytest

from storage import crc

CASES = [(b"", b""), (b"a", b""), (b"", b"x"), (b"ab", b"cd"), (bytes(range(256)) * 3, b"\x00" * 4097),
         (b"header" * 5, bytes(range(251)) * 4096)]


@pytest.mark.parametrize("a,b", CASES)
def test_combine_equals_crc_of_the_concatenation(a, b):
    want = zlib.crc32(a + b)
    assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
    assert crc._crc32_combine_py(zlib.crc32(a), zlib.crc32(b), len(b)) == want
    libz = crc._load_crc32_combine()
    if libz is not None:
        assert libz(zlib.crc32(a), zlib.crc32(b), len(b)) == want


@pytest.mark.parametrize("size", [0, 1, 29, 4095, 4096, 4097, 5119, 5120, 5121, 8192, 10240, 65536 + 7, 1 << 20])
@pytest.mark.parametrize("start", [0, 0xDEADBEEF])
def test_crc32_and_crc32_held_are_zlibs(size, start):
    """The zlib-ng CRC and the GIL-keeping sliced one give zlib's values, over bytes, bytearrays
    and memoryview slices, with a running value."""
    data = bytes(range(251)) * (size // 251 + 1)
    data = data[:size]
    want = zlib.crc32(data, start)
    for form in (data, bytearray(data), memoryview(b"xx" + data)[2:]):
        assert crc.crc32(form, start) == want
        assert crc.crc32_held(form, start) == want


@pytest.mark.parametrize("parts", [(b"head", b"x" * 70000), (b"a", b"", b"bc", b"records" * 9), (b"", b"z")])
def test_a_wal_entry_crc_with_its_last_parts_crc_given_is_the_same(parts):
    # the store passes a record batch's checked records-block CRC instead of reading it again
    from storage.wal import T_BATCH, entry_crc

    assert entry_crc(4096, T_BATCH, parts, tail_crc=zlib.crc32(parts[-1])) == entry_crc(4096, T_BATCH, parts)


def test_crc32_held_keeps_the_gil():
    """crc32_held's slices stay at or below the size from which the binding releases the GIL (a
    release would let the store's other thread take the GIL for up to the switch interval): a
    thread spinning in Python makes no progress while the main thread runs crc32_held over 64 KiB
    batches (with 5 KiB + 1 byte slices it does: the test fails)."""
    import sys
    import threading
    import time

    data = bytes(range(251)) * 262  # ~64 KiB
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    old = sys.getswitchinterval()
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        while count[0] == 0:
            threading.Event().wait(0.001)
        # from here the spinner runs only while this thread releases the GIL, or after it has held
        # it for 0.5 s (100 calls take ~1.5 ms); the sleep lets a forced switch of the old 5 ms
        # interval (the spinner's wait may have begun before the change) happen before measuring
        sys.setswitchinterval(0.5)
        time.sleep(0.02)
        before = count[0]
        for _ in range(100):
            crc.crc32_held(data)
        held = count[0] - before
    finally:
        stop[0] = True
        sys.setswitchinterval(old)
        spinner.join()
    assert held == 0
