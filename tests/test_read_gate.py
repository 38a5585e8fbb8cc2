"""The read gate every server connection reads through (protocols/read_gate.py)."""

import pytest
from twisted.internet import task
from twisted.internet.testing import StringTransport

from protocols import read_gate
from protocols.read_gate import BUDGET, CLOSING, SEND_BUFFER, STORE, ReadGate
from storage import record_batch
from tests.storage_helpers.inline import close, complete, congest, hold, open_inline


def gate():
    tr = StringTransport()
    opened = []
    g = ReadGate(tr, lambda: opened.append(True))
    tr.registerProducer(g, True)
    return g, tr, opened


def test_reading_stops_while_any_reason_holds_and_resumes_once_none_does():
    g, tr, opened = gate()
    g.hold(BUDGET)
    g.pauseProducing()  # the transport's send buffer is full
    assert tr.producerState == "paused" and g.reasons == {BUDGET, SEND_BUFFER}
    g.release(BUDGET)
    assert tr.producerState == "paused" and not opened
    g.resumeProducing()
    assert tr.producerState == "producing" and g.reading and opened == [True]


def test_the_transport_is_driven_only_when_the_answer_changes():
    g, tr, opened = gate()
    g.release(BUDGET)  # not held: nothing happens
    g.hold(BUDGET)
    g.hold(BUDGET)
    g.set(SEND_BUFFER, True)
    g.set(SEND_BUFFER, False)
    assert tr.producerState == "paused" and not opened
    g.set(BUDGET, False)
    assert opened == [True]


def test_closing_holds_for_good_and_a_stopped_gate_leaves_the_transport_alone():
    g, tr, opened = gate()
    g.hold(CLOSING)
    g.stop()
    g.release(CLOSING)
    assert tr.producerState == "paused" and not opened


def test_reason_names():
    assert {read_gate.SEND_BUFFER, read_gate.SEND_QUEUE, read_gate.BUDGET, read_gate.STORE, read_gate.CLOSING} == {
        "send buffer", "send queue", "budget", "store congestion", "closing"}


@pytest.fixture
def store(tmp_path):
    s = open_inline(tmp_path / "store", task.Clock())
    yield s
    close(s)


def test_watch_store_holds_until_the_real_store_drains(store):
    g, tr, opened = gate()
    assert not g.watch_store(store)  # not congested: nothing held
    sid = store.log.create_stream().result.stream_id
    hold(store)  # the writer commits when the test says
    queued = [congest(store), store.log.append(sid, record_batch.encode([(1, [], b"x" * (1 << 20))]))]
    assert store.congested
    assert g.watch_store(store) and g.watch_store(store)  # one wait, however often asked
    assert g.reasons == {STORE} and tr.producerState == "paused"
    complete(store, None)
    assert all(d.called for d in queued) and store.when_drained().called
    assert g.reading and tr.producerState == "producing" and opened == [True]


def test_a_stopped_gate_lets_go_of_the_protocol_and_the_transport():
    """The gate is its transport's producer and holds the protocol's callback: kept after the
    connection is lost, that is a reference cycle only a full garbage collection frees (a connect
    flood's long stall, docs/operations.md "Floods")."""
    import gc
    import weakref

    class Protocol:
        def reopened(self):
            pass

    p = Protocol()
    tr = StringTransport()
    g = ReadGate(tr, p.reopened)
    tr.registerProducer(g, True)
    p.gate, p.transport = g, tr
    g.hold(BUDGET)
    g.stop()
    g.release(BUDGET)  # a late release after the loss touches nothing
    assert g.on_open is None and g.transport is None and tr.producerState == "paused"
    alive = weakref.ref(p)
    gc.disable()
    try:
        del p, g, tr
        assert alive() is None  # freed by reference counting alone
    finally:
        gc.enable()
