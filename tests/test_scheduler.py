"""Scheduler: chunked prefill, admission, preemption, stops, aborts, prefix sharing.

A fake runner plays the worker: it writes every row's tokens into a paged "KV cache" (a dict of
slots), then reads each row's whole context back through its block table, so a block handed to
the wrong request, evicted while in use, or shared without equal prefix shows up as a mismatch.
The next token is a deterministic function of the context read back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flexserve.config import CacheConfig, SchedulerConfig
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.engine.request import Request, RequestStatus
from flexserve.engine.scheduler import Scheduler
from flexserve.sampling_params import SamplingParams

VOCAB = 12
EOS = 0


def next_token(context: list[int]) -> int:
    h = 17
    for token in context:
        h = (h * 31 + token + 1) % 1_000_003
    return h % VOCAB


class FakeRunner:
    """Executes a BatchPlan against a dict-backed paged KV cache."""

    def __init__(self, block_size: int, token_fn: Callable[[str, list[int]], int] | None = None):
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.token_fn = token_fn or (lambda request_id, context: next_token(context))

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, plan: BatchPlan) -> StepResult:
        # Writes of the whole step land before any read, as in each layer of the real model.
        for row in plan.sequences:
            assert row.num_scheduled_tokens >= 1
            end = row.num_computed_tokens + row.num_scheduled_tokens
            assert len(row.block_ids) == -(-end // self.block_size)
            for offset, token in enumerate(row.new_token_ids):
                self.slots[self._slot(row.block_ids, row.num_computed_tokens + offset)] = token
        result = StepResult()
        for row in plan.sequences:
            end = row.num_computed_tokens + row.num_scheduled_tokens
            context = [self.slots[self._slot(row.block_ids, pos)] for pos in range(end)]
            assert context == (row.prompt_token_ids + row.output_token_ids)[:end]
            if row.needs_sample:
                assert end == len(row.prompt_token_ids) + len(row.output_token_ids)
                result.sampled_token_ids[row.request_id] = self.token_fn(row.request_id, context)
        return result


def make_scheduler(budget=64, max_num_seqs=16, block_size=4, num_blocks=64, max_model_len=512,
                   caching=True) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks=num_blocks, max_model_len=max_model_len,
    )


def make_request(request_id, prompt, max_tokens=8, eos=EOS, **params) -> Request:
    params.setdefault("max_tokens", max_tokens)
    return Request(request_id, prompt, SamplingParams(**params), eos, max_tokens)


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[BatchPlan, list[Request]]:
    plan = scheduler.schedule()
    assert plan.num_batched_tokens == sum(r.num_scheduled_tokens for r in plan.sequences)
    assert plan.num_batched_tokens <= scheduler.scheduler_config.max_num_batched_tokens
    assert len(plan.sequences) <= scheduler.scheduler_config.max_num_seqs
    updated = scheduler.update(plan, runner.execute(plan)) if plan.sequences else []
    scheduler.kv_cache_manager.check_invariants()
    return plan, updated


def run_all(scheduler: Scheduler, runner: FakeRunner, max_steps=2000) -> list[BatchPlan]:
    plans = []
    while scheduler.has_unfinished_requests():
        assert len(plans) < max_steps, "scheduler made no progress"
        plans.append(step(scheduler, runner)[0])
    return plans


def reference_output(request: Request, max_model_len: int) -> list[int]:
    """What the request generates alone: the fake model is deterministic in the context."""
    params, context, output = request.sampling_params, list(request.prompt_token_ids), []
    while True:
        token = next_token(context)
        context.append(token)
        output.append(token)
        if len(output) >= params.min_tokens and (
            (not params.ignore_eos and token == request.eos_token_id)
            or token in params.stop_token_ids
        ):
            return output
        if len(output) >= request.max_tokens or len(context) >= max_model_len:
            return output


def rows(plan: BatchPlan) -> list[tuple[str, int, int, bool]]:
    return [(r.request_id, r.num_computed_tokens, r.num_scheduled_tokens, r.needs_sample)
            for r in plan.sequences]


def test_chunked_prefill_then_decode_rides_with_other_rows():
    scheduler, runner = make_scheduler(budget=16), FakeRunner(4)
    a = make_request("a", [i % 5 + 1 for i in range(40)], max_tokens=5, ignore_eos=True)
    scheduler.add_request(a)
    plans = [step(scheduler, runner)[0] for _ in range(3)]
    assert [rows(p) for p in plans] == [
        [("a", 0, 16, False)], [("a", 16, 16, False)], [("a", 32, 8, True)],
    ]
    assert a.num_output_tokens == 1 and a.num_computed_tokens == 40
    scheduler.add_request(make_request("b", [7] * 30, max_tokens=3, ignore_eos=True))
    plans = [step(scheduler, runner)[0] for _ in range(3)]
    assert [rows(p) for p in plans] == [
        [("a", 40, 1, True), ("b", 0, 15, False)],
        [("a", 41, 1, True), ("b", 15, 15, True)],
        [("a", 42, 1, True), ("b", 30, 1, True)],
    ]
    run_all(scheduler, runner)
    assert a.output_token_ids == reference_output(a, 512)
    assert a.status == RequestStatus.FINISHED_LENGTH and scheduler.kv_cache_usage == 0.0


def test_max_num_seqs_is_respected():
    scheduler, runner = make_scheduler(max_num_seqs=2), FakeRunner(4)
    requests = [make_request(f"r{i}", [i + 1] * 4, max_tokens=3, ignore_eos=True) for i in range(5)]
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, runner)
        assert len(plan.sequences) <= 2 and scheduler.num_running <= 2
    assert all(r.num_output_tokens == 3 for r in requests)


def test_admission_waits_until_the_whole_prompt_fits():
    # 8 blocks of 4: "a" needs 5 blocks for its prompt and 6 at its longest; "b" needs 4. A
    # first chunk of "b" (one block) would fit after step 3, but its whole prompt does not.
    scheduler, runner = make_scheduler(budget=8, num_blocks=8), FakeRunner(4)
    a = make_request("a", [1] * 20, max_tokens=4, ignore_eos=True)
    b = make_request("b", [2] * 16, max_tokens=2, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plans = run_all(scheduler, runner)
    assert [rows(p) for p in plans[:3]] == [
        [("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 4, True)],
    ]
    first_b = next(i for i, p in enumerate(plans) if any(r.request_id == "b" for r in p.sequences))
    assert first_b == 6  # only after "a" finished its 4 tokens and released its blocks
    assert a.status == RequestStatus.FINISHED_LENGTH and plans[6].finished_request_ids == ["a"]
    assert rows(plans[6]) == [("b", 0, 8, False)]
    assert scheduler.num_preemptions_total == 0 and b.num_output_tokens == 2


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_recomputes_the_latest_request_with_the_same_tokens(caching):
    scheduler, runner = make_scheduler(block_size=2, num_blocks=8, caching=caching), FakeRunner(2)
    a = make_request("a", [1, 2, 3, 1], max_tokens=8, ignore_eos=True)
    b = make_request("b", [3, 2, 1, 3], max_tokens=8, ignore_eos=True)
    scheduler.add_request(a)
    scheduler.add_request(b)
    plans = run_all(scheduler, runner)
    preempting = [p for p in plans if p.preempted_request_ids]
    assert preempting and all(p.preempted_request_ids == ["b"] for p in preempting)
    assert scheduler.num_preemptions_total == b.num_preemptions == len(preempting)
    assert a.num_preemptions == 0
    assert a.output_token_ids == reference_output(a, 512)
    assert b.output_token_ids == reference_output(b, 512)
    assert len(b.output_token_ids) == 8 and scheduler.kv_cache_usage == 0.0


def test_request_that_cannot_get_a_block_preempts_itself():
    scheduler, runner = make_scheduler(block_size=1, num_blocks=5), FakeRunner(1)
    a = make_request("a", [1, 2], max_tokens=3, ignore_eos=True)
    b = make_request("b", [2, 1], max_tokens=3, ignore_eos=True)
    c = make_request("c", [3, 3, 3], max_tokens=3, ignore_eos=True)  # waits: 3 blocks needed
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler, runner)
    plan, _ = step(scheduler, runner)
    assert rows(plan) == [("a", 2, 1, True)] and plan.preempted_request_ids == ["b"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert list(scheduler.waiting) == [b, c]  # back at the front, ahead of later arrivals
    assert b.output_token_ids == [next_token([2, 1])]
    run_all(scheduler, runner)
    assert b.output_token_ids == reference_output(b, 512)
    assert c.output_token_ids == reference_output(c, 512)


def scripted(tokens: list[int]) -> FakeRunner:
    return FakeRunner(4, lambda request_id, context: tokens[len(context) - 3])


@pytest.mark.parametrize("script, kwargs, status, output, stop_reason", [
    ([5, 0, 7], {}, RequestStatus.FINISHED_STOPPED, [5, 0], None),
    ([0, 0, 0, 9], {"min_tokens": 3}, RequestStatus.FINISHED_STOPPED, [0, 0, 0], None),
    ([0, 0, 0, 0, 0], {"ignore_eos": True, "max_tokens": 4}, RequestStatus.FINISHED_LENGTH,
     [0, 0, 0, 0], None),
    ([5, 7, 8], {"stop_token_ids": [7]}, RequestStatus.FINISHED_STOPPED, [5, 7], 7),
    ([7, 7, 8], {"stop_token_ids": [7], "min_tokens": 2}, RequestStatus.FINISHED_STOPPED,
     [7, 7], 7),
    ([5, 6, 7, 8], {"max_tokens": 3}, RequestStatus.FINISHED_LENGTH, [5, 6, 7], None),
    ([5, 6, 0], {"max_tokens": 3}, RequestStatus.FINISHED_STOPPED, [5, 6, 0], None),
    ([5, 6, 7, 8], {"max_tokens": 100, "max_model_len": 5}, RequestStatus.FINISHED_LENGTH,
     [5, 6], None),
])
def test_stop_conditions(script, kwargs, status, output, stop_reason):
    kwargs = dict(kwargs)
    max_model_len = kwargs.pop("max_model_len", 512)
    scheduler = make_scheduler(max_model_len=max_model_len)
    request = make_request("r", [1, 2, 3], **kwargs)
    scheduler.add_request(request)
    plans = run_all(scheduler, scripted(script))
    assert (request.status, request.output_token_ids, request.stop_reason) == \
        (status, output, stop_reason)
    assert scheduler.kv_cache_usage == 0.0 and scheduler.get_request("r") is None
    assert scheduler.finished_request_ids == ["r"]  # sent with the next plan that has rows
    assert all(p.finished_request_ids == [] for p in plans)


def test_abort_waiting_and_running_requests_frees_blocks():
    scheduler, runner = make_scheduler(num_blocks=6), FakeRunner(4)
    a = make_request("a", [1] * 16, ignore_eos=True)
    b = make_request("b", [2] * 16, ignore_eos=True)  # does not fit while "a" runs
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler, runner)
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED and scheduler.num_waiting == 0
    plan = scheduler.schedule()  # "a" is aborted between schedule and update
    assert plan.finished_request_ids == ["b"]
    scheduler.finish_requests(["a", "a", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.update(plan, runner.execute(plan)) == []
    assert a.num_output_tokens == 1 and a.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_usage == 0.0 and not scheduler.has_unfinished_requests()
    scheduler.kv_cache_manager.check_invariants()
    scheduler.add_request(make_request("c", [3] * 4))
    assert scheduler.schedule().finished_request_ids == ["a"]
    with pytest.raises(ValueError):
        scheduler.finish_requests("c", RequestStatus.RUNNING)


@pytest.mark.parametrize("budget", [256, 40])
def test_sibling_requests_share_prompt_blocks_in_the_same_step(budget):
    scheduler, runner = make_scheduler(budget=budget, block_size=8), FakeRunner(8)
    prompt = [i % 3 + 1 for i in range(32)]
    siblings = [make_request(f"s{i}", prompt, max_tokens=4, ignore_eos=True) for i in range(3)]
    for request in siblings:
        scheduler.add_request(request)
    plan, _ = step(scheduler, runner)
    # The first computes all 4 blocks; the others hit the 3 it registered this very step and
    # compute only the last block (its last token must run to produce logits).
    assert rows(plan)[:2] == [("s0", 0, 32, True), ("s1", 24, 8, True)]
    assert plan.num_new_prefix_cache_hit_tokens == 24 * (len(plan.sequences) - 1)
    assert plan.num_new_prefix_cache_query_tokens == 32 * len(plan.sequences)
    tables = [scheduler.kv_cache_manager.get_block_ids(r.request_id) for r in siblings[:2]]
    assert tables[0][:3] == tables[1][:3] and tables[0][3] != tables[1][3]
    run_all(scheduler, runner)
    assert [r.num_cached_tokens for r in siblings] == [0, 24, 24]
    assert siblings[0].output_token_ids == siblings[1].output_token_ids == \
        siblings[2].output_token_ids == reference_output(siblings[0], 512)
    assert scheduler.num_prefix_cache_hit_tokens == 48
    assert scheduler.kv_cache_usage == 0.0


def test_add_request_rejects_what_could_never_run():
    scheduler = make_scheduler(block_size=4, num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.add_request(make_request("big", [1] * 10, max_tokens=8))  # 17 KV tokens
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(make_request("long", [1] * 65))
    scheduler.add_request(make_request("ok", [1] * 10, max_tokens=7))  # 16 KV tokens
    with pytest.raises(ValueError, match="in use"):
        scheduler.add_request(make_request("ok", [1] * 4))


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(8, 48))
    prefixes = [[], [1, 2, 3, 1, 2, 3, 1, 2, 1, 3], [3, 3, 2, 2, 1, 1, 3]]
    specs = []
    for i in range(draw(st.integers(1, 12))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(1, 3), max_size=10))
        prompt = (prompt or [1])[:max_model_len]
        max_tokens = draw(st.integers(1, 16))
        params = dict(
            ignore_eos=draw(st.booleans()), min_tokens=draw(st.integers(0, max_tokens)),
            stop_token_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=2)),
        )
        arrival = draw(st.just(0) | st.integers(0, 20))  # bursts make blocks scarce
        abort_at = draw(st.none() | st.integers(0, 40))
        specs.append((f"r{i}", prompt, max_tokens, params, arrival, abort_at))
    longest = max(max(len(p), min(len(p) + m, max_model_len) - 1) for _, p, m, *_ in specs)
    min_blocks = -(-longest // block_size)
    num_blocks = min_blocks + draw(st.integers(0, 3) | st.integers(0, 32))
    config = dict(budget=draw(st.integers(1, 48)), max_num_seqs=draw(st.integers(1, 6)),
                  block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                  caching=draw(st.booleans()))
    return config, specs


def arrive_and_abort(scheduler: Scheduler, specs, requests: dict, step_index: int) -> None:
    """A workload's requests that arrive or are aborted at `step_index`."""
    for request_id, prompt, max_tokens, params, arrival, abort_at in specs:
        if arrival == step_index:
            requests[request_id] = make_request(request_id, prompt, max_tokens, **params)
            scheduler.add_request(requests[request_id])
        if abort_at == step_index and request_id in requests:
            scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_exact_outputs_and_no_leaks(workload):
    config, specs = workload
    scheduler, runner = make_scheduler(**config), FakeRunner(config["block_size"])
    requests, finished_ids = {}, []
    for step_index in range(5000):
        arrive_and_abort(scheduler, specs, requests, step_index)
        if step_index > 20 and not scheduler.has_unfinished_requests():
            break
        plan, _ = step(scheduler, runner)
        finished_ids += plan.finished_request_ids
        assert not set(scheduler.running) & set(scheduler.waiting)
    else:
        pytest.fail("requests did not finish")
    event(f"preempted: {scheduler.num_preemptions_total > 0}")
    event(f"prefix hits: {scheduler.num_prefix_cache_hit_tokens > 0}")
    event(f"aborted: {any(r.status == RequestStatus.FINISHED_ABORTED for r in requests.values())}")
    assert scheduler.kv_cache_usage == 0.0
    assert scheduler.kv_cache_manager.num_free_blocks == config["num_blocks"]
    finished_ids += scheduler.finished_request_ids
    assert sorted(finished_ids) == sorted(requests)
    for request in requests.values():
        expected = reference_output(request, config["max_model_len"])
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected[:request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
            last = expected[-1]
            stopped = request.status == RequestStatus.FINISHED_STOPPED
            assert stopped == (len(expected) >= request.sampling_params.min_tokens and (
                (last == EOS and not request.sampling_params.ignore_eos)
                or last in request.sampling_params.stop_token_ids))
