"""A small blocking stream! client for scripts, tests and benchmarks (the node's own syncer is
protocols/swarm/syncer.py)."""

import hashlib

from protocols import client_socket
from protocols.swarm import codec
from protocols.swarm.codec import (
    BatchDone,
    ChunkDelivery,
    GetRange,
    OfferedHashes,
    StreamInfoReq,
    StreamInfoRes,
    StreamState,
    WantedHashes,
)


class SwarmError(Exception):
    pass


class BlockingSwarmClient:
    def __init__(self, host, port, timeout=10.0, tls_ca=None):
        self.sock = client_socket.connect(host, port, timeout, tls_ca)
        self.reader = codec.FrameReader()
        self.pending = []
        self.ruid = 0

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, msg):
        self.sock.sendall(codec.encode(msg))

    def recv(self):
        while not self.pending:
            data = self.sock.recv(1 << 20)
            if not data:
                raise SwarmError("connection closed by the node")
            self.pending += [codec.decode_body(b) for b in self.reader.feed(data)]
        return self.pending.pop(0)

    def stream_info(self, ids=(codec.CHUNKS_ID, codec.ALL_LOGS_ID)):
        """{ID: cursor} for the given IDs."""
        self.send(StreamInfoReq(list(ids)))
        msg = self.recv()
        if not isinstance(msg, StreamInfoRes):
            raise SwarmError("expected StreamInfoRes, got %r" % (msg,))
        return {d.stream: d.cursor for d in msg.streams}

    def get_range(self, stream, from_, to=None, batch_size=1024, roundtrip=True, want=lambda h: True):
        """One batch: (last, offered hashes or None, [(addr, data)]). ``want(hash)`` picks."""
        self.ruid += 1
        ruid = self.ruid
        self.send(GetRange(ruid, stream, from_, to, batch_size, roundtrip))
        offered = None
        items = []
        while True:
            msg = self.recv()
            if isinstance(msg, StreamState):
                raise SwarmError("StreamState %d %s" % (msg.code_, msg.message))
            if isinstance(msg, OfferedHashes):
                offered = msg.hash_list()
                self.send(WantedHashes(ruid, codec.bitvector_encode([want(h) for h in offered])))
            elif isinstance(msg, ChunkDelivery):
                for addr, data in msg.chunks:
                    if hashlib.sha256(data).digest() != addr:
                        raise SwarmError("hash mismatch")
                items.extend(msg.chunks)
            elif isinstance(msg, BatchDone):
                return msg.last, offered, items

    def hashes(self, stream, cursor):
        """Every hash of a stream up to cursor, in index order (roundtrip, wanting nothing)."""
        out = []
        pos = 1
        while pos <= cursor:
            last, offered, _ = self.get_range(stream, pos, cursor, 1024, True, want=lambda h: False)
            out += offered or []
            pos = last + 1
        return out
