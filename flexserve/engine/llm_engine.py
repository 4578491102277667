"""`LLMEngine`: prompts in, `RequestOutput`s out, one `step()` at a time (synchronous)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from flexserve.config import EngineConfig
from flexserve.engine.engine_core import EngineCore, Executor, StepStats
from flexserve.engine.input_processor import InputProcessor, Prompt
from flexserve.engine.output_processor import OutputProcessor
from flexserve.engine.request import Request, RequestStatus
from flexserve.engine.scheduler import Scheduler
from flexserve.outputs import RequestOutput
from flexserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInfo:
    """What the engine knows about the loaded model (filled by the loader side)."""

    name: str  # the name the model was asked for
    vocab_size: int  # logits width
    max_model_len: int  # resolved context length
    eos_token_id: int | None  # from the tokenizer, else the config
    num_blocks: int  # KV cache blocks allocated
    block_size: int  # tokens per block
    device: str  # e.g. "cuda:0" or "cpu"
    dtype: str  # e.g. "bfloat16"


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized prompt ready to enqueue."""

    request_id: str  # the caller's id; children get "-i" suffixes when n > 1
    prompt_text: str | None  # the prompt as text, when known
    prompt_token_ids: list[int]  # tokenized prompt
    params: SamplingParams  # how to sample
    max_tokens: int  # resolved generation limit
    arrival_time: float  # time.monotonic() at arrival


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
        self.scheduler = Scheduler(config.scheduler, config.cache, info.num_blocks, info.max_model_len)
        self.core = EngineCore(self.scheduler, executor)
        self.input_processor = InputProcessor(tokenizer, info.vocab_size, info.max_model_len)
        self.output_processor = OutputProcessor(tokenizer)
        self._children: dict[str, list[str]] = {}  # parent request id -> child request ids
        self._ids = itertools.count()
        self.last_step_stats: StepStats | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        """Resolve and load the model, size the KV cache, build the engine."""
        # Imported here so that the engine package itself never imports torch.
        from flexserve.worker.builder import build_executor

        executor, tokenizer, info = build_executor(config)
        return cls(config, executor, tokenizer, info)

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
    ) -> PreparedRequest:
        """Tokenize and validate a prompt; raises ValueError on bad input.

        Touches no engine state, so a server may call it off the engine thread and hand the
        result to `add_prepared_request` there.
        """
        text, token_ids = self.input_processor.process(prompt)
        return PreparedRequest(
            request_id=request_id,
            prompt_text=prompt_text if prompt_text is not None else text,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=self.input_processor.resolve_max_tokens(len(token_ids), params),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Enqueue a validated prompt: one scheduler request per completion (`n`)."""
        request_id, params = prepared.request_id, prepared.params
        if request_id in self._children:
            raise ValueError(f"request id {request_id!r} is already in use")
        eos = None if params.ignore_eos else self.info.eos_token_id
        child_ids = [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        requests = [
            Request(
                child_id, prepared.prompt_token_ids, params, eos, prepared.max_tokens,
                prepared.arrival_time, None if params.seed is None else params.seed + i,
            )
            for i, child_id in enumerate(child_ids)
        ]
        self.output_processor.add_request(
            request_id, prepared.prompt_text, prepared.prompt_token_ids, params, child_ids
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
    ) -> None:
        """Validate and enqueue a prompt (text or token ids); raises ValueError on bad input."""
        self.add_prepared_request(
            self.process_inputs(request_id, prompt, params, prompt_text, arrival_time)
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

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of every request that changed."""
        updated, result, stats = self.core.step()
        self.last_step_stats = stats
        if result is None:
            return []
        outputs, stopped_ids = self.output_processor.process(updated, result)
        if stopped_ids:
            self.scheduler.finish_requests(stopped_ids, RequestStatus.FINISHED_STOPPED)
        for output in outputs:
            if output.finished:
                self._children.pop(output.request_id, None)
        return outputs
