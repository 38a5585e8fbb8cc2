"""Toasty client checks against a lying chunk server (a socket thread that answers wrongly)."""

import hashlib
import socket
import threading

import pytest

from protocols.toasty import codec
from protocols.toasty.client import BlockingToastyClient, FileState, ToastyError, aligned, plan_uploads


class LyingChunkServer:
    """Answers every DOWNLOAD_CHUNK with ``data`` and every CREATE_CHUNK with ``hash``."""

    def __init__(self, data=b"not what you asked for", hash_=b"\x07" * 32):
        self.data, self.hash = data, hash_
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.address = self.sock.getsockname()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            buf = b""
            while True:
                try:
                    more = conn.recv(1 << 16)
                except OSError:
                    return
                if not more:
                    return
                buf += more
                while len(buf) >= 8:
                    _, mtype, length = codec.HEADER.unpack_from(buf, 0)
                    if len(buf) < length:
                        break
                    buf = buf[length:]
                    reply = codec.DownloadChunkSuccess(self.data) if mtype == codec.DOWNLOAD_CHUNK else codec.CreateChunkSuccess(self.hash)
                    conn.sendall(codec.encode(reply))

    def close(self):
        self.sock.close()


@pytest.fixture
def liar():
    s = LyingChunkServer()
    yield s
    s.close()


def client_without_meta():
    c = BlockingToastyClient.__new__(BlockingToastyClient)
    c.meta = None
    c._pool = None
    c.timeout = 5
    c.parallel = 4
    c._chunk_conns = {}
    return c


def test_download_with_a_wrong_hash_is_refused(liar):
    c = client_without_meta()
    h = hashlib.sha256(b"the real chunk").digest()
    rs = codec.ReadSuccess(5, 4096, 100, [codec.ReadChunk(h, [codec.AddrList([liar.address])])], [])
    sunk = []
    with pytest.raises(ToastyError, match="failed its hash check"):
        c._download_piece(rs, 0, sunk.append, verify=True)
    assert sunk == []  # nothing unverified reaches the sink
    c._chunk_conns.clear()


def test_upload_answered_with_a_wrong_hash_is_refused(liar):
    c = client_without_meta()
    state = FileState(5, 4096, write_locations=[liar.address])
    planned = plan_uploads(state, 0, 4096, lambda lo, hi: b"x" * (hi - lo), False)
    with pytest.raises(ToastyError, match="returned hash"):
        c._upload_all(planned, [])


def test_plan_uploads_picks_create_or_patch():
    h_old = hashlib.sha256(b"old").digest()
    holder = ("127.0.0.1", 1)
    state = FileState(9, 16, first=0, hashes=[h_old, h_old, codec.ZERO_HASH], holders=[[holder]] * 3, write_locations=[holder])
    data = bytes(range(40))
    ups = list(plan_uploads(state, 4, 40, lambda lo, hi: data[lo - 4 : hi - 4], False))
    # chunk 0: starts at 4 inside an existing chunk -> patch; chunk 1: whole -> create;
    # chunk 2: a hole -> create (zero-padded)
    assert [type(u.msg).__name__ for u in ups] == ["UploadChunk", "CreateChunk", "CreateChunk"]
    assert ups[0].msg.offset == 4 and ups[0].expected is None and ups[0].targets == [holder]
    assert ups[1].expected == hashlib.sha256(data[12:28]).digest()
    assert ups[2].expected == hashlib.sha256(data[28:40] + bytes(4)).digest()
    # with truncation, the last (partial) chunk is fully known, so it is created, not patched
    state.hashes = [h_old] * 3
    ups = list(plan_uploads(state, 16, 20, lambda lo, hi: data[lo - 16 : hi - 16], True))
    assert [type(u.msg).__name__ for u in ups] == ["CreateChunk", "CreateChunk"]
    assert ups[1].expected == hashlib.sha256(data[16:20] + bytes(12)).digest()


def test_aligned_read_range():
    assert aligned(10, 10, 16) == (0, 32)
    assert aligned(16, 16, 16) == (16, 16)
    assert aligned(5, 0, None) == (5, 0)
