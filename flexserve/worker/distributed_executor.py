"""What every tensor-parallel executor does in the engine process, whatever drives its ranks
(`MultiprocExecutor`: worker processes on this host; `RayExecutor`: Ray actors on a cluster).

The engine process holds no model. It compiles structured-output constraints against the
tokenizer (so one that does not compile is refused before it reaches the ranks; each rank
compiles its own for its sampler) and validates LoRA adapters by reading them (each rank reads
an adapter again at its first slot load and keeps its shard). A rank that dies or fails a step
raises `WorkerDiedError`, and every later step raises it too.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from flexserve.config import EngineConfig
from flexserve.engine.lora_request import LoRARequest
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.model.registry import ResolvedModel
from flexserve.peft.bypass import target_shapes
from flexserve.peft.peft_io import load_peft_adapter
from flexserve.sampling_params import StructuredOutputsParams
from flexserve.worker.structured_outputs import GrammarManager
from flexserve.worker.tp_worker import RankCall, RankCallError, WorkerReady, check_rank_method


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank exited or failed; the executor cannot run steps any more."""


class DistributedExecutor(ABC):
    """The engine-side half of a tensor-parallel executor; subclasses start the ranks, set
    `ready` (rank 0's `WorkerReady`) and implement `execute_async` and `shutdown`."""

    ready: WorkerReady

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, tokenizer: Any | None,
                 eos_token_id: int | None) -> None:
        self._tokenizer, self._eos_token_id = tokenizer, eos_token_id
        self._lora_config, self._hf_config = config.lora, resolved.hf_config
        self._lora_ids: set[int] = set()  # adapters added and not removed
        self._lora_lock = threading.Lock()
        self._grammars: GrammarManager | None = None
        self._grammars_lock = threading.Lock()

    def execute(self, plan: BatchPlan) -> StepResult:
        return self.execute_async(plan)()

    def execute_async(self, plan: BatchPlan) -> Callable[[], StepResult]:
        """Send the plan to every rank; the returned call waits for all of them (the driver's
        result). Plans run in the order sent, so a continuation plan follows the one before."""
        start = time.perf_counter()
        wait = self._submit(plan)

        def wait_result() -> StepResult:
            result = wait()
            result.execute_time = time.perf_counter() - start
            return result

        return wait_result

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the ranks; idempotent."""

    @abstractmethod
    def _submit(self, message: BatchPlan | RankCall) -> Callable[[], Any]:
        """Send `message` to every rank (`PlanSender.encode`d), after those sent before; the
        call that waits for all of them and returns `rank_reply` of their replies."""

    def call_ranks(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`ModelRunner.method(*args, **kwargs)` on every rank (`RANK_METHODS`): the driver's
        value; ValueError when a rank refused it (the ranks stay up)."""
        check_rank_method(method)
        reply = self._submit(RankCall(method, args, kwargs))()
        if isinstance(reply, RankCallError):
            raise ValueError(reply.message)
        return reply

    # ------------------------------------------------------------------- fine-tuning jobs
    def add_finetune_job(self, **kwargs: Any) -> Any:
        """Set up the job on every rank (each trains its part of the adapter); a rank that
        refuses it makes every rank forget it again."""
        try:
            return self.call_ranks("add_finetune_job", **kwargs)
        except ValueError:
            self.call_ranks("remove_finetune_job", kwargs["job_id"])
            raise

    def end_finetune_job(self, job_id: str) -> None:
        self.call_ranks("end_finetune_job", job_id)

    def remove_finetune_job(self, job_id: str) -> None:
        self.call_ranks("remove_finetune_job", job_id)

    def save_finetune_adapter(self, job_id: str, path: str) -> None:
        """The ranks gather the job's adapter; rank 0 writes it."""
        self.call_ranks("save_finetune_adapter", job_id, path)

    def save_finetune_checkpoint(self, job_id: str, directory: str,
                                 trainer_state: dict[str, Any]) -> None:
        """The ranks gather the job's adapter and AdamW state; rank 0 writes the checkpoint
        (whole tensors: it resumes at any tensor-parallel size)."""
        self.call_ranks("save_finetune_checkpoint", job_id, directory, trainer_state)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and validate the adapter here (ValueError with the reason), before a plan asks
        the ranks for it: each rank reads it from disk into its host cache at its first slot
        load and keeps its shard in the slot (`LoRAManager.load_slots`). Thread-safe."""
        config = self._lora_config
        if config is None:
            raise ValueError("LoRA is not enabled in this engine")
        load_peft_adapter(lora_request.lora_path, target_shapes(self._hf_config),
                          self._hf_config.num_hidden_layers, config.max_lora_rank,
                          config.allowed_dir_for(lora_request.lora_path))
        with self._lora_lock:
            self._lora_ids.add(lora_request.lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget the adapter (the ranks' host caches drop it as they fill); thread-safe."""
        with self._lora_lock:
            self._lora_ids.discard(lora_int_id)

    @property
    def num_cpu_loras(self) -> int:
        """Adapters the ranks may hold in host memory (each rank's cache keeps at most
        max_cpu_loras)."""
        with self._lora_lock:
            return min(len(self._lora_ids), self._lora_config.max_cpu_loras
                       if self._lora_config is not None else 0)

    def prepare_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile the constraint here, so one that does not compile is refused (ValueError)
        before it reaches the ranks (`StructuredOutputsExecutor`); thread-safe."""
        with self._grammars_lock:
            if self._grammars is None:
                if self._tokenizer is None:
                    raise ValueError("structured outputs need the model's tokenizer")
                self._grammars = GrammarManager(
                    self._tokenizer, self.ready.vocab_size,
                    [] if self._eos_token_id is None else [self._eos_token_id])
        self._grammars.compile(params)
