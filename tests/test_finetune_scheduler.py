"""The fine-tuning half of the scheduler (pure Python): windows fill the budget inference leaves,
forward windows cover each sequence in order (one per sequence per plan), backward windows go
layer by layer from the top and from the end of the sequence (never in the plan of the
sequence's forward window), every optimizer step follows its step's last backward window, KV
blocks are held from a sequence's start to its last backward window, and a cancel frees them.
Also: the sizer/picker contract, packing of a step's sequences into concurrent bins, the update
feed, and the trainer state of checkpoints."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexserve.config import CacheConfig, SchedulerConfig
from flexserve.engine.finetune_scheduler import (
    FinetuneJobState,
    FinetuneJobStatus,
    FinetuneScheduler,
    TokenBudgetSizer,
    TrainingSequence,
)
from flexserve.engine.kv_cache_manager import KVCacheManager
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.engine.request import Request
from flexserve.engine.scheduler import Scheduler
from flexserve.sampling_params import SamplingParams

NUM_LAYERS = 3
BLOCK = 4


def make_scheduler(budget: int, num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
                     CacheConfig(block_size=BLOCK, num_blocks=num_blocks), num_blocks,
                     max_model_len=64, num_layers=NUM_LAYERS, max_finetune_len=40)


def job(job_id: str, lengths: list[int], steps: list[list[int]],
        pack_capacity: int | None = None, tenant: str = "default") -> FinetuneJobState:
    sequences = [TrainingSequence(list(range(1, n + 1)), [False] + [True] * (n - 1))
                 for n in lengths]
    return FinetuneJobState(job_id, sequences, steps, lora_slot=0, tenant=tenant,
                            pack_capacity=pack_capacity)


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
        forwarded = set()
        for w in plan.finetune_windows:
            key = (w.job_id, w.sequence_id)
            assert w.start == fwd[key] and w.end > w.start
            assert key not in forwarded, "two forward windows of a sequence in one plan"
            forwarded.add(key)
            fwd[key] = w.end
        for w in plan.backward_windows:
            key = (w.job_id, w.sequence_id)
            assert fwd[key] == lengths[key], "backward before the forward finished"
            assert key not in forwarded, "backward in the plan of the sequence's forward window"
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
                                                                 w.end - w.start, 0)
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


# ------------------------------------------------------------------------ sizer and picker
def finetune_only(num_blocks: int = 64) -> FinetuneScheduler:
    return FinetuneScheduler(KVCacheManager(num_blocks, BLOCK), NUM_LAYERS, max_finetune_len=40)


def fold(ft: FinetuneScheduler, plan: BatchPlan, errors: dict[str, str] | None = None) -> None:
    """Update with what a worker would return: loss 2.0 per token, grad norm 0.5 per step."""
    losses = {(w.job_id, w.sequence_id): (2.0 * (w.end - w.start), w.end - w.start, 0)
              for w in plan.finetune_windows}
    ft.update(plan, losses, dict.fromkeys(plan.optimizer_steps, 0.5), errors or {})


def step(ft: FinetuneScheduler, budget: int) -> BatchPlan:
    plan = BatchPlan()
    ft.schedule(plan, TokenBudgetSizer(budget))
    fold(ft, plan)
    return plan


class RecordingPicker:
    """Picks the candidate listed last (the job that started last) and records every call."""

    def __init__(self) -> None:
        self.candidates: list[list[str]] = []
        self.charges: list[tuple[str, int, bool]] = []

    def pick(self, jobs):
        self.candidates.append([j.job_id for j in jobs])
        return jobs[-1]

    def charge(self, job, num_tokens, backward):
        self.charges.append((job.job_id, num_tokens, backward))


class ForwardOnlySizer:
    """Grants forward tokens from a budget and no backward token (a sizer may say 0)."""

    def __init__(self, budget: int) -> None:
        self.remaining = budget

    def forward(self, start, max_tokens):
        n = min(max_tokens, self.remaining)
        self.remaining -= n
        return n

    def backward(self, end, max_tokens):
        return 0


def test_token_budget_sizer_counts_what_it_grants():
    sizer = TokenBudgetSizer(10)
    assert sizer.forward(0, 4) == 4 and sizer.remaining == 6
    assert sizer.backward(9, 9) == 6 and sizer.remaining == 0
    assert sizer.forward(4, 3) == 0 and sizer.backward(3, 3) == 0
    assert TokenBudgetSizer(-5).remaining == 0


def test_picker_chooses_and_is_charged_every_window():
    ft = finetune_only()
    ft.add_job(job("a", [9], [[0]]))
    ft.add_job(job("b", [9], [[0]]))
    picker = RecordingPicker()
    plan = BatchPlan()
    ft.schedule(plan, TokenBudgetSizer(12), picker)
    # b (picked first, as the last candidate) gets its whole forward; a gets what is left.
    assert picker.candidates[0] == ["a", "b"]
    assert [(w.job_id, w.start, w.end) for w in plan.finetune_windows] == [("b", 0, 9),
                                                                          ("a", 0, 3)]
    assert picker.charges == [("b", 9, False), ("a", 3, False)]
    fold(ft, plan)
    plan = BatchPlan()
    ft.schedule(plan, TokenBudgetSizer(100), picker)
    # b's backward (3 layers x 9) and a's last forward window; charges sum to the plan's tokens
    num_tokens = sum(w.end - w.start for w in plan.finetune_windows + plan.backward_windows)
    assert sum(n for _, n, _ in picker.charges[2:]) == num_tokens == 27 + 6
    assert sum(n for _, n, backward in picker.charges[2:] if backward) == 27
    assert plan.optimizer_steps == ["b"]


def test_default_picker_serves_the_job_that_started_first():
    ft = finetune_only()
    ft.add_job(job("a", [9], [[0]]))
    ft.add_job(job("b", [9], [[0]]))
    plan = BatchPlan()
    ft.schedule(plan, TokenBudgetSizer(10))
    assert [(w.job_id, w.end - w.start) for w in plan.finetune_windows] == [("a", 9), ("b", 1)]


def test_a_sizer_that_grants_no_backward_stops_only_backward():
    ft = finetune_only()
    state = job("a", [5, 6], [[0, 1]], pack_capacity=11)
    ft.add_job(state)
    plan = BatchPlan()
    ft.schedule(plan, ForwardOnlySizer(100))
    assert [(w.sequence_id, w.start, w.end) for w in plan.finetune_windows] == [(0, 0, 5),
                                                                                (1, 0, 6)]
    fold(ft, plan)
    plan = BatchPlan()
    ft.schedule(plan, ForwardOnlySizer(100))
    assert plan.is_empty and len(state.running) == 2  # nothing fits; the bin keeps its blocks


# ------------------------------------------------------------------------------- packing
def test_bins_run_concurrently_and_the_optimizer_step_follows_the_last_bin():
    scheduler = make_scheduler(budget=16)
    # Step 0: lengths 10, 3, 5, 4, 9 -> FFD bins of <= 16 tokens: {10, 5}, {9, 4, 3}.
    state = job("a", [10, 3, 5, 4, 9, 7], [[0, 1, 2, 3, 4], [5]], pack_capacity=16)
    scheduler.finetune.add_job(state)
    plans = run(scheduler)
    starts = [[(s.sequence_id, len(s.token_ids)) for s in p.finetune_starts]
              for p in plans if p.finetune_starts]
    # Sequence ids are training positions: example i of step 0 is sequence i, step 1's is 5.
    assert starts == [[(0, 10), (2, 5)], [(1, 3), (3, 4), (4, 9)], [(5, 7)]]
    first = next(p for p in plans if p.finetune_starts)
    assert [(w.sequence_id, w.start, w.end) for w in first.finetune_windows] == [(0, 0, 10),
                                                                                 (2, 0, 5)]
    steps_at = [i for i, p in enumerate(plans) if p.optimizer_steps]
    last_backward_of_step_0 = max(i for i, p in enumerate(plans) for w in p.backward_windows
                                  if w.sequence_id < 5)
    assert steps_at[0] == last_backward_of_step_0
    assert state.status == FinetuneJobStatus.SUCCEEDED and state.losses == [1.0, 1.0]
    assert scheduler.kv_cache_manager.usage == 0.0


def test_packing_trains_short_examples_in_far_fewer_iterations():
    lengths = [3, 4, 5, 6, 3, 4, 5, 6] * 4
    steps = [list(range(i, i + 16)) for i in range(0, 32, 16)]
    counts = {}
    for capacity in (None, 64):
        scheduler = make_scheduler(budget=64)
        state = job("a", lengths, steps, pack_capacity=capacity)
        scheduler.finetune.add_job(state)
        counts[capacity] = len(run(scheduler))
        assert state.status == FinetuneJobStatus.SUCCEEDED
    # Unpacked: one sequence at a time, its forward beside the previous one's backward, so about
    # one iteration per sequence. Packed: 13 of a step's 16 sequences (61 tokens) share one
    # forward iteration, their 3 x 61 backward token-layers the next three; then the last 3.
    assert counts[None] == 34 and counts[64] == 12


def test_a_bin_starts_only_when_all_its_blocks_fit():
    scheduler = make_scheduler(budget=64, num_blocks=8)  # 32 tokens of cache
    scheduler.add_request(Request("r", [1] * 12, SamplingParams(max_tokens=1), 0, 1))
    # One bin of 3 sequences needing 2 + 2 + 2 blocks; the request holds 3 of the 8, so none of
    # the bin starts (not even the two that would fit) until the request frees its blocks.
    scheduler.finetune.add_job(job("a", [8, 8, 8], [[0, 1, 2]], pack_capacity=64))
    plan = scheduler.schedule()
    assert plan.sequences and not plan.finetune_starts
    assert scheduler.kv_cache_manager.num_free_blocks == 5
    scheduler.update(plan, StepResult(sampled_token_ids={"r": 1}))
    plan = scheduler.schedule()
    assert len(plan.finetune_starts) == 3


def test_bins_never_need_more_blocks_than_the_cache_has():
    scheduler = make_scheduler(budget=64, num_blocks=4)  # 16 tokens of cache
    state = job("a", [5, 5, 5], [[0, 1, 2]], pack_capacity=64)  # 2 blocks each
    scheduler.finetune.add_job(state)
    plans = run(scheduler)
    assert [len(p.finetune_starts) for p in plans if p.finetune_starts] == [2, 1]
    assert state.status == FinetuneJobStatus.SUCCEEDED


# --------------------------------------------------------------------- updates and state
def test_updates_report_steps_then_success():
    ft = finetune_only()
    state = job("a", [5, 6, 7], [[0, 1], [2]], pack_capacity=64)
    ft.add_job(state)
    updates = []
    while not state.finished:
        step(ft, 8)
        for update in ft.pop_updates():
            updates.append((update.kind, update.step, update.num_steps, update.loss,
                            update.grad_norm, update.num_trained_tokens))
            if update.kind == "step":  # a step boundary: a checkpoint may be taken right now
                assert state.at_step_boundary
                assert ft.trainer_state("a").step == update.step
    assert updates == [("step", 1, 2, 2.0, 0.5, 11), ("step", 2, 2, 2.0, 0.5, 18),
                       ("succeeded", 2, 2, None, None, 18)]
    assert ft.pop_updates() == []


def test_cancel_and_failure_updates():
    ft = finetune_only()
    ft.add_job(job("a", [9], [[0]]))
    ft.add_job(job("b", [9], [[0]]))
    plan = BatchPlan()
    ft.schedule(plan, TokenBudgetSizer(64))
    ft.end_job("a", FinetuneJobStatus.CANCELLED)
    fold(ft, plan, errors={"b": "the gradient norm is nan"})
    updates = [(u.job_id, u.kind, u.message) for u in ft.pop_updates()]
    assert updates == [("a", "cancelled", "Job cancelled."),
                       ("b", "failed", "the gradient norm is nan")]
    assert ft.kv.usage == 0.0


def test_trainer_state_only_at_a_step_boundary_and_restore_continues_there():
    lengths, steps = [5, 6, 7, 8], [[0, 1], [2, 3]]
    ft = finetune_only()
    state = job("a", lengths, steps, pack_capacity=64)
    ft.add_job(state)
    assert ft.trainer_state("a").step == 0
    step(ft, 4)
    with pytest.raises(ValueError, match="step boundary"):
        ft.trainer_state("a")
    while state.step_index < 1:
        step(ft, 4)
    saved = ft.trainer_state("a")
    assert (saved.step, saved.num_steps, saved.num_sequences_started) == (1, 2, 2)
    assert (saved.losses, saved.grad_norms, saved.num_forward_tokens) == ([2.0], [0.5], 11)
    # A fresh scheduler continues at step 1 with the same sequence ids and counters.
    fresh = finetune_only()
    twin = job("a", lengths, steps, pack_capacity=64)
    fresh.restore(twin, saved)
    fresh.add_job(twin)
    plan = step(fresh, 64)
    assert [s.sequence_id for s in plan.finetune_starts] == [2, 3]
    assert twin.losses == [2.0] and twin.num_forward_tokens == 11 + 15
    while not twin.finished:
        step(fresh, 64)
    while not state.finished:
        step(ft, 4)
    assert twin.losses == state.losses and twin.num_steps == 2
    assert (twin.num_forward_tokens, twin.num_backward_tokens) == (
        state.num_forward_tokens, state.num_backward_tokens)
    with pytest.raises(ValueError, match="other examples"):
        finetune_only().restore(job("a", [5, 6, 7, 9], steps), saved)
    with pytest.raises(ValueError, match="optimizer steps"):
        finetune_only().restore(job("a", lengths, [[0, 1, 2, 3]]), saved)
    done = job("a", lengths, steps)
    ft.restore(done, ft.trainer_state("a"))  # the final checkpoint: nothing left to run
    fresh = finetune_only()
    fresh.add_job(done)
    assert done.status == FinetuneJobStatus.SUCCEEDED
    assert [u.kind for u in fresh.pop_updates()] == ["succeeded"]


@pytest.mark.parametrize("length,overlaps", [(10, True), (30, False)])
def test_next_bin_starts_beside_finishing_ones_only_where_both_fit_the_activation_reserve(
        length, overlaps):
    # max_finetune_len (40) tokens of activations are reserved: two 10-token sequences fit at
    # once, so the next one's forward rides beside the last backward window of this one; two
    # 30-token ones do not, so the next starts in the plan after.
    scheduler = make_scheduler(budget=64)
    state = job("a", [length] * 3, [[0, 1, 2]])
    scheduler.finetune.add_job(state)
    plans = run(scheduler)
    beside = [p for p in plans if p.finished_finetune_sequences and p.finetune_starts]
    assert bool(beside) == overlaps
    assert state.status == FinetuneJobStatus.SUCCEEDED


# ------------------------------------------------------------------ several jobs, one round
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(2, 30), min_size=1, max_size=6),
                          st.integers(1, 3), st.sampled_from([None, 24, 64])),
                min_size=1, max_size=4),
       st.integers(4, 48), st.integers(0, 2))
def test_jobs_share_bins_within_capacity_and_each_step_covers_exactly_its_batch(
        specs, budget, num_cancelled):
    scheduler = make_scheduler(budget, num_blocks=48)
    ft = scheduler.finetune
    jobs = []
    for j, (lengths, batch, capacity) in enumerate(specs):
        steps = [list(range(i, min(i + batch, len(lengths))))
                 for i in range(0, len(lengths), batch)]
        jobs.append(job(f"j{j}", lengths, steps, pack_capacity=capacity))
        ft.add_job(jobs[-1])
    cancelled: set[str] = set()  # ended mid-run: the others must not notice
    started: dict[str, list[int]] = {state.job_id: [] for state in jobs}  # examples, in order
    finished: dict[str, set[int]] = {state.job_id: set() for state in jobs}
    steps_done = dict.fromkeys(started, 0)
    plans = num_rounds = 0
    while ft.has_work():
        plans += 1
        assert plans < 2000
        if plans == 3:
            for state in jobs[:num_cancelled]:
                if not state.finished:
                    ft.end_job(state.job_id, FinetuneJobStatus.CANCELLED)
                    cancelled.add(state.job_id)
        plan = scheduler.schedule()
        if ft.num_rounds != num_rounds:  # a new round: every bin within the jobs' capacity
            num_rounds = ft.num_rounds
            for round_bin in ft.round:
                packed = [(j, e) for j, _, e in round_bin if ft.jobs[j].pack_capacity is not None]
                if len(packed) > 1:
                    assert sum(len(ft.jobs[j].sequences[e].token_ids) for j, e in packed) <= min(
                        ft.jobs[j].pack_capacity for j, _ in packed)
        for start in plan.finetune_starts:
            state = ft.jobs[start.job_id]
            index = state.sequences.index(next(s for s in state.sequences
                                               if s.token_ids == start.token_ids))
            started[start.job_id].append(start.sequence_id)
            # Sequence ids are training positions: a start belongs to the job's current step.
            step = state.steps[state.step_index]
            first = sum(len(s) for s in state.steps[:state.step_index])
            assert first <= start.sequence_id < first + len(step), (start, index)
        for job_id in plan.optimizer_steps:
            state = ft.jobs[job_id]
            first = sum(len(s) for s in state.steps[:state.step_index])
            step_ids = set(range(first, first + len(state.steps[state.step_index])))
            # The step's update follows exactly its batch's sequences, all of them finished.
            done = finished[job_id] | {sid for jid, sid in plan.finished_finetune_sequences
                                       if jid == job_id}
            assert step_ids <= done and not (done - step_ids - set(range(first)))
            steps_done[job_id] += 1
        for job_id, sequence_id in plan.finished_finetune_sequences:
            finished[job_id].add(sequence_id)
        result = StepResult()
        for w in plan.finetune_windows:
            result.finetune_losses[(w.job_id, w.sequence_id)] = (1.0, w.end - w.start, 0)
        for job_id in plan.optimizer_steps:
            result.grad_norms[job_id] = 1.0
        scheduler.update(plan, result)
        scheduler.kv_cache_manager.check_invariants()
    for state in jobs:
        if state.job_id in cancelled:
            assert state.status == FinetuneJobStatus.CANCELLED
            continue
        assert state.status == FinetuneJobStatus.SUCCEEDED
        assert steps_done[state.job_id] == state.num_steps
        assert sorted(started[state.job_id]) == list(range(len(state.sequences)))
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_jobs_sequences_go_down_the_layers_in_lockstep():
    """Backward windows of one job's sequences in a plan pair up layer by layer (the worker runs
    each layer's pair as one window), within the same budget."""
    ft = finetune_only()
    ft.add_job(job("a", [10, 6], [[0, 1]], pack_capacity=16))
    first = step(ft, 32)
    assert [(w.sequence_id, w.end) for w in first.finetune_windows] == [(0, 10), (1, 6)]
    plans = [step(ft, 32) for _ in range(2)]
    windows = [[(w.sequence_id, w.layer, w.start, w.end) for w in p.backward_windows]
               for p in plans]
    assert windows == [[(0, 2, 0, 10), (1, 2, 0, 6), (0, 1, 0, 10), (1, 1, 0, 6)],
                       [(0, 0, 0, 10), (1, 0, 0, 6)]]
    assert plans[1].optimizer_steps == ["a"]


def grouped_jobs(groups: dict[str, tuple], lockstep_jobs: bool = False) -> FinetuneScheduler:
    """A fine-tuning-only scheduler with one three-example job per entry of `groups` (job id ->
    its window group)."""
    ft = finetune_only()
    ft.lockstep_jobs = lockstep_jobs
    for job_id, group in groups.items():
        state = job(job_id, [9, 7, 12], [[0, 1], [2]], pack_capacity=40)
        state.window_group = group
        ft.add_job(state)
    return ft


def test_forward_windows_of_one_plan_share_an_iteration_only_with_their_window_group():
    """Jobs of another window group (another LoRA rank or targets: the worker's graph of an
    iteration writes one plan's activations) never put forward windows in the same plan; the
    jobs of one group do, and every job finishes."""
    groups = {"a": (8, ("down_proj",)), "b": (16, ("down_proj",)), "c": (8, ("down_proj",))}
    ft = grouped_jobs(groups)
    shared = 0
    for _ in range(300):
        if not ft.has_work():
            break
        plan = step(ft, 30)
        jobs = {w.job_id for w in plan.finetune_windows}
        assert len({groups[j] for j in jobs}) <= 1, plan.finetune_windows
        shared += jobs == {"a", "c"}
    assert not ft.has_work() and shared > 0
    assert all(ft.jobs[j].status == FinetuneJobStatus.SUCCEEDED for j in groups)


def test_jobs_of_one_window_group_run_their_backward_in_lockstep():
    """The backward windows of the jobs of one window group (one plan, whose backward pieces
    they share) move in lockstep: a plan's windows of one layer of every job's sequences follow
    each other (the worker runs them as one); a job of another group keeps its own lockstep.
    Every job still finishes, each step covering exactly its batch."""
    groups = {"a": (8, ("down_proj",)), "b": (8, ("down_proj",)), "c": (16, ("down_proj",))}
    ft = grouped_jobs(groups, lockstep_jobs=True)
    mixed_layers = 0
    for _ in range(300):
        if not ft.has_work():
            break
        plan = step(ft, 40)
        windows = [(w.job_id, w.layer) for w in plan.backward_windows]
        # Windows of a and b of one layer are next to each other: a layer of the group is one
        # run of consecutive windows.
        runs = [key for i, key in enumerate(windows)
                if groups[key[0]] == groups["a"] and (i == 0 or windows[i - 1][1] != key[1]
                                                      or groups[windows[i - 1][0]] != groups["a"])]
        layers = [layer for _, layer in runs]
        assert len(layers) == len(set(layers)), windows
        for layer in set(layers):
            jobs = {j for j, w_layer in windows if w_layer == layer and groups[j] == groups["a"]}
            mixed_layers += jobs == {"a", "b"}
    assert not ft.has_work() and mixed_layers > 0
    assert all(ft.jobs[j].status == FinetuneJobStatus.SUCCEEDED for j in groups)
