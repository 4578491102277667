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
    ModelList,
    VersionResponse,
)

_ERRORS = {
    "400": "Invalid JSON, schema violation or bad value",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "503": "The engine has stopped",
}


def build_openapi(version: str, api_key_required: bool) -> dict[str, Any]:
    """The whole document; `/v1/*` operations declare bearer auth when a key is configured."""
    models: list[type[BaseModel]] = [
        CompletionRequest, CompletionResponse, ChatCompletionRequest, ChatCompletionResponse,
        ChatCompletionStreamResponse, ModelList, VersionResponse, HealthResponse, ErrorResponse,
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
