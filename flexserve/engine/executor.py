"""The executor interface: what the engine needs from the worker side.

The engine imports no worker. The caller (`flexserve.entrypoints.engine_builder`) builds the
worker's executor (the model runner) and hands it to the engine, which sees only these protocols.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from flexserve.engine.lora_request import LoRARequest
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.sampling_params import StructuredOutputsParams


class Executor(Protocol):
    """What the core needs from the worker side (the model runner satisfies it)."""

    def execute(self, plan: BatchPlan) -> StepResult: ...


class AsyncExecutor(Executor, Protocol):
    """An executor that can launch a plan and be waited on later (the model runner)."""

    def execute_async(self, plan: BatchPlan) -> Callable[[], StepResult]:
        """Launch the plan; the returned call waits for it and gives its result. A plan with
        `continues_previous` feeds the tokens sampled by the plan launched just before it."""
        ...


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


class StructuredOutputsExecutor(Executor, Protocol):
    """An executor that constrains sampling with grammars (the model runner)."""

    def prepare_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile the constraint now, so the step that first samples under it does not;
        ValueError when it does not compile. Thread-safe: servers call it off the engine
        thread, while requests are prepared."""
        ...
