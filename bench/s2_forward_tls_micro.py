"""The S2 forwarder's hop alone, plain HTTP against mutual TLS (docs/benchmarks.md, "S2 forwarding
with and without the cluster's mutual TLS"): CPU per request of protocols/s2/forward.py's
``Forwarder`` (twisted.web Agent, persistent pool) posting a 200-byte body to a twisted.web site
that answers 60 bytes, both ends in this one process, over loopback; with --rounds pairs of
runs alternating plain and TLS (node/cluster/tls.py's ``listen`` and ``client_options_for`` with
a test CA from tests/tlscerts.py). The connection is made and warmed before timing, as the
forwarder's pool keeps it.

    python bench/s2_forward_tls_micro.py [--requests 2000] [--rounds 4]
"""

import argparse
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Request:
    """What the forwarder reads of a client request."""

    def __init__(self, path):
        self.headers = {"content-type": "application/json"}
        self.raw_path = path
        self.method = "POST"


async def run(reactor, n, paths):
    from twisted.web import resource as web_resource, server

    from node.cluster import tls
    from protocols.s2.forward import Forwarder

    class Answer(web_resource.Resource):
        isLeaf = True

        def render_POST(self, request):
            request.content.read()
            return b"x" * 60

    port = tls.listen(reactor, server.Site(Answer()), "127.0.0.1", paths)
    forwarder = Forwarder(reactor, tls=tls.client_options_for(*paths) if paths else None)
    address = "127.0.0.1:%d" % port.getHost().port
    body = b"y" * 200

    async def one():
        response = await forwarder.request(address, Request("/v1/streams/s/records"), body)
        await forwarder.content(response)

    for _ in range(50):
        await one()
    c0, t0 = cpu(), time.perf_counter()
    for _ in range(n):
        await one()
    used, took = cpu() - c0, time.perf_counter() - t0
    await forwarder.close()
    await port.stopListening()
    return used / n * 1e6, took / n * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from twisted.internet import defer, reactor

    from tests.tlscerts import CA

    async def all_rounds(directory):
        ca = CA(directory)
        cert, key = ca.issue("node")
        print("load average before: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
        for _ in range(args.rounds):
            for paths in (None, (cert, key, ca.path)):
                used, took = await run(reactor, args.requests, paths)
                print("%-5s CPU %7.1f us/request  wall %7.1f us/request" % ("tls" if paths else "plain", used, took),
                      flush=True)
        print("load average after: %.2f %.2f %.2f" % os.getloadavg())

    with tempfile.TemporaryDirectory() as directory:
        d = defer.ensureDeferred(all_rounds(directory))
        d.addErrback(lambda f: f.printTraceback())
        d.addBoth(lambda _: reactor.stop())
        reactor.run()


if __name__ == "__main__":
    main()
