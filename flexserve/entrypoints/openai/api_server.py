"""The OpenAI-compatible Starlette app: thin routes over the serving handlers, state on `app.state`.

`build_app(engine)` returns an ASGI app for uvicorn; `flexserve serve` (cli.py) loads the model,
builds the app and runs it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import flexserve
from flexserve.engine.adapter_manager import AdapterExistsError, AdapterNotFoundError
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.entrypoints.openai import serving_files
from flexserve.entrypoints.openai import serving_finetune as serving_fine_tuning
from flexserve.entrypoints.openai.auth import APIKeyMiddleware, APIKeyTable
from flexserve.entrypoints.openai.errors import (
    EXCEPTION_HANDLERS,
    APIError,
    InternalErrorMiddleware,
    bad_request,
    error_response,
    model_not_found,
)
from flexserve.entrypoints.openai.health import HealthMonitor
from flexserve.entrypoints.openai.limits import (
    AdmissionController,
    AdmissionLimits,
    AdmissionMiddleware,
)
from flexserve.entrypoints.openai.model_access import (
    PRIVATE_ADAPTER,
    ModelAccess,
    adapter_not_found,
    check_name,
)
from flexserve.entrypoints.openai.offload import DEFAULT_MAX_PENDING, Offload
from flexserve.entrypoints.openai.openapi import build_openapi
from flexserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
    VersionResponse,
    now_s,
)
from flexserve.entrypoints.openai.request_body import read_json
from flexserve.entrypoints.openai.serving_base import ClientDisconnected, json_response
from flexserve.entrypoints.openai.serving_chat import OpenAIServingChat
from flexserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from flexserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from flexserve.entrypoints.openai.shutdown import DEFAULT_SHUTDOWN_GRACE_S, GracefulShutdown
from flexserve.finetune.service import FinetuneService, FinetuneServiceConfig
from flexserve.metrics import PrometheusStatLogger
from flexserve.metrics.finetune_metrics import FinetuneMetrics

DEFAULT_MAX_REQUEST_BODY_BYTES = 10 * 1024 * 1024
UNBOUNDED_PREPARATION_QUEUE = 4096  # the preparation queue of a server without a request limit
# nginx's code for "client closed the request": logged, never seen by the (gone) client.
_CLIENT_CLOSED_REQUEST = 499
# Room for the multipart framing (boundaries, part headers, `purpose`) around an upload of
# --max-upload-mb; the file's own size is checked exactly once it is parsed.
_MULTIPART_SLACK_BYTES = 64 * 1024


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    finetune: FinetuneServiceConfig | None = None,
    *,
    api_keys: APIKeyTable | None = None,
    limits: AdmissionLimits | None = None,
    allowed_origins: Sequence[str] = (),
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    metrics_job_ids: bool = False,
    tool_call_parser: str | None = None,
) -> Starlette:
    """An app serving `engine` under `served_model_name` (default: the model's name).

    The app starts the engine thread on startup if it is not running; whoever created the engine
    shuts it down. Each app has its own Prometheus registry. With `finetune`, the app also serves
    the files and fine-tuning jobs API (`FinetuneService`, state under `finetune.state_dir`).

    Security and limits (docs/operations.md): `api_key` (one key) or `api_keys` (several, with
    tenants) guard `/v1/*`; `limits` bounds the generation requests in flight (429 past them);
    `allowed_origins` turns CORS on for those origins (off by default); a graceful shutdown
    (`app.state.shutdown`) gives requests in flight `shutdown_grace_s` to finish.
    `/metrics` and `/health` name jobs and tenants' adapters only with `metrics_job_ids`
    (`--metrics-job-ids`): they answer without a key.
    `tool_call_parser` (a `TOOL_PARSERS` name) reads tool calls under `tool_choice: "auto"`.
    """
    if max_request_body_bytes <= 0:
        raise ValueError(f"max_request_body_bytes must be positive, got {max_request_body_bytes}")
    model_name = (served_model_name or engine.engine.config.model.served_model_name
                  or engine.info.name)
    for lora_request in engine.list_loras():
        if lora_request.lora_name == model_name:
            raise ValueError(f"LoRA adapter name {model_name!r} is the served model's name")
    config = engine.engine.config
    def public_lora_name(name: str) -> str:  # called once model_access exists
        return name if metrics_job_ids or model_access.is_shared(name) else PRIVATE_ADAPTER

    metrics = PrometheusStatLogger(
        model_name, config.scheduler.max_num_batched_tokens, enable_lora=engine.lora_enabled,
        job_id_labels=metrics_job_ids, public_lora_name=public_lora_name,
        slo_ttft_s=config.coserve.slo_ttft_ms / 1000.0,
        slo_tpot_s=(math.inf if config.coserve.slo_tpot_ms is None
                    else config.coserve.slo_tpot_ms / 1000.0))
    engine.add_stat_logger(metrics)
    # --- reliability and security (auth.py, limits.py, health.py, shutdown.py) ---
    if api_key and api_keys is not None:
        raise ValueError("give either api_key or api_keys, not both")
    keys = APIKeyTable.from_sources([api_key]) if api_key else api_keys
    admission = AdmissionController(limits, on_reject=metrics.record_rejection)
    health_monitor = HealthMonitor(job_ids=metrics_job_ids)
    engine.add_finetune_listener(health_monitor.on_finetune_updates)
    # --- fine-tuning service (files + jobs API) ---
    service = None if finetune is None else FinetuneService(
        engine, model_name, finetune, FinetuneMetrics(metrics.registry, model_name, metrics_job_ids))
    body_limits = {} if finetune is None else {
        "/v1/files": (finetune.max_upload_bytes + _MULTIPART_SLACK_BYTES,
                      lambda: serving_files.upload_too_large(finetune.max_upload_bytes))}
    # --- end fine-tuning service ---

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        if service is None:
            yield
            return
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = Starlette(
        routes=[
            Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
            *(_finetune_routes() if service is not None else []),
        ],
        middleware=[
            # Outermost first: CORS answers preflights and decorates even 401s and 429s; the
            # key's tenant is known before admission counts the request.
            *([Middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                          allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                          allow_headers=["Authorization", "Content-Type"],
                          expose_headers=["Retry-After", "x-request-id"])]
              if allowed_origins else []),
            Middleware(InternalErrorMiddleware),
            Middleware(APIKeyMiddleware, keys=keys),
            Middleware(AdmissionMiddleware, controller=admission),
            Middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes,
                       path_limits=body_limits),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    state = app.state
    state.engine = engine
    state.served_model_name = model_name
    state.metrics = metrics
    state.created = now_s()
    model_access = ModelAccess(service, multi_tenant=keys is not None and bool(keys.tenants),
                               keys_required=keys is not None)
    state.model_access = model_access
    # The preparation queue holds every generation request admission lets in (it bounds them),
    # plus room for uploads and job creations.
    max_admitted = admission.limits.max_num_requests
    offload = Offload(max_pending=(UNBOUNDED_PREPARATION_QUEUE if max_admitted is None
                                   else max_admitted + DEFAULT_MAX_PENDING))
    state.offload = offload
    state.completions = OpenAIServingCompletion(engine, [model_name], model_access.may_use,
                                                offload)
    state.chat = OpenAIServingChat(engine, [model_name], model_access.may_use, offload,
                                   tool_call_parser=tool_call_parser)
    state.tokenization = OpenAIServingTokenization(engine, [model_name], model_access.may_use,
                                                   offload)
    state.finetune = service
    state.admission = admission
    state.health_monitor = health_monitor
    state.shutdown = GracefulShutdown(admission, engine, service, shutdown_grace_s)
    state.openapi = build_openapi(flexserve.__version__, api_key_required=keys is not None,
                                  finetune=service is not None,
                                  vocab_size=engine.info.vocab_size,
                                  max_model_len=engine.info.max_model_len,
                                  tool_call_parser=tool_call_parser is not None)
    return app


def _finetune_routes() -> list[Route]:
    """The files and fine-tuning jobs API (`serving_files`, `serving_fine_tuning`)."""
    files, jobs = serving_files, serving_fine_tuning
    return [
        Route("/v1/files", files.create_file, methods=["POST"]),
        Route("/v1/files", files.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", files.retrieve_file, methods=["GET"]),
        Route("/v1/files/{file_id}", files.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", files.file_content, methods=["GET"]),
        Route("/v1/fine_tuning/jobs", jobs.create_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs", jobs.list_jobs, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}", jobs.retrieve_job, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}/cancel", jobs.cancel_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/pause", jobs.pause_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/resume", jobs.resume_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/events", jobs.list_events, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}/checkpoints", jobs.list_checkpoints,
              methods=["GET"]),
    ]


# ---------------------------------------------------------------------------------------- routes
async def create_completion(request: Request) -> Response:
    body = await read_json(CompletionRequest, request)
    try:
        return await request.app.state.completions.create_completion(body, request)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)


async def create_chat_completion(request: Request) -> Response:
    body = await read_json(ChatCompletionRequest, request)
    try:
        return await request.app.state.chat.create_chat_completion(body, request)
    except ClientDisconnected:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)


def _model_cards(request: Request) -> list[ModelCard]:
    """The base model, then the adapters the caller's tenant may see."""
    state = request.app.state
    info = state.engine.info
    access: ModelAccess = state.model_access
    paths = access.shows_paths(request)
    cards = [ModelCard(id=state.served_model_name, created=state.created,
                       root=info.name if paths else state.served_model_name, parent=None,
                       max_model_len=info.max_model_len)]
    cards.extend(
        ModelCard(id=lora.lora_name, created=state.created,
                  root=lora.lora_path if paths else None, parent=state.served_model_name,
                  max_model_len=info.max_model_len)
        for lora in state.engine.list_loras() if access.may_list(lora.lora_name, request)
    )
    return cards


async def list_models(request: Request) -> Response:
    return json_response(ModelList(data=_model_cards(request)))


async def retrieve_model(request: Request) -> Response:
    """`GET /v1/models/{model}` (`client.models.retrieve`); ids may contain slashes."""
    model = request.path_params["model"]
    for card in _model_cards(request):
        if card.id == model:
            return json_response(card)
    raise model_not_found(model)


async def tokenize(request: Request) -> Response:
    """vLLM's `/tokenize`: a prompt, or messages through the chat template. Parsed, templated and
    tokenized on the offload workers (request_body.py, offload.py), as generation requests are."""
    body = await request.body()
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None  # the request model's validation reports the bad JSON
    is_chat = isinstance(parsed, dict) and "messages" in parsed
    model = TokenizeChatRequest if is_chat else TokenizeCompletionRequest
    parsed_request = await read_json(model, request)
    handler = request.app.state.tokenization
    return json_response(await handler.off_loop(handler.tokenize, parsed_request, request))


async def detokenize(request: Request) -> Response:
    body = await read_json(DetokenizeRequest, request)
    handler = request.app.state.tokenization
    return json_response(await handler.off_loop(handler.detokenize, body, request))


async def load_lora_adapter(request: Request) -> Response:
    body = await read_json(LoadLoRAAdapterRequest, request)
    state = request.app.state
    engine: AsyncLLMEngine = state.engine
    if not engine.lora_enabled:
        raise bad_request("LoRA is not enabled: the server runs with --no-enable-lora")
    check_name(body.lora_name, "lora_name")
    if body.lora_name == state.served_model_name:
        raise bad_request(f"'{body.lora_name}' is the base model's name", param="lora_name")
    access: ModelAccess = state.model_access
    access.check_load(body.lora_name, body.lora_path, request)
    try:
        await engine.add_lora(body.lora_name, body.lora_path)
    except AdapterExistsError as e:
        raise bad_request(str(e), param="lora_name") from e
    except ValueError as e:  # missing files, bad config, shapes, rank, outside the allowed dir
        raise bad_request(f"Cannot load LoRA adapter '{body.lora_name}': {e}",
                          param="lora_path") from e
    access.loaded(body.lora_name, request)
    service: FinetuneService | None = state.finetune
    if service is not None:
        await service.model_loaded(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    body = await read_json(UnloadLoRAAdapterRequest, request)
    state = request.app.state
    engine: AsyncLLMEngine = state.engine
    if not engine.lora_enabled:
        raise bad_request("LoRA is not enabled: the server runs with --no-enable-lora")
    access: ModelAccess = state.model_access
    loaded = body.lora_name in {lora.lora_name for lora in engine.list_loras()}
    access.check_unload(body.lora_name, request, loaded)
    try:
        num_in_use = await engine.remove_lora(body.lora_name)
    except AdapterNotFoundError as e:
        raise adapter_not_found(body.lora_name) from e
    access.unloaded(body.lora_name)
    service: FinetuneService | None = state.finetune
    if service is not None:
        await service.model_unloaded(body.lora_name)
    message = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
    if num_in_use:
        message += f" {num_in_use} request(s) already using it will finish first."
    return PlainTextResponse(message)


async def health(request: Request) -> Response:
    state = request.app.state
    engine: AsyncLLMEngine = state.engine
    if engine.is_healthy:
        return json_response(state.health_monitor.status(state.admission))
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
class BodySizeLimitMiddleware:
    """Rejects request bodies over `max_bytes` with 413, by Content-Length or while reading.

    `path_limits`: path -> (its own limit, the error to send over it), e.g. uploads to
    `/v1/files`, limited by --max-upload-mb instead.
    """

    def __init__(self, app: ASGIApp, max_bytes: int,
                 path_limits: Mapping[str, tuple[int, Callable[[], APIError]]] | None = None,
                 ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, make_error = self.path_limits.get(scope["path"], (self.max_bytes, None))
        if make_error is None:
            make_error = functools.partial(self._error, max_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            error = make_error()
            response = error_response(error.status_code, error.message, error.type,
                                      error.param, error.code)
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    # Raised inside the route's body read, so the app's handlers turn it into a
                    # response in the usual error shape.
                    raise make_error()
            return message

        await self.app(scope, limited_receive, send)

    @staticmethod
    def _error(max_bytes: int) -> APIError:
        return APIError(413, f"The request body exceeds the limit of {max_bytes} bytes.",
                        code="request_too_large")


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
