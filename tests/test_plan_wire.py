"""The plans' wire format to the ranks: a request's prompt travels once, and every rank puts it
back; both sides forget it at the plan that finishes or preempts the request."""

from __future__ import annotations

import pickle

import pytest

from flexserve.engine.plan import BatchPlan, ScheduledSequence
from flexserve.sampling_params import SamplingParams
from flexserve.worker.plan_wire import PlanSender, PromptCache


def row(request_id: str, prompt: list[int], outputs: list[int]) -> ScheduledSequence:
    return ScheduledSequence(request_id, [outputs[-1] if outputs else prompt[-1]],
                             len(prompt) + len(outputs) - 1, [0, 1], True,
                             SamplingParams(max_tokens=8), prompt, outputs, None, None)


def test_prompts_travel_once_and_come_back_on_every_rank():
    sender, ranks = PlanSender(), [PromptCache(), PromptCache()]
    prompts = {f"r{i}": list(range(i, i + 512)) for i in range(4)}

    def send(plan):
        payload = sender.encode(plan)
        got = [rank.decode(payload) for rank in ranks]
        for plan_here in got:
            assert [(r.request_id, r.prompt_token_ids) for r in plan_here.sequences] == [
                (r.request_id, r.prompt_token_ids) for r in plan.sequences]
        return len(payload)

    outputs = {k: [] for k in prompts}
    first = send(BatchPlan(sequences=[row(k, p, outputs[k]) for k, p in prompts.items()]))
    for step in range(3):  # the engine's lists grow; the ranks get what is new
        for k in outputs:
            outputs[k].append(100 + step)
        later = send(BatchPlan(sequences=[row(k, p, outputs[k]) for k, p in prompts.items()]))
        assert later < first / 3  # the prompts stayed on the ranks
    for rank in ranks:
        assert all(rank._outputs[k] == outputs[k] and rank._outputs[k] is not outputs[k]
                   for k in outputs)
    # r0 finished, r1 preempted: both sides forget them; r1's prompt travels again when it
    # comes back, and a request never seen before brings its own.
    send(BatchPlan(sequences=[row("r2", prompts["r2"], [7, 8])],
                   finished_request_ids=["r0"], preempted_request_ids=["r1"]))
    assert all("r0" not in rank._prompts and "r1" not in rank._prompts for rank in ranks)
    send(BatchPlan(sequences=[row("r1", prompts["r1"], []), row("r9", [1, 2, 3], [])]))
    # The engine's own plan objects are never changed.
    plan = BatchPlan(sequences=[row("r2", prompts["r2"], [7, 8, 9])])
    sender.encode(plan)
    assert plan.sequences[0].prompt_token_ids == prompts["r2"]
    # Other messages pass as they are.
    assert ranks[0].decode(sender.encode(("call", 3))) == ("call", 3)
    assert ranks[0].decode(sender.encode(None)) is None


def test_a_rank_that_missed_a_prompt_fails_loudly():
    sender = PlanSender()
    sender.encode(BatchPlan(sequences=[row("r0", [1, 2], [])]))
    with pytest.raises(KeyError):
        PromptCache().decode(sender.encode(BatchPlan(sequences=[row("r0", [1, 2], [3])])))
    # A rank whose outputs fell out of step says so rather than sampling from wrong penalties.
    sender, rank = PlanSender(), PromptCache()
    rank.decode(sender.encode(BatchPlan(sequences=[row("r1", [1, 2], [5])])))
    rank._outputs["r1"] = []
    with pytest.raises(ValueError, match="holds 0 output tokens"):
        rank.decode(sender.encode(BatchPlan(sequences=[row("r1", [1, 2], [5, 6])])))
    assert pickle.loads(sender.encode(BatchPlan())).sequences == []
