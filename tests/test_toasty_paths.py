"""The one Toasty path rule (CONTRACT §5)."""

import pytest
from hypothesis import given, strategies as st

from protocols.toasty.paths import InvalidPath, normalize, split_list_path


@pytest.mark.parametrize(
    "raw,expected",
    [
        (b"", ()),
        (b"/", ()),
        (b"a", (b"a",)),
        (b"/a", (b"a",)),
        (b"a/", (b"a",)),
        (b"/a/b/", (b"a", b"b")),
        ("/ünï/cödé", ("ünï".encode(), "cödé".encode())),
        (b"/.hidden/x..y", (b".hidden", b"x..y")),
    ],
)
def test_valid(raw, expected):
    assert normalize(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [b"//", b"a//b", b"/a/./b", b"..", b"/..", b"/a/../../etc/passwd", b"./a", b"a/..", b"a\x00b", b"///a", b"a" * 256],
)
def test_invalid(raw):
    with pytest.raises(InvalidPath) as e:
        normalize(raw)
    assert str(e.value).startswith("Invalid path")


def test_list_continuation():
    assert split_list_path(b"dir/\x00after") == ((b"dir",), b"after")
    assert split_list_path(b"/\x00x") == ((), b"x")
    assert split_list_path(b"\x00") == ((), b"")
    assert split_list_path(b"/d") == ((b"d",), None)


@given(st.binary(max_size=300))
def test_never_escapes_root(raw):
    try:
        parts = normalize(raw)
    except InvalidPath:
        return
    for p in parts:
        assert p not in (b"", b".", b"..") and b"/" not in p and b"\x00" not in p
