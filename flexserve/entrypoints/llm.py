"""The offline API: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

import os
from typing import Any, Sequence

from tqdm.auto import tqdm

from flexserve.config import (
    DEFAULT_MODEL,
    CacheConfig,
    CoserveConfig,
    EngineConfig,
    FinetuneConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from flexserve.engine.adapter_manager import AdapterLoadError
from flexserve.engine.lora_request import LoRARequest
from flexserve.entrypoints.engine_builder import build_engine
from flexserve.finetune.job import FinetuneJob, start_finetune_job
from flexserve.outputs import RequestOutput
from flexserve.sampling_params import SamplingParams
from flexserve.worker.structured_outputs import check_structured_outputs

Message = dict[str, Any]
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching.

    Keyword arguments are the fields of `ModelConfig`, `CacheConfig`, `SchedulerConfig`,
    `LoRAConfig`, `FinetuneConfig`, `CoserveConfig` and `ParallelConfig` (e.g. `dtype`,
    `max_model_len`, `max_num_batched_tokens`, `num_blocks`, `kv_cache_gib`, `max_loras`,
    `max_lora_rank`, `policy`, `slo_tpot_ms`, `tensor_parallel_size`,
    `pipeline_parallel_size`). LoRA slots are on by default (`finetune` needs one per job, and
    `generate(..., lora_request=LoRARequest(name, id, path))` uses adapters); a batch without
    adapters runs only the base GEMMs. `enable_lora=False` allocates none; above one rank LoRA
    is off unless asked for (`enable_lora=True` or a LoRA option): adapters are then served
    sharded over the ranks, and `finetune` trains across tensor-parallel ranks (it is refused
    under pipeline parallelism). `shutdown()` stops the ranks' workers. Offline there is no
    latency SLO unless `slo_tpot_ms` is given: fine-tuning windows then fill the token budget.
    """

    def __init__(self, model: str = DEFAULT_MODEL, enable_lora: bool | None = None,
                 **kwargs: Any) -> None:
        sections = {}
        for cls in (ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig, FinetuneConfig,
                    CoserveConfig, ParallelConfig):
            names = set(cls.__dataclass_fields__)
            sections[cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if kwargs:
            raise ValueError(f"unknown LLM argument(s): {', '.join(sorted(kwargs))}")
        parallel = ParallelConfig(**sections[ParallelConfig])
        if enable_lora is None:
            enable_lora = parallel.world_size == 1 or bool(sections[LoRAConfig])
        lora = None
        if enable_lora:
            lora = LoRAConfig(**sections[LoRAConfig])
        elif sections[LoRAConfig]:
            raise ValueError(f"enable_lora=False turns LoRA off, so "
                             f"{', '.join(sorted(sections[LoRAConfig]))} cannot apply")
        config = EngineConfig(
            model=ModelConfig(model=model, **sections[ModelConfig]),
            cache=CacheConfig(**sections[CacheConfig]),
            scheduler=SchedulerConfig(**sections[SchedulerConfig]),
            lora=lora,
            finetune=FinetuneConfig(**sections[FinetuneConfig]),
            coserve=CoserveConfig(**{"slo_tpot_ms": None, **sections[CoserveConfig]}),
            parallel=parallel,
        )
        self.engine = build_engine(config)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); a no-op without them."""
        self.engine.shutdown()

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        """An LLM over an already built EngineConfig (the CLI builds one from its options)."""
        llm = cls.__new__(cls)
        llm.engine = build_engine(config)
        return llm

    def finetune(
        self,
        dataset: Any,
        lora: dict[str, Any] | None = None,
        hyperparameters: Any = None,
        job_id: str | None = None,
        resume_from: str | None = None,
        method: str | None = None,
    ) -> FinetuneJob:
        """Start token-level LoRA fine-tuning on this model (in one of its LoRA slots).

        `dataset`: a JSONL path, JSONL bytes or a list of dicts, each {"text"}, {"prompt",
        "completion"} or {"messages"}, or for `method="dpo"` preference pairs {"input",
        "preferred_output", "non_preferred_output"} (docs/finetuning.md). `lora`: r, alpha,
        dropout, target_modules, init_adapter. `hyperparameters`: a `Hyperparameters` or its dict
        (batch_size, learning_rate, lr_scheduler, warmup_steps, weight_decay, max_grad_norm,
        n_epochs, shuffle, seed, max_seq_len; beta for dpo). `method`: "supervised" (the
        default) or "dpo" (preference fine-tuning against the job's starting point). Returns at
        once with a handle; the job trains in the engine's steps, alongside any `generate` call
        (`handle.wait()` to finish it). `resume_from`: a directory written by
        `handle.checkpoint(...)` for the same dataset and settings; the job continues from there
        exactly.
        """
        return start_finetune_job(self.engine, dataset, lora, hyperparameters, job_id,
                                  resume_from, method)

    def get_tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order.

        `lora_request`: one adapter for every prompt, or one per prompt (None: the base model).
        An adapter not loaded yet is loaded on first use and stays loaded.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        lora_names = self._lora_names_for(len(prompt_list), lora_request)
        return self._run([(p, None) for p in prompt_list], params_list, use_tqdm, lora_names)

    # ------------------------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter now (it is also loaded on first use); ValueError with the reason."""
        self._ensure_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter by name; AdapterNotFoundError (a ValueError) when unknown."""
        self.engine.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters (with the ids the engine gave them)."""
        return list(self.engine.list_loras())

    def _ensure_lora(self, lora_request: LoRARequest) -> None:
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        loaded = {r.lora_name: r for r in self.engine.list_loras()}
        existing = loaded.get(lora_request.lora_name)
        if existing is None:
            self.engine.add_lora(lora_request.lora_name, lora_request.lora_path)
        elif os.path.realpath(existing.lora_path) != os.path.realpath(lora_request.lora_path):
            raise ValueError(
                f"a different adapter named {lora_request.lora_name!r} is loaded (from "
                f"{existing.lora_path}); remove it first or choose another name"
            )

    def _lora_names_for(self, num_prompts: int, lora_request: LoRAArg) -> list[str | None]:
        if lora_request is None:
            return [None] * num_prompts
        if isinstance(lora_request, LoRARequest):
            requests: list[LoRARequest | None] = [lora_request] * num_prompts
        else:
            requests = list(lora_request)
            if len(requests) != num_prompts:
                raise ValueError(
                    f"got {len(requests)} LoRA requests for {num_prompts} prompts")
        for request in {id(r): r for r in requests if r is not None}.values():
            self._ensure_lora(request)
        return [None if r is None else r.lora_name for r in requests]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRAArg = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        processor = self.engine.input_processor
        prompts = []
        for conversation in conversations:
            text = processor.apply_chat_template(
                list(conversation), add_generation_prompt, chat_template, chat_template_kwargs
            )
            prompts.append((processor.encode_chat_prompt(text), text))
        params_list = self._params_for(prompts, sampling_params)
        lora_names = self._lora_names_for(len(prompts), lora_request)
        return self._run(prompts, params_list, use_tqdm, lora_names)

    # -------------------------------------------------------------------------------- internals
    @staticmethod
    def _params_for(prompts: list, params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        for p in {id(p): p for p in params}.values():
            if p.structured_outputs is not None:
                check_structured_outputs(p.structured_outputs)
        return params

    def _run(
        self,
        prompts: list[tuple[Any, str | None]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        lora_names: list[str | None],
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for (prompt, text), params, lora_name in zip(prompts, params_list, lora_names):
                request_id = engine.next_request_id()
                # Only finished outputs are used here: none is built for the steps between.
                engine.add_request(request_id, prompt, params, prompt_text=text,
                                   lora_name=lora_name, final_output_only=True)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="prompt", disable=not use_tqdm)
        generated = 0
        try:
            while len(finished) < len(ids):
                outputs = engine.step()
                failed = engine.pop_failed_requests()
                if failed:
                    raise AdapterLoadError(next(iter(failed.values())))
                for output in outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        generated += sum(len(o.token_ids) for o in output.outputs)
                        bar.update(1)
                        bar.set_postfix(output_tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f}")
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Any) -> list[Any]:
    """A single prompt (text or one token-id list) becomes a list of one."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise ValueError("prompts must be a string, a list of strings or token-id lists")
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)]
    return list(prompts)
