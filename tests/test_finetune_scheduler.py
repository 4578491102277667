"""The fine-tuning half of the scheduler (pure Python): windows fill the budget inference leaves,
forward windows cover each sequence in order, backward windows go layer by layer from the top and
from the end of the sequence, every optimizer step follows its step's last backward window, KV
blocks are held from a sequence's start to its last backward window, and a cancel frees them."""

from __future__ import annotations

import random

import pytest

from flexserve.config import CacheConfig, SchedulerConfig
from flexserve.engine.finetune_scheduler import (
    FinetuneJobState,
    FinetuneJobStatus,
    TrainingSequence,
)
from flexserve.engine.plan import StepResult
from flexserve.engine.request import Request
from flexserve.engine.scheduler import Scheduler
from flexserve.sampling_params import SamplingParams

NUM_LAYERS = 3
BLOCK = 4


def make_scheduler(budget: int, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
                     CacheConfig(block_size=BLOCK, num_blocks=num_blocks), num_blocks,
                     max_model_len=64, num_layers=NUM_LAYERS, max_finetune_len=40)


def job(job_id: str, lengths: list[int], steps: list[list[int]]) -> FinetuneJobState:
    sequences = [TrainingSequence(list(range(1, n + 1)), [False] + [True] * (n - 1))
                 for n in lengths]
    return FinetuneJobState(job_id, sequences, steps, lora_slot=0)


def run(scheduler: Scheduler, max_steps: int = 500) -> list:
    """Step until fine-tuning is done; check every plan against the rules; returns the plans."""
    plans = []
    fwd: dict[tuple[str, int], int] = {}  # next forward position per sequence
    bwd: dict[tuple[str, int], tuple[int, int]] = {}  # (layer, end) of the next backward window
    lengths: dict[tuple[str, int], int] = {}
    for _ in range(max_steps):
        plan = scheduler.schedule()
        if plan.is_empty:
            break
        used = sum(r.num_scheduled_tokens for r in plan.sequences)
        used += sum(w.end - w.start for w in plan.finetune_windows)
        used += sum(w.end - w.start for w in plan.backward_windows)
        assert used <= scheduler.scheduler_config.max_num_batched_tokens
        for start in plan.finetune_starts:
            key = (start.job_id, start.sequence_id)
            lengths[key] = len(start.token_ids)
            fwd[key] = 0
            assert len(start.block_ids) * BLOCK >= len(start.token_ids)
        for w in plan.finetune_windows:
            key = (w.job_id, w.sequence_id)
            assert w.start == fwd[key] and w.end > w.start
            fwd[key] = w.end
        for w in plan.backward_windows:
            key = (w.job_id, w.sequence_id)
            assert fwd[key] == lengths[key], "backward before the forward finished"
            layer, end = bwd.get(key, (NUM_LAYERS - 1, lengths[key]))
            assert (w.layer, w.end) == (layer, end) and 0 <= w.start < w.end
            bwd[key] = (layer, w.start) if w.start else (layer - 1, lengths[key])
        for key in plan.finished_finetune_sequences:
            assert bwd[key] == (-1, lengths[key])
        result = StepResult()
        for row in plan.sequences:
            if row.needs_sample:
                result.sampled_token_ids[row.request_id] = 1
        for w in plan.finetune_windows:
            result.finetune_losses[(w.job_id, w.sequence_id)] = (1.0 * (w.end - w.start),
                                                                 w.end - w.start)
        for job_id in plan.optimizer_steps:
            result.grad_norms[job_id] = 1.0
        scheduler.update(plan, result)
        scheduler.kv_cache_manager.check_invariants()
        plans.append(plan)
    return plans


@pytest.mark.parametrize("budget", [1, 3, 7, 64])
def test_windows_follow_algorithm_2(budget):
    scheduler = make_scheduler(budget)
    state = job("a", [9, 5, 13], [[0, 1], [2]])
    scheduler.finetune.add_job(state)
    plans = run(scheduler)
    assert state.status == FinetuneJobStatus.SUCCEEDED
    assert [p.optimizer_steps for p in plans if p.optimizer_steps] == [["a"], ["a"]]
    assert len(state.losses) == 2 and state.losses == [1.0, 1.0]
    assert scheduler.kv_cache_manager.usage == 0.0


def test_inference_goes_first_and_finetuning_takes_the_rest():
    scheduler = make_scheduler(budget=8)
    scheduler.add_request(Request("r", list(range(6)), SamplingParams(max_tokens=3), 0, 3))
    scheduler.finetune.add_job(job("a", [20], [[0]]))
    plan = scheduler.schedule()
    assert plan.sequences[0].num_scheduled_tokens == 6
    assert [(w.start, w.end) for w in plan.finetune_windows] == [(0, 2)]


def test_random_workloads_with_inference_and_two_jobs():
    rng = random.Random(0)
    for trial in range(20):
        scheduler = make_scheduler(rng.randint(1, 20), num_blocks=rng.randint(12, 40))
        jobs = []
        for j in range(2):
            lengths = [rng.randint(2, 30) for _ in range(rng.randint(1, 4))]
            steps = [[i] for i in range(len(lengths))]
            jobs.append(job(f"j{j}", lengths, steps))
            scheduler.finetune.add_job(jobs[-1])
        for i in range(rng.randint(0, 4)):
            scheduler.add_request(Request(f"r{i}", [1] * rng.randint(1, 10),
                                          SamplingParams(max_tokens=2), 0, 2))
        run(scheduler)
        assert not scheduler.has_unfinished_requests()
        assert all(j.status == FinetuneJobStatus.SUCCEEDED for j in jobs), trial
        assert scheduler.kv_cache_manager.usage == 0.0


def test_cancel_frees_the_sequence_blocks():
    scheduler = make_scheduler(budget=4)
    state = job("a", [30], [[0]])
    scheduler.finetune.add_job(state)
    scheduler.schedule()
    assert scheduler.kv_cache_manager.usage > 0
    scheduler.finetune.end_job("a", FinetuneJobStatus.CANCELLED)
    assert scheduler.kv_cache_manager.usage == 0.0
    assert scheduler.schedule().is_empty


def test_a_sequence_waits_for_kv_blocks_that_inference_holds():
    scheduler = make_scheduler(budget=64, num_blocks=8)  # 32 tokens of cache
    scheduler.add_request(Request("r", [1] * 20, SamplingParams(max_tokens=1), 0, 1))
    scheduler.finetune.add_job(job("a", [30], [[0]]))
    plan = scheduler.schedule()
    assert plan.sequences and not plan.finetune_starts  # 8 blocks needed, 3 free: it waits
    result = StepResult(sampled_token_ids={"r": 1})
    scheduler.update(plan, result)  # the request ends and frees its blocks
    assert scheduler.schedule().finetune_starts


def test_sequences_longer_than_max_finetune_len_or_the_cache_are_refused():
    scheduler = make_scheduler(budget=8)
    with pytest.raises(ValueError, match="max_finetune_len"):
        scheduler.finetune.add_job(job("a", [41], [[0]]))
    small = make_scheduler(budget=8, num_blocks=4)
    with pytest.raises(ValueError, match="KV cache holds 16"):
        small.finetune.add_job(job("a", [17], [[0]]))
