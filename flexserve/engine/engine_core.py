"""`EngineCore.step()`: schedule -> execute -> update, the iteration every feature rides on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from flexserve.engine.lora_request import LoRARequest
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.engine.request import Request
from flexserve.engine.scheduler import Scheduler


class Executor(Protocol):
    """What the core needs from the worker side (the model runner satisfies it)."""

    def execute(self, plan: BatchPlan) -> StepResult: ...


class LoRAExecutor(Executor, Protocol):
    """An executor that serves LoRA adapters (the model runner when LoRA is enabled)."""

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and validate the adapter into host memory; ValueError with the reason.
        Thread-safe: servers call it off the engine thread."""
        ...

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget the adapter's host copy (a no-op when it has none); thread-safe."""
        ...

    @property
    def num_cpu_loras(self) -> int:
        """Adapters held in host memory."""
        ...


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


class EngineCore:
    """Drives one scheduler and one executor; knows nothing about text or HTTP."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def step(self) -> tuple[list[Request], StepResult | None, StepStats | None]:
        """One iteration. Returns the requests that advanced or finished, the raw result, stats."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return [], None, None
        result = self.executor.execute(plan)
        # Schedule + execute is what the next token waits for; the latency model predicts it.
        self.scheduler.observe_iteration(plan, time.perf_counter() - start)
        failed = self.scheduler.fail_adapters(result.lora_load_errors)
        updated = self.scheduler.update(plan, result)
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
        )
        for window in plan.finetune_windows:
            tokens = stats.finetune_forward_tokens
            tokens[window.job_id] = tokens.get(window.job_id, 0) + window.end - window.start
        for window in plan.backward_windows:
            tokens = stats.finetune_backward_tokens
            tokens[window.job_id] = tokens.get(window.job_id, 0) + window.end - window.start
        return updated, result, stats
