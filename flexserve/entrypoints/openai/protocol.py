"""OpenAI-compatible request and response models (pydantic), with OpenAI's exact field names.

Requests are parsed strictly from JSON (no string-to-number coercion) and unknown fields are
ignored, as OpenAI does. Value ranges that `SamplingParams` checks are left to it, so there is
one source of truth; the checks here are those OpenAI states for the HTTP API itself.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


def _only_with(field: str, kind: str, then: dict[str, Any],
               required: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON-schema condition: when `field` holds a `kind` value, the fields of `then` must hold
    their values (and those of `required` be present). A rule between fields, which the
    handlers check with a 400; stated in the OpenAPI document for schema-driven clients."""
    return {"if": {"properties": {field: {"type": kind}}, "required": [field]},
            "then": {"properties": {k: {"const": v} for k, v in then.items()},
                     "required": list(required)}}


# stream_options only with "stream": true (as OpenAI).
_STREAM_OPTIONS_RULE = _only_with("stream_options", "object", {"stream": True}, ("stream",))
MAX_PROMPTS_PER_REQUEST = 2048  # a list of prompts is batched work: bounded like OpenAI's batches
_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[int], Field(min_length=1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    """Base of every request and response model."""

    model_config = ConfigDict(extra="ignore", strict=True)


# ------------------------------------------------------------------------------------- shared
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    """Every error response: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries the usage so far (a
    # choice's chunk: its prompt's tokens and the choice's tokens generated until then)
    continuous_usage_stats: bool = False


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def _bounded(default: Any, **bounds: float) -> Any:
    """A field whose range `SamplingParams` checks (the one source of truth, with its own
    messages), stated in the JSON schema too so that schema-driven clients send valid values."""
    return Field(default=default, json_schema_extra=bounds)


class SamplingFields(OpenAIModel):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    frequency_penalty: float | None = _bounded(0.0, minimum=-2.0, maximum=2.0)
    presence_penalty: float | None = _bounded(0.0, minimum=-2.0, maximum=2.0)
    n: int | None = Field(default=1, ge=1, le=128)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: _Text | list[_Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = _bounded(None, minimum=0.0)  # None: 1.0 as OpenAI
    top_p: float | None = _bounded(None, exclusiveMinimum=0.0, maximum=1.0)  # None: 1.0
    user: str | None = None  # the end user's id: accepted, never an account (the key's tenant is)
    # token id (as a string) -> bias in [-100, 100]
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # vLLM extras
    top_k: int | None = _bounded(None, minimum=-1)
    min_p: float | None = _bounded(None, minimum=0.0, maximum=1.0)
    repetition_penalty: float | None = _bounded(None, exclusiveMinimum=0.0)
    min_tokens: int = _bounded(0, minimum=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's structured outputs (at most one): a JSON schema, a regex, one of some strings, or an
    # EBNF grammar the output must follow
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[_Text], Field(min_length=1)] | None = None
    guided_grammar: str | None = None


# --------------------------------------------------------------------------------- completions
class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    # best_of is accepted equal to n only; the document states the simplest case of it.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_RULE,
        _only_with("best_of", "integer", {"best_of": 1, "n": 1}),
        # max_tokens 0 only scores the prompt, with echo
        {"if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
         "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]}}]})

    model: str
    # A text, texts, one prompt's token ids, or several prompts' token ids; none empty.
    prompt: (_Text | Annotated[list[_Text], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
             | _TokenIds
             | Annotated[list[_TokenIds], Field(min_length=1,
                                                max_length=MAX_PROMPTS_PER_REQUEST)])
    best_of: int | None = None  # accepted only equal to n: not supported otherwise
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    max_tokens: int | None = _bounded(16, minimum=0)  # 0: with echo, score the prompt only
    suffix: Annotated[str, Field(max_length=0)] | None = None  # accepted only empty: not supported


class CompletionLogprobs(OpenAIModel):
    """OpenAI's legacy logprobs object: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended it


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# Stream chunks have the same shape as the response (OpenAI reuses the object name).
CompletionStreamResponse = CompletionResponse


# --------------------------------------------------------------------------------------- chat
class TextContentPart(OpenAIModel):
    """One part of a message's content: only text parts (`{"type": "text", "text": ...}`)."""

    type: Literal["text"]
    text: str


class RequestFunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text of the arguments object, or the object


class RequestToolCall(OpenAIModel):
    """A tool call of an assistant message sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: RequestFunctionCall


class _Message(OpenAIModel):
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[RequestToolCall] | None = None


class InstructionMessage(_Message):
    """A system, developer or user message: its content is required."""

    role: Literal["system", "developer", "user"]
    content: list[TextContentPart] | str


class ReplyMessage(_Message):
    """An assistant message (its content may be null beside tool calls) or a tool result."""

    role: Literal["assistant", "tool"]
    content: list[TextContentPart] | str | None = None


# One message of a conversation, told apart by its role.
ChatMessage = Annotated[InstructionMessage | ReplyMessage, Field(discriminator="role")]


class JSONSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: OpenAI's structured outputs."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # True: no properties beyond the schema's


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(OpenAIModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIModel):
    """A streamed piece of tool call `index`: the first carries its id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        _STREAM_OPTIONS_RULE,
        _only_with("top_logprobs", "integer", {"logprobs": True}, ("logprobs",)),
        # any tool_choice but "none" needs tools
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
            "not": {"anyOf": [{"const": "none"}, {"type": "null"}]}}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array",
                                                                   "minItems": 1}}}}]})

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = _bounded(None, minimum=1)  # deprecated: max_completion_tokens
    max_completion_tokens: int | None = _bounded(None, minimum=1)
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" when tools are given, else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True  # False: at most one call per response
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(OpenAIModel):
    """A stream delta; fields that are None are left out, as OpenAI's final `{}` delta."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ------------------------------------------------------------------------------------- models
class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flexserve"
    root: str | None = None  # the base model the served name resolves to; for adapters, its path
    parent: str | None = None  # for adapters: the model they sit on; null for base models
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------- LoRA adapters
class LoadLoRAAdapterRequest(OpenAIModel):
    """`POST /v1/load_lora_adapter` (vLLM's shape)."""

    lora_name: str = Field(min_length=1)  # the `model` requests will use
    lora_path: str = Field(min_length=1)  # PEFT directory on the server's file system


class UnloadLoRAAdapterRequest(OpenAIModel):
    """`POST /v1/unload_lora_adapter` (vLLM's shape; `lora_int_id` is accepted and ignored)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ------------------------------------------------------------------------------- tokenization
class TokenizeCompletionRequest(OpenAIModel):
    """`POST /tokenize` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIModel):
    """`POST /tokenize` with chat messages, rendered by the chat template (vLLM's shape)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class VersionResponse(OpenAIModel):
    version: str


class HealthResponse(OpenAIModel):
    status: Literal["ok"] = "ok"


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, LoadLoRAAdapterRequest,
                  UnloadLoRAAdapterRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                  DetokenizeRequest)
RESPONSE_MODELS = (
    CompletionResponse, ChatCompletionResponse, ChatCompletionStreamResponse, ModelList,
    ModelCard, TokenizeResponse, DetokenizeResponse, VersionResponse, HealthResponse,
    ErrorResponse,
)
