"""A longer fuzz campaign for SBP than the suite runs (issue 4).

    python bench/fuzz_sbp.py [--examples 20000]

1. the frame decoder (FrameBuffer) over random bytes and mutated valid frames, fed in random chunks;
2. every header table's decoder over garbage and over mutated valid tables;
3. the server protocol (real store in a temp dir, StringTransport) fed random frame sequences:
   mutated APPEND/FETCH/admin requests with valid framing. It must never raise out of dataReceived,
   every reply must be a well-formed frame, and the connection must stay usable (a PING at the end
   is answered) unless the server sent GOAWAY and closed for a bad frame_length.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from protocols.sbp import codec  # noqa: E402
from storage import record_batch  # noqa: E402

ROOTS = sorted({t for _, req, resp in codec.OPCODES.values() for t in (req, resp) if t} | {"SystemErrorResponse"})


def mutate(data, draw):
    buf = bytearray(data)
    for _ in range(draw(st.integers(0, 6))):
        if not buf:
            break
        op = draw(st.integers(0, 2))
        i = draw(st.integers(0, len(buf) - 1))
        if op == 0:
            buf[i] = draw(st.integers(0, 255))
        elif op == 1:
            del buf[i:i + draw(st.integers(1, 8))]
        else:
            buf[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(buf)


def sample_requests(sid):
    b = record_batch.encode([(1, [(b"h", b"v")], b"body")])
    T = codec.T
    return [
        (codec.APPEND, "AppendRequest", T.AppendRequest(0, [T.AppendInfo(sid, 0, len(b))]), b),
        (codec.FETCH, "FetchRequest", T.FetchRequest(0, 1, [T.FetchInfo(sid, 0, 0, 1000)]), b""),
        (codec.FETCH, "FetchRequest", T.FetchRequest(5, 1, [T.FetchInfo(sid, 0, 1 << 40, 10)]), b""),
        (codec.LIST_RANGES, "ListRangesRequest", T.ListRangesRequest(0, [T.RangeOwner(sid, None)]), b""),
        (codec.SEAL_RANGES, "SealRangesRequest", T.SealRangesRequest(0, [T.RangeId(sid, 0)]), b""),
        (codec.TRIM_STREAMS, "TrimStreamsRequest", T.TrimStreamsRequest(0, [T.TrimmedStream(sid, 1)]), b""),
        (codec.DESCRIBE_STREAMS, "DescribeStreamsRequest", T.DescribeStreamsRequest(0, [sid, 3]), b""),
        (codec.CREATE_RANGE, "CreateRangeRequest", T.CreateRangeRequest(0, T.Range(sid, 0, 0, 0, -1, [])), b""),
        (codec.HEARTBEAT, "HeartbeatRequest", T.HeartbeatRequest("c", 2, None), b""),
        (codec.PING, None, None, b"ping"),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=20000)
    args = ap.parse_args()
    cfg = dict(max_examples=args.examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)

    # 1. frame decoder
    t0 = time.monotonic()
    count = [0]

    @settings(**cfg)
    @given(data=st.data())
    def frames(data):
        count[0] += 1
        base = codec.encode_frame(data.draw(st.sampled_from(sorted(codec.OPCODES))), data.draw(st.integers(0, 7)),
                                  data.draw(st.integers(0, 2**32 - 1)), data.draw(st.binary(max_size=40)), data.draw(st.binary(max_size=40)))
        wire = mutate(base * data.draw(st.integers(1, 3)), data.draw) + data.draw(st.binary(max_size=30))
        fb = codec.FrameBuffer()
        pos = 0
        while pos < len(wire):
            n = data.draw(st.integers(1, 64))
            fb.feed(wire[pos:pos + n])
            pos += n
            while True:
                try:
                    f = fb.next()
                except codec.FrameLengthError:
                    return
                except codec.FrameError:
                    continue
                if f is None:
                    break
                assert codec.decode(codec.encode(f)) == f

    frames()
    print("frame decoder: %d cases in %.1fs, no crash" % (count[0], time.monotonic() - t0))

    # 2. header decoders
    t0 = time.monotonic()
    count[0] = 0
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from test_sbp_codec import table_strategy

    @settings(**cfg)
    @given(data=st.data())
    def headers(data):
        count[0] += 1
        name = data.draw(st.sampled_from(ROOTS))
        if data.draw(st.booleans()):
            buf = data.draw(st.binary(max_size=300))
        else:
            buf = mutate(codec.encode_table(name, data.draw(table_strategy(name))), data.draw)
        try:
            codec.decode_table(name, buf)
        except codec.HeaderDecodeError:
            pass

    headers()
    print("header decoders: %d cases in %.1fs, no crash" % (count[0], time.monotonic() - t0))

    # 3. the server protocol over a real store
    from twisted.internet import reactor
    from twisted.internet.testing import StringTransport

    from protocols.sbp import server
    from storage import Store

    class Node:
        def __init__(self, store):
            self.store = store
            self.config = type("C", (), {"max_batch_bytes": 1 << 20})()
            self.node_id = 1
            self.reactor = reactor
            self.metrics = {}

        def advertised(self, name):
            return "127.0.0.1:1"

        def on_shutdown(self, fn):
            pass

    from twisted.logger import globalLogPublisher

    failures = []
    # a caught bug still logs a failure: the campaign fails on any
    globalLogPublisher.addObserver(lambda e: failures.append(e) if e.get("log_failure") is not None else None)
    tmp = tempfile.mkdtemp(prefix="fuzz-sbp-")
    store = Store.open(os.path.join(tmp, "store"), fsync="never", reactor=reactor, node_id=1)
    results = {}

    def run_protocol_phase():
        d = store.log.create_stream()

        def go(meta):
            sid = meta.stream_id
            samples = sample_requests(sid)
            t0 = time.monotonic()
            n = [0]

            @settings(**dict(cfg, max_examples=min(args.examples, 5000)))
            @given(data=st.data())
            def proto(data):
                n[0] += 1
                p = server.SbpServerFactory(Node(store)).buildProtocol(None)
                tr = StringTransport()
                p.makeConnection(tr)
                wire = b""
                for _ in range(data.draw(st.integers(1, 5))):
                    op, table, obj, payload = data.draw(st.sampled_from(samples))
                    header = codec.encode_table(table, obj) if table else b""
                    frame = codec.encode_frame(op, 0, data.draw(st.integers(0, 2**32 - 1)), header, payload)
                    wire += mutate(frame, data.draw) if data.draw(st.booleans()) else frame
                wire += codec.encode_frame(codec.PING, 0, 4242)
                pos = 0
                while pos < len(wire):
                    k = data.draw(st.integers(1, 200))
                    p.dataReceived(wire[pos:pos + k])
                    pos += k
                fb = codec.FrameBuffer()
                fb.feed(tr.value())
                while (f := fb.next()) is not None:
                    if f.flags & codec.FLAG_RESPONSE and f.header and f.opcode != codec.PING:
                        codec.decode_header(f)
                p.connectionLost(None)

            proto()
            results["cases"] = n[0]
            results["seconds"] = time.monotonic() - t0

        d.addCallback(go)
        d.addBoth(lambda r: (results.setdefault("error", r) if hasattr(r, "value") else None, store.close().addBoth(lambda _: reactor.stop())))

    reactor.callWhenRunning(run_protocol_phase)
    try:
        reactor.run()
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if "error" in results:
        results["error"].raiseException()
    if failures:
        f = failures[0]
        raise SystemExit("logged failure: %s\n%s" % (f.get("log_format"), f["log_failure"].getTraceback()))
    print("server protocol: %d frame sequences in %.1fs, no exception out of dataReceived" % (results["cases"], results["seconds"]))


if __name__ == "__main__":
    main()
