"""`LLMEngine`: prompts in, `RequestOutput`s out, one `step()` at a time (synchronous)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from flexserve import envs
from flexserve.config import EngineConfig
from flexserve.engine.adapter_manager import AdapterExistsError, AdapterManager
from flexserve.engine.engine_core import EngineCore, StepStats
from flexserve.engine.executor import Executor, LoRAExecutor
from flexserve.engine.finetune_capacity import FinetuneCapacity, adapter_shape
from flexserve.engine.finetune_scheduler import (
    FinetuneJobState,
    FinetuneJobStatus,
    FinetuneUpdate,
    TrainingSequence,
)
from flexserve.engine.input_processor import InputProcessor, Prompt
from flexserve.engine.latency_model import LatencyModel, load_matching_profile, profile_path
from flexserve.engine.lora_request import LoRARequest
from flexserve.engine.model_info import ModelInfo
from flexserve.engine.online_latency_model import OnlineLatencyModel
from flexserve.engine.output_processor import OutputProcessor
from flexserve.engine.request import Request, RequestStatus
from flexserve.engine.scheduler import Scheduler
from flexserve.outputs import RequestOutput
from flexserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized prompt ready to enqueue."""

    request_id: str  # the caller's id; children get "-i" suffixes when n > 1
    prompt_text: str | None  # the prompt as text, when known
    prompt_token_ids: list[int]  # tokenized prompt
    params: SamplingParams  # how to sample
    max_tokens: int  # resolved generation limit
    arrival_time: float  # time.monotonic() at arrival
    lora_name: str | None = None  # adapter to use (resolved when enqueued); None: base model
    tenant: str = "default"  # the fair-share account it is charged to (the API key's tenant)
    final_output_only: bool = False  # `step` returns only its finished output (offline generate)


class LLMEngine:
    """Owns the scheduler, the executor (model runner) and text processing for one model."""

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: Any | None,
        info: ModelInfo,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.info = info
        self.executor = executor
        max_finetune_len = config.finetune.max_finetune_len or info.max_model_len
        if max_finetune_len > info.max_model_len:
            # Positions past max_model_len have no rotary entries and no KV-cache guarantee.
            raise ValueError(f"max_finetune_len {max_finetune_len} exceeds max_model_len "
                             f"{info.max_model_len}")
        self.scheduler = Scheduler(
            config.scheduler, config.cache, info.num_blocks, info.max_model_len, config.lora,
            num_layers=info.num_layers,
            max_finetune_len=max_finetune_len,
            coserve_config=config.coserve,
            latency_model=OnlineLatencyModel(self._load_latency_profile(config, info)),
            vocab_size=info.vocab_size,
            finetune_config=config.finetune,
        )
        # Under pipeline parallelism only the last stage samples, so a step cannot start from
        # the previous one's tokens on the first stage: steps wait for the previous one.
        self.core = EngineCore(self.scheduler, executor, config.scheduler.async_scheduling
                               and config.parallel.pipeline_parallel_size == 1)
        self.input_processor = InputProcessor(tokenizer, info.vocab_size, info.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self._children: dict[str, list[str]] = {}  # parent request id -> child request ids
        self._ids = itertools.count()
        self.last_step_stats: StepStats | None = None
        self._lora_ids = itertools.count(1)  # engine-wide adapter ids; next() is thread-safe
        self._job_ids = itertools.count(1)
        self._failed: dict[str, str] = {}  # parent request id -> why the engine ended it
        # Fine-tuning jobs' own LoRA slots (after the max_loras serving slots) and state memory
        self._capacity: FinetuneCapacity | None = None
        if config.lora is not None and info.num_finetune_slots:
            self._capacity = FinetuneCapacity(
                config.lora.max_loras, info.num_finetune_slots, info.finetune_state_bytes,
                info.num_layers, dict(info.lora_target_features))
            logger.info("fine-tuning: %s", self._capacity.describe())
        if config.lora is not None:
            for name, path in config.lora.lora_modules.items():
                try:
                    self.add_lora(name, path)
                except ValueError as e:
                    raise ValueError(f"LoRA adapter {name}={path}: {e}") from e

    @staticmethod
    def _load_latency_profile(config: EngineConfig, info: ModelInfo) -> LatencyModel | None:
        """The `flexserve profile` result for this device, model and dtype, if one exists."""
        path, tp = config.coserve.latency_profile, config.parallel.tensor_parallel_size
        if path is not None:
            model = LatencyModel.load(path)
        elif config.parallel.pipeline_parallel_size > 1:
            # Profiles time one stage's ranks (`flexserve profile`), not a pipeline's steps.
            logger.info("%d pipeline stages: no latency profile; fine-tuning windows start "
                        "small and grow from measured iterations",
                        config.parallel.pipeline_parallel_size)
            return None
        else:
            model = load_matching_profile(envs.home(), info.device_name, info.name,
                                          info.dtype, tp)
            path = profile_path(envs.home(), info.device_name, info.name, info.dtype, tp)
        if model is None:
            # Above one rank the learned windows can outgrow the SLO before they are right
            # (docs/benchmarks.md, "Co-serving at 2 ranks").
            logger.log(logging.WARNING if tp > 1 else logging.INFO,
                       "no latency profile at %s: fine-tuning windows start small and grow "
                       "from measured iterations (run `flexserve profile%s` to calibrate)", path,
                       f" --tensor-parallel-size {tp}" if tp > 1 else "")
        else:
            logger.info("latency profile %s (held-out median error %s)", path,
                        model.metadata.get("median_rel_error", "unknown"))
        return model

    # ------------------------------------------------------------------------------- requests
    def next_request_id(self) -> str:
        return str(next(self._ids))

    def process_inputs(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        prompt_text: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        tenant: str = "default",
        final_output_only: bool = False,
    ) -> PreparedRequest:
        """Tokenize and validate a prompt; raises ValueError on bad input.

        Touches no engine state, so a server may call it off the engine thread and hand the
        result to `add_prepared_request` there. `final_output_only`: `step` returns no output
        for it until it finished (no per-step output objects; the offline `LLM` uses it).
        """
        self.input_processor.check_params(params)
        text, token_ids = self.input_processor.process(prompt)
        if params.structured_outputs is not None:
            # Grammars compile here, not in the engine's step that every running request waits
            # for (a small JSON schema: 2-6 ms on the dev CPU, the first one about 400 ms).
            compile_grammar = getattr(self.executor, "prepare_structured_outputs", None)
            if compile_grammar is not None:
                compile_grammar(params.structured_outputs)
        return PreparedRequest(
            request_id=request_id,
            prompt_text=prompt_text if prompt_text is not None else text,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=self.input_processor.resolve_max_tokens(len(token_ids), params),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            lora_name=lora_name,
            tenant=tenant,
            final_output_only=final_output_only,
        )

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Enqueue a validated prompt: one scheduler request per completion (`n`).

        Raises `AdapterNotFoundError` (a ValueError) when its adapter is not being served.
        """
        request_id, params = prepared.request_id, prepared.params
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        lora_request = None
        if prepared.lora_name is not None:
            lora_request = self._adapters().lookup(prepared.lora_name)
        eos = None if params.ignore_eos else self.info.eos_token_id
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        requests = [
            Request(
                child_id, prepared.prompt_token_ids, params, eos, prepared.max_tokens,
                prepared.arrival_time, None if params.seed is None else params.seed + i,
                lora_request, prepared.tenant,
            )
            for i, child_id in enumerate(child_ids)
        ]
        self.output_processor.add_request(
            request_id, prepared.prompt_text, prepared.prompt_token_ids, params, child_ids,
            prepared.final_output_only,
        )
        self._children[request_id] = child_ids
        try:
            for request in requests:
                self.scheduler.add_request(request)
        except ValueError:
            self.abort_request(request_id)  # all or nothing: no half-added parent stays behind
            raise

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        prompt_text: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        final_output_only: bool = False,
    ) -> None:
        """Validate and enqueue a prompt (text or token ids); raises ValueError on bad input.

        `lora_name` selects a loaded adapter (see `add_lora`); None runs the base model.
        `final_output_only`: `step` returns its output only once it finished.
        """
        self.add_prepared_request(
            self.process_inputs(request_id, prompt, params, prompt_text, arrival_time, lora_name,
                                final_output_only=final_output_only)
        )

    def abort_request(self, request_ids: list[str] | str) -> None:
        """Cancel requests (by the id given to add_request); frees their KV blocks at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            child_ids = self._children.pop(request_id, None)
            if child_ids is None:
                continue
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(request_id)
        self._drop_freed_adapters()

    def has_unfinished_requests(self) -> bool:
        """Requests are running or waiting, or a step launched ahead still has to be applied."""
        return self.scheduler.has_unfinished_requests() or self.core.has_pending_step

    # ----------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of every request that changed."""
        updated, result, stats = self.core.step()
        self.last_step_stats = stats
        if stats is not None and stats.failed_requests:
            self._fail_requests(stats.failed_requests)
        if result is not None and (result.grad_norms or result.finetune_errors):
            self._release_finished_jobs()
        self._drop_freed_adapters()
        if result is None:
            return []
        outputs, stopped_ids = self.output_processor.process(updated, result)
        if stopped_ids:
            self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOPPED)
        for output in outputs:
            if output.finished:
                self._children.pop(output.request_id, None)
        return outputs

    def pop_failed_requests(self) -> dict[str, str]:
        """Requests the engine ended on its own since the last call (request id -> reason).

        They get no final output; today the only cause is an adapter that failed to load.
        """
        failed, self._failed = self._failed, {}
        return failed

    def _fail_requests(self, child_reasons: dict[str, str]) -> None:
        parent_of = {c: p for p, children in self._children.items() for c in children}
        for child_id, reason in child_reasons.items():
            parent_id = parent_of.get(child_id)
            if parent_id is not None and parent_id not in self._failed:
                logger.error("request %s failed: %s", parent_id, reason)
                self._failed[parent_id] = reason
                self.abort_request(parent_id)

    # ---------------------------------------------------------------------------- fine-tuning
    def add_finetune_job(
        self, data: Any, hyperparameters: Any, job_id: str | None = None,
        init_adapter_path: str | None = None, resume_from: str | None = None,
        tenant: str = "default", step_plan: list[list[int]] | None = None,
    ) -> FinetuneJobState:
        """Start a LoRA fine-tuning job on tokenized `data` (`flexserve.finetune.TrainingData`)
        with `Hyperparameters`; its windows ride in the following steps. ValueError when LoRA
        is off, an example does not fit max_finetune_len, or the job's training state exceeds
        the fine-tuning memory; `FinetuneCapacityError` (a ValueError) when every fine-tuning
        slot is held or the running jobs leave too little memory for its state now.

        `resume_from`: a checkpoint directory (`save_finetune_checkpoint`) of the same job (same
        data, step plan, LoRA shape and optimizer settings, else ValueError); the job continues
        at the checkpoint's step with its adapter, AdamW state, sequence ids, losses and counters
        (it then replaces `init_adapter_path`). `tenant`: the fair-share account of its windows.
        Its steps' sequences are packed, with the other jobs', into bins of at most
        max_num_batched_tokens tokens.
        `step_plan`: the examples of each step (`plan_training_steps` of the same data and
        hyper-parameters), when the caller planned them off the engine thread.
        """
        from flexserve.finetune.checkpoint import read_trainer_state
        from flexserve.finetune.steps import plan_training_steps

        self.check_finetune_supported()
        self._adapters()
        hp = hyperparameters
        job_id = job_id or f"ftjob-{next(self._job_ids)}"
        if job_id in self.scheduler.finetune.jobs:
            raise ValueError(f"fine-tuning job {job_id!r} exists already")
        trainer_state = None if resume_from is None else read_trainer_state(resume_from)
        seed = hp.seed if hp.seed is not None else 0
        dpo = getattr(hp, "method", "supervised") == "dpo"
        if dpo != data.is_preference:
            raise ValueError("method dpo trains on preference pairs, and preference pairs need "
                             "method dpo")
        if step_plan is None:
            step_plan = [list(step.example_indices) for step in plan_training_steps(
                data.num_items, hp.batch_size, hp.n_epochs, hp.shuffle, seed)]
        job = FinetuneJobState(
            job_id, [TrainingSequence(e.input_ids, e.loss_mask) for e in data.examples],
            step_plan, -1, tenant=tenant,
            pack_capacity=self.config.scheduler.max_num_batched_tokens,
            beta=hp.beta if dpo else None)
        if trainer_state is not None:
            self.scheduler.finetune.restore(job, trainer_state)
        rank, targets = hp.lora.r, tuple(hp.lora.target_modules)
        start = resume_from or init_adapter_path
        if start is not None:  # the worker trains the starting adapter's rank and targets
            rank, targets = adapter_shape(start, rank, targets)
        slot = self._finetune_capacity().reserve(job_id, rank, targets)
        job.lora_slot = slot
        if self.info.device.startswith("cuda") and not self.config.model.enforce_eager:
            # A mixed iteration's CUDA graph writes one plan's activations: jobs of one (rank,
            # targets, dropout) share iterations' forward windows, other jobs' take others.
            job.window_group = (rank, tuple(sorted(targets)), hp.lora.dropout > 0)
        # DPO's reference is the job's start: its own slot before the first optimizer step, or
        # the backbone alone when the adapter starts from PEFT's init (B = 0 adds exactly 0)
        job.reference_slot = -1 if init_adapter_path is None and resume_from is None else slot
        try:
            self.scheduler.finetune.add_job(job)
            self.executor.add_finetune_job(
                job_id=job_id, lora_slot=slot, hyperparameters=hp, num_training_steps=len(step_plan),
                init_adapter_path=init_adapter_path, seed=seed, resume_from=resume_from)
        except Exception:
            self.scheduler.finetune.remove_job(job_id)
            self._finetune_capacity().release(job_id)
            raise
        job.events.extend(event.message for event in data.events)
        job.events.append(f"Job started: {data.num_items} "
                          f"{'pairs' if dpo else 'examples'}, {len(step_plan)} steps.")
        if trainer_state is not None:
            job.events.append(f"Resumed from a checkpoint after step {job.step_index}.")
        logger.info("fine-tuning job %s: %d examples, %d steps, LoRA slot %d%s", job_id,
                    len(data.examples), len(step_plan), slot,
                    "" if resume_from is None else f", resumed at step {job.step_index}")
        self._release_finished_jobs()  # a checkpoint of the last step has nothing left to run
        return job

    def check_finetune_supported(self) -> None:
        """ValueError when this engine's layout cannot train jobs (pipeline parallelism: a
        job needs every layer's activations and gradients on one stage's ranks)."""
        pp = self.config.parallel.pipeline_parallel_size
        if pp > 1:
            raise ValueError(f"fine-tuning does not run under pipeline parallelism (this engine "
                             f"runs pipeline_parallel_size {pp}, --pipeline-parallel-size); "
                             "tensor parallelism trains across GPUs")

    def cancel_finetune_job(self, job_id: str) -> FinetuneJobState:
        job = self.get_finetune_job(job_id)
        if not job.finished:
            self.scheduler.finetune.end_job(job_id, FinetuneJobStatus.CANCELLED)
            self.executor.end_finetune_job(job_id)
            job.events.append("Job cancelled.")
        self._release_finished_jobs()
        return job

    def remove_finetune_job(self, job_id: str) -> None:
        """Forget a finished job (succeeded, failed or cancelled) for good: its LoRA slot if it
        still holds it, its scheduler state and the worker's (fp32 adapter masters and AdamW
        state on the device). What it saved (adapters, checkpoints) is untouched; afterwards
        `get_finetune_job` and the save methods no longer know it. ValueError for an unknown
        job or one still running (cancel it first)."""
        job = self.get_finetune_job(job_id)
        if not job.finished:
            raise ValueError(f"fine-tuning job {job_id!r} is still running: cancel it before "
                             "removing it")
        self._release_job(job)
        self.scheduler.finetune.remove_job(job_id)
        self.executor.remove_finetune_job(job_id)

    def get_finetune_job(self, job_id: str) -> FinetuneJobState:
        job = self.scheduler.finetune.jobs.get(job_id)
        if job is None:
            raise ValueError(f"no fine-tuning job {job_id!r}")
        return job

    def save_finetune_adapter(self, job_id: str, path: str) -> None:
        """The job's adapter as it is now, in PEFT format."""
        self.get_finetune_job(job_id)
        self.executor.save_finetune_adapter(job_id, path)

    def save_finetune_checkpoint(self, job_id: str, directory: str) -> None:
        """Write the job's checkpoint into `directory` atomically (`flexserve.finetune.
        checkpoint`): its adapter in PEFT format (fp32), its AdamW state and its data position.
        Only between optimizer steps, e.g. right after a "step" update of
        `pop_finetune_updates` (ValueError mid-step, and for a failed job)."""
        self.get_finetune_job(job_id)
        state = self.scheduler.finetune.trainer_state(job_id)
        self.executor.save_finetune_checkpoint(job_id, directory, state.to_json())

    def pop_finetune_updates(self) -> list[FinetuneUpdate]:
        """What fine-tuning jobs did since the last call, oldest first (engine thread, after a
        step): a "step" update per optimizer step, then "succeeded", or "failed"/"cancelled".
        At a "step" update the job is at a step boundary, so `save_finetune_checkpoint` may be
        called right then, before the next `step()`."""
        return self.scheduler.finetune.pop_updates()

    def shutdown(self) -> None:
        """Stop the executor's worker processes, where it has any."""
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def prepare_thread(self) -> None:
        """Per-thread start-up of the executor for the thread that will run `step` when that is
        not the one that built the engine (the server's engine thread), where it has one."""
        prepare = getattr(self.executor, "prepare_thread", None)
        if prepare is not None:
            prepare()

    def has_finetune_work(self) -> bool:
        return self.scheduler.finetune.has_work()

    def _release_finished_jobs(self) -> None:
        for job in self.scheduler.finetune.jobs.values():
            if job.finished:
                self._release_job(job)

    def _release_job(self, job: FinetuneJobState) -> None:
        """An ended job gives its LoRA slot back and drops its activations (its weights stay
        on the worker for `save_finetune_*` until `remove_finetune_job`)."""
        if job.slot_released:
            return
        job.slot_released = True
        self.executor.end_finetune_job(job.job_id)
        if self._capacity is not None:
            self._capacity.release(job.job_id)

    def _finetune_capacity(self) -> FinetuneCapacity:
        """The fine-tuning slots and state memory (ValueError when LoRA is off)."""
        if self._capacity is None:
            self._adapters()  # LoRA off: its error
            raise ValueError("this engine has no fine-tuning LoRA slots (max_finetune_loras)")
        return self._capacity

    @property
    def finetune_capacity(self) -> FinetuneCapacity | None:
        """Fine-tuning slots and state memory of this engine; None without LoRA."""
        return self._capacity

    # ----------------------------------------------------------------------------------- LoRA
    @property
    def lora_enabled(self) -> bool:
        return self.scheduler.adapter_manager is not None

    def new_lora_request(self, lora_name: str, lora_path: str) -> LoRARequest:
        """A fresh registration of an adapter (a new, never reused id); thread-safe.

        Raises `AdapterExistsError` early when the name is taken (checked again on registering).
        """
        if lora_name in self._adapters().names:
            raise AdapterExistsError(f"The lora adapter '{lora_name}' has already been loaded.")
        return LoRARequest(lora_name, next(self._lora_ids), lora_path)

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Read and validate the adapter into the worker's host cache (disk I/O; thread-safe).

        ValueError with the reason: missing files, bad config, shapes or targets the model does
        not have, rank over max_lora_rank, a path outside allowed_adapter_dir.
        """
        self._adapters()
        self._lora_executor().add_lora(lora_request)

    def register_lora(self, lora_request: LoRARequest) -> None:
        """Make a loaded adapter servable by name (engine thread); AdapterExistsError if taken."""
        try:
            self._adapters().register(lora_request)
        except ValueError:
            self._lora_executor().remove_lora(lora_request.lora_int_id)
            raise

    def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Load and register an adapter in one call (offline use and start-up `lora_modules`)."""
        lora_request = self.new_lora_request(lora_name, lora_path)
        self.load_lora(lora_request)
        self.register_lora(lora_request)
        logger.info("loaded LoRA adapter %r from %s", lora_name, lora_path)
        return lora_request

    def remove_lora(self, lora_name: str) -> int:
        """Stop serving `lora_name`; returns how many accepted requests still finish with it.

        Raises `AdapterNotFoundError` for an unknown name.
        """
        num_in_use = self._adapters().unregister(lora_name)
        self._drop_freed_adapters()
        logger.info("unloaded LoRA adapter %r (%d requests still use it)", lora_name, num_in_use)
        return num_in_use

    def list_loras(self) -> tuple[LoRARequest, ...]:
        """The servable adapters (a snapshot; safe to read from any thread)."""
        adapters = self.scheduler.adapter_manager
        return () if adapters is None else adapters.lora_requests

    def lora_stats(self) -> tuple[dict[str, int], int, int]:
        """(running requests per adapter name, adapters in device slots, adapters in host RAM)."""
        adapters = self._adapters()
        return (adapters.num_running_by_name(), adapters.num_resident,
                self._lora_executor().num_cpu_loras)

    def _adapters(self) -> AdapterManager:
        adapters = self.scheduler.adapter_manager
        if adapters is None:
            if self.config.parallel.tensor_parallel_size > 1:
                raise ValueError("LoRA is not enabled in this engine: under tensor parallelism "
                                 "it is on only when asked for (enable_lora=True / "
                                 "--enable-lora)")
            raise ValueError("LoRA is not enabled in this engine (it was built with "
                             "enable_lora=False / --no-enable-lora)")
        return adapters

    def _lora_executor(self) -> LoRAExecutor:
        return self.executor  # type: ignore[return-value]

    def _drop_freed_adapters(self) -> None:
        adapters = self.scheduler.adapter_manager
        if adapters is None:
            return
        for lora_int_id in adapters.pop_freed_ids():
            self._lora_executor().remove_lora(lora_int_id)
