"""The OpenAPI 3.1 document of the HTTP API, built from the protocol models' JSON schemas."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from flexserve.entrypoints.openai.health import HealthStatus
from flexserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from flexserve.entrypoints.openai.protocol_finetune import (
    FileDeleted,
    FileList,
    FileObject,
    FineTuningJob,
    FineTuningJobCheckpointList,
    FineTuningJobCreateRequest,
    FineTuningJobEventList,
    FineTuningJobList,
)
from flexserve.entrypoints.openai.serving_files import MAX_LIST_LIMIT
from flexserve.entrypoints.openai.serving_finetune import MAX_PAGE_LIMIT

_ERRORS = {
    "400": "Invalid JSON, schema violation or bad value",
    "401": "Missing or wrong API key",
    "403": "A shared adapter that only an admin key may unload",
    "404": "Unknown model or LoRA adapter (or another tenant's)",
    "408": "The request ran past --request-timeout-s and was aborted",
    "413": "Request body too large",
    "429": ("Over a request, sequence or token limit (--max-queue-len, --max-requests-per-tenant, "
            "--max-seqs-per-tenant, --max-tokens-per-tenant) or the preparation queue; retry "
            "after Retry-After seconds"),
    "500": "The server failed on this request (the body names an error id, never details)",
    "503": "The engine has stopped, or the server is shutting down (new requests refused)",
}
# Sent with 429 and with the 503 of a draining server.
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying",
                                "schema": {"type": "string"}}}


# Query parameters of the list operations (`limit` gets its bounds per operation).
_QUERY_SCHEMAS: dict[str, dict[str, Any]] = {
    "after": {"type": "string", "description": "The id of the last item of the previous page"},
    "order": {"type": "string", "enum": ["asc", "desc"]},
    "purpose": {"type": "string"},
    "limit": {"type": "integer", "minimum": 1},
}


_INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}
# Free-form JSON (tool arguments, JSON schemas, chat template arguments) as the server reads it:
# integers and numbers within the 64-bit range that request_body.py enforces everywhere.
_JSON_VALUE_REF = {"$ref": "#/components/schemas/JSONValue"}
_JSON_VALUE = {"anyOf": [
    {"type": "string"}, {"type": "integer", **_INT64}, {"type": "number", **_INT64},
    {"type": "boolean"}, {"type": "null"},
    {"type": "array", "items": _JSON_VALUE_REF},
    {"type": "object", "additionalProperties": _JSON_VALUE_REF},
]}


class _Int64JsonSchema(GenerateJsonSchema):
    """Every integer states the 64-bit range the server accepts (request_body.py refuses larger
    ones), unless the field has tighter bounds of its own; so does free-form JSON."""

    def int_schema(self, schema: core_schema.IntSchema) -> JsonSchemaValue:
        json_schema = super().int_schema(schema)
        for key, value in _INT64.items():
            json_schema.setdefault(key, value)
        return json_schema

    def any_schema(self, schema: core_schema.AnySchema) -> JsonSchemaValue:
        return dict(_JSON_VALUE_REF)

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        # Unknown fields are ignored, but read like the rest of the body.
        json_schema = super().model_schema(schema)
        if "properties" in json_schema:
            json_schema.setdefault("additionalProperties", dict(_JSON_VALUE_REF))
        return json_schema


def token_id_pattern(vocab_size: int) -> str:
    """A regular expression of the decimal token ids 0 ... vocab_size - 1 (no leading zeros)."""
    top = str(vocab_size - 1)
    options = ["0"] if len(top) > 1 else []
    if len(top) > 2:
        options.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    elif len(top) == 2:
        options.append("[1-9]")
    for i, digit in enumerate(top):  # as many digits as `top`: a smaller digit at position i
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            options.append(top[:i] + f"[{low}-{int(digit) - 1}]"
                           + (f"[0-9]{{{rest}}}" if rest else ""))
    options.append(top)
    return "^(" + "|".join(options) + ")$"


def _bound_token_ids(schemas: dict[str, Any], vocab_size: int) -> None:
    """State the vocabulary in the request schemas that take token ids."""
    ids = {"minimum": 0, "maximum": vocab_size - 1}
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    prompt[2]["items"].update(ids)  # one prompt's token ids
    prompt[3]["items"]["items"].update(ids)  # several prompts' token ids
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"].update(ids)
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        bias = schemas[request]["properties"]["logit_bias"]["anyOf"][0]
        bias["propertyNames"] = {"pattern": token_id_pattern(vocab_size)}


def _bound_lengths(schemas: dict[str, Any], max_model_len: int) -> None:
    """State the context length where a request asks for new tokens (prompt and completion
    together must fit it too, which a schema cannot say)."""
    for request, fields in (("CompletionRequest", ("max_tokens",)),
                            ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens"))):
        for name in fields:
            schemas[request]["properties"][name]["maximum"] = max_model_len - 1


def _without_auto_tool_choice(schemas: dict[str, Any]) -> None:
    """A server without a tool-call parser reads no tool calls from free text: requests with
    tools name their tool_choice, and it is not "auto"."""
    chat = schemas["ChatCompletionRequest"]
    chat["allOf"].append({
        "if": {"required": ["tools"], "properties": {"tools": {"type": "array",
                                                               "minItems": 1}}},
        "then": {"required": ["tool_choice"],
                 "properties": {"tool_choice": {"not": {"type": "null"}}}}})
    for option in chat["properties"]["tool_choice"]["anyOf"]:
        if option.get("enum") is not None:
            option["enum"] = [v for v in option["enum"] if v != "auto"]


def build_openapi(version: str, api_key_required: bool, finetune: bool = False,
                  vocab_size: int | None = None, max_model_len: int | None = None,
                  tool_call_parser: bool = True) -> dict[str, Any]:
    """The whole document; `/v1/*` operations declare bearer auth when a key is configured.
    `finetune`: the files and fine-tuning jobs API is served too; `vocab_size` and
    `max_model_len`: the model's, which bound the token ids and lengths requests may ask for;
    `tool_call_parser`: the server reads tool calls from free text (tool_choice "auto")."""
    models: list[type[BaseModel]] = [
        CompletionRequest, CompletionResponse, ChatCompletionRequest, ChatCompletionResponse,
        ChatCompletionStreamResponse, ModelList, ModelCard, VersionResponse, HealthStatus,
        ErrorResponse, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
        TokenizeCompletionRequest, TokenizeChatRequest, TokenizeResponse, DetokenizeRequest,
        DetokenizeResponse,
    ]
    if finetune:
        models += [FileObject, FileList, FileDeleted, FineTuningJobCreateRequest, FineTuningJob,
                   FineTuningJobList, FineTuningJobEventList, FineTuningJobCheckpointList]
    refs, schema = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}",
        schema_generator=_Int64JsonSchema,
    )

    if vocab_size is not None:
        _bound_token_ids(schema["$defs"], vocab_size)
    if max_model_len is not None:
        _bound_lengths(schema["$defs"], max_model_len)
    if not tool_call_parser:
        _without_auto_tool_choice(schema["$defs"])

    def ref(model: type[BaseModel]) -> dict[str, Any]:
        return refs[(model, "validation")]

    def json_body(model: type[BaseModel]) -> dict[str, Any]:
        return {"application/json": {"schema": ref(model)}}

    def errors(codes: tuple[str, ...]) -> dict[str, Any]:
        # Every counted route may answer 503 while the server drains, and 500 on a bug.
        codes = tuple(dict.fromkeys((*codes, "500", "503")))
        return {code: {"description": _ERRORS[code], "content": json_body(ErrorResponse),
                       **({"headers": _RETRY_AFTER} if code in ("429", "503") else {})}
                for code in codes}

    security = [{"bearerAuth": []}] if api_key_required else []
    api_errors = ("400", "401", "404", "408", "413", "429", "500", "503")

    def generation(summary: str, request: type[BaseModel], response: type[BaseModel],
                   chunk: type[BaseModel]) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "security": security,
            "requestBody": {"required": True, "content": json_body(request)},
            "responses": {
                "200": {
                    "description": "The result, or server-sent events of chunks ending with "
                                   "`data: [DONE]` when `stream` is true",
                    "content": {
                        **json_body(response),
                        # One server-sent event: its data is a chunk's JSON, or [DONE].
                        "text/event-stream": {"schema": {
                            "type": "object", "required": ["data"],
                            "properties": {"data": {"type": "string"},
                                           "event": {"type": "string"}}},
                            "x-chunk-schema": ref(chunk)},
                    },
                },
                **errors(api_errors),
            },
        }}

    def simple_get(summary: str, content: dict[str, Any], extra: dict | None = None) -> dict:
        return {"get": {"summary": summary,
                        "responses": {"200": {"description": "OK", "content": content},
                                      **(extra or {})}}}

    paths = {
        "/v1/completions": generation(
            "Create a completion", CompletionRequest, CompletionResponse, CompletionResponse),
        "/v1/chat/completions": generation(
            "Create a chat completion", ChatCompletionRequest, ChatCompletionResponse,
            ChatCompletionStreamResponse),
        "/v1/models": simple_get("List served models", json_body(ModelList), errors(("401",))),
        "/health": simple_get("Health: ok or degraded (with reasons) while the engine runs; "
                              "503 once it is dead", json_body(HealthStatus),
                              errors(("503",))),
        "/version": simple_get("Server version", json_body(VersionResponse)),
        "/metrics": simple_get("Prometheus metrics",
                               {"text/plain": {"schema": {"type": "string"}}}),
    }
    paths["/v1/models"]["get"]["security"] = security
    paths["/v1/models/{model}"] = simple_get(
        "Retrieve one served model (the base model or a LoRA adapter)", json_body(ModelCard),
        errors(("401", "404")))
    paths["/v1/models/{model}"]["get"].update(security=security, parameters=[
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}])

    def tokenization(summary: str, body: dict[str, Any], response: type[BaseModel]) -> dict:
        return {"post": {"summary": summary,
                         "requestBody": {"required": True, "content": body},
                         "responses": {"200": {"description": "OK",
                                               "content": json_body(response)},
                                       **errors(("400", "404"))}}}

    paths["/tokenize"] = tokenization(
        "Token ids of a prompt, or of chat messages through the chat template (vLLM's shape)",
        {"application/json": {"schema": {"oneOf": [ref(TokenizeCompletionRequest),
                                                   ref(TokenizeChatRequest)]}}},
        TokenizeResponse)
    paths["/detokenize"] = tokenization("Text of token ids (vLLM's shape)",
                                        json_body(DetokenizeRequest), DetokenizeResponse)

    def lora_admin(summary: str, request: type[BaseModel], codes: tuple[str, ...]) -> dict:
        return {"post": {
            "summary": summary,
            "security": security,
            "requestBody": {"required": True, "content": json_body(request)},
            "responses": {
                "200": {"description": "A short confirmation",
                        "content": {"text/plain": {"schema": {"type": "string"}}}},
                **errors(codes),
            },
        }}

    paths["/v1/load_lora_adapter"] = lora_admin(
        "Load a LoRA adapter (PEFT directory) and serve it under `lora_name`",
        LoadLoRAAdapterRequest, ("400", "401", "404", "503"))
    paths["/v1/unload_lora_adapter"] = lora_admin(
        "Stop serving a LoRA adapter; requests already using it finish first",
        UnloadLoRAAdapterRequest, ("400", "401", "403", "404", "503"))
    if finetune:
        paths.update(_finetune_paths(security, ref, json_body, errors))
    return {
        "openapi": "3.1.0",
        "info": {"title": "flexserve", "version": version,
                 "description": "OpenAI-compatible LLM serving"},
        "paths": paths,
        "components": {
            "schemas": {**schema.get("$defs", {}), "JSONValue": _JSON_VALUE},
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }


def _finetune_paths(security: list, ref: Any, json_body: Any, errors: Any) -> dict[str, Any]:
    """The files and fine-tuning jobs operations (OpenAI's paths and objects)."""

    def operation(summary: str, response: type[BaseModel] | None, codes: tuple[str, ...],
                  params: tuple[str, ...] = (), body: dict | None = None,
                  files: bool = False) -> dict[str, Any]:
        content = (json_body(response) if response is not None
                   else {"application/octet-stream": {"schema": {"type": "string",
                                                                 "format": "binary"}}})
        op: dict[str, Any] = {
            "summary": summary, "security": security,
            "responses": {"200": {"description": "OK", "content": content}, **errors(codes)},
        }
        path_params = [p for p in params if p.endswith("_id")]
        query = [p for p in params if not p.endswith("_id")]
        op["parameters"] = (
            [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
             for p in path_params]
            + [{"name": p, "in": "query", "required": False, "schema": _QUERY_SCHEMAS[p]}
               for p in query])
        if "limit" in query:  # the files list pages further than the jobs lists
            limit = {"type": "integer", "minimum": 1,
                     "maximum": MAX_LIST_LIMIT if files else MAX_PAGE_LIMIT}
            op["parameters"][-len(query) + query.index("limit")]["schema"] = limit
        if body is not None:
            op["requestBody"] = {"required": True, "content": body}
        return op

    upload = {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary",
                                "description": "JSONL training data (text, prompt/completion "
                                               "or chat messages); at most --max-upload-mb"},
                       "purpose": {"type": "string", "enum": ["fine-tune"]}}}}}
    ok, missing = ("400", "401", "429"), ("400", "401", "404")
    missing_after = ("400", "401", "404", "429")  # 404: `after` names no item of the caller's
    return {
        "/v1/files": {
            "post": operation("Upload a training file (validated as JSONL)", FileObject, ok,
                              body=upload),
            "get": operation("List the files of the API key's tenant, newest first", FileList,
                             missing_after, ("purpose", "limit", "order", "after"), files=True),
        },
        "/v1/files/{file_id}": {
            "get": operation("Retrieve a file", FileObject, missing, ("file_id",)),
            "delete": operation("Delete a file (not while a queued or running job uses it)",
                                FileDeleted, missing, ("file_id",)),
        },
        "/v1/files/{file_id}/content": {
            "get": operation("The file's content", None, missing, ("file_id",)),
        },
        "/v1/fine_tuning/jobs": {
            "post": operation("Create a fine-tuning job", FineTuningJob, ok,
                              body=json_body(FineTuningJobCreateRequest)),
            "get": operation("List the fine-tuning jobs of the API key's tenant, newest first",
                             FineTuningJobList, missing_after, ("after", "limit")),
        },
        "/v1/fine_tuning/jobs/{job_id}": {
            "get": operation("Retrieve a fine-tuning job", FineTuningJob, missing, ("job_id",)),
        },
        "/v1/fine_tuning/jobs/{job_id}/cancel": {
            "post": operation("Cancel a queued or running job", FineTuningJob, missing,
                              ("job_id",)),
        },
        "/v1/fine_tuning/jobs/{job_id}/pause": {
            "post": operation("Pause a queued or running job at its next step boundary",
                              FineTuningJob, missing, ("job_id",)),
        },
        "/v1/fine_tuning/jobs/{job_id}/resume": {
            "post": operation("Resume a paused job from its pause checkpoint", FineTuningJob,
                              missing, ("job_id",)),
        },
        "/v1/fine_tuning/jobs/{job_id}/events": {
            "get": operation("A job's events (status, loss per step, warnings), newest first",
                             FineTuningJobEventList, missing, ("job_id", "after", "limit")),
        },
        "/v1/fine_tuning/jobs/{job_id}/checkpoints": {
            "get": operation("A job's checkpoints, newest first (those deleted by retention "
                             "carry deleted_at)",
                             FineTuningJobCheckpointList, missing, ("job_id", "after", "limit")),
        },
    }
