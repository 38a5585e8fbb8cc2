"""CONTRACT §5 on a real node: requests pipelined on one metadata connection take effect in order,
so each LIST and READ sees exactly the requests sent before it on its connection.

Random rounds of CREATE, WRITE, DELETE, LIST and READ are each sent in one write; the replies are
checked, in order, against a sequential model of the tree. Generations come from the node (one
node-wide counter), so the model learns each new one from its reply and checks that it grows and
that later LISTs, READs and generation checks agree with it.
"""

import hashlib
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from protocols.toasty import codec
from protocols.toasty.client import BlockingConnection
from protocols.toasty.codec import CREATE_IF_MISSING, MISSING_GENERATION as MISSING, TRUNCATE_AFTER, WriteChunk

CS = 4096  # every file's chunk size (CREATE_IF_MISSING's default too)
READ_LEN = 3 * CS
# Chunks with data in their first byte only: no WRITE below needs its tail zeroed by the server,
# so a chunk index holds exactly the hash the WRITE named.
CONTENTS = [b"A", b"B", b"C"]
BOGUS_GEN = 2**63  # never handed out here


class Ent:
    def __init__(self, gen, is_dir):
        self.gen, self.is_dir = gen, is_dir
        self.size = 0
        self.chunks = {}  # chunk index -> hash


class Model:
    """The tree under one directory (path "" is that directory), applied one request at a time."""

    def __init__(self, base_gen):
        self.ents = {"": Ent(base_gen, True)}
        self.last_gen = base_gen

    def parent_ok(self, path):
        parent = path.rpartition("/")[0]
        p = self.ents.get(parent)
        return p is not None and p.is_dir

    def file_on_the_way(self, path):
        parts = path.split("/")
        for i in range(1, len(parts)):
            ent = self.ents.get("/".join(parts[:i]))
            if ent is None:
                return False
            if not ent.is_dir:
                return True
        return False

    def gen_ok(self, ent, expect_gen):
        if expect_gen == 0:
            return True
        if expect_gen == MISSING:
            return False
        return ent.gen == expect_gen

    def new_gen(self, reply):
        assert reply.gen > self.last_gen, (reply, self.last_gen)
        self.last_gen = reply.gen
        return reply.gen

    def check(self, op, reply):
        """Assert ``reply`` is what the sequential model says ``op`` gets, then apply ``op``."""
        kind = op[0]
        if kind == "create":
            _, path, is_dir = op
            ok = path not in self.ents and self.parent_ok(path)
            assert reply.TYPE == (codec.CREATE_SUCCESS if ok else codec.CREATE_ERROR), (op, reply)
            if ok:
                self.ents[path] = Ent(self.new_gen(reply), is_dir)
        elif kind == "delete":
            _, path, expect_gen = op
            ent = self.ents.get(path)
            if ent is None:
                # a missing path is fine with "must not exist", unless a file is in its way
                ok = expect_gen == MISSING and not self.file_on_the_way(path)
            else:
                children = any(p.startswith(path + "/") for p in self.ents)
                ok = self.gen_ok(ent, expect_gen) and not (ent.is_dir and children)
            assert reply.TYPE == (codec.DELETE_SUCCESS if ok else codec.DELETE_ERROR), (op, reply)
            if ok:
                self.ents.pop(path, None)
        elif kind == "list":
            _, path, expect_gen = op
            ent = self.ents.get(path)
            ok = ent is not None and ent.is_dir and self.gen_ok(ent, expect_gen)
            assert reply.TYPE == (codec.LIST_SUCCESS if ok else codec.LIST_ERROR), (op, reply)
            if ok:
                prefix = path + "/" if path else ""
                want = sorted(
                    (p[len(prefix) :].encode(), e.gen, e.is_dir)
                    for p, e in self.ents.items()
                    if p and p.startswith(prefix) and "/" not in p[len(prefix) :]
                )
                assert (reply.gen, reply.truncated) == (ent.gen, False), (op, reply)
                assert [(i.name, i.gen, i.is_dir) for i in reply.items] == want, (op, reply)
        elif kind == "read":
            _, path, expect_gen = op
            ent = self.ents.get(path)
            ok = ent is not None and not ent.is_dir and self.gen_ok(ent, expect_gen)
            assert reply.TYPE == (codec.READ_SUCCESS if ok else codec.READ_ERROR), (op, reply)
            if ok:
                length = min(ent.size, READ_LEN)
                hashes = [ent.chunks.get(i, codec.ZERO_HASH) for i in range(-(-length // CS))]
                got = (reply.gen, reply.chunk_size, reply.file_length, [c.hash for c in reply.chunks])
                assert got == (ent.gen, CS, length, hashes), (op, reply)
        else:
            _, path, expect_gen, flags, offset, length, hashes = op
            ent = self.ents.get(path)
            if ent is None:
                ok = expect_gen == MISSING and flags & CREATE_IF_MISSING and self.parent_ok(path)
            else:
                ok = not ent.is_dir and expect_gen != 0 and self.gen_ok(ent, expect_gen)
            assert reply.TYPE == (codec.WRITE_SUCCESS if ok else codec.WRITE_ERROR), (op, reply)
            if ok:
                if ent is None:
                    ent = self.ents[path] = Ent(None, False)
                ent.gen = self.new_gen(reply)
                first = offset // CS
                for i, h in enumerate(hashes):
                    ent.chunks[first + i] = h
                end = offset + length
                ent.size = end if flags & TRUNCATE_AFTER else max(ent.size, end)
                if flags & TRUNCATE_AFTER:
                    keep = -(-ent.size // CS)
                    ent.chunks = {i: h for i, h in ent.chunks.items() if i < keep}


# An op names its expect_gen by a choice made when the round is sent: 0, "must not exist", the
# generation the model knew before the round (stale if the round changed it) or a bogus one.
# Each example starts from directory "a" and file "b"; the paths are few, so requests meet.
GEN_CHOICES = st.sampled_from(["zero", "zero", "known", "missing", "bogus"])
WRITE_GEN_CHOICES = st.sampled_from(["known", "known", "missing", "zero", "bogus"])
RANGES = [(0, 1), (0, CS), (100, 10), (CS, 1), (CS + 5, CS), (0, 2 * CS + 1), (7, 0)]
FILES = ["b", "a/c", "a/d", "c"]

OP = st.one_of(
    st.tuples(st.just("create"), st.sampled_from(["a/c", "a/d", "c", "a/c/e", "a"]), st.booleans()),
    st.tuples(st.just("delete"), st.sampled_from(["a", "b", "a/c", "a/d", "c"]), GEN_CHOICES),
    st.tuples(st.just("list"), st.sampled_from(["", "", "a", "a", "a/c", "b"]), GEN_CHOICES),
    st.tuples(st.just("read"), st.sampled_from(FILES + ["b", "a/c"]), GEN_CHOICES),
    st.tuples(st.just("read"), st.sampled_from(FILES), st.just("zero")),
    st.tuples(
        st.just("write"), st.sampled_from(FILES), WRITE_GEN_CHOICES,
        st.sampled_from([0, CREATE_IF_MISSING, CREATE_IF_MISSING, TRUNCATE_AFTER, CREATE_IF_MISSING | TRUNCATE_AFTER]),
        st.sampled_from(RANGES), st.integers(0, len(CONTENTS) - 1),
    ),
)
ROUNDS = st.lists(st.lists(OP, min_size=4, max_size=16), min_size=1, max_size=4)


def _expect_gen(choice, model, path):
    if choice == "zero":
        return 0
    if choice == "missing":
        return MISSING
    ent = model.ents.get(path)
    return ent.gen if choice == "known" and ent is not None else BOGUS_GEN


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_random_pipelined_rounds_match_a_sequential_model(node_factory, fsync):
    node = node_factory(fsync=fsync)
    chunk_conn = BlockingConnection(*node.address("chunks"))
    hashes = []
    for data in CONTENTS:
        r = chunk_conn.call(codec.CreateChunk(CS, 0, data))
        assert r.hash == hashlib.sha256(data + bytes(CS - len(data))).digest()
        hashes.append(r.hash)
    chunk_conn.close()
    holder = [node.address("chunks")]
    conn = BlockingConnection(*node.address("meta"))
    examples = itertools.count()

    @settings(max_examples=25, deadline=None)
    @given(rounds=ROUNDS)
    def run(rounds):
        base = "/t%d" % next(examples)
        r = conn.call(codec.Create(base.encode(), True))
        assert r.TYPE == codec.CREATE_SUCCESS, r
        model = Model(r.gen)
        start = [("create", "a", True), ("write", "b", "missing", CREATE_IF_MISSING, (0, 1), 0)]
        rounds = [start] + rounds
        for ops in rounds:
            sent, msgs = [], []
            for op in ops:
                kind, path = op[0], op[1]
                wire = ("%s/%s" % (base, path) if path else base).encode()
                if kind == "create":
                    sent.append(op)
                    msgs.append(codec.Create(wire, op[2], 0 if op[2] else CS))
                    continue
                gen = _expect_gen(op[2], model, path)
                if kind == "delete":
                    msgs.append(codec.Delete(gen, wire))
                elif kind == "list":
                    msgs.append(codec.List_(gen, wire))
                elif kind == "read":
                    msgs.append(codec.Read(gen, wire, 0, READ_LEN))
                else:
                    _, _, _, flags, (offset, length), h = op
                    n = 0 if length == 0 else (offset + length - 1) // CS - offset // CS + 1
                    chunks = [hashes[(h + i) % len(hashes)] for i in range(n)]
                    msgs.append(codec.Write(gen, flags, wire, offset, length, [WriteChunk(c, holder) for c in chunks]))
                    sent.append((kind, path, gen, flags, offset, length, chunks))
                    continue
                sent.append((kind, path, gen))
            conn.send_many(msgs)  # one write: the node frames the whole round in one pass
            replies = [conn.recv() for _ in msgs]
            for op, reply in zip(sent, replies):
                model.check(op, reply)

    try:
        run()
    finally:
        conn.close()
