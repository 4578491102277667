"""Asynchronous scheduling: a decode step launched before the previous step's tokens are known.

A fake executor plays the device: `execute_async` runs the plan at launch (the order a CUDA
stream would run it in), writing every row's token into a dict-backed paged KV cache through the
row's block table and reading the whole context back; a continuation row's token is the one the
executor sampled for the same row of the plan before. Requests must end with exactly the tokens
they generate alone, with every block back in the pool, whether steps were launched ahead or not.
The end-to-end tests compare `LLM.generate` with and without it on a tiny model.
"""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings

from flexserve.engine.engine_core import EngineCore
from flexserve.engine.plan import PLACEHOLDER_TOKEN_ID, BatchPlan, StepResult
from flexserve.engine.request import RequestStatus
from test_scheduler import (
    arrive_and_abort,
    make_request,
    make_scheduler,
    next_token,
    reference_output,
    workloads,
)


class AsyncFakeExecutor:
    """Runs plans at launch against a paged dict cache; continuation rows read the previous
    plan's sampled tokens, which only this executor knows until the engine applies them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.last_sampled: list[int] | None = None
        self.num_continuations = 0

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.block_size], pos % self.block_size

    def execute(self, plan: BatchPlan) -> StepResult:
        return self.execute_async(plan)()

    def execute_async(self, plan: BatchPlan):
        rows = plan.sequences
        if plan.continues_previous:
            self.num_continuations += 1
            assert self.last_sampled is not None and len(self.last_sampled) == len(rows)
            assert all(r.new_token_ids == [PLACEHOLDER_TOKEN_ID] and r.needs_sample for r in rows)
            tokens = [[t] for t in self.last_sampled]
        else:
            assert all(PLACEHOLDER_TOKEN_ID not in r.new_token_ids for r in rows)
            tokens = [r.new_token_ids for r in rows]
        for row, new in zip(rows, tokens):
            end = row.num_computed_tokens + len(new)
            assert len(row.block_ids) >= -(-end // self.block_size)
            for offset, token in enumerate(new):
                self.slots[self._slot(row.block_ids, row.num_computed_tokens + offset)] = token
        result, sampled = StepResult(), []
        for row, new in zip(rows, tokens):
            end = row.num_computed_tokens + len(new)
            context = [self.slots[self._slot(row.block_ids, pos)] for pos in range(end)]
            if row.needs_sample:
                sampled.append(next_token(context))
                result.sampled_token_ids[row.request_id] = sampled[-1]
        self.last_sampled = sampled if len(sampled) == len(rows) else None
        return lambda: result


def run_workload(config, specs, async_scheduling: bool):
    scheduler = make_scheduler(**config)
    executor = AsyncFakeExecutor(config["block_size"])
    core = EngineCore(scheduler, executor, async_scheduling=async_scheduling)
    requests = {}
    for step_index in range(5000):
        arrive_and_abort(scheduler, specs, requests, step_index)
        if step_index > 20 and not (scheduler.has_unfinished_requests() or core.has_pending_step):
            break
        core.step()
        scheduler.kv_cache_manager.check_invariants()
    else:
        pytest.fail("requests did not finish")
    return scheduler, executor, requests


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_launching_ahead_gives_the_tokens_of_synchronous_steps(workload):
    config, specs = workload
    scheduler, executor, requests = run_workload(config, specs, async_scheduling=True)
    event(f"continuations: {executor.num_continuations > 0}")
    event(f"preempted: {scheduler.num_preemptions_total > 0}")
    assert scheduler.kv_cache_usage == 0.0
    assert scheduler.kv_cache_manager.num_free_blocks == config["num_blocks"]
    for request in requests.values():
        expected = reference_output(request, config["max_model_len"])
        if request.status == RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected[:request.num_output_tokens]
        else:
            assert request.output_token_ids == expected


def test_decode_steps_continue_and_waiting_requests_stop_the_chain():
    config = dict(budget=64, max_num_seqs=2, block_size=2, num_blocks=64, max_model_len=64,
                  caching=False)
    specs = [(f"r{i}", [i + 1, 2, 3], 8, dict(ignore_eos=True), 0, None) for i in range(3)]
    scheduler, executor, requests = run_workload(config, specs, async_scheduling=True)
    # r0 and r1 decode together; r2 waits, so no step is launched ahead until one finishes;
    # then r2 is admitted alone and its 7 decode steps after the first token chain up.
    assert executor.num_continuations >= 7
    for request in requests.values():
        assert request.output_token_ids == reference_output(request, 64)


def test_schedule_continuation_refuses_rows_that_read_host_state():
    for params in (dict(logprobs=2), dict(temperature=0.8, seed=3), dict(min_tokens=5),
                   dict(repetition_penalty=1.2)):
        scheduler = make_scheduler()
        request = make_request("r", [1, 2, 3], 8, **params)
        request.seed = params.get("seed")  # the engine sets the effective seed
        scheduler.add_request(request)
        plan = scheduler.schedule()
        assert scheduler.schedule_continuation(plan) is None, params
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [1, 2, 3], 8, temperature=0.8))  # unseeded random
    plan = scheduler.schedule()
    following = scheduler.schedule_continuation(plan)
    assert following is not None and following.continues_previous
    row = following.sequences[0]
    assert (row.num_computed_tokens, row.new_token_ids, row.needs_sample) == (
        3, [PLACEHOLDER_TOKEN_ID], True)
    assert scheduler.requests["r"].num_computed_tokens == 4
    # The next one waits for the first plan's token to be applied, as EngineCore does.
    assert scheduler.schedule_continuation(following) is None
    scheduler.update(plan, StepResult(sampled_token_ids={"r": 5}))
    assert scheduler.schedule_continuation(following) is not None


def test_a_request_ending_at_the_previous_step_wastes_only_its_row():
    scheduler = make_scheduler(block_size=2)
    scheduler.add_request(make_request("r", [1, 2, 3], 1))  # one token: ends at its first update
    executor = AsyncFakeExecutor(2)
    core = EngineCore(scheduler, executor, async_scheduling=True)
    scheduler.add_request(make_request("s", [4, 5], 3))
    updated, _, _ = core.step()  # both prefill; the next step is launched ahead for both rows
    assert [r.request_id for r in updated] == ["r", "s"] and core.has_pending_step
    assert updated[0].status == RequestStatus.FINISHED_LENGTH
    # r's row is wasted, s gets its second token; with r gone the rows no longer match the
    # running requests, so nothing is launched ahead of this step.
    updated, _, _ = core.step()
    assert [r.request_id for r in updated] == ["s"] and not core.has_pending_step
    updated, _, _ = core.step()  # s ends: the step launched ahead is dropped, not waited for
    assert updated[0].status == RequestStatus.FINISHED_LENGTH and not core.has_pending_step
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert updated[0].output_token_ids == reference_output(updated[0], 512)


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_llama(tiny_checkpoint, tiny_config):
    return tiny_checkpoint(tiny_config("llama", num_hidden_layers=2))


def _generate(path, async_scheduling, params, prompts, **kwargs):
    import gc

    import torch

    from flexserve import LLM

    if torch.cuda.is_available():  # three engines in turn: each takes a slice, and frees it
        kwargs["gpu_memory_utilization"] = 0.2

    # fp32: a finished request keeps its row one step longer with async scheduling, so batch
    # sizes differ and 16-bit GEMMs may round differently (a greedy near-tie could flip).
    llm = LLM(path, async_scheduling=async_scheduling, max_model_len=64, dtype="float32",
              **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=3), dict(num_blocks=20, block_size=4, max_num_seqs=8)])
def test_generate_is_token_identical_with_and_without_async_scheduling(tiny_llama, kwargs):
    from flexserve import SamplingParams

    prompts = [[5, 6, 7, 8, 9][: 1 + i % 5] + [i + 10] for i in range(10)]
    reference = _generate(tiny_llama, False, [SamplingParams(
        max_tokens=3 + (i * 7) % 20, temperature=0.0, ignore_eos=True) for i in range(10)],
        prompts, **kwargs)
    # Stop on tokens the requests really generate, at different steps.
    stops = [out[len(out) // 2] for out, _ in reference]
    params = [SamplingParams(max_tokens=3 + (i * 7) % 20, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stops[i]] if i % 2 else []) for i in range(10)]
    sync = _generate(tiny_llama, False, params, prompts, **kwargs)
    ahead = _generate(tiny_llama, True, params, prompts, **kwargs)
    assert ahead == sync
    assert any(reason == "stop" for _, reason in sync)


# ------------------------------------------------------------------- co-serving launched ahead
def _coserve(path, async_scheduling: bool, tmp_path):
    """Generate beside a fine-tuning job to its end; returns (tokens, initial adapter, final
    adapter, plans with fine-tuning work that were launched ahead)."""
    from safetensors.torch import load_file

    from flexserve import LLM, SamplingParams
    from flexserve.finetune.hyperparameters import Hyperparameters

    from _training_data import random_training_data

    # An earlier engine of this test (kept alive by reference cycles) gives its device memory
    # back first: the KV cache is sized from what is free.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    llm = LLM(path, async_scheduling=async_scheduling, max_model_len=64, dtype="float32",
              enable_lora=True, max_lora_rank=4, max_num_batched_tokens=16)
    engine = llm.engine
    ahead = []
    continuation = engine.scheduler.schedule_continuation

    def record(previous):
        plan = continuation(previous)
        if plan is not None and plan.has_finetune_work:
            # What the update of `previous` changes for fine-tuning is not planned over.
            assert not previous.optimizer_steps and not previous.finished_finetune_sequences
            ahead.append(plan)
        return plan

    engine.scheduler.schedule_continuation = record
    job = engine.add_finetune_job(random_training_data([9, 14, 5, 11, 7, 12], seed=4),
                                  Hyperparameters.from_dict({
                                      "batch_size": 3, "n_epochs": 1, "shuffle": False,
                                      "learning_rate": 1e-2, "lr_scheduler": "constant",
                                      "lora": {"r": 4, "alpha": 8,
                                               "target_modules": ["q_proj", "down_proj"]}}))
    adapters = []
    engine.save_finetune_adapter(job.job_id, str(tmp_path / "initial"))
    prompts = [[5, 6, 7, 8][: 1 + i % 4] + [i + 10] for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    while not job.finished:
        engine.step()
    assert job.status.value == "succeeded", job.error
    engine.save_finetune_adapter(job.job_id, str(tmp_path / "final"))
    for name in ("initial", "final"):
        adapters.append(load_file(str(tmp_path / name / "adapter_model.safetensors")))
    assert engine.scheduler.kv_cache_usage == 0.0
    return [o.outputs[0].token_ids for o in outputs], *adapters, ahead


def test_coserving_steps_launched_ahead_train_as_synchronous_steps(tiny_llama, tmp_path):
    """Mixed steps (decode rows and fine-tuning windows) and fine-tuning-only steps are launched
    before the previous step's result is applied, never after a step that ends sequences or
    steps the optimizer; the tokens are the same and the adapter differs only by float rounding
    (other batch shapes): relative difference of the weight change <= 1e-4, as in the
    fine-tuning exactness tests."""
    import torch

    tokens, initial, sync, none_ahead = _coserve(tiny_llama, False, tmp_path / "sync")
    assert not none_ahead
    ahead_tokens, initial_ahead, ahead, plans = _coserve(tiny_llama, True, tmp_path / "ahead")
    assert ahead_tokens == tokens
    assert any(p.sequences and p.finetune_windows for p in plans)  # mixed steps
    assert any(not p.sequences and (p.finetune_windows or p.backward_windows) for p in plans)
    assert any(p.optimizer_steps for p in plans)  # a plan launched ahead may step the optimizer
    keys = sorted(sync)
    assert keys == sorted(ahead)
    change = torch.cat([(sync[k] - initial[k]).double().flatten() for k in keys])
    diff = torch.cat([(ahead[k] - initial_ahead[k] - sync[k] + initial[k]).double().flatten()
                      for k in keys])
    assert change.norm() > 0
    assert float(diff.norm() / change.norm()) <= 1e-4
