"""The hybrid token scheduler (FlexLLM 6.2): how much fine-tuning work rides in each iteration.

The inference rows of a step are chosen first (iteration-level scheduling with chunked prefill, in
`Scheduler`). This module then decides the fine-tuning part, by sharing policy:

- `coserve` (default): forward windows of s = max s with f(c + s) <= SLO, where c is the inference
  work already in the plan and f the latency model; then backward layer-windows the same way until
  the predicted iteration time reaches the limit (TPOT SLO minus a margin, minus the host time
  each iteration also costs outside schedule + execute, see `observe_overhead`). When the inference work
  alone is predicted over the limit, or a waiting prompt is close to its TTFT deadline, fine-tuning
  gets only its minimum share (`finetune_min_share` of the token budget): none by default, so
  fine-tuning never makes a request miss an SLO it would meet alone; an operator who wants
  fine-tuning guaranteed some progress under saturating traffic sets a share above 0. A TPOT SLO
  the device cannot meet even with decode alone is reported (`TPOTFeasibility`).
  With `slo_tpot_mode="mean"` the limit of an iteration with running requests is what keeps the
  mean of the last TPOT_MEAN_WINDOW such iterations within the TPOT limit (a request's TPOT is
  a mean), up to MAX_ITERATION_SLOS x the SLO (`effective_limit_s`).
- `temporal` / `dynamic-temporal`: no fine-tuning in inference iterations; after every n inference
  iterations (fixed n, or appendix A's algorithm 3) the engine runs fine-tuning-only iterations
  until one optimizer step completes.
- `spatial`: fine-tuning takes the remaining token budget every iteration, unsized, and runs on its
  own CUDA stream concurrently with the inference rows.
- `inference-only`: no fine-tuning at all.

Whatever the policy, fine-tuning uses the whole iteration when there is no inference work (under
`coserve` the whole iteration is still the SLO, so a request that arrives waits at most one SLO).
Without a TPOT SLO (`slo_tpot_ms=None`, the offline `LLM`), windows fill the token budget, forward
and backward tokens alike. Jobs and tenants are picked fairly with the Virtual Token Counter
(appendix C). Pure Python, no torch.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from flexserve.config import CoserveConfig, SchedulerConfig
from flexserve.engine.fairness import VirtualTokenCounter, VTCWeights
from flexserve.engine.finetune_scheduler import FinetuneJobState, TokenBudgetSizer
from flexserve.engine.iteration_shape import (
    IterationShape,
    backward_window_shape,
    forward_window_shape,
    plan_shape,
)
from flexserve.engine.iteration_trace import IterationTrace
from flexserve.engine.latency_model import max_window
from flexserve.engine.online_latency_model import OnlineLatencyModel
from flexserve.engine.plan import BatchPlan
from flexserve.engine.request import Request
from flexserve.engine.sharing_policy import DynamicTemporalSharing, SharingPolicy, TemporalSharing
from flexserve.engine.slo_feasibility import TPOTFeasibility

logger = logging.getLogger(__name__)


class StepMode(enum.Enum):
    """What kind of iteration the scheduler builds next."""

    INFERENCE = "inference"  # inference rows only
    COSERVE = "coserve"  # inference rows, then SLO-sized fine-tuning windows
    FINETUNE = "finetune"  # fine-tuning only (a temporal-sharing phase, or no inference work)
    SPATIAL = "spatial"  # inference rows, and unsized fine-tuning on its own stream


class LatencyWindowSizer:
    """A `WindowSizer` over the latency model: a window fits while the predicted iteration time,
    inference rows included, stays within `limit_s`.

    `floor_tokens` fine-tuning tokens are granted even when nothing fits (the minimum share; a
    backward layer-window token counts 1/num_layers, so the floor buys as much backward as it
    buys forward). Forward tokens also respect the step's remaining token budget; one backward
    window is at most `max_window_tokens` long (its intermediate tensors scale with it).

    With `floor_slack` > 0, a window the floor grants grows while the predicted iteration stays
    within (1 + floor_slack) x what it is with the floor's tokens: an iteration that carries a
    window at all pays its fixed costs (on the H200 with Llama-3.1-8B, a forward window of 16
    tokens took 29 ms and one of 1024 tokens 45 ms, host-bound below ~1000 tokens), so a floor
    of a few tokens would pay nearly the whole price for nothing. The scheduler sets it where no
    inference row rides in the iteration.
    """

    def __init__(self, predict: Callable[[IterationShape], float], shape: IterationShape,
                 limit_s: float, max_forward_tokens: int, max_window_tokens: int,
                 num_layers: int, floor_tokens: int = 0, floor_slack: float = 0.0) -> None:
        self.predict = predict
        self.shape = shape  # the iteration so far: inference rows plus the windows granted
        self.limit_s = limit_s
        self.forward_left = max(max_forward_tokens, 0)
        self.max_window_tokens = max_window_tokens
        self.num_layers = max(num_layers, 1)
        self.floor_left = float(floor_tokens)  # minimum share still owed, in forward tokens
        self.floor_slack = floor_slack
        self.num_forward_tokens = 0
        self.num_backward_tokens = 0

    def forward(self, start: int, max_tokens: int) -> int:
        cap = min(max_tokens, self.forward_left)
        if cap <= 0:
            return 0
        cost = lambda s: self.predict(self.shape + forward_window_shape(start, s))  # noqa: E731
        n = _aligned(max_window(cost, self.limit_s, cap), cap)
        n = self._with_floor(n, cost, cap, min(cap, math.ceil(self.floor_left)))
        n = self._fill_bucket(n, cost, cap)
        if n:
            self.shape = self.shape + forward_window_shape(start, n)
            self.forward_left -= n
            self.floor_left = max(self.floor_left - n, 0.0)
            self.num_forward_tokens += n
        return n

    def backward(self, end: int, max_tokens: int) -> int:
        cap = min(max_tokens, self.max_window_tokens, end)
        if cap <= 0:
            return 0
        cost = lambda s: self.predict(self.shape + backward_window_shape(end - s, end))  # noqa: E731
        n = _aligned(max_window(cost, self.limit_s, cap), cap)
        n = self._with_floor(n, cost, cap, min(cap, math.ceil(self.floor_left * self.num_layers)))
        if n:
            self.shape = self.shape + backward_window_shape(end - n, end)
            self.floor_left = max(self.floor_left - n / self.num_layers, 0.0)
            self.num_backward_tokens += n
        return n

    def _fill_bucket(self, n: int, cost: Callable[[int], float], cap: int) -> int:
        """`n` moved so the iteration's forward tokens end on a multiple of WINDOW_ALIGNMENT:
        the CUDA graphs of mixed iterations run padded token buckets that are multiples of it
        (`flexserve.worker.mixed_graphs`), so the padding does fine-tuning work instead. Up to
        the next multiple where the model says it fits, else down to the previous one."""
        if n <= 0 or n >= cap:
            return n
        total = self.shape.total_forward_tokens + n
        up = n + (-total) % WINDOW_ALIGNMENT
        if up == n:
            return n
        if up <= min(cap, self.forward_left) and cost(up) <= self.limit_s:
            return up
        down = n - total % WINDOW_ALIGNMENT
        return down if down > 0 else n

    def _with_floor(self, n: int, cost: Callable[[int], float], cap: int, floor: int) -> int:
        """`n` (what fits the limit), or the floor's grant where that is larger, grown by
        `floor_slack` (see the class docstring)."""
        if floor <= n:
            return n
        floor_cost = cost(floor) if self.floor_slack > 0 else math.inf
        if math.isfinite(floor_cost):  # inf: the fallback model refuses to extrapolate that far
            floor = max(floor, _aligned(max_window(
                cost, floor_cost * (1.0 + self.floor_slack), cap), cap))
        return floor


WINDOW_ALIGNMENT = 128  # window sizes the latency model picks are multiples of this
OVERHEAD_EWMA_ALPHA = 0.1  # weight of one sample in the host-overhead average
FLOOR_SLACK = 0.1  # a floor-granted window may lengthen an iteration with no inference by 10%
TPOT_MEAN_WINDOW = 32  # slo_tpot_mode "mean": iterations whose mean time the limit bounds
MAX_ITERATION_SLOS = 3.0  # slo_tpot_mode "mean": one iteration at most this many TPOT SLOs


def _aligned(n: int, cap: int) -> int:
    """`n` rounded down to a multiple of WINDOW_ALIGNMENT, unless it is the whole `cap` (the rest
    of a sequence) or smaller than one multiple. Windows of arbitrary sizes were 2-3x slower
    than aligned ones of the same tokens (H200, Llama-3.1-8B: backward iterations of 8 windows,
    16384 layer-tokens took 39 ms, of 8-9 windows with 14904-17757 tokens 95-120 ms)."""
    if n >= cap or n < WINDOW_ALIGNMENT:
        return n
    return n - n % WINDOW_ALIGNMENT


class VTCJobPicker:
    """A `JobPicker` for the Virtual Token Counter: the job of the least-served tenant goes next
    (algorithm 4, lines 21-27); ties go to the job that started first. A forward token costs w_r,
    a backward layer-token w_r / num_layers, so a token's whole training costs 2 w_r."""

    def __init__(self, vtc: VirtualTokenCounter, num_layers: int) -> None:
        self.vtc = vtc
        self.num_layers = max(num_layers, 1)
        self._backward_layer_tokens: dict[str, int] = {}  # tenant -> layer-tokens not charged yet

    def pick(self, jobs: Sequence[FinetuneJobState]) -> FinetuneJobState:
        tenant = self.vtc.pick(job.tenant for job in jobs)
        return next(job for job in jobs if job.tenant == tenant)

    def charge(self, job: FinetuneJobState, num_tokens: int, backward: bool) -> None:
        if not backward:
            self.vtc.charge_finetune(job.tenant, num_tokens)
            return
        # Whole tokens only: num_layers backward layer-tokens are one token's backward.
        pending = self._backward_layer_tokens.get(job.tenant, 0) + num_tokens
        whole, self._backward_layer_tokens[job.tenant] = divmod(pending, self.num_layers)
        if whole:
            self.vtc.charge_finetune(job.tenant, whole)


class HybridTokenScheduler:
    """Owns the sharing policy, the latency model and the fairness counters of one scheduler."""

    def __init__(self, config: CoserveConfig, scheduler_config: SchedulerConfig, num_layers: int,
                 latency_model: OnlineLatencyModel | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.policy = SharingPolicy(config.policy)
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.num_layers = max(num_layers, 1)
        self.latency_model = latency_model if latency_model is not None \
            else OnlineLatencyModel(None)
        self.clock = clock
        self.vtc = VirtualTokenCounter(VTCWeights(
            config.vtc_prompt_weight, config.vtc_output_weight, config.vtc_finetune_weight))
        self.picker = VTCJobPicker(self.vtc, num_layers)
        self.limit_s = None if config.slo_tpot_ms is None \
            else config.slo_tpot_ms / 1000.0 * (1.0 - config.slo_margin)
        # EWMA of the host time between two back-to-back iterations that the latency model does
        # not see (update, output processing, handing outputs to clients): a running request's
        # next token waits for it too, so the window sizing takes it off the limit.
        self.overhead_s = 0.0
        # slo_tpot_mode "mean": the last TPOT_MEAN_WINDOW - 1 iterations that had running
        # requests, each with the host overhead after it (what their next token waited).
        self.mean_mode = config.slo_tpot_mode == "mean"
        self._token_iterations: deque[float] = deque(maxlen=TPOT_MEAN_WINDOW - 1)
        self.floor_tokens = math.ceil(config.finetune_min_share * self.max_num_batched_tokens)
        self.temporal = TemporalSharing(config.temporal_frequency) \
            if self.policy == SharingPolicy.TEMPORAL else None
        self.dynamic = DynamicTemporalSharing() \
            if self.policy == SharingPolicy.DYNAMIC_TEMPORAL else None
        self.in_finetune_phase = False  # temporal policies: fine-tuning-only iterations until a
        # job completes an optimizer step
        self._queued_jobs: dict[str, str] = {}  # job id -> tenant, jobs the VTC counts as queued
        self.num_arrivals = 0  # requests added since the last inference iteration (algorithm 3)
        self.num_completions = 0  # requests finished since then
        self.last_mode: StepMode | None = None
        self.last_predicted_s = 0.0  # the latency model's prediction for the last plan
        self._last_plan: BatchPlan | None = None  # that plan and its shape (observed after it ran)
        self._last_shape = IterationShape()
        self.trace = IterationTrace.from_env()  # FLEXSERVE_ITERATION_TRACE
        # Whether a decode step alone fits the TPOT limit: from the profile now (a fallback
        # model knows nothing before it measures), from decode-only iterations later.
        self.tpot_feasibility = None if config.slo_tpot_ms is None \
            else TPOTFeasibility(config.slo_tpot_ms, config.slo_margin)
        if self.tpot_feasibility is not None \
                and not getattr(self.latency_model, "is_fallback", False):
            self.tpot_feasibility.check_profile(self.latency_model.predict)

    @property
    def plans_ahead(self) -> bool:
        """Whether fine-tuning windows may be planned into a step launched ahead (asynchronous
        scheduling): co-serving on one stream. The temporal policies switch phases on the
        step's outcome and spatial sharing joins a second stream at every step."""
        return (self.policy == SharingPolicy.COSERVE
                and not self.config.finetune_backward_stream)

    # ---------------------------------------------------------------------------- the step
    def mode(self, has_inference_work: bool, has_finetune_work: bool) -> StepMode:
        """The kind of iteration to build now."""
        if self.policy == SharingPolicy.INFERENCE_ONLY or not has_finetune_work:
            self.in_finetune_phase = False
            return StepMode.INFERENCE
        if not has_inference_work:
            return StepMode.FINETUNE  # work-conserving: nothing to protect
        if self.policy == SharingPolicy.COSERVE:
            return StepMode.COSERVE
        if self.policy == SharingPolicy.SPATIAL:
            return StepMode.SPATIAL
        return StepMode.FINETUNE if self.in_finetune_phase else StepMode.INFERENCE

    def schedule_finetune(self, plan: BatchPlan, finetune, mode: StepMode,
                          waiting: Iterable[Request]) -> None:
        """Add this step's fine-tuning work to `plan` (its inference rows are final)."""
        self.last_mode = mode
        self.sync_jobs(finetune.jobs.values())
        if mode == StepMode.INFERENCE:
            return
        budget_left = self.max_num_batched_tokens - plan.num_batched_tokens
        if mode == StepMode.SPATIAL:
            plan.finetune_concurrent = True
            finetune.schedule(plan, TokenBudgetSizer(budget_left), self.picker)
            return
        if self.limit_s is None or mode == StepMode.FINETUNE:
            # No SLO to keep (offline), temporal phases, no request running or waiting: the
            # plain token budget, forward and backward tokens alike (fine-tuning alone runs as
            # fast as the offline engine).
            finetune.schedule(plan, TokenBudgetSizer(budget_left), self.picker)
            return
        shape = plan_shape(plan)
        predict = self.latency_model.predict
        limit = self.effective_limit_s if plan.sequences else self.iteration_limit_s
        saturated = bool(plan.sequences) and predict(shape) > limit
        pressure = self._ttft_pressure(waiting)
        if pressure:
            limit = 0.0
        floor = self.floor_tokens if (saturated or pressure) else 0
        slack = 0.0
        if not plan.sequences:
            # Nothing to protect: progress even when the model predicts that no window fits
            # (a device too slow for the SLO, or the fallback before its first fit), else the
            # plan stays empty, nothing is measured and fine-tuning stalls for good. And a
            # floor-granted window gets as long as its fixed costs make worth it.
            floor, slack = max(self.floor_tokens, 1), FLOOR_SLACK
        sizer = LatencyWindowSizer(predict, shape, limit, budget_left,
                                   self.max_num_batched_tokens, self.num_layers, floor, slack)
        finetune.schedule(plan, sizer, self.picker)

    def _ttft_pressure(self, waiting: Iterable[Request]) -> bool:
        """A prompt still waiting after this step's admission is close to its TTFT deadline."""
        deadline = self.config.ttft_pressure * self.config.slo_ttft_ms / 1000.0
        now = self.clock()
        return any(now - request.arrival_time > deadline for request in waiting)

    def finish_step(self, plan: BatchPlan, num_waiting: int) -> None:
        """Advance the temporal policies after a plan was built."""
        self._last_plan, self._last_shape = plan, plan_shape(plan)
        self.last_predicted_s = self.latency_model.predict(self._last_shape)
        if self.in_finetune_phase:
            if plan.optimizer_steps or not (plan.finetune_windows or plan.backward_windows):
                self.in_finetune_phase = False  # one fine-tuning step done (or nothing to do)
            return
        if not plan.sequences:
            return
        due = False
        if self.temporal is not None:
            due = self.temporal.after_iteration()
        elif self.dynamic is not None:
            due = self.dynamic.scheduler_step(num_waiting, len(plan.sequences),
                                              self.num_arrivals, self.num_completions)
        self.num_arrivals = self.num_completions = 0
        if due:
            self.in_finetune_phase = True

    def observe(self, plan: BatchPlan, seconds: float, thread_seconds: float | None = None) -> None:
        """The measured time of an executed plan (corrects the latency model online);
        `thread_seconds`, the engine thread's CPU time in it, only goes to the trace."""
        shape = self._last_shape if plan is self._last_plan else plan_shape(plan)
        if self.trace is not None:
            predicted = self.last_predicted_s if plan is self._last_plan \
                else self.latency_model.predict(shape)
            self.trace.record(shape, predicted, seconds, self.latency_model.scale,
                              self.last_mode.value if self.last_mode else None, thread_seconds,
                              self.latency_model.backward_scale)
        self.latency_model.observe(shape, seconds)
        if self.tpot_feasibility is not None:
            self.tpot_feasibility.observe(shape, seconds)
        if self.mean_mode and plan.sequences:
            self._token_iterations.append(seconds + self.overhead_s)

    @property
    def tpot_feasible(self) -> bool | None:
        """Whether a decode step alone fits the TPOT limit; None: no SLO, or not known yet."""
        return None if self.tpot_feasibility is None else self.tpot_feasibility.feasible

    @property
    def iteration_limit_s(self) -> float | None:
        """The TPOT limit less the host overhead: what one iteration may take on its own."""
        if self.limit_s is None:
            return None
        return max(self.limit_s - self.overhead_s, 0.0)

    @property
    def effective_limit_s(self) -> float | None:
        """What schedule + execute of an iteration with running requests may take.

        slo_tpot_mode "iteration" (FlexLLM 6.2): `iteration_limit_s`. "mean": what keeps the
        mean of this and the last TPOT_MEAN_WINDOW - 1 such iterations (overhead included)
        within the limit, between half the iteration limit and MAX_ITERATION_SLOS x the SLO. A
        request's TPOT is the mean of its inter-token times, so decode iterations far under
        the limit (CUDA graphs: 6-8 ms against 40 ms on an H200 with Llama-3.1-8B) leave
        room for fine-tuning iterations longer than one limit, whose fixed host costs (~30 ms
        a window iteration) then buy far more tokens. Until the window has filled it is the
        iteration limit."""
        per_iteration = self.iteration_limit_s
        if per_iteration is None or not self.mean_mode \
                or len(self._token_iterations) < self._token_iterations.maxlen:
            return per_iteration
        budget = (TPOT_MEAN_WINDOW * self.limit_s - sum(self._token_iterations)
                  - self.overhead_s)
        most = MAX_ITERATION_SLOS * self.config.slo_tpot_ms / 1000.0
        return min(max(budget, 0.5 * per_iteration), most)

    def observe_overhead(self, seconds: float) -> None:
        """Host time between the end of one iteration's execute and the start of the next, while
        requests were running (their next token waited for it). Gaps longer than the limit are
        pauses (a collection, an adapter load between steps), not a per-iteration cost, and are
        ignored."""
        if not (0.0 <= seconds < math.inf):
            return
        if self.limit_s is not None and seconds > self.limit_s:
            return
        self.overhead_s += OVERHEAD_EWMA_ALPHA * (seconds - self.overhead_s)

    # ------------------------------------------------------------------------------ fairness
    def request_queued(self, request: Request) -> None:
        """A request entered the waiting queue (new, or preempted)."""
        self.vtc.enqueue(request.tenant, request.request_id)

    def request_dequeued(self, request: Request) -> None:
        """A request left the waiting queue (admitted or aborted)."""
        self.vtc.dequeue(request.tenant, request.request_id)

    def request_admitted(self, request: Request, num_prompt_tokens: int) -> None:
        self.vtc.dequeue(request.tenant, request.request_id)
        self.vtc.charge_prompt(request.tenant, num_prompt_tokens)

    def tokens_generated(self, request: Request, num_tokens: int = 1) -> None:
        self.vtc.charge_output(request.tenant, num_tokens)

    def pick_tenant(self, tenants: Iterable[str]) -> str | None:
        return self.vtc.pick(tenants)

    def sync_jobs(self, jobs: Iterable[FinetuneJobState]) -> None:
        """Jobs with work left are queued in the VTC; ended ones leave it."""
        active = {job.job_id: job.tenant for job in jobs if not job.finished}
        for job_id, tenant in list(self._queued_jobs.items()):
            if job_id not in active:
                self.vtc.dequeue(tenant, f"job:{job_id}")
                del self._queued_jobs[job_id]
        for job_id, tenant in active.items():
            if job_id not in self._queued_jobs:
                self.vtc.enqueue(tenant, f"job:{job_id}")
                self._queued_jobs[job_id] = tenant
