"""Where the ``sbp`` source reads in a cluster (CONTRACT §9 Reads): which replica serves each
(stream, range) partition, and a FETCH loop that moves to another replica when one is down or
behind. (A stream's ranges with its tail as the open range's replicas know it:
``BlockingSbpClient.current_ranges``.)

Plain blocking code over ``BlockingSbpClient`` (no Spark, no reactor): the driver plans with it,
the Python workers read with it. On a single node every list below has one address, the node's.
"""

import time
import zlib

from protocols.sbp import codec
from protocols.sbp.client import BlockingSbpClient, SbpConnectionError, SbpError

# read_from: "replicas" spreads partitions over the live replicas of their range; "endpoint"
# sends every FETCH to the node the source was given (which serves or redirects it)
READ_FROM = ("replicas", "endpoint")
# A partition's FETCH that finds no replica able to serve its offset waits this long between
# rounds (a replica behind the confirm offset catches up within milliseconds, a failover in ~3 s)
RETRY_PAUSE = 0.1
# Every replica answering OFFSET_OUT_OF_RANGE this many rounds running: the offset is gone
# (trimmed or the stream deleted), not merely not confirmed there yet
OUT_OF_RANGE_ROUNDS = 3


def split_address(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def range_end(r) -> int:
    """A range's end as known: its end offset if sealed, else its next offset."""
    return r["next_offset"] if r["end_offset"] < 0 else r["end_offset"]


def bounds(ranges):
    """A stream's (earliest, tail) from its LIST_RANGES entries."""
    if not ranges:
        return 0, 0
    return min(r["start_offset"] for r in ranges), max(range_end(r) for r in ranges)


def live_addresses(client) -> set:
    """The SBP addresses of the cluster's live members (a single node: itself)."""
    return {n["advertise_addr"] for n in client.live_members() if n["advertise_addr"]}


def replica_addresses(r, live) -> list:
    """The range's servers that are live members, primary first."""
    servers = sorted(r["servers"], key=lambda s: not s["is_primary"])
    return [s["advertise_addr"] for s in servers if s["advertise_addr"] in live]


class Spreader:
    """Chooses the replica each partition reads from: the live replica of its range with the
    fewest records planned so far (ties: by a hash of stream and range, so equal streams do not
    all start on the same node)."""

    def __init__(self, live, endpoint, read_from="replicas"):
        if read_from not in READ_FROM:
            raise ValueError("read_from must be one of %s, got %r" % ("/".join(READ_FROM), read_from))
        self.live = live
        self.endpoint = endpoint
        self.read_from = read_from
        self.load = {}

    def servers(self, r, lo, hi) -> list:
        """The addresses to try for ``[lo, hi)`` of range ``r``, the chosen one first; the endpoint
        last (it redirects to a replica if it holds none)."""
        if self.read_from == "endpoint":
            return [self.endpoint]
        replicas = replica_addresses(r, self.live)
        if not replicas:
            return [self.endpoint]
        turn = zlib.crc32(b"%d/%d" % (r["stream_id"], r["range_index"])) % len(replicas)
        rotated = replicas[turn:] + replicas[:turn]
        chosen = min(rotated, key=lambda a: self.load.get(a, 0))
        self.load[chosen] = self.load.get(chosen, 0) + (hi - lo)
        order = [chosen] + [a for a in rotated if a != chosen]
        if self.endpoint not in order:
            order.append(self.endpoint)
        return order


class ReplicaReader:
    """FETCHes of one partition over its replicas: the first address while it serves, the next
    one when it is unreachable or has not confirmed the offset yet (CONTRACT §9: a replica
    serves up to the confirm offset it has learned), until ``timeout`` passes without progress."""

    def __init__(self, addresses, timeout):
        self.addresses = list(addresses)
        self.timeout = timeout
        self.at = 0
        self.clients = {}

    @property
    def address(self):
        return self.addresses[self.at]

    def _client(self, address):
        c = self.clients.get(address)
        if c is None:
            host, port = split_address(address)
            # follow_cluster: a node that holds no replica of the open range names one
            c = self.clients[address] = BlockingSbpClient(host, port, timeout=self.timeout, follow_cluster=True)
        return c

    def _drop(self, address):
        c = self.clients.pop(address, None)
        if c is not None:
            c.close()

    def fetch(self, sid, offset, batch_max_bytes):
        """Whole batches from ``offset`` (non-empty), from the first replica that has them."""
        deadline = time.monotonic() + self.timeout
        misses = 0
        out_of_range = 0
        last = None
        while True:
            address = self.address
            # after a whole round without data, long-poll: the replica answers when it has it
            wait_ms = 0 if misses < len(self.addresses) else 500
            try:
                buf = self._client(address).fetch(sid, offset, batch_max_bytes=batch_max_bytes, max_wait_ms=wait_ms)
                if buf:
                    return buf
                out_of_range = 0
                last = None  # NO_NEW_RECORD: not confirmed here yet
            except SbpConnectionError as e:
                self._drop(address)
                last = e
            except SbpError as e:
                if e.code != codec.OFFSET_OUT_OF_RANGE:
                    raise
                out_of_range += 1
                last = e
                if out_of_range >= OUT_OF_RANGE_ROUNDS * len(self.addresses):
                    raise
            misses += 1
            if time.monotonic() > deadline:
                if last is not None:
                    raise last
                raise RuntimeError("sbp: no replica of stream %d (%s) served offset %d within %.0f s"
                                   % (sid, ", ".join(self.addresses), offset, self.timeout))
            self.at = (self.at + 1) % len(self.addresses)
            if self.at == 0 and wait_ms == 0:
                time.sleep(RETRY_PAUSE)

    def close(self):
        for address in list(self.clients):
            self._drop(address)
