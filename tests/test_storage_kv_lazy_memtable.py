"""The memtable's lazily built dict (storage/kv.py ``_Memtable``): landed runs are kept as they are
and folded into the dict when something reads ``entries``; ``writes`` hands the row cache the runs
in order without folding; ``sorted_keys`` stays the key order of everything landed. Checked against a
plain dict model with hypothesis: runs of puts and removes (plain dicts, as ``write_many`` lands them,
and ``PackedRun``s, as the compiled SET pass does), reads, scans and ``writes`` interleaved."""

from hypothesis import given, settings
from hypothesis import strategies as st

from storage.kv import PackedRun, _Memtable

keys = st.binary(min_size=1, max_size=3)
stored = st.one_of(st.none(), st.binary(max_size=4).map(lambda v: b"\x00" + v))
dict_run = st.dictionaries(keys, stored, min_size=1, max_size=6)
packed_run = st.lists(st.tuples(keys, st.binary(max_size=4).map(lambda v: b"\x00" + v)), min_size=1, max_size=6)
step = st.one_of(
    st.tuples(st.just("dict"), dict_run),
    st.tuples(st.just("packed"), packed_run),
    st.tuples(st.just("read"), st.none()),
    st.tuples(st.just("scan"), st.none()),
    st.tuples(st.just("writes"), st.none()),
)


def _last_writes(writes):
    ks, vs = writes
    out = {}
    for k, v in zip(list(ks), list(vs)):
        out[k] = v
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=25))
def test_lazy_memtable_against_a_dict(steps):
    table = _Memtable()
    model = {}
    landed = 0
    for kind, arg in steps:
        if kind == "dict":
            table.land(dict(arg))
            model.update(arg)
            landed += len(arg)
        elif kind == "packed":
            run = PackedRun([k for k, _ in arg], [v for _, v in arg])
            if landed % 2:
                run.mapping()  # a GET of the connection's pending write looked in it first
            table.land(run)
            model.update(arg)
            landed += len(arg)
        elif kind == "read":
            assert table.entries == model
        elif kind == "scan":
            assert list(table.sorted_keys()) == sorted(model)
        else:
            assert _last_writes(table.writes()) == model
        assert table.empty() == (not model)
        assert table.count() >= len(model)
    assert _last_writes(table.writes()) == model
    assert table.entries == model
    assert list(table.sorted_keys()) == sorted(model)
    assert table.count() == len(model)  # folded: exact
