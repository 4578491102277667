"""`POST /v1/chat/completions`: messages through the tokenizer's chat template, one engine request.

Streams as OpenAI does: a first chunk per choice with `{"role": "assistant", "content": ""}`,
then content (or tool-call) deltas, a chunk carrying `finish_reason`, an optional usage chunk,
`data: [DONE]`.

Tools reach the chat template (`tools=`). `tool_choice` "required" and a named function are
enforced by a grammar (`structured_outputs.py`); "auto" parses the reply with the
`--tool-call-parser` (`tool_parsers.py`); "none" leaves the reply as text.
"""

from __future__ import annotations

import functools
import json
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
    ChatTool,
    DeltaMessage,
    NamedToolChoice,
    RequestToolCall,
    TopLogprob,
    UsageInfo,
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
from flexserve.entrypoints.openai.structured_outputs import (
    named_tool_params,
    request_structured_outputs,
    required_tools_params,
)
from flexserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolCall,
    RequiredToolCalls,
    ToolCallStream,
    ToolParser,
)
from flexserve.outputs import PositionLogprobs, RequestOutput
from flexserve.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
    """Turns a `ChatCompletionRequest` into one engine request, its result into OpenAI's shape.

    `tool_call_parser`: the `TOOL_PARSERS` name that reads tool calls out of replies under
    `tool_choice: "auto"` (None: "auto" is refused with a 400 naming the flag)."""

    def __init__(self, *args: Any, tool_call_parser: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {tool_call_parser!r}; choose from "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        self.tool_call_parser = tool_call_parser

    def _tool_handling(self, request: ChatCompletionRequest
                       ) -> tuple[ToolParser | None, StructuredOutputsParams | None]:
        """How the reply is read (a tool parser or None for text) and the grammar it needs."""
        tools = request.tools or []
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise bad_request("tools must have distinct function names", param="tools")
        constrained = request_structured_outputs(request, request.response_format)
        if choice == "none":
            return None, constrained
        if constrained is not None:
            raise bad_request("response_format and guided_* cannot be combined with tool_choice "
                              f"{choice if isinstance(choice, str) else 'naming a function'}; "
                              "use tool_choice 'none'", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            tool = _find_tool(tools, choice.function.name)
            return NamedToolCall(tool.function.name), named_tool_params(tool)
        if choice == "required":
            return RequiredToolCalls(), required_tools_params(
                tools, request.parallel_tool_calls is not False)
        if self.tool_call_parser is None:
            raise bad_request(
                "tool_choice 'auto' needs a tool call parser: start the server with "
                f"--tool-call-parser ({', '.join(sorted(TOOL_PARSERS))}), or use tool_choice "
                "'required', 'none' or a named function", param="tool_choice")
        return TOOL_PARSERS[self.tool_call_parser](), None

    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        lora_name = self.check_model(request.model, raw_request)
        tool_parser, structured_outputs = self._tool_handling(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if request.max_completion_tokens is not None:
            max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
        num_top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, num_top,
                                      max_tokens_param=max_tokens_param,
                                      structured_outputs=structured_outputs)
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
                                  request.model, include_usage, tool_parser,
                                  usage_every_chunk(request), len(prepared.prompt_token_ids))
            return StreamingResponse(stream, media_type="text/event-stream")
        (final,) = await cancel_on_disconnect(raw_request, final_outputs([generator]))
        choices = []
        for completion in final.outputs:
            logprobs = None
            if num_top is not None:
                logprobs = ChatLogprobs(content=self._logprob_tokens(
                    completion.token_ids, completion.logprobs or [], num_top))
            content, tool_calls = completion.text, []
            if tool_parser is not None:
                content, tool_calls = tool_parser.extract(completion.text)
            choices.append(ChatCompletionChoice(
                index=completion.index,
                message=ChatResponseMessage(content=content, tool_calls=tool_calls),
                logprobs=logprobs,
                finish_reason=_finish_reason(completion.finish_reason, tool_parser,
                                             bool(tool_calls)),
                stop_reason=completion.stop_reason,
            ))
        response = ChatCompletionResponse(id=request_id, created=created, model=request.model,
                                          choices=choices, usage=usage_of([final]))
        return json_response(response)

    def _render_and_prepare(self, request: ChatCompletionRequest, request_id: str,
                            params: SamplingParams, max_tokens_param: str,
                            lora_name: str | None, tenant: str) -> PreparedRequest:
        """The messages (and tools) through the chat template, tokenized and validated (off the
        loop)."""
        text, token_ids = self.render_chat(request.messages, request.add_generation_prompt,
                                           request.tools, request.chat_template_kwargs)
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
        tool_parser: ToolParser | None,
        every_chunk: bool = False,
        num_prompt_tokens: int = 0,
    ) -> AsyncIterator[str]:
        def chunk(choice: ChatCompletionStreamChoice, usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice],
                usage=usage if every_chunk else None))

        num_chars_sent = [0] * n
        num_tokens_sent = [0] * n
        done = [False] * n
        tool_streams = [None if tool_parser is None else ToolCallStream(tool_parser)
                        for _ in range(n)]
        final: RequestOutput | None = None
        try:
            for i in range(n):
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content="")),
                    UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=0,
                              total_tokens=num_prompt_tokens))
            async for _, output in merge_async_iterators([generator]):
                final = output
                for completion in output.outputs:
                    i = completion.index
                    if done[i]:
                        continue
                    delta = completion.text[num_chars_sent[i]:]
                    tool_calls = None
                    tool_stream = tool_streams[i]
                    if tool_stream is not None:
                        delta, tool_calls = tool_stream.update(
                            completion.text, completion.finish_reason is not None)
                        delta = delta or ""
                    new_ids = completion.token_ids[num_tokens_sent[i]:]
                    logprobs = None
                    if num_top is not None and new_ids:
                        entries = (completion.logprobs or [])[num_tokens_sent[i]:]
                        logprobs = ChatLogprobs(
                            content=self._logprob_tokens(new_ids, entries, num_top))
                    num_chars_sent[i] = len(completion.text)
                    num_tokens_sent[i] = len(completion.token_ids)
                    done[i] = completion.finish_reason is not None
                    if not delta and logprobs is None and not done[i] and not tool_calls:
                        continue
                    finish_reason = completion.finish_reason
                    if done[i] and tool_stream is not None:
                        finish_reason = _finish_reason(finish_reason, tool_parser,
                                                       tool_stream.num_calls > 0)
                    yield chunk(ChatCompletionStreamChoice(
                        index=i,
                        delta=DeltaMessage(content=delta or None, tool_calls=tool_calls or None),
                        logprobs=logprobs,
                        finish_reason=finish_reason,
                        stop_reason=completion.stop_reason,
                    ), choice_usage(output, completion))
            if include_usage and final is not None:
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=usage_of([final])))
        except Exception as e:  # the stream has started: report in-band
            yield sse_error(e)
        yield SSE_DONE

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                    tools: Sequence[ChatTool] | None,
                    chat_template_kwargs: dict[str, Any] | None) -> tuple[str, list[int]]:
        """The conversation through the chat template (with the tools): (text, token ids)."""
        kwargs = dict(chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
        processor = self.engine.input_processor
        try:
            text = processor.apply_chat_template(
                _template_messages(messages), add_generation_prompt, chat_template_kwargs=kwargs)
            return text, processor.encode_chat_prompt(text)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e

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
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
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
            entry["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
        result.append(entry)
    return result


def _template_tool_call(call: RequestToolCall) -> dict[str, Any]:
    """An assistant message's tool call for the template: OpenAI sends the arguments as JSON
    text, templates (Llama 3, Qwen2.5) expect the object. Arguments that are not a JSON object
    (a model's own malformed call, sent back) reach the template as the text they are."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
    entry = {"type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        entry["id"] = call.id
    return entry


def _find_tool(tools: Sequence[ChatTool], name: str) -> ChatTool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                      param="tool_choice")


def _finish_reason(reason: str | None, tool_parser: ToolParser | None,
                   made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when the model chose to call (auto, required); a named function's
    call ends with "stop", as OpenAI's does."""
    if reason == "stop" and made_calls and not isinstance(tool_parser, NamedToolCall):
        return "tool_calls"
    return reason


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
