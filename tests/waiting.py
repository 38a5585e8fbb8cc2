"""Waiting on conditions, for tests that drive real node processes (never a fixed sleep)."""

import time


def wait_until(predicate, timeout=60.0, what="condition", interval=0.05):
    """Poll ``predicate()`` until it is true and return its value; fail after ``timeout`` seconds
    naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        time.sleep(interval)


async def reactor_until(predicate, timeout=20.0, what="condition", interval=0.01):
    """``wait_until`` for tests running in the reactor (pytest-twisted): polls between reactor
    turns, so the server under test keeps running."""
    from twisted.internet import reactor, task

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %.0f s waiting for %s" % (timeout, what))
        await task.deferLater(reactor, interval, lambda: None)
