"""The one framer (protocols/framing.py) and every protocol's layout over it: byte at a time, many
frames per read, frames cut anywhere, limits checked before the body, garbage refused cleanly."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols import framing
from protocols.framing import Framer, FrameRefused, Layout, read_frame
from protocols.partition import codec as kv_codec
from protocols.s2 import codec as s2_codec
from protocols.sbp import codec as sbp_codec
from protocols.swarm import codec as swarm_codec
from protocols.toasty import codec as toasty_codec

U32 = struct.Struct(">I")
# u32 length of the body after it, bodies up to 1000 bytes
SIMPLE = Layout(U32, 0, 4, 0, 1000)


def frame(body: bytes) -> bytes:
    return U32.pack(len(body)) + body


def drain(framer):
    return [bytes(buf[start:end]) for buf, start, end in framer.spans()]


bodies = st.lists(st.binary(max_size=300), min_size=1, max_size=20)


@given(bodies, st.data())
def test_frames_cut_anywhere_come_out_whole_and_in_order(items, data):
    wire = b"".join(frame(b) for b in items)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    framer = Framer(SIMPLE)
    got = []
    prev = 0
    for cut in cuts + [len(wire)]:
        framer.feed(wire[prev:cut])
        prev = cut
        got += drain(framer)
    assert got == [frame(b) for b in items]
    assert framer.buffered() == 0


def test_byte_at_a_time():
    items = [b"", b"a", b"bc" * 100, b"\x00" * 7]
    wire = b"".join(frame(b) for b in items)
    framer = Framer(SIMPLE)
    got = []
    for i in range(len(wire)):
        framer.feed(wire[i:i + 1])
        got += drain(framer)
    assert got == [frame(b) for b in items]


def test_many_frames_per_read_are_spans_of_that_read():
    read = b"".join(frame(bytes([i]) * i) for i in range(50))
    framer = Framer(SIMPLE)
    framer.feed(read)
    spans = list(framer.spans())
    assert len(spans) == 50
    assert all(buf is read for buf, _, _ in spans)  # decoded where they lie: no copy
    assert [bytes(b[s:e]) for b, s, e in spans] == [frame(bytes([i]) * i) for i in range(50)]


def test_a_cut_frame_is_joined_once_with_a_small_rest_of_its_last_read():
    first, second = frame(b"x" * 500), frame(b"y" * 10)
    wire = first + second
    framer = Framer(SIMPLE)
    framer.feed(wire[:100])
    assert framer.next() is None
    framer.feed(wire[100:300])
    assert framer.next() is None
    framer.feed(wire[300:])
    buf, s, e = framer.next()
    assert buf[s:e] == first and (s, e) == (0, len(first))
    assert framer.rest() == (buf, e)  # the frames after it lie in the same buffer
    buf2, s, e = framer.next()
    assert buf2 is buf and buf[s:e] == second


def test_a_big_rest_of_a_read_is_not_copied_for_one_cut_frame():
    layout = Layout(U32, 0, 4, 0, 1 << 20)
    first, rest = U32.pack(500) + b"x" * 500, b"".join(U32.pack(60000) + b"y" * 60000 for _ in range(2))
    framer = Framer(layout)
    framer.feed(first[:100])
    last = first[100:] + rest
    framer.feed(last)
    buf, s, e = framer.next()
    assert buf[s:e] == first and (s, e) == (0, len(first))
    buf, s, e = framer.next()
    assert buf is last and buf[s:e] == rest[:60004]


def test_next_pieces_hands_a_cut_frame_over_in_its_pieces():
    f = Framer(Layout(struct.Struct(">I"), 0, 4))
    frame = struct.pack(">I", 10) + b"0123456789"
    small = struct.pack(">I", 1) + b"x"
    f.feed(small + frame[:6])
    f.feed(frame[6:9])
    assert f.next_pieces() == (f._buf, 0, 5)  # inside one read: a span, as next gives it
    assert f.next_pieces() is None  # not all in yet
    f.feed(frame[9:] + small)
    buf, pieces, size = f.next_pieces()
    assert buf is None and size == 14 and b"".join(pieces) == frame and len(pieces) == 3
    assert all(type(p) is memoryview for p in pieces)  # not joined
    b, start, end = f.next_pieces()
    assert b[start:end] == small
    assert f.next_pieces() is None


def test_length_is_refused_before_the_body_is_buffered():
    framer = Framer(SIMPLE)
    framer.feed(U32.pack(1001)[:3])
    assert framer.next() is None
    framer.feed(U32.pack(1001)[3:])
    with pytest.raises(FrameRefused) as e:
        framer.next()
    assert e.value.length == 1001


def test_rest_and_skip_to_let_a_reader_take_a_run_in_place():
    read = frame(b"a") + frame(b"b") + frame(b"c")
    framer = Framer(SIMPLE)
    framer.feed(read)
    buf, s, e = framer.next()
    assert framer.rest() == (read, e)
    framer.skip_to(e + 5)  # the reader consumed the "b" frame itself
    buf, s, e = framer.next()
    assert buf[s:e] == frame(b"c")


def test_read_frame_blocks_until_a_frame_is_in():
    wire = frame(b"hello") + frame(b"world")
    pieces = [wire[i:i + 3] for i in range(0, len(wire), 3)]
    framer = Framer(SIMPLE)
    recv = lambda n: pieces.pop(0) if pieces else b""  # noqa: E731
    for want in (b"hello", b"world"):
        buf, s, e = read_frame(framer, recv)
        assert buf[s + 4:e] == want
    with pytest.raises(ConnectionError):
        read_frame(framer, recv)


# -- every protocol's layout over random bytes: frames or the protocol's refusal, nothing else ------

LAYOUTS = [
    (sbp_codec.LAYOUT, sbp_codec.FrameError),
    (toasty_codec.Layout(toasty_codec.META_REQUESTS), toasty_codec.CodecError),
    (kv_codec.Layout(), kv_codec.TotalRefused),
    (kv_codec.Layout(kv_codec.HEADER_LEN, 64 << 20, echo_client_id=False), kv_codec.TotalRefused),
    (swarm_codec._Layout(swarm_codec.MAX_FRAME), swarm_codec.FrameTooLarge),
    (s2_codec._S2SLayout(s2_codec.S2S_MAX_FRAME), s2_codec.S2Error),
]


@settings(max_examples=600, deadline=None)
@given(which=st.sampled_from(LAYOUTS), garbage=st.binary(max_size=400), data=st.data())
def test_garbage_is_framed_or_refused_cleanly(which, garbage, data):
    layout, refusal = which
    framer = Framer(layout)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(garbage)), max_size=6)))
    taken = 0
    prev = 0
    try:
        for cut in cuts + [len(garbage)]:
            framer.feed(garbage[prev:cut])
            prev = cut
            for buf, s, e in framer.spans():
                assert 0 <= s < e <= len(buf)
                taken += e - s
    except refusal:
        return
    assert taken + framer.buffered() == len(garbage)


def test_the_sbp_refusal_names_the_opcode_when_its_bytes_are_in():
    framer = sbp_codec.FrameBuffer()
    framer.feed(U32.pack(5) + b"\x01\x00\x03")  # frame_length 5 < 16, magic, opcode 0x0003
    with pytest.raises(sbp_codec.FrameLengthError) as e:
        framer.next()
    assert e.value.opcode == 0x0003


def test_the_kv_server_refusal_waits_for_the_client_id_to_echo_it():
    framer = Framer(kv_codec.Layout())
    framer.feed(struct.pack(">Q", (32 << 20) + 1) + b"\x00" * 7)
    assert framer.next() is None
    framer.feed(b"\x2a")
    with pytest.raises(kv_codec.TotalRefused) as e:
        framer.next()
    assert e.value.client_id == 42
    under = Framer(kv_codec.Layout())
    under.feed(struct.pack(">Q", 7))
    with pytest.raises(kv_codec.TotalRefused) as e:
        under.next()
    assert e.value.client_id is None


def test_framing_module_is_pure():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(framing))
    names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any("twisted" in (m or "") for m in mods | names)
