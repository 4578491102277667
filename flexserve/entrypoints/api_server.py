"""The OpenAI-compatible Starlette app: thin routes over the serving handlers, state on `app.state`.

`build_app(engine)` returns an ASGI app for uvicorn; `flexserve serve` (cli.py) loads the model,
builds the app and runs it.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import flexserve
from flexserve.engine.adapter_manager import AdapterExistsError, AdapterNotFoundError
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.entrypoints.errors import EXCEPTION_HANDLERS, APIError, bad_request, error_response
from flexserve.entrypoints.openapi import build_openapi
from flexserve.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HealthResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    now_s,
)
from flexserve.entrypoints.serving_base import ClientDisconnected, json_response
from flexserve.entrypoints.serving_chat import OpenAIServingChat
from flexserve.entrypoints.serving_completions import OpenAIServingCompletion
from flexserve.metrics import PrometheusStatLogger

DEFAULT_MAX_REQUEST_BODY_BYTES = 10 * 1024 * 1024
# nginx's code for "client closed the request": logged, never seen by the (gone) client.
_CLIENT_CLOSED_REQUEST = 499


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> Starlette:
    """An app serving `engine` under `served_model_name` (default: the model's name).

    The app starts the engine thread on startup if it is not running; whoever created the engine
    shuts it down. Each app has its own Prometheus registry.
    """
    if max_request_body_bytes <= 0:
        raise ValueError(f"max_request_body_bytes must be positive, got {max_request_body_bytes}")
    model_name = (served_model_name or engine.engine.config.model.served_model_name
                  or engine.info.name)
    for lora_request in engine.list_loras():
        if lora_request.lora_name == model_name:
            raise ValueError(f"LoRA adapter name {model_name!r} is the served model's name")
    metrics = PrometheusStatLogger(
        model_name, engine.engine.config.scheduler.max_num_batched_tokens,
        enable_lora=engine.lora_enabled)
    engine.add_stat_logger(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        yield

    app = Starlette(
        routes=[
            Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        middleware=[
            Middleware(APIKeyMiddleware, api_key=api_key),
            Middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    state = app.state
    state.engine = engine
    state.served_model_name = model_name
    state.metrics = metrics
    state.created = now_s()
    state.completions = OpenAIServingCompletion(engine, [model_name])
    state.chat = OpenAIServingChat(engine, [model_name])
    state.openapi = build_openapi(flexserve.__version__, api_key_required=bool(api_key))
    return app


# ---------------------------------------------------------------------------------------- routes
async def create_completion(request: Request) -> Response:
    body = CompletionRequest.model_validate_json(await request.body())
    try:
        return await request.app.state.completions.create_completion(body, request)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)


async def create_chat_completion(request: Request) -> Response:
    body = ChatCompletionRequest.model_validate_json(await request.body())
    try:
        return await request.app.state.chat.create_chat_completion(body, request)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)


async def list_models(request: Request) -> Response:
    state = request.app.state
    info = state.engine.info
    cards = [ModelCard(id=state.served_model_name, created=state.created, root=info.name,
                       parent=None, max_model_len=info.max_model_len)]
    cards.extend(
        ModelCard(id=lora.lora_name, created=state.created, root=lora.lora_path,
                  parent=state.served_model_name, max_model_len=info.max_model_len)
        for lora in state.engine.list_loras()
    )
    return json_response(ModelList(data=cards))


async def load_lora_adapter(request: Request) -> Response:
    body = LoadLoRAAdapterRequest.model_validate_json(await request.body())
    state = request.app.state
    engine: AsyncLLMEngine = state.engine
    if not engine.lora_enabled:
        raise bad_request("LoRA is not enabled: start the server with --enable-lora")
    if body.lora_name == state.served_model_name:
        raise bad_request(f"'{body.lora_name}' is the base model's name", param="lora_name")
    try:
        await engine.add_lora(body.lora_name, body.lora_path)
    except AdapterExistsError as e:
        raise bad_request(str(e), param="lora_name") from e
    except ValueError as e:  # missing files, bad config, shapes, rank, outside the allowed dir
        raise bad_request(f"Cannot load LoRA adapter '{body.lora_name}': {e}",
                          param="lora_path") from e
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    body = UnloadLoRAAdapterRequest.model_validate_json(await request.body())
    engine: AsyncLLMEngine = request.app.state.engine
    if not engine.lora_enabled:
        raise bad_request("LoRA is not enabled: start the server with --enable-lora")
    try:
        num_in_use = await engine.remove_lora(body.lora_name)
    except AdapterNotFoundError as e:
        raise APIError(404, str(e), param="lora_name", code="not_found") from e
    message = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
    if num_in_use:
        message += f" {num_in_use} request(s) already using it will finish first."
    return PlainTextResponse(message)


async def health(request: Request) -> Response:
    engine: AsyncLLMEngine = request.app.state.engine
    if engine.is_healthy:
        return json_response(HealthResponse())
    reason = engine.dead_error or "the engine is not running"
    return error_response(503, str(reason), "server_error", code="engine_dead")


async def version(request: Request) -> Response:
    return json_response(VersionResponse(version=flexserve.__version__))


async def metrics_endpoint(request: Request) -> Response:
    content, content_type = request.app.state.metrics.render()
    return Response(content, media_type=content_type)


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


# ------------------------------------------------------------------------------------ middleware
class APIKeyMiddleware:
    """Every `/v1/*` request needs `Authorization: Bearer <key>` when a key is configured."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = None if not api_key else f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.expected is None
            or scope["type"] != "http"
            or not scope["path"].startswith("/v1/")
            or scope["method"] == "OPTIONS"
        ):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None and secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if given is not None
                   else "You didn't provide an API key: send `Authorization: Bearer <key>`.")
        response = error_response(401, message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodySizeLimitMiddleware:
    """Rejects request bodies over `max_bytes` with 413, by Content-Length or while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().__call__(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read, so the app's handlers turn it into a
                    # response in the usual error shape.
                    raise self._error()
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> APIError:
        return APIError(413, f"The request body exceeds the limit of {self.max_bytes} bytes.",
                        code="request_too_large")

    def _too_large(self) -> Response:
        error = self._error()
        return error_response(error.status_code, error.message, error.type, code=error.code)


# --------------------------------------------------------------------------------- embedding
class ServerThread:
    """Runs an app under uvicorn in a background thread (tests, notebooks).

    Port 0 picks a free port; `url` is known once `start()` returns.
    """

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="on",
            timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="flexserve-uvicorn",
                                       daemon=True)
        self.url = ""

    def start(self, timeout: float = 60.0) -> str:
        """Start serving; returns the base URL (`http://host:port`)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
