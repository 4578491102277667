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


class _Int64JsonSchema(GenerateJsonSchema):
    """Every integer states the 64-bit range the server accepts (request_body.py refuses larger
    ones), unless the field has tighter bounds of its own."""

    def int_schema(self, schema: core_schema.IntSchema) -> JsonSchemaValue:
        json_schema = super().int_schema(schema)
        json_schema.setdefault("minimum", -(2**63))
        json_schema.setdefault("maximum", 2**63 - 1)
        return json_schema


def build_openapi(version: str, api_key_required: bool, finetune: bool = False
                  ) -> dict[str, Any]:
    """The whole document; `/v1/*` operations declare bearer auth when a key is configured.
    `finetune`: the files and fine-tuning jobs API is served too."""
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
                        "text/event-stream": {"schema": {"type": "string"},
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
            "schemas": schema.get("$defs", {}),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }


def _finetune_paths(security: list, ref: Any, json_body: Any, errors: Any) -> dict[str, Any]:
    """The files and fine-tuning jobs operations (OpenAI's paths and objects)."""

    def operation(summary: str, response: type[BaseModel] | None, codes: tuple[str, ...],
                  params: tuple[str, ...] = (), body: dict | None = None) -> dict[str, Any]:
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
            + [{"name": p, "in": "query", "required": False,
                "schema": {"type": "integer" if p == "limit" else "string"}} for p in query])
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
    return {
        "/v1/files": {
            "post": operation("Upload a training file (validated as JSONL)", FileObject, ok,
                              body=upload),
            "get": operation("List the files of the API key's tenant, newest first", FileList, ok,
                             ("purpose", "limit", "order", "after")),
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
                             FineTuningJobList, ok, ("after", "limit")),
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
