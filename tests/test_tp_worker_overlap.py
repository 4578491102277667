"""A rank's message loop (`tp_worker.serve_messages`): on CUDA a continuation plan that arrives
while the device still runs the previous one is launched before the previous reply is sent
(the rank prepares step N+1 while its device runs step N); anything else waits for the reply
before it; every message gets exactly one reply, in order. A stand-in runner and device event
record the order of launches and waits (CPU)."""

from __future__ import annotations

import threading
import types
from multiprocessing import Pipe

import pytest

from flexserve.engine.plan import BatchPlan
from flexserve.worker import tp_worker
from flexserve.worker.plan_wire import PlanSender, PromptCache
from flexserve.worker.tp_worker import RankCall, RankCallError, WorkerError


class FakeEvent:
    done = False  # whether the device "finished" what was launched

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return FakeEvent.done


class FakeRunner:
    def __init__(self, device: str = "cuda") -> None:
        self.device = types.SimpleNamespace(type=device)
        self.log: list[str] = []

    def execute_async(self, plan):
        name = plan.finished_request_ids[0]
        if name == "bad":
            raise RuntimeError("launch failed")
        self.log.append(f"launch {name}")

        def wait():
            self.log.append(f"wait {name}")
            return f"result {name}"
        return wait

    def end_finetune_job(self, job_id):
        self.log.append(f"call {job_id}")
        if job_id == "refused":
            raise ValueError("no such job")
        return f"ended {job_id}"


def plan(name: str, continuation: bool) -> BatchPlan:
    return BatchPlan(continues_previous=continuation, finished_request_ids=[name])


def run(messages, device: str = "cuda", device_done: bool = False, driver: bool = True,
        late=()):
    """Send `messages` before the rank looks (they arrive early), `late` ones 0.2 s later."""
    FakeEvent.done = device_done
    runner = FakeRunner(device)
    engine, rank = Pipe()
    sender = PlanSender()
    for message in messages:
        engine.send_bytes(sender.encode(message))
    if not late:
        engine.send_bytes(sender.encode(None))
    tp_worker.torch.cuda.Event = FakeEvent
    thread = threading.Thread(target=tp_worker.serve_messages,
                              args=(runner, rank, PromptCache(), 0, driver))
    thread.start()
    if late:
        threading.Event().wait(0.2)
        for message in [*late, None]:
            engine.send_bytes(sender.encode(message))
    thread.join(10)
    assert not thread.is_alive()
    replies = []
    while engine.poll(0):
        replies.append(engine.recv())
    return runner.log, replies


@pytest.fixture(autouse=True)
def _restore_event():
    event = tp_worker.torch.cuda.Event
    yield
    tp_worker.torch.cuda.Event = event


def test_a_continuation_is_launched_before_the_previous_reply():
    log, replies = run([plan("a", False), plan("b", True), plan("c", True)])
    assert log == ["launch a", "launch b", "wait a", "launch c", "wait b", "wait c"]
    assert replies == ["result a", "result b", "result c"]


def test_a_fresh_plan_or_a_call_waits_for_the_previous_reply():
    log, replies = run([plan("a", False), plan("b", False),
                        RankCall("end_finetune_job", ("j",)), plan("c", True)])
    assert log == ["launch a", "wait a", "launch b", "wait b", "call j", "launch c", "wait c"]
    assert replies == ["result a", "result b", "ended j", "result c"]


def test_a_finished_device_replies_before_reading_on():
    log, replies = run([plan("a", False)], device_done=True, late=[plan("b", True)])
    assert log == ["launch a", "wait a", "launch b", "wait b"]
    assert replies == ["result a", "result b"]
    # Still running when the next plan comes: the next is launched first.
    log, _ = run([plan("a", False)], late=[plan("b", True)])
    assert log == ["launch a", "launch b", "wait a", "wait b"]


def test_the_cpu_runs_each_plan_to_its_end():
    log, replies = run([plan("a", False), plan("b", True)], device="cpu")
    assert log == ["launch a", "wait a", "launch b", "wait b"]
    assert replies == ["result a", "result b"]


def test_errors_and_other_ranks_replies_keep_their_places():
    log, replies = run([plan("a", False), plan("bad", True), plan("c", False),
                        RankCall("end_finetune_job", ("refused",))], driver=False)
    assert log == ["launch a", "wait a", "launch c", "wait c", "call refused"]
    assert replies[0] is None and isinstance(replies[1], WorkerError)
    assert "launch failed" in replies[1].message
    assert replies[2] is None and replies[3] == RankCallError("no such job")


def test_the_engine_gone_mid_step_ends_the_loop_quietly():
    FakeEvent.done = False
    runner = FakeRunner()
    engine, rank = Pipe()
    engine.send_bytes(PlanSender().encode(plan("a", False)))
    tp_worker.torch.cuda.Event = FakeEvent
    errors = []

    def serve():
        try:
            tp_worker.serve_messages(runner, rank, PromptCache(), 0, True)
        except Exception as e:  # what must not happen
            errors.append(e)

    thread = threading.Thread(target=serve)
    thread.start()
    threading.Event().wait(0.1)
    engine.close()  # the engine process exits while the step runs
    thread.join(10)
    assert not thread.is_alive() and not errors
    assert runner.log == ["launch a", "wait a"]
