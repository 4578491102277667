"""What the completions and chat handlers share: model check, sampling params, prompt
preparation with the context-length check, logprob formatting, SSE and disconnect handling."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.engine.llm_engine import PreparedRequest
from flexserve.entrypoints.openai.auth import owner_tenant
from flexserve.entrypoints.openai.errors import (
    APIError,
    bad_request,
    error_payload,
    model_not_found,
    to_api_error,
    value_error,
)
from flexserve.entrypoints.openai.offload import Offload
from flexserve.entrypoints.openai.protocol import PromptTokensDetails, SamplingFields, UsageInfo
from flexserve.outputs import PositionLogprobs, RequestOutput
from flexserve.sampling_params import SamplingParams, StructuredOutputsParams

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response was ready; its requests were aborted."""


class OpenAIServing:
    """Base of the endpoint handlers: one engine, the names it is served under."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: Sequence[str],
                 model_access: Callable[[str, Request], bool] | None = None,
                 offload: Offload | None = None) -> None:
        self.engine = engine
        # worker threads for tokenizing and chat templates (offload.py); None: run inline
        self.offload = offload
        self.served_model_names = list(served_model_names)
        self.max_model_len = engine.info.max_model_len
        # (adapter name, request) -> whether the request's caller may use it (model_access.py:
        # adapters and fine-tuned models belong to tenants); None: every adapter serves everyone
        self.model_access = model_access

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the offload workers (inline without them): tokenization and chat
        templates never hold the event loop."""
        if self.offload is None:
            return fn(*args)
        return await self.offload.run(fn, *args)

    def charge_admission(self, raw_request: Request, num_sequences: int = 0,
                         num_tokens: int = 0) -> None:
        """Charge the request what it queues (`limits.AdmissionController.charge`); 429 with
        Retry-After past a tenant's or the server's limit, 400 when it could never fit."""
        ticket = getattr(raw_request.state, "admission_ticket", None)
        admission = getattr(raw_request.app.state, "admission", None)
        if ticket is None or admission is None:
            return
        rejection = admission.charge(ticket, num_sequences, num_tokens)
        if rejection is None:
            return
        if rejection.status_code == 429:
            raise APIError(429, rejection.message, "rate_limit_error", code=rejection.code,
                           headers={"Retry-After": str(rejection.retry_after_s)})
        raise APIError(rejection.status_code, rejection.message, code=rejection.code)

    def check_model(self, model: str, raw_request: Request) -> str | None:
        """The LoRA adapter `model` names (None for the base model); 404 for unknown names and
        for adapters the request's tenant may not use."""
        if model in self.served_model_names:
            return None
        if self.engine.lora_enabled and model in {r.lora_name for r in self.engine.list_loras()}:
            if self.model_access is None or self.model_access(model, raw_request):
                return model
        raise model_not_found(model)

    def sampling_params(
        self,
        request: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        max_tokens_param: str = "max_tokens",
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's sampling fields as `SamplingParams`; bad values are a 400."""
        logit_bias = self._logit_bias(request.logit_bias)
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              param="stream_options")
        stop = request.stop
        try:
            return SamplingParams(
                n=1 if request.n is None else request.n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=0 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if request.repetition_penalty is None else request.repetition_penalty),
                seed=request.seed,
                stop=[] if stop is None else ([stop] if isinstance(stop, str) else list(stop)),
                stop_token_ids=list(request.stop_token_ids or []),
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                logit_bias=logit_bias,
                structured_outputs=structured_outputs,
            )
        except ValueError as e:
            error = value_error(e, set(type(request).model_fields))
            if error.param == "max_tokens":
                error.param = max_tokens_param
            raise error from e

    def _logit_bias(self, logit_bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's `{"token id": bias}` with ids checked against the vocabulary."""
        if not logit_bias:
            return None
        vocab_size = self.engine.input_processor.vocab_size
        result = {}
        for key, bias in logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                                  param="logit_bias") from None
            if not 0 <= token_id < vocab_size:
                raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary "
                                  f"[0, {vocab_size})", param="logit_bias")
            result[token_id] = bias
        return result

    def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        prompt_param: str,
        max_tokens_param: str,
        prompt_text: str | None = None,
        lora_name: str | None = None,
        tenant: str = "default",
    ) -> PreparedRequest:
        """Tokenize and validate one prompt; prompt plus max_tokens must fit the context."""
        try:
            prepared = self.engine.prepare(request_id, prompt, params, prompt_text, lora_name,
                                           tenant)
        except ValueError as e:
            code = "context_length_exceeded" if "context length" in str(e) else None
            raise bad_request(str(e), param=prompt_param, code=code) from e
        num_prompt_tokens = len(prepared.prompt_token_ids)
        max_tokens = params.max_tokens
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + params.max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or of the completion.",
                param=max_tokens_param, code="context_length_exceeded",
            )
        return prepared

    def token_text(self, token_id: int, entry: PositionLogprobs | None = None) -> str:
        """The text of one token, from its logprob entry when it has one."""
        if entry is not None:
            logprob = entry.get(token_id)
            if logprob is not None and logprob.decoded_token is not None:
                return logprob.decoded_token
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def top_logprobs(self, entry: PositionLogprobs, k: int) -> list[tuple[int, str, float]]:
        """The k best entries of a position by rank, as (token id, text, logprob)."""
        best = sorted(entry.items(), key=lambda item: item[1].rank)[:k]
        return [(token_id, self.token_text(token_id, entry), lp.logprob) for token_id, lp in best]


def tenant_of(raw_request: Request) -> str:
    """The fair-share account of a request: its API key's tenant (`auth.owner_tenant`). The
    request's `user` field is an end-user id the client chose: it is never an account, or any
    client could charge its work to another tenant, or grow the counters without bound."""
    return owner_tenant(raw_request)


def usage_of(outputs: Sequence[RequestOutput]) -> UsageInfo:
    """Each prompt counted once, completion tokens over all choices."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in outputs)),
    )


def choice_usage(output: RequestOutput, completion: Any | None) -> UsageInfo:
    """The usage so far of one choice (`completion`, one of `output.outputs`; None: before any)
    of a streamed request: its prompt's tokens and the tokens the choice generated until now
    (`stream_options.continuous_usage_stats`)."""
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = 0 if completion is None else len(completion.token_ids)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=output.num_cached_tokens))


def usage_every_chunk(request: Any) -> bool:
    """Whether a streamed request asked for usage in every chunk (include_usage and vLLM's
    continuous_usage_stats)."""
    options = request.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def json_response(payload: BaseModel, status_code: int = 200) -> Response:
    """pydantic's JSON (non-finite floats become null instead of failing the response)."""
    return Response(payload.model_dump_json(), status_code=status_code,
                    media_type="application/json")


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying a JSON payload."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def sse_error(error: Exception) -> str:
    """An error after the stream has started: sent in-band, OpenAI's shape."""
    return sse(error_payload(to_api_error(error)))


async def merge_async_iterators(
    iterators: Sequence[AsyncIterator[T]],
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators, yielding (iterator index, item) as items arrive.

    Closing the merged iterator cancels the rest, which aborts their engine requests.
    """
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    done = object()
    items: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def drain(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                items.put_nowait((index, item))
        except Exception as e:
            items.put_nowait((index, e))
        finally:
            items.put_nowait((index, done))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await items.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(generators: Sequence[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run every prompt's generation to the end; the final output of each, in prompt order."""
    finals: list[RequestOutput | None] = [None] * len(generators)
    async for index, output in merge_async_iterators(generators):
        finals[index] = output
    if any(output is None or not output.finished for output in finals):
        raise APIError(503, "the request was aborted before it finished", "server_error",
                       code="aborted")
    return finals  # type: ignore[return-value]


async def cancel_on_disconnect(raw_request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


async def _wait_for_disconnect(raw_request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return
