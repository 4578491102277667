"""`EngineCore.step()`: schedule -> execute -> update, the iteration every feature rides on.

With asynchronous scheduling (vLLM's `--async-scheduling`), step N+1 is scheduled and launched
before step N's sampled tokens (and fine-tuning window losses) are waited for, so the host's
per-step work (the next step's scheduling and input preparation, then step N's update and
output processing) overlaps the device's work of step N+1 instead of leaving the device idle
between steps. That covers decode steps and, under co-serving, mixed and fine-tuning-only steps.
Only plans `Scheduler.schedule_continuation` accepts are launched ahead; the results are those
of synchronous stepping (tokens of requests that end are discarded with their extra row).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flexserve.engine.executor import Executor
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.engine.request import Request
from flexserve.engine.scheduler import Scheduler


@dataclass(slots=True)
class StepStats:
    """What one iteration did, for logs and metrics."""

    num_batched_tokens: int  # tokens in the forward (prefill chunks + decodes)
    num_sequences: int  # rows in the forward
    num_generated_tokens: int  # tokens sampled this step
    num_preemptions: int  # requests preempted while scheduling this step
    latency: float  # wall seconds of schedule + execute + update
    # request id -> reason, for requests the engine aborted because their adapter failed to load
    failed_requests: dict[str, str] = field(default_factory=dict)
    finetune_forward_tokens: dict[str, int] = field(default_factory=dict)  # job id -> tokens of
    # its forward windows this step
    finetune_backward_tokens: dict[str, int] = field(default_factory=dict)  # job id -> backward
    # layer-window tokens this step
    predicted_latency: float = 0.0  # the latency model's prediction for this plan, seconds
    latency_model_error_ratio: float = 0.0  # rolling |predicted - measured| / measured
    latency_model_scale: float = 1.0  # the latency model's online correction factor
    latency_model_backward_scale: float = 1.0  # its correction of backward windows' terms
    iteration_overhead: float = 0.0  # seconds: EWMA of host time between back-to-back steps


class EngineCore:
    """Drives one scheduler and one executor; knows nothing about text or HTTP."""

    def __init__(self, scheduler: Scheduler, executor: Executor,
                 async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        # Launching ahead needs an executor that can be waited on later.
        self.async_scheduling = async_scheduling and hasattr(executor, "execute_async")
        # The plan launched ahead, the call that waits for it, and when the step before it
        # finished (its iteration time is measured from there).
        self._pending: tuple[BatchPlan, Callable[[], StepResult]] | None = None
        self._last_done = 0.0
        # When the last synchronous step's execute ended, while requests were running: the time
        # from then to the next step's start is host overhead their next token also waits for.
        self._tokens_waiting_since: float | None = None

    @property
    def has_pending_step(self) -> bool:
        """A plan was launched ahead and its result has not been applied yet."""
        return self._pending is not None

    def step(self) -> tuple[list[Request], StepResult | None, StepStats | None]:
        """One iteration. Returns the requests that advanced or finished, the raw result, stats."""
        start = time.perf_counter()
        # The engine thread's CPU time goes only to an iteration trace.
        traced = self.scheduler.hybrid.trace is not None
        thread_start = time.thread_time() if traced else 0.0
        since, self._tokens_waiting_since = self._tokens_waiting_since, None
        if since is not None:
            self.scheduler.observe_overhead(start - since)
        if self._pending is not None:
            plan, wait = self._pending
            self._pending = None
            began = self._last_done  # launched during the previous step: timed from its end
        else:
            plan = self.scheduler.schedule()
            if plan.is_empty:
                return [], None, None
            began = start
            if self.async_scheduling:
                wait = self.executor.execute_async(plan)
            else:
                result = self.executor.execute(plan)
                wait = lambda: result  # noqa: E731
        if self.async_scheduling:
            following = self.scheduler.schedule_continuation(plan)
            if following is not None:
                self._pending = (following, self.executor.execute_async(following))
        result = wait()
        self._last_done = done = time.perf_counter()
        # Schedule + execute is what the next token waits for; the latency model predicts it.
        self.scheduler.observe_iteration(
            plan, done - began, time.thread_time() - thread_start if traced else None)
        failed = self.scheduler.fail_adapters(result.lora_load_errors)
        updated = self.scheduler.update(plan, result)
        if (self._pending is not None and not self.scheduler.num_running
                and not self._pending[0].has_finetune_work):
            # Its rows were all the running requests, and every one just ended: nothing will
            # read its tokens, and the device runs it before any later step reusing its blocks.
            # (Fine-tuning windows in it are waited for: their losses count.)
            self._pending = None
        if self._pending is None and self.scheduler.num_running:
            # (A step launched ahead is timed from `done` on: the gap is inside its time.)
            self._tokens_waiting_since = done
        hybrid = self.scheduler.hybrid
        stats = StepStats(
            num_batched_tokens=plan.num_batched_tokens,
            num_sequences=len(plan.sequences),
            num_generated_tokens=len(result.sampled_token_ids),
            num_preemptions=len(plan.preempted_request_ids),
            latency=time.perf_counter() - start,
            failed_requests=failed,
            predicted_latency=hybrid.last_predicted_s,
            latency_model_error_ratio=hybrid.latency_model.error_ratio,
            latency_model_scale=hybrid.latency_model.scale,
            latency_model_backward_scale=hybrid.latency_model.backward_scale,
            iteration_overhead=hybrid.overhead_s,
        )
        for window in plan.finetune_windows:
            tokens = stats.finetune_forward_tokens
            tokens[window.job_id] = tokens.get(window.job_id, 0) + window.end - window.start
        for window in plan.backward_windows:
            tokens = stats.finetune_backward_tokens
            tokens[window.job_id] = tokens.get(window.job_id, 0) + window.end - window.start
        return updated, result, stats
