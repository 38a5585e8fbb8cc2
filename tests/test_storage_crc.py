"""storage/crc: crc32_combine (libz and the pure-Python fallback) equals zlib.crc32 of A + B."""

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
