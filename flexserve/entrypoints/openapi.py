"""The OpenAPI 3.1 document of the HTTP API, built from the protocol models' JSON schemas."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from flexserve.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    HealthResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)

_ERRORS = {
    "400": "Invalid JSON, schema violation or bad value",
    "401": "Missing or wrong API key",
    "404": "Unknown model or LoRA adapter",
    "413": "Request body too large",
    "503": "The engine has stopped",
}


def build_openapi(version: str, api_key_required: bool) -> dict[str, Any]:
    """The whole document; `/v1/*` operations declare bearer auth when a key is configured."""
    models: list[type[BaseModel]] = [
        CompletionRequest, CompletionResponse, ChatCompletionRequest, ChatCompletionResponse,
        ChatCompletionStreamResponse, ModelList, VersionResponse, HealthResponse, ErrorResponse,
        LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
    ]
    refs, schema = models_json_schema(
        [(model, "validation") for model in models], ref_template="#/components/schemas/{model}"
    )

    def ref(model: type[BaseModel]) -> dict[str, Any]:
        return refs[(model, "validation")]

    def json_body(model: type[BaseModel]) -> dict[str, Any]:
        return {"application/json": {"schema": ref(model)}}

    def errors(codes: tuple[str, ...]) -> dict[str, Any]:
        return {code: {"description": _ERRORS[code], "content": json_body(ErrorResponse)}
                for code in codes}

    security = [{"bearerAuth": []}] if api_key_required else []
    api_errors = ("400", "401", "404", "413", "503")

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
        "/health": simple_get("Liveness of the engine", json_body(HealthResponse),
                              errors(("503",))),
        "/version": simple_get("Server version", json_body(VersionResponse)),
        "/metrics": simple_get("Prometheus metrics",
                               {"text/plain": {"schema": {"type": "string"}}}),
    }
    paths["/v1/models"]["get"]["security"] = security

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
        LoadLoRAAdapterRequest, ("400", "401", "503"))
    paths["/v1/unload_lora_adapter"] = lora_admin(
        "Stop serving a LoRA adapter; requests already using it finish first",
        UnloadLoRAAdapterRequest, ("400", "401", "404", "503"))
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
