"""`POST /v1/completions`: one engine request per prompt, choices indexed prompt_index * n + i.

`max_tokens: 0` with `echo` scores the prompt without generating (what lm-eval's log-likelihood
requests send): one token is computed, as the engine always samples, and left out of the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from flexserve.engine.llm_engine import PreparedRequest
from flexserve.entrypoints.openai.errors import bad_request
from flexserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    now_s,
    random_id,
)
from flexserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    cancel_on_disconnect,
    choice_usage,
    final_outputs,
    json_response,
    merge_async_iterators,
    sse,
    sse_error,
    tenant_of,
    usage_every_chunk,
    usage_of,
)
from flexserve.entrypoints.openai.structured_outputs import request_structured_outputs
from flexserve.outputs import PositionLogprobs, RequestOutput
from flexserve.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """Turns a `CompletionRequest` into engine requests and their results into OpenAI's shape."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        lora_name = self.check_model(request.model, raw_request)
        n = 1 if request.n is None else request.n
        if request.best_of is not None and request.best_of != n:
            raise bad_request("best_of is not supported (only best_of == n)", param="best_of")
        if request.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        prompts = _prompt_list(request.prompt)
        echo = bool(request.echo)
        logprobs = request.logprobs
        prompt_only = echo and request.max_tokens == 0
        params = self.sampling_params(
            request, 1 if prompt_only else request.max_tokens, logprobs,
            prompt_logprobs=logprobs if echo and logprobs is not None else None,
            structured_outputs=request_structured_outputs(request),
        )
        request_id = random_id("cmpl")
        tenant = tenant_of(raw_request)
        self.charge_admission(raw_request, num_sequences=len(prompts) * n)
        prepared = await self.off_loop(self._prepare_all, request_id, prompts, params,
                                       lora_name, tenant)
        self.charge_admission(raw_request, num_tokens=n * sum(
            len(p.prompt_token_ids) + p.max_tokens for p in prepared))
        generators = [self.engine.generate(p) for p in prepared]
        if prompt_only:
            generators = [_prompt_only(g) for g in generators]
        created = now_s()
        formatter = _ChoiceFormatter(self, n, logprobs, echo)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self._stream(generators, formatter, request_id, created, request.model,
                                  include_usage, usage_every_chunk(request))
            return StreamingResponse(stream, media_type="text/event-stream")
        finals = await cancel_on_disconnect(raw_request, final_outputs(generators))
        choices = [
            formatter.choice(prompt_index, output, completion.index)
            for prompt_index, output in enumerate(finals)
            for completion in output.outputs
        ]
        response = CompletionResponse(id=request_id, created=created, model=request.model,
                                      choices=choices, usage=usage_of(finals))
        return json_response(response)

    def _prepare_all(self, request_id: str, prompts: list, params: SamplingParams,
                     lora_name: str | None, tenant: str) -> list[PreparedRequest]:
        return [self.prepare(f"{request_id}-{i}", prompt, params, "prompt", "max_tokens",
                             lora_name=lora_name, tenant=tenant)
                for i, prompt in enumerate(prompts)]

    async def _stream(
        self,
        generators: Sequence[AsyncIterator[RequestOutput]],
        formatter: _ChoiceFormatter,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
        every_chunk: bool = False,
    ) -> AsyncIterator[str]:
        finals: list[RequestOutput | None] = [None] * len(generators)
        try:
            async for prompt_index, output in merge_async_iterators(generators):
                finals[prompt_index] = output
                for completion in output.outputs:
                    choice = formatter.delta(prompt_index, output, completion.index)
                    if choice is not None:
                        yield sse(CompletionStreamResponse(
                            id=request_id, created=created, model=model, choices=[choice],
                            usage=choice_usage(output, completion) if every_chunk else None))
            if include_usage:
                usage = usage_of([o for o in finals if o is not None])
                yield sse(CompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage))
        except Exception as e:  # the stream has started: report in-band
            yield sse_error(e)
        yield SSE_DONE


class _ChoiceFormatter:
    """Builds choices (whole or as stream deltas) from cumulative outputs."""

    def __init__(self, serving: OpenAIServing, n: int, logprobs: int | None, echo: bool) -> None:
        self.serving = serving
        self.n = n
        self.logprobs = logprobs
        self.echo = echo
        # Stream state per choice index: characters and tokens sent, text offset, done.
        self.num_chars_sent: dict[int, int] = {}
        self.num_tokens_sent: dict[int, int] = {}
        self.text_offsets: dict[int, int] = {}
        self.done: set[int] = set()

    def choice(self, prompt_index: int, output: RequestOutput, i: int) -> CompletionChoice:
        completion = output.outputs[i]
        text = completion.text
        lp = None
        if self.logprobs is not None:
            lp = CompletionLogprobs()
            offset = 0
            if self.echo:
                offset = self._append_prompt(lp, output, offset)
            self._append(lp, completion.token_ids, completion.logprobs or [], offset)
        if self.echo:
            text = self._prompt_text(output) + text
        return CompletionChoice(
            index=prompt_index * self.n + completion.index, text=text, logprobs=lp,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        )

    def delta(self, prompt_index: int, output: RequestOutput, i: int) -> CompletionChoice | None:
        """The part of choice i not sent yet, or None when there is nothing new."""
        completion = output.outputs[i]
        index = prompt_index * self.n + completion.index
        if index in self.done:
            return None
        first = index not in self.num_chars_sent
        num_chars = self.num_chars_sent.get(index, 0)
        num_tokens = self.num_tokens_sent.get(index, 0)
        offset = self.text_offsets.get(index, 0)
        text = ""
        lp = CompletionLogprobs() if self.logprobs is not None else None
        if first and self.echo:
            text = self._prompt_text(output)
            if lp is not None:
                offset = self._append_prompt(lp, output, offset)
        text += completion.text[num_chars:]
        new_ids = completion.token_ids[num_tokens:]
        if lp is not None and new_ids:
            offset = self._append(lp, new_ids, (completion.logprobs or [])[num_tokens:], offset)
        self.num_chars_sent[index] = len(completion.text)
        self.num_tokens_sent[index] = len(completion.token_ids)
        self.text_offsets[index] = offset
        if completion.finish_reason is not None:
            self.done.add(index)
        has_logprobs = lp is not None and bool(lp.tokens)
        if not text and not has_logprobs and completion.finish_reason is None:
            return None
        return CompletionChoice(
            index=index, text=text, logprobs=lp if has_logprobs else None,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        )

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        tokenizer = self.serving.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(output.prompt_token_ids)

    def _append_prompt(self, lp: CompletionLogprobs, output: RequestOutput, offset: int) -> int:
        entries: list[PositionLogprobs | None] = list(output.prompt_logprobs or [])
        entries += [None] * (len(output.prompt_token_ids) - len(entries))
        return self._append(lp, output.prompt_token_ids, entries, offset)

    def _append(self, lp: CompletionLogprobs, token_ids: Sequence[int],
                entries: Sequence[PositionLogprobs | None], offset: int) -> int:
        """Add one entry per token; returns the text offset after them."""
        k = self.logprobs or 0
        for token_id, entry in zip(token_ids, entries):
            text = self.serving.token_text(token_id, entry)
            lp.tokens.append(text)
            lp.text_offset.append(offset)
            offset += len(text)
            chosen = None if entry is None else entry.get(token_id)
            lp.token_logprobs.append(None if chosen is None else chosen.logprob)
            if entry is None:
                lp.top_logprobs.append(None)
                continue
            top = {t: logprob for _, t, logprob in self.serving.top_logprobs(entry, k)}
            if chosen is not None:
                top.setdefault(text, chosen.logprob)  # vLLM: the chosen token is always listed
            lp.top_logprobs.append(top)
        return offset


async def _prompt_only(generator: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The outputs without their generated token: the prompt alone, ended by its length."""
    async for output in generator:
        yield dataclasses.replace(output, outputs=[
            dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None,
                                logprobs=None if c.logprobs is None else [],
                                finish_reason=None if c.finish_reason is None else "length",
                                stop_reason=None)
            for c in output.outputs])


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's prompts: a string or one token-id list is one prompt."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # the request model bounds their number
