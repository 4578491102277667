"""`POST /v1/chat/completions`: messages through the tokenizer's chat template, one engine request.

Streams as OpenAI does: a first chunk per choice with `{"role": "assistant", "content": ""}`,
then content deltas, a chunk carrying `finish_reason`, an optional usage chunk, `data: [DONE]`.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from flexserve.engine.llm_engine import PreparedRequest
from flexserve.entrypoints.openai.errors import bad_request
from flexserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    TopLogprob,
    now_s,
    random_id,
)
from flexserve.entrypoints.openai.serving_base import (
    SSE_DONE,
    OpenAIServing,
    cancel_on_disconnect,
    final_outputs,
    json_response,
    merge_async_iterators,
    sse,
    sse_error,
    tenant_of,
    usage_of,
)
from flexserve.outputs import PositionLogprobs, RequestOutput
from flexserve.sampling_params import SamplingParams

_CONTENT_REQUIRED_ROLES = ("system", "developer", "user")


class OpenAIServingChat(OpenAIServing):
    """Turns a `ChatCompletionRequest` into one engine request, its result into OpenAI's shape."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        lora_name = self.check_model(request.model, raw_request)
        if request.tools:
            raise bad_request("tools are not supported", param="tools")
        if request.response_format is not None and request.response_format.type != "text":
            raise bad_request(
                f"response_format {request.response_format.type!r} is not supported; only 'text'",
                param="response_format")
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if request.max_completion_tokens is not None:
            max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_top,
                                      max_tokens_param=max_tokens_param)

        request_id = random_id("chatcmpl")
        self.charge_admission(raw_request, num_sequences=params.n)
        prepared = await self.off_loop(self._render_and_prepare, request, request_id, params,
                                       max_tokens_param, lora_name, tenant_of(raw_request))
        self.charge_admission(raw_request, num_tokens=params.n * (
            len(prepared.prompt_token_ids) + prepared.max_tokens))
        generator = self.engine.generate(prepared)
        created = now_s()
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            stream = self._stream(generator, params.n, num_top, request_id, created,
                                  request.model, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        (final,) = await cancel_on_disconnect(raw_request, final_outputs([generator]))
        choices = []
        for completion in final.outputs:
            logprobs = None
            if num_top is not None:
                logprobs = ChatLogprobs(content=self._logprob_tokens(
                    completion.token_ids, completion.logprobs or [], num_top))
            choices.append(ChatCompletionChoice(
                index=completion.index,
                message=ChatResponseMessage(content=completion.text),
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
            ))
        response = ChatCompletionResponse(id=request_id, created=created, model=request.model,
                                          choices=choices, usage=usage_of([final]))
        return json_response(response)

    def _render_and_prepare(self, request: ChatCompletionRequest, request_id: str,
                            params: SamplingParams, max_tokens_param: str,
                            lora_name: str | None, tenant: str) -> PreparedRequest:
        """The messages through the chat template, tokenized and validated (off the loop)."""
        messages = _template_messages(request.messages)
        processor = self.engine.input_processor
        try:
            text = processor.apply_chat_template(
                messages, request.add_generation_prompt,
                chat_template_kwargs=request.chat_template_kwargs)
            token_ids = processor.encode_chat_prompt(text)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        return self.prepare(request_id, token_ids, params, "messages", max_tokens_param,
                            prompt_text=text, lora_name=lora_name, tenant=tenant)

    async def _stream(
        self,
        generator: AsyncIterator[RequestOutput],
        n: int,
        num_top: int | None,
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        def chunk(choice: ChatCompletionStreamChoice) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice]))

        num_chars_sent = [0] * n
        num_tokens_sent = [0] * n
        done = [False] * n
        final: RequestOutput | None = None
        try:
            for i in range(n):
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content="")))
            async for _, output in merge_async_iterators([generator]):
                final = output
                for completion in output.outputs:
                    i = completion.index
                    if done[i]:
                        continue
                    delta = completion.text[num_chars_sent[i]:]
                    new_ids = completion.token_ids[num_tokens_sent[i]:]
                    logprobs = None
                    if num_top is not None and new_ids:
                        entries = (completion.logprobs or [])[num_tokens_sent[i]:]
                        logprobs = ChatLogprobs(
                            content=self._logprob_tokens(new_ids, entries, num_top))
                    num_chars_sent[i] = len(completion.text)
                    num_tokens_sent[i] = len(completion.token_ids)
                    done[i] = completion.finish_reason is not None
                    if not delta and logprobs is None and not done[i]:
                        continue
                    yield chunk(ChatCompletionStreamChoice(
                        index=i,
                        delta=DeltaMessage(content=delta or None),
                        logprobs=logprobs,
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    ))
            if include_usage and final is not None:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=usage_of([final])))
        except Exception as e:  # the stream has started: report in-band
            yield sse_error(e)
        yield SSE_DONE

    def _logprob_tokens(
        self, token_ids: Sequence[int], entries: Sequence[PositionLogprobs], num_top: int
    ) -> list[ChatLogprobToken]:
        tokens = []
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id, entry)
            chosen = entry.get(token_id)
            tokens.append(ChatLogprobToken(
                token=text,
                logprob=chosen.logprob if chosen is not None else -9999.0,  # OpenAI's -inf
                bytes=self.token_bytes(token_id, text),
                top_logprobs=[
                    TopLogprob(token=t, logprob=lp, bytes=self.token_bytes(tid, t))
                    for tid, t, lp in self.top_logprobs(entry, num_top)
                ],
            ))
        return tokens

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """The token's UTF-8 bytes; a byte-level BPE token holding part of a character (shown
        as U+FFFD) is mapped back to its raw bytes through GPT-2's byte alphabet."""
        if "\ufffd" in text and self.engine.tokenizer is not None:
            piece = self.engine.tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(piece, str) and piece and all(c in decoder for c in piece):
                return [decoder[c] for c in piece]
        return list(text.encode("utf-8"))


def _template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them; content parts are joined text."""
    result = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"content part type {part.type!r} is not supported: this model takes "
                        "text parts ({'type': 'text', 'text': ...}) only",
                        param=f"messages.{i}.content.{j}")
                texts.append(part.text)
            content = "\n".join(texts)
        if content is None and message.role in _CONTENT_REQUIRED_ROLES:
            raise bad_request(f"messages[{i}] ({message.role}) must have content",
                              param=f"messages.{i}.content")
        # OpenAI's "developer" role replaces "system"; templates only know the latter.
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": content or "",
        }
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        result.append(entry)
    return result


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map, inverted."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}
