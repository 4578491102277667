"""The `mp` executor's replies: taken in any order, each by its own waiter.

A plan launched ahead (asynchronous scheduling) may still be unanswered when the engine thread
sends the ranks a call (a fine-tuning job starting): the call's reply comes after the plan's, and
waiting for it must leave the plan's reply for the plan's own wait. The pipes are replaced by a
queue of replies in the order the ranks would send them."""

from __future__ import annotations

import gc

import pytest

from flexserve.worker import mp_executor
from flexserve.worker.mp_executor import MultiprocExecutor


class _Ranks:
    """Stands in for the pipes: every message sent gets the reply `reply-<index>`."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0

    def receive_all(self) -> list[str]:
        assert self.received < self.sent, "waited for a reply to a message never sent"
        self.received += 1
        return [f"reply-{self.received - 1}"]


@pytest.fixture()
def executor(monkeypatch):
    ranks = _Ranks()
    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    ex._error, ex._driver = None, 0
    ex._num_sent = ex._num_received = 0
    ex._results, ex._abandoned = {}, set()
    ex._conns, ex._processes = [], []

    class _Sender:
        def encode(self, message):
            return message

    ex._sender = _Sender()
    monkeypatch.setattr(ex, "_receive_all", ranks.receive_all, raising=False)
    monkeypatch.setattr(mp_executor, "rank_reply", lambda replies, driver: replies[driver])

    def submit(message):
        ranks.sent += 1
        return MultiprocExecutor._submit(ex, message)

    ex.submit = submit
    return ex


def test_a_call_between_a_plan_and_its_wait_leaves_the_plans_reply(executor):
    plan = executor.submit("plan")
    call = executor.submit("call")
    assert call() == "reply-1"  # receives the plan's reply first and keeps it
    assert plan() == "reply-0"
    assert executor._results == {}


def test_a_waiter_dropped_unanswered_drops_its_reply(executor):
    ahead = executor.submit("plan launched ahead")
    later = executor.submit("plan")
    del ahead  # nobody will read its tokens
    gc.collect()
    assert later() == "reply-1"
    assert executor._results == {} and executor._abandoned == set()
    answered = executor.submit("plan")
    following = executor.submit("plan")
    assert following() == "reply-3"
    del answered  # its reply arrived before it was dropped
    gc.collect()
    assert executor._results == {}


def test_a_reply_is_taken_once(executor):
    wait = executor.submit("plan")
    assert wait() == "reply-0"
    with pytest.raises(RuntimeError, match="taken already"):
        wait()
