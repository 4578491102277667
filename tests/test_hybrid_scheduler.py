"""The hybrid token scheduler (FlexLLM 6.2) with an injected latency model and clock: windows are
the largest that fit the TPOT SLO, no plan is predicted over the SLO when the inference work alone
fits, idle iterations are filled, saturated ones keep only the minimum share, TTFT pressure shrinks
fine-tuning first, the sharing policies build the iterations they promise, and waiting requests
are admitted fairly by tenant (Virtual Token Counter)."""

from __future__ import annotations

import math
import random
from dataclasses import fields

import pytest

from flexserve.config import CacheConfig, CoserveConfig, SchedulerConfig
from flexserve.engine.finetune_scheduler import FinetuneJobState, TrainingSequence
from flexserve.engine.hybrid_scheduler import (
    MAX_ITERATION_SLOS,
    TPOT_MEAN_WINDOW,
    WINDOW_ALIGNMENT,
)
from flexserve.engine.iteration_shape import IterationShape, plan_shape
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.engine.request import Request
from flexserve.engine.scheduler import Scheduler
from flexserve.sampling_params import SamplingParams

NUM_LAYERS = 4
BLOCK = 16
BUDGET = 512
SLO_MS = 20.0
MARGIN = 0.1
LIMIT = SLO_MS / 1000 * (1 - MARGIN)


class FakeLatencyModel:
    """A monotone latency model with known coefficients (seconds)."""

    error_ratio = 0.0
    scale = 1.0
    backward_scale = 1.0

    def __init__(self, per_token: float = 2e-5, per_decode_context: float = 1e-7,
                 per_backward_token: float = 1e-5, base: float = 2e-3) -> None:
        self.per_token = per_token
        self.per_decode_context = per_decode_context
        self.per_backward_token = per_backward_token
        self.base = base
        self.observed: list[tuple[IterationShape, float]] = []

    def predict(self, shape: IterationShape) -> float:
        return (self.base + self.per_token * shape.total_forward_tokens
                + self.per_decode_context * shape.decode_context
                + self.per_backward_token * shape.backward_tokens)

    def observe(self, shape: IterationShape, seconds: float) -> None:
        self.observed.append((shape, seconds))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(policy: str = "coserve", model: FakeLatencyModel | None = None,
                   clock: Clock | None = None, max_num_seqs: int = 64,
                   num_blocks: int = 2048, **coserve) -> Scheduler:
    config = CoserveConfig(**{"policy": policy, "slo_tpot_ms": SLO_MS, "slo_margin": MARGIN,
                              **coserve})
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks), num_blocks, max_model_len=4096,
        num_layers=NUM_LAYERS, max_finetune_len=4096, coserve_config=config,
        latency_model=model or FakeLatencyModel(), clock=clock or Clock())


def add_job(scheduler: Scheduler, job_id: str = "job", lengths=(2000,), tenant: str = "default",
            batch_size: int = 1) -> FinetuneJobState:
    sequences = [TrainingSequence(list(range(1, n + 1)), [False] + [True] * (n - 1))
                 for n in lengths]
    steps = [list(range(i, min(i + batch_size, len(lengths))))
             for i in range(0, len(lengths), batch_size)]
    job = FinetuneJobState(job_id, sequences, steps, lora_slot=0)
    job.tenant = tenant
    scheduler.finetune.add_job(job)
    return job


def add_request(scheduler: Scheduler, request_id: str, prompt_len: int = 32,
                max_tokens: int = 64, tenant: str = "default", arrival: float | None = None
                ) -> Request:
    request = Request(request_id, list(range(1, prompt_len + 1)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, max_tokens,
                      arrival_time=arrival if arrival is not None else scheduler.clock(),
                      tenant=tenant)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler) -> BatchPlan:
    """Schedule, then apply a result that samples token 1 for every row at its end."""
    plan = scheduler.schedule()
    result = StepResult()
    for row in plan.sequences:
        if row.needs_sample:
            result.sampled_token_ids[row.request_id] = 1
    for w in plan.finetune_windows:
        result.finetune_losses[(w.job_id, w.sequence_id)] = (float(w.end - w.start),
                                                             w.end - w.start, 0)
    for job_id in plan.optimizer_steps:
        result.grad_norms[job_id] = 1.0
    scheduler.update(plan, result)
    return plan


def inference_shape(plan: BatchPlan) -> IterationShape:
    only_rows = BatchPlan(sequences=plan.sequences, num_batched_tokens=plan.num_batched_tokens)
    return plan_shape(only_rows)


def finetune_tokens(plan: BatchPlan) -> int:
    return (sum(w.end - w.start for w in plan.finetune_windows)
            + sum(w.end - w.start for w in plan.backward_windows) / NUM_LAYERS)


def test_idle_iterations_take_the_whole_token_budget():
    # No request running or waiting: nothing to protect, so the SLO does not size the window
    # (fine-tuning alone runs as fast as the offline engine), though the model says ~400 fit.
    model = FakeLatencyModel(per_token=4e-5)
    scheduler = make_scheduler(model=model)
    add_job(scheduler, lengths=(3000,))
    plan = step(scheduler)
    (window,) = plan.finetune_windows
    assert window.end - window.start == BUDGET
    assert model.predict(plan_shape(plan)) > LIMIT


def test_slo_sizes_the_window_beside_a_running_request():
    model = FakeLatencyModel(per_token=4e-5)  # about 400 tokens fit, below the token budget
    scheduler = make_scheduler(model=model)
    add_job(scheduler, lengths=(3000,))
    add_request(scheduler, "r", prompt_len=4, max_tokens=50)
    step(scheduler)  # the prompt
    plan = step(scheduler)
    n = sum(w.end - w.start for w in plan.finetune_windows)
    # The largest window that fits with the iteration's tokens on a multiple of
    # WINDOW_ALIGNMENT (a CUDA-graph bucket): it fits, WINDOW_ALIGNMENT more does not.
    assert 0 < n < BUDGET and plan_shape(plan).total_forward_tokens % WINDOW_ALIGNMENT == 0
    assert model.predict(plan_shape(plan)) <= LIMIT
    assert model.predict(plan_shape(plan) + IterationShape(finetune_tokens=WINDOW_ALIGNMENT)) > LIMIT


def test_backward_windows_take_the_token_budget_when_idle():
    model = FakeLatencyModel(per_backward_token=3e-5)  # about 530 layer-tokens fit the SLO
    scheduler = make_scheduler(model=model)
    add_job(scheduler, lengths=(300,))
    for _ in range(5):
        plan = step(scheduler)
        if plan.backward_windows:
            break
    assert plan.backward_windows
    assert sum(w.end - w.start for w in plan.backward_windows) >= min(300, BUDGET)


@pytest.mark.parametrize("seed", range(6))
def test_no_plan_is_predicted_over_the_slo_when_inference_alone_fits(seed):
    rng = random.Random(seed)
    clock = Clock()
    model = FakeLatencyModel(per_token=rng.uniform(1e-5, 4e-5),
                             per_decode_context=rng.uniform(0, 4e-7))
    scheduler = make_scheduler(model=model, clock=clock)
    add_job(scheduler, "a", lengths=[rng.randint(50, 900) for _ in range(12)], batch_size=2)
    add_job(scheduler, "b", lengths=[rng.randint(50, 900) for _ in range(10)], tenant="t2")
    checked = 0
    for i in range(300):
        if rng.random() < 0.3:
            add_request(scheduler, f"r{i}", prompt_len=rng.randint(1, 400),
                        max_tokens=rng.randint(1, 60))
        clock.now += 0.01
        plan = step(scheduler)
        # (iterations without a running request take the token budget: nothing to protect)
        if plan.sequences and (plan.finetune_windows or plan.backward_windows):
            if model.predict(inference_shape(plan)) <= LIMIT:
                assert model.predict(plan_shape(plan)) <= LIMIT + 1e-12
                checked += 1
        scheduler.kv_cache_manager.check_invariants()
    assert checked > 20


def test_saturated_inference_runs_no_fine_tuning_beside_it_by_default():
    # Decode rows alone cost more than the SLO: by default fine-tuning waits, so no request is
    # slowed beyond what it costs alone; with no request left it runs again.
    model = FakeLatencyModel(per_token=1e-4)
    scheduler = make_scheduler(model=model, max_num_seqs=BUDGET)
    assert scheduler.hybrid.floor_tokens == 0
    for i in range(BUDGET - 64):
        add_request(scheduler, f"r{i}", prompt_len=1, max_tokens=3)
    add_job(scheduler, lengths=(3000,))
    step(scheduler)  # admits the prompts (they alone exceed the SLO)
    saturated = 0
    while scheduler.num_running:
        plan = step(scheduler)
        if plan.sequences:
            assert model.predict(inference_shape(plan)) > LIMIT
            assert not (plan.finetune_windows or plan.backward_windows), plan
            saturated += 1
    assert saturated >= 2
    idle = step(scheduler)
    assert not idle.sequences and sum(w.end - w.start for w in idle.finetune_windows) > 0


def test_saturated_inference_leaves_fine_tuning_its_opt_in_minimum_share():
    # Decode rows alone cost more than the SLO: fine-tuning gets exactly the floor asked for.
    model = FakeLatencyModel(per_token=1e-4)
    scheduler = make_scheduler(model=model, finetune_min_share=0.05, max_num_seqs=BUDGET)
    floor = math.ceil(0.05 * BUDGET)
    for i in range(BUDGET - 64):
        add_request(scheduler, f"r{i}", prompt_len=1, max_tokens=500)
    add_job(scheduler, lengths=(3000,))
    step(scheduler)  # admits the prompts (they alone exceed the SLO)
    for _ in range(3):
        plan = step(scheduler)
        assert model.predict(inference_shape(plan)) > LIMIT
        assert sum(w.end - w.start for w in plan.finetune_windows) == floor


def test_ttft_pressure_shrinks_fine_tuning_to_its_minimum_share():
    clock = Clock()
    model = FakeLatencyModel()
    scheduler = make_scheduler(model=model, clock=clock, max_num_seqs=1,
                               finetune_min_share=0.02, slo_ttft_ms=1000.0, ttft_pressure=0.5)
    add_job(scheduler, lengths=(4000,))
    add_request(scheduler, "running", prompt_len=8, max_tokens=1000)
    step(scheduler)
    # A second request cannot be admitted (max_num_seqs=1) and waits.
    add_request(scheduler, "waiting", prompt_len=8, arrival=clock.now)
    relaxed = step(scheduler)
    clock.now += 0.6  # it has waited longer than half the TTFT SLO
    pressured = step(scheduler)
    assert sum(w.end - w.start for w in relaxed.finetune_windows) > math.ceil(0.02 * BUDGET)
    assert sum(w.end - w.start for w in pressured.finetune_windows) == math.ceil(0.02 * BUDGET)


def test_inference_only_never_fine_tunes_while_requests_run():
    scheduler = make_scheduler(policy="inference-only")
    add_job(scheduler, lengths=(100,))
    add_request(scheduler, "r", prompt_len=8, max_tokens=5)
    for _ in range(5):
        plan = step(scheduler)
        assert not (plan.finetune_windows or plan.backward_windows or plan.finetune_starts)


def test_temporal_sharing_runs_a_fine_tuning_step_every_n_iterations():
    scheduler = make_scheduler(policy="temporal", temporal_frequency=3)
    add_job(scheduler, lengths=(40,) * 6)
    add_request(scheduler, "r", prompt_len=8, max_tokens=10_000)
    kinds = []
    for _ in range(40):
        plan = step(scheduler)
        has_finetune = bool(plan.finetune_windows or plan.backward_windows)
        assert not (has_finetune and plan.sequences), "a fine-tuning phase holds inference back"
        kinds.append("F" if has_finetune else "I")
        if plan.optimizer_steps:
            kinds.append("|")
    pattern = "".join(kinds)
    # Three inference iterations, then fine-tuning iterations up to an optimizer step, repeated.
    phases = pattern.split("|")
    for phase in phases[:-1]:
        assert phase.startswith("III") and set(phase[3:]) == {"F"}, pattern


def test_spatial_sharing_runs_fine_tuning_concurrently_every_iteration():
    scheduler = make_scheduler(policy="spatial")
    add_job(scheduler, lengths=(600,))
    add_request(scheduler, "r", prompt_len=8, max_tokens=100)
    plan = step(scheduler)
    assert plan.finetune_concurrent and plan.sequences and plan.finetune_windows
    assert plan.num_batched_tokens <= BUDGET


def test_no_slo_fills_the_token_budget():
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=BUDGET),
                          CacheConfig(block_size=BLOCK, num_blocks=512), 512,
                          max_model_len=4096, num_layers=NUM_LAYERS, max_finetune_len=4096)
    add_job(scheduler, lengths=(3000,))
    plan = step(scheduler)
    assert sum(w.end - w.start for w in plan.finetune_windows) == BUDGET


def test_waiting_requests_are_admitted_fairly_by_tenant():
    # Tenant A floods the queue; B's requests arrive later but are admitted as soon as A has
    # been served more (VTC), not after A's whole backlog.
    scheduler = make_scheduler(policy="inference-only", max_num_seqs=2)
    for i in range(10):
        add_request(scheduler, f"a{i}", prompt_len=64, max_tokens=2, tenant="A")
    for i in range(3):
        add_request(scheduler, f"b{i}", prompt_len=64, max_tokens=2, tenant="B")
    admitted = []
    for _ in range(40):
        plan = step(scheduler)
        admitted.extend(r.request_id for r in plan.sequences if r.request_id not in admitted)
    b_positions = [admitted.index(f"b{i}") for i in range(3)]
    assert b_positions[0] <= 2 and b_positions[-1] <= 6, admitted
    assert admitted.index("a9") > b_positions[-1]


def test_a_single_tenant_is_served_first_come_first_served():
    scheduler = make_scheduler(policy="inference-only", max_num_seqs=3)
    for i in range(8):
        add_request(scheduler, f"r{i}", prompt_len=16, max_tokens=3)
    admitted = []
    for _ in range(30):
        plan = step(scheduler)
        admitted.extend(r.request_id for r in plan.sequences if r.request_id not in admitted)
    assert admitted == [f"r{i}" for i in range(8)]


def test_the_latency_model_observes_every_executed_plan():
    from flexserve.engine.engine_core import EngineCore

    model = FakeLatencyModel()
    scheduler = make_scheduler(model=model)
    add_request(scheduler, "r", prompt_len=8, max_tokens=3)

    class Executor:
        def execute(self, plan):
            result = StepResult()
            for row in plan.sequences:
                if row.needs_sample:
                    result.sampled_token_ids[row.request_id] = 1
            return result

    core = EngineCore(scheduler, Executor())
    for _ in range(3):
        core.step()
    assert len(model.observed) == 3
    assert {f.name for f in fields(IterationShape)} >= {"prefill_tokens", "decode_rows"}
    assert model.observed[0][0].prefill_tokens == 8
    assert model.observed[1][0].decode_rows == 1


def test_host_overhead_between_steps_is_taken_off_the_limit():
    """A running request's next token also waits for the host work between two iterations, so
    windows are sized against the limit minus the overhead's average; pauses longer than the
    limit are not a per-iteration cost and leave the average alone."""
    model = FakeLatencyModel(per_token=4e-5)
    scheduler = make_scheduler(model=model)
    add_job(scheduler, lengths=(3000,))
    hybrid = scheduler.hybrid
    overhead = 0.004
    for _ in range(200):
        hybrid.observe_overhead(overhead)
    hybrid.observe_overhead(5 * LIMIT)  # a pause
    hybrid.observe_overhead(-1.0)  # a clock that went back
    assert hybrid.overhead_s == pytest.approx(overhead, rel=1e-6)
    assert hybrid.effective_limit_s == pytest.approx(LIMIT - overhead)

    def window_beside_a_request(scheduler):
        add_request(scheduler, "r", prompt_len=4, max_tokens=50)
        step(scheduler)  # the prompt
        plan = step(scheduler)
        return plan, sum(w.end - w.start for w in plan.finetune_windows)

    plan, n = window_beside_a_request(scheduler)
    assert model.predict(plan_shape(plan)) <= LIMIT - overhead
    assert model.predict(plan_shape(plan) + IterationShape(finetune_tokens=WINDOW_ALIGNMENT)) \
        > LIMIT - overhead
    # Without the overhead the same job gets a larger window.
    fresh = make_scheduler(model=model)
    add_job(fresh, lengths=(3000,))
    assert window_beside_a_request(fresh)[1] > n


def test_the_engine_measures_host_overhead_only_while_tokens_wait(monkeypatch):
    """The gap from one synchronous step's execute end to the next step's start is sampled
    when requests were running after it, and not after the last request finished."""
    import flexserve.engine.engine_core as engine_core

    now = [0.0]
    monkeypatch.setattr(engine_core.time, "perf_counter", lambda: now[0])
    scheduler = make_scheduler(model=FakeLatencyModel())
    add_request(scheduler, "r", prompt_len=8, max_tokens=3)
    samples: list[float] = []
    monkeypatch.setattr(scheduler.hybrid, "observe_overhead", samples.append)

    class Executor:
        def execute(self, plan):
            now[0] += 0.020  # the device
            result = StepResult()
            for row in plan.sequences:
                if row.needs_sample:
                    result.sampled_token_ids[row.request_id] = 1
            return result

    core = engine_core.EngineCore(scheduler, Executor())
    core.step()  # prefill: first token, the request keeps running
    now[0] += 0.003  # the caller hands the output out
    core.step()  # second token
    now[0] += 0.005
    core.step()  # third token: the request finishes
    now[0] += 1.0  # idle
    core.step()  # nothing to do
    assert [round(s, 6) for s in samples] == [0.003, 0.005]


def test_fine_tuning_jobs_of_two_tenants_share_windows_by_vtc():
    from flexserve.engine.fairness import VirtualTokenCounter
    from flexserve.engine.hybrid_scheduler import VTCJobPicker

    vtc = VirtualTokenCounter()
    picker = VTCJobPicker(vtc, NUM_LAYERS)
    a = FinetuneJobState("a", [], [], lora_slot=0)
    b = FinetuneJobState("b", [], [], lora_slot=1)
    a.tenant, b.tenant = "A", "B"
    vtc.enqueue("A", "job:a")
    vtc.enqueue("B", "job:b")
    picker.charge(a, 10, backward=False)
    assert picker.pick([a, b]) is b
    picker.charge(b, 6, backward=True)  # 6 layer-tokens of 4 layers: one whole token so far
    assert vtc.counter("B") == 1.0
    picker.charge(b, 2, backward=True)  # 8 layer-tokens: two tokens
    assert vtc.counter("B") == 2.0
    picker.charge(b, 9, backward=False)
    assert picker.pick([a, b]) is a and vtc.counter("B") == 11.0

    # In the scheduler: two tenants' jobs, idle GPU, token budget split by the counters.
    scheduler = make_scheduler()
    add_job(scheduler, "x", lengths=(3000,), tenant="X")
    add_job(scheduler, "y", lengths=(3000,), tenant="Y")
    served = {"x": 0, "y": 0}
    for _ in range(6):
        plan = step(scheduler)
        for w in plan.finetune_windows:
            served[w.job_id] += w.end - w.start
    assert served["x"] > 0 and served["y"] > 0
    assert abs(served["x"] - served["y"]) <= BUDGET


def test_an_idle_device_too_slow_for_the_slo_still_makes_progress():
    # Every window is predicted over the SLO; with no request the budget applies regardless.
    model = FakeLatencyModel(base=1.0, per_token=1e-3)
    scheduler = make_scheduler(model=model, finetune_min_share=0.02)
    add_job(scheduler, lengths=(1000,))
    plan = step(scheduler)
    assert sum(w.end - w.start for w in plan.finetune_windows) == BUDGET
    # With inference rows that fit, nothing is forced beside them: backward, which is
    # predicted over the SLO, does not run.
    fast_rows = FakeLatencyModel(base=0.0, per_token=1e-6, per_backward_token=1.0)
    scheduler.hybrid.latency_model = fast_rows
    add_request(scheduler, "r", prompt_len=4, max_tokens=50)
    checked = 0
    for _ in range(8):
        plan = step(scheduler)
        if plan.sequences:
            assert fast_rows.predict(inference_shape(plan)) <= LIMIT
            assert not plan.backward_windows
            checked += 1
    assert checked >= 5


class FixedWindowCostModel(FakeLatencyModel):
    """FakeLatencyModel plus a fixed cost for an iteration with any fine-tuning work (the host
    cost of a window iteration, which dominates small windows on the GPU)."""

    def __init__(self, fixed: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fixed = fixed

    def predict(self, shape: IterationShape) -> float:
        busy = shape.finetune_tokens or shape.backward_tokens
        return super().predict(shape) + (self.fixed if busy else 0.0)


def _run_with_a_request(mode: str, steps: int = 120) -> tuple[list[float], int]:
    """Iteration times (as predicted: the fake device runs exactly to the model) of the steps
    with the running request, and fine-tuning forward tokens placed beside it."""
    model = FixedWindowCostModel(fixed=0.95 * LIMIT, base=2e-3, per_token=1e-5)
    scheduler = make_scheduler(model=model, slo_tpot_mode=mode)
    add_job(scheduler, lengths=(4000,))
    add_request(scheduler, "r", prompt_len=8, max_tokens=10_000)
    times, tokens = [], 0
    for _ in range(steps):
        plan = step(scheduler)
        seconds = model.predict(plan_shape(plan))
        scheduler.observe_iteration(plan, seconds)
        assert plan.sequences
        times.append(seconds)
        tokens += sum(w.end - w.start for w in plan.finetune_windows)
    return times, tokens


def test_iteration_mode_keeps_every_iteration_within_the_limit():
    # A window's fixed cost alone leaves no room beside the decode row: nothing fits, no
    # iteration goes over the limit, and fine-tuning waits (the inference rows fit, so no floor).
    times, tokens = _run_with_a_request("iteration")
    assert max(times) <= LIMIT and tokens == 0


def test_mean_mode_keeps_the_running_mean_within_the_limit():
    # Short decode iterations leave room: windows run in longer iterations, while the mean of
    # every TPOT_MEAN_WINDOW consecutive iterations stays within the limit.
    times, tokens = _run_with_a_request("mean")
    assert tokens > 0
    assert max(times) > LIMIT and max(times) <= MAX_ITERATION_SLOS * SLO_MS / 1000
    for i in range(len(times) - TPOT_MEAN_WINDOW + 1):
        assert sum(times[i:i + TPOT_MEAN_WINDOW]) / TPOT_MEAN_WINDOW <= LIMIT * (1 + 1e-9)


def test_tpot_mode_is_validated():
    with pytest.raises(ValueError, match="slo_tpot_mode"):
        CoserveConfig(slo_tpot_mode="median")


def test_a_tpot_slo_below_a_decode_step_is_reported_at_start_up(caplog):
    slow = FakeLatencyModel(base=2 * LIMIT)
    with caplog.at_level("WARNING", logger="flexserve.engine.slo_feasibility"):
        scheduler = make_scheduler(model=slow)
    assert scheduler.hybrid.tpot_feasible is False
    assert "TPOT SLO out of reach" in caplog.text and "batch 1" in caplog.text
    fast = make_scheduler(model=FakeLatencyModel())
    assert fast.hybrid.tpot_feasible is True


def test_measured_decode_steps_over_the_limit_are_reported_online(caplog):
    from flexserve.engine.slo_feasibility import MIN_DECODE_SAMPLES

    scheduler = make_scheduler(model=FakeLatencyModel())  # the profile says it fits
    add_request(scheduler, "r", prompt_len=4, max_tokens=100)
    scheduler.observe_iteration(step(scheduler), 5 * LIMIT)  # a prefill: not a decode step
    assert scheduler.hybrid.tpot_feasibility.num_decode_samples == 0
    with caplog.at_level("WARNING", logger="flexserve.engine.slo_feasibility"):
        for i in range(MIN_DECODE_SAMPLES):
            assert scheduler.hybrid.tpot_feasible is True, i
            scheduler.observe_iteration(step(scheduler), 2 * LIMIT)
    assert scheduler.hybrid.tpot_feasible is False
    assert "decode-only iterations" in caplog.text
    for _ in range(60):  # the device got faster (another process left)
        scheduler.observe_iteration(step(scheduler), 0.2 * LIMIT)
    assert scheduler.hybrid.tpot_feasible is True


def test_without_a_tpot_slo_feasibility_is_unknown():
    scheduler = make_scheduler(model=FakeLatencyModel(base=1.0), slo_tpot_ms=None)
    assert scheduler.hybrid.tpot_feasible is None
