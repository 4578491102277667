"""The offline API: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from flexserve.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from flexserve.engine.llm_engine import LLMEngine
from flexserve.outputs import RequestOutput
from flexserve.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching.

    Keyword arguments are the fields of `ModelConfig`, `CacheConfig` and `SchedulerConfig`
    (e.g. `dtype`, `max_model_len`, `max_num_batched_tokens`, `num_blocks`, `kv_cache_gib`).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        sections = {}
        for cls in (ModelConfig, CacheConfig, SchedulerConfig):
            names = set(cls.__dataclass_fields__)
            sections[cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if kwargs:
            raise ValueError(f"unknown LLM argument(s): {', '.join(sorted(kwargs))}")
        config = EngineConfig(
            model=ModelConfig(model=model, **sections[ModelConfig]),
            cache=CacheConfig(**sections[CacheConfig]),
            scheduler=SchedulerConfig(**sections[SchedulerConfig]),
        )
        self.engine = LLMEngine.from_config(config)

    def get_tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        return self._run([(p, None) for p in prompt_list], params_list, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
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
        return self._run(prompts, params_list, use_tqdm)

    # -------------------------------------------------------------------------------- internals
    @staticmethod
    def _params_for(prompts: list, params: SamplingParams | Sequence[SamplingParams] | None) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        return params

    def _run(
        self,
        prompts: list[tuple[Any, str | None]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.engine
        ids: list[str] = []
        try:
            for (prompt, text), params in zip(prompts, params_list):
                request_id = engine.next_request_id()
                engine.add_request(request_id, prompt, params, prompt_text=text)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="prompt", disable=not use_tqdm)
        generated = 0
        try:
            while len(finished) < len(ids):
                for output in engine.step():
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
