"""The record body of a key-value partition's replicated stream (node/cluster/kv_log.py): byte vectors."""

import pytest

from node.cluster import kv_log


def test_set_and_remove_encode_to_known_bytes():
    body = kv_log.encode_ops([(b"ab", b"xyz"), (b"c", None)])
    assert body == bytes.fromhex("01" "0002" "6162" "00000003" "78797a" "02" "0001" "63")
    assert kv_log.decode_ops(body) == [(b"ab", b"xyz"), (b"c", None)]
    assert kv_log.op_size(b"ab", b"xyz") == 12 and kv_log.op_size(b"c", None) == 4


def test_empty_value_and_empty_body():
    assert kv_log.decode_ops(kv_log.encode_ops([(b"k", b"")])) == [(b"k", b"")]
    assert kv_log.decode_ops(b"") == []


@pytest.mark.parametrize("body", [
    bytes.fromhex("01"),  # header cut
    bytes.fromhex("010005" "6162"),  # key runs past
    bytes.fromhex("010001" "61" "0000"),  # value length cut
    bytes.fromhex("010001" "61" "00000009" "78"),  # value runs past
    bytes.fromhex("030001" "61"),  # unknown op
])
def test_bad_bodies_are_refused(body):
    with pytest.raises(kv_log.BadOps):
        kv_log.decode_ops(body)
