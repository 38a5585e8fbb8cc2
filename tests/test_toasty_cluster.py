"""Toasty across the cluster (CONTRACT §9): 3 nodes + etcd, the project's clients and a client
that behaves as ToastyFS's own; kill -9 a holder, re-replication, racing WRITEs.

The tests share one cluster and run in file order; the kill test comes last (it changes it)."""

import hashlib
import threading
import time
from contextlib import closing

import pytest
import pytest_twisted

from protocols.sbp.client import BlockingSbpClient, call_status
from protocols.toasty import codec
from protocols.toasty.client import BlockingConnection, BlockingToastyClient, ToastyClient, ToastyError
from tests.etcdproc import EtcdCluster, etcd_available
from tests.test_cluster import start_nodes, wait_for
from tests.nodeproc import NodeProcess

pytestmark = pytest.mark.skipif(not etcd_available(), reason="etcd-server is not installed")

MISSING = codec.MISSING_GENERATION


def blob(n, seed=b"x"):
    out = bytearray()
    block = hashlib.sha256(seed).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block * 64
    return bytes(out[:n])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("toastyc")
    etcd = EtcdCluster(base, members=1).start()
    nodes = []
    try:
        nodes.extend(start_nodes(base, etcd.client_urls, [1, 2, 3]))
        with BlockingToastyClient(*nodes[0].address("meta")) as c:
            c.mkdir("/shared")
        yield base, etcd, nodes
    finally:
        for n in nodes:
            n.kill9()
        etcd.stop()


def meta(node):
    return closing(BlockingConnection(*node.address("meta")))


def holders_of(node, path, offset, length):
    """[[(host, port)]] per chunk of ``path`` in the range as READ on ``node`` lists them."""
    with meta(node) as c:
        rs = c.call(codec.Read(0, path, offset, length))
    assert isinstance(rs, codec.ReadSuccess), rs
    return [[a for h in ch.holders for a in h.addresses()] for ch in rs.chunks]


def test_one_tree_and_r_write_locations(cluster):
    _, _, (a, b, c) = cluster
    with meta(a) as ca, meta(b) as cb:
        r = ca.call(codec.Create(b"/dir", True, 0))
        assert isinstance(r, codec.CreateSuccess), r
        listed = cb.call(codec.List_(0, b"/"))
        assert [(i.name, i.gen, i.is_dir) for i in listed.items][0] == (b"dir", r.gen, True)
        # a missing file: READ_ERROR with R = 3 distinct live chunk listeners
        err = cb.call(codec.Read(0, b"/shared/none", 0, 10))
        assert isinstance(err, codec.ReadError)
        locs = {x for w in err.write_locations for x in w.addresses()}
        assert locs == {n.address("chunks") for n in (a, b, c)}
        again = cb.call(codec.Create(b"/dir", True, 0))
        assert isinstance(again, codec.ErrorReply) and again.message.startswith("File or directory already exists")


def test_tree_semantics_through_any_node(cluster):
    """CONTRACT §5's rules hold in the cluster's tree, whichever node each request goes to."""
    _, _, (a, b, c) = cluster
    with BlockingToastyClient(*a.address("meta")) as ca, BlockingToastyClient(*b.address("meta")) as cb:
        ca.mkdir("/t")
        dir_gen = cb.stat("/t")["gen"]
        data = blob(100_000, b"sem")
        gen = cb.write("/t/f", data)
        assert ca.stat("/t")["gen"] == dir_gen  # a directory keeps its generation
        assert ca.stat("/t/f") == {"is_dir": False, "gen": gen, "chunk_size": 4096, "size": len(data)}
        assert ca.read("/t/f", 5000, 20_000) == data[5000:25_000]
        cb.write("/t/f", b"W", offset=6)
        assert ca.read("/t/f")[:10] == data[:6] + b"W" + data[7:10]
        cb.write("/t/f", b"hello world", truncate=True)
        assert ca.read("/t/f") == b"hello world"
        cb.write("/t/f", b"!", offset=9000)  # a hole in between reads as zeros
        assert ca.read("/t/f") == b"hello world" + bytes(9000 - 11) + b"!"
        # truncation across pages of 256 chunk references: nothing past the new end comes back
        long = blob(700 * 4096 + 5, b"pages")
        cb.write("/t/long", long)
        assert ca.read("/t/long", 256 * 4096 - 10, 20) == long[256 * 4096 - 10 : 256 * 4096 + 10]
        ca.write("/t/long", long[:3000], truncate=True)
        cb.write("/t/long", b"!", offset=600 * 4096)
        assert ca.read("/t/long") == long[:3000] + bytes(600 * 4096 - 3000) + b"!"
        with pytest.raises(ToastyError, match="truncation inside a chunk"):
            cb.write("/t/long", b"", offset=11, truncate=True)  # the cluster's one refusal
        # a file made anew with another chunk size: a node that read the old one is not misled
        cb.write("/t/re", data[:9000])
        assert ca.read("/t/re") == data[:9000]
        cb.delete("/t/re")
        cb.write("/t/re", data[:70_000], chunk_size=1000)
        assert ca.read("/t/re") == data[:70_000]
        cb.delete("/t/re")
        ca.write("/t/k64", data, chunk_size=65536)
        assert cb.stat("/t/k64")["chunk_size"] == 65536 and cb.read("/t/k64") == data
        for i in range(130):
            cb.mkdir("/t/d%03d" % i)
        _, items = ca.list("/t")  # 132 names: LIST continuation past the first 128
        assert [i.name for i in items] == sorted([b"f", b"k64", b"long"] + [b"d%03d" % i for i in range(130)])
        with pytest.raises(ToastyError):
            ca.delete("/t")  # not empty
        with pytest.raises(ToastyError):
            cb.mkdir("/nope/x")  # no parent
    with meta(c) as m:
        st = m.call(codec.Read(0, b"/t/f", 0, 1))
        assert isinstance(m.call(codec.Read(st.gen + 1, b"/t/f", 0, 1)), codec.ReadError)  # READ checks gen
        assert isinstance(m.call(codec.List_(1, b"/")), codec.ListSuccess)  # the root has generation 1
        assert m.call(codec.Read(0, b"/t", 0, 1)).message.startswith("Entity is a directory")
        w0 = m.call(codec.Write(0, 0, b"/t/f", 0, 0, []))
        assert w0.message.startswith("Generation counter mismatch")  # WRITE refuses expect_gen 0
        assert isinstance(m.call(codec.Delete(MISSING, b"/t/none")), codec.DeleteSuccess)
        assert isinstance(m.call(codec.Delete(0, b"/t/none")), codec.ErrorReply)
        assert isinstance(m.call(codec.Delete(st.gen + 1, b"/t/f")), codec.ErrorReply)
        assert isinstance(m.call(codec.Delete(st.gen, b"/t/f")), codec.DeleteSuccess)
        # pipelined: a READ sees the WRITE sent before it on its connection
        m.send(codec.Create(b"/t/p", False, 4096))
        m.send(codec.Read(0, b"/t/p", 0, 10))
        created, read = m.recv(), m.recv()
        assert isinstance(created, codec.CreateSuccess) and read.gen == created.gen


def test_toastyfs_style_client(cluster):
    """Uploads each chunk to all three locations itself, refuses fewer than 3, then WRITE and a
    READ that tries holders in order."""
    _, _, (a, b, c) = cluster
    data = blob(3 * 4096 + 100, b"toastyfs")
    path = b"/shared/tfs"
    with meta(a) as m:
        err = m.call(codec.Read(0, path, 0, len(data)))
        locations = [w.addresses()[0] for w in err.write_locations]
        assert len(locations) >= 3  # ToastyFS's client refuses to commit with fewer
        chunks = []
        for i in range(0, len(data), 4096):
            piece = data[i : i + 4096]
            got = set()
            for loc in locations:
                with closing(BlockingConnection(*loc)) as cs:
                    r = cs.call(codec.CreateChunk(4096, 0, piece))
                assert isinstance(r, codec.CreateChunkSuccess), r
                got.add(r.hash)
            assert len(got) == 1
            chunks.append(codec.WriteChunk(got.pop(), list(locations)))
        w = m.call(codec.Write(MISSING, codec.CREATE_IF_MISSING | codec.TRUNCATE_AFTER, path, 0, len(data), chunks))
        assert isinstance(w, codec.WriteSuccess), w
    # READ through another node, then each chunk from its holders in order
    with meta(b) as m:
        rs = m.call(codec.Read(0, path, 0, len(data)))
    assert isinstance(rs, codec.ReadSuccess), rs
    assert rs.gen == w.gen and rs.file_length == len(data)
    out = b""
    for ch in rs.chunks:
        holders = [x for h in ch.holders for x in h.addresses()]
        assert len(holders) == 3
        for address in [("127.0.0.1", 1)] + holders:  # a dead first holder: try the next
            try:
                with closing(BlockingConnection(*address)) as cs:
                    r = cs.call(codec.DownloadChunk(ch.hash, True))
            except OSError:
                continue
            if isinstance(r, codec.DownloadChunkSuccess):
                out += r.data
                break
    assert out[: len(data)] == data


def test_write_naming_a_location_without_the_chunk_is_refused(cluster):
    _, _, (a, b, c) = cluster
    piece = blob(4096, b"only-on-a")
    with closing(BlockingConnection(*a.address("chunks"))) as cs:
        h = cs.call(codec.CreateChunk(4096, 0, piece)).hash
    locs = [n.address("chunks") for n in (a, b, c)]
    with meta(c) as m:
        w = m.call(codec.Write(MISSING, codec.CREATE_IF_MISSING, b"/shared/minority", 0, 4096, [codec.WriteChunk(h, locs)]))
        assert isinstance(w, codec.ErrorReply) and "majority" in w.message, w
        few = m.call(codec.Write(MISSING, codec.CREATE_IF_MISSING, b"/shared/minority", 0, 4096, [codec.WriteChunk(h, locs[:1])]))
        assert isinstance(few, codec.ErrorReply) and "replication factor" in few.message, few


def test_concurrent_writes_same_expect_gen_exactly_one_wins(cluster):
    _, _, (a, b, c) = cluster
    with BlockingToastyClient(*a.address("meta")) as cl:
        gen = cl.write("/shared/race", b"base" * 1000, truncate=True)
    pieces = [blob(4096, b"one"), blob(4096, b"two")]
    locs = [n.address("chunks") for n in (a, b, c)]
    hashes = []
    for piece in pieces:
        for n in (a, b, c):
            with closing(BlockingConnection(*n.address("chunks"))) as cs:
                h = cs.call(codec.CreateChunk(4096, 0, piece)).hash
        hashes.append(h)
    for rnd in range(5):
        conns = [BlockingConnection(*a.address("meta")), BlockingConnection(*b.address("meta"))]
        replies = [None, None]
        go = threading.Barrier(2)

        def run(i):
            go.wait()
            replies[i] = conns[i].call(codec.Write(gen, 0, b"/shared/race", 0, 4096, [codec.WriteChunk(hashes[i], locs)]))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for conn in conns:
            conn.close()
        ok = [r for r in replies if isinstance(r, codec.WriteSuccess)]
        bad = [r for r in replies if isinstance(r, codec.ErrorReply)]
        assert len(ok) == 1 and len(bad) == 1, replies
        assert bad[0].message.startswith("Generation counter mismatch"), bad[0].message
        gen = ok[0].gen


@pytest_twisted.ensureDeferred
async def test_twisted_client_across_nodes(cluster):
    from twisted.internet import reactor

    _, _, (a, b, c) = cluster
    data = blob(300_000, b"twisted")
    wa = await ToastyClient.connect(reactor, *a.address("meta"))
    rc = await ToastyClient.connect(reactor, *c.address("meta"))
    try:
        gen = await wa.write("/shared/tw", data, truncate=True)
        assert await rc.read("/shared/tw") == data
        rs = await rc.read_raw("/shared/tw", 0, len(data))
        assert rs.gen == gen
        assert all(len(ch.holders) == 3 for ch in rs.chunks)
    finally:
        wa.close()
        rc.close()


def toasty_status(node):
    """The node's Toasty cluster status (None until it has joined its cluster)."""
    with BlockingSbpClient("127.0.0.1", node.ports["sbp"], timeout=10) as c:
        return (c.call(call_status()).get("cluster") or {}).get("toasty")


def test_unreferenced_chunks_are_released_cluster_wide(cluster):
    """Every holder keeps a local reference per chunk the tree lists it for, and drops it when no
    file does (the store's sweep then reclaims the chunk after its grace period)."""
    _, _, nodes = cluster

    def settled():
        # the module's earlier tests may still be releasing or re-replicating chunks: take the
        # counts once they hold still for a second with nothing under-replicated
        first = [toasty_status(n) for n in nodes]
        time.sleep(1.0)
        again = [toasty_status(n) for n in nodes]
        steady = [a["pinned"] for a in first] == [b["pinned"] for b in again]
        return steady and all(b["under_replicated"] == 0 for b in again) and [b["pinned"] for b in again]
    before = wait_for(settled, timeout=60, what="every holder's references settled")

    def pinned_are(extra):
        return all(toasty_status(n)["pinned"] == b0 + extra for n, b0 in zip(nodes, before))

    with BlockingToastyClient(*nodes[1].address("meta")) as cl:
        cl.write("/shared/gc", blob(40 * 4096, b"gc"), truncate=True)
        wait_for(lambda: pinned_are(40), timeout=30, what="40 new chunks referenced on every holder")
        cl.write("/shared/gc", blob(4096, b"gc-short"), truncate=True)
        wait_for(lambda: pinned_are(1), timeout=30, what="the overwritten chunks released")
        cl.delete("/shared/gc")
        wait_for(lambda: pinned_are(0), timeout=30, what="the deleted file's chunks released")
    assert all(toasty_status(n)["under_replicated"] == 0 for n in nodes)


@pytest.mark.slow
def test_10mib_across_nodes_kill9_holder_and_rereplication(cluster):
    base, etcd, nodes = cluster
    a, b, c = nodes[:3]
    data = blob(10 * 1024 * 1024, b"ten")
    small = blob(200_000, b"small")
    with BlockingToastyClient(*a.address("meta")) as ca:
        ca.write("/shared/ten", data, truncate=True)
        ca.write("/shared/small", small, truncate=True)
    for n in (b, c):
        with BlockingToastyClient(*n.address("meta")) as cl:
            assert cl.read("/shared/ten") == data
    span = 1024 * 4096
    first = holders_of(b, b"/shared/ten", 0, span)
    assert all(len(h) == 3 for off in range(0, len(data), span) for h in holders_of(b, b"/shared/ten", off, span))
    # kill -9 the holder listed first (the writer, a): both clients go on to the next holder
    assert first[0][0] == a.address("chunks")
    a.kill9()
    with BlockingToastyClient(*b.address("meta")) as cl:
        assert cl.read("/shared/ten") == data
    check_twisted_read(c, "/shared/small", small)
    # a write through another node goes on: READ offers the dead node until its lease expires,
    # the upload to it fails, and the client starts again from the READ
    after = blob(100_000, b"after")
    with BlockingToastyClient(*b.address("meta")) as cl:
        cl.write("/shared/after", after)
    with BlockingToastyClient(*c.address("meta")) as cl:
        assert cl.read("/shared/after") == after
    dead = a.address("chunks")

    def only_live_holders():  # a leaves the member list when its lease expires
        return all(dead not in h and len(h) == 2 for h in holders_of(b, b"/shared/ten", 0, span))

    wait_for(only_live_holders, timeout=20, what="READ to list only live holders")
    # a new member takes the copies that bring every chunk back to R = 3 live holders
    d = start_nodes(base, etcd.client_urls, [4])[0]
    nodes.append(d)
    new = d.address("chunks")

    def every_chunk_has_r_live_holders():
        return all(len(h) == 3 and new in h for path, size in ((b"/shared/ten", len(data)), (b"/shared/small", len(small)))
                   for off in range(0, size, span) for h in holders_of(c, path, off, span))

    wait_for(every_chunk_has_r_live_holders, timeout=60, what="every chunk with 3 live holders")
    assert toasty_status(d)["copied"] >= 2560 + 49  # every chunk of both files, copied by the new node
    wait_for(lambda: all(toasty_status(n)["under_replicated"] == 0 for n in (b, c, d)), timeout=30,
             what="no node seeing an under-replicated chunk")
    with BlockingToastyClient(*d.address("meta")) as cl:
        assert cl.read("/shared/ten") == data
    with BlockingToastyClient(*b.address("meta")) as cl:
        assert cl.read("/shared/ten") == data

    # The dead holder comes back with its old copies: the lists keep R = 3 live holders (it was
    # cut from them once the copies made 3 live ones), so it drops its references and its copies
    # are left to the sweep.
    assert toasty_status(b)["pinned"] > 0
    a.start(timeout=60)
    wait_for(lambda: (toasty_status(a) or {}).get("pinned") == 0, timeout=30, what="the returned node to drop its references")
    back = a.address("chunks")
    for path, size in ((b"/shared/ten", len(data)), (b"/shared/small", len(small))):
        for off in range(0, size, span):
            assert all(len(h) == 3 and back not in h for h in holders_of(c, path, off, span))
    with BlockingToastyClient(*a.address("meta")) as cl:
        assert cl.read("/shared/ten") == data

    # A WRITE that names four holding locations: the list is cut to the first three, and the
    # fourth drops its reference.
    live = [b, c, d, a]
    piece = blob(4096, b"four")
    for n in live:
        with closing(BlockingConnection(*n.address("chunks"))) as cs:
            h = cs.call(codec.CreateChunk(4096, 0, piece)).hash
    pinned = [toasty_status(n)["pinned"] for n in live]
    with meta(b) as m:
        w = m.call(codec.Write(MISSING, codec.CREATE_IF_MISSING, b"/shared/four", 0, 4096,
                               [codec.WriteChunk(h, [n.address("chunks") for n in live])]))
    assert isinstance(w, codec.WriteSuccess), w
    wait_for(lambda: holders_of(c, b"/shared/four", 0, 4096) == [[n.address("chunks") for n in live[:3]]],
             timeout=30, what="the four holders cut to the first three")
    wait_for(lambda: [toasty_status(n)["pinned"] for n in live] == [p + 1 for p in pinned[:3]] + [pinned[3]],
             timeout=30, what="only the three listed holders to reference the chunk")


def test_holder_lists_are_cut_to_r_live_holders():
    from node.cluster.toasty_chunks import trimmed

    assert trimmed([1, 2, 3, 4], {1, 2, 3, 4}, 3) == [1, 2, 3]  # a returned node's extra copy
    assert trimmed([1, 2, 3, 4], {2, 3, 4}, 3) == [2, 3, 4]  # the dead holder once 3 are live
    assert trimmed([1, 2, 3], {2, 3}, 3) == [1, 2, 3]  # too few live: the dead one stays listed
    assert trimmed([4, 1, 2], {1, 2, 4}, 3) == [4, 1, 2]


def check_twisted_read(node, path, expected):
    """The Twisted client's read of ``path`` through ``node``, in a process of its own (this test
    is synchronous: its blocking waits would stall pytest-twisted's reactor)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from twisted.internet import task\n"
        "from protocols.toasty.client import ToastyClient\n"
        "async def main(reactor):\n"
        "    c = await ToastyClient.connect(reactor, '127.0.0.1', %d)\n"
        "    try:\n"
        "        data = await c.read(%r)\n"
        "    finally:\n"
        "        c.close()\n"
        "    sys.stdout.buffer.write(data)\n"
        "from twisted.internet.defer import ensureDeferred\n"
        "task.react(lambda r: ensureDeferred(main(r)))\n"
    ) % (node.ports["meta"], path)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout == expected
