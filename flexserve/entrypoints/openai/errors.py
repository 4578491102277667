"""One error shape for every failure, OpenAI's: `{"error": {"message", "type", "param", "code"}}`.

Invalid JSON, schema violations and bad values are 400 (never FastAPI-style 422), an unknown
model or LoRA adapter is 404, a bad API key 401, an oversized body 413, a request past
--request-timeout-s 408, one whose processing failed 500 `request_failed`. An unexpected
exception is a 500 whose body says only that, with an error id (also in the `x-request-id`
header): the stack trace and whatever the exception's message holds (local paths, tensor
shapes) go to the server log under that id, never to the client. Such a 500 carries
`Connection: close` and the server closes the connection after it, so a client's connection pool
never reuses a connection the server is about to drop (`InternalErrorMiddleware`).
"""

from __future__ import annotations

import logging
import re
import secrets
from http import HTTPStatus

from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flexserve.engine.adapter_manager import AdapterLoadError, AdapterNotFoundError
from flexserve.engine.async_engine import (
    EngineDeadError,
    RequestFailedError,
    RequestTimeoutError,
)
from flexserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
# Tags of the chat message union (by role) in error locations: `messages.0.user.content`.
_MESSAGE_ROLES = {"system", "developer", "user", "assistant", "tool"}


class APIError(Exception):
    """An error to return to the client as-is."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.error_id: str | None = None  # set on internal errors: the id in the server log
        self.headers = dict(headers or {})  # extra response headers (Retry-After on a 429)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


def cursor_not_found(e: ValueError) -> APIError:
    """A list's `after` names no item the caller can see (404, as for retrieving it)."""
    return APIError(404, str(e), param="after", code="cursor_not_found")


def error_response(status_code: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


def error_payload(error: APIError) -> dict:
    """The error body, for streams that have already started (sent as an SSE event)."""
    info = ErrorInfo(message=error.message, type=error.type, param=error.param, code=error.code)
    return ErrorResponse(error=info).model_dump()


def to_api_error(e: Exception) -> APIError:
    """Any exception as the error a client gets (streams report it in-band)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, AdapterNotFoundError):
        return APIError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, AdapterLoadError):  # its reason may name server-side files: log it
        error_id = new_error_id()
        logger.error("LoRA adapter load failed (%s): %s", error_id, e)
        error = APIError(500, f"The request's LoRA adapter could not be loaded (error id "
                              f"{error_id}); the server logged the details.", "server_error",
                         code="lora_load_failed")
        error.error_id = error_id
        return error
    if isinstance(e, ValidationError):
        return validation_error(e)
    if isinstance(e, ValueError):
        return value_error(e)
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_dead")
    if isinstance(e, RequestTimeoutError):
        return APIError(408, str(e), "timeout_error", code="request_timeout")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), "server_error", code="request_failed")
    return internal_error(e)


def internal_error(e: BaseException, where: str = "") -> APIError:
    """A generic 500 for an unexpected exception: its trace is logged under a fresh error id,
    which is all the client learns (besides that it was the server's fault)."""
    error_id = new_error_id()
    logger.error("internal error %s%s", error_id, f" on {where}" if where else "",
                 exc_info=(type(e), e, e.__traceback__))
    error = APIError(500, f"Internal server error (error id {error_id}); the server logged the "
                          "details.", "server_error", code="internal_error")
    error.error_id = error_id
    return error


def new_error_id() -> str:
    """An id that ties a client-visible error to its server log entry."""
    return f"err-{secrets.token_hex(8)}"


def value_error(e: ValueError, fields: set[str] | frozenset[str] = frozenset()) -> APIError:
    """A `ValueError` from parameter or prompt validation; `param` is its leading field name."""
    message = str(e)
    first = message.split(" ", 1)[0]
    return bad_request(message, param=first if first in fields else None)


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error on the request body as one readable 400."""
    errors = e.errors(include_url=False)
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return bad_request(f"Invalid JSON body: {detail}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    param = _param_of(first["loc"])
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):  # e.g. a message's role
        tag = first.get("ctx", {}).get("discriminator", "").strip("'")
        param = f"{param}.{tag}" if tag else param
        if first["type"] == "union_tag_not_found":
            return bad_request(f"Missing required parameter: '{param}'.", param=param,
                               code="missing_required_parameter")
    messages = []
    for error in errors:
        if _param_of(error["loc"]) == param and error["msg"] not in messages:
            messages.append(error["msg"])
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    got = f" (got {first['input']!r})" if first["type"] == "literal_error" else ""
    return bad_request(f"Invalid value for '{param}': {' or '.join(messages[:4])}{got}.",
                       param=param, code="invalid_value")


def _param_of(loc: tuple) -> str:
    """`("messages", 0, "role")` -> "messages.0.role"; union-member tags are dropped, and so is
    the tag of a discriminated union's member (`("messages", 0, "user", "content")`)."""
    parts = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(str(item))
        elif (_FIELD.match(item) and item not in _TYPE_TAGS
              and not (i > 0 and isinstance(loc[i - 1], int) and item in _MESSAGE_ROLES)):
            parts.append(item)
    return ".".join(parts)


# ----------------------------------------------------------------------------------- handlers
async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = dict(exc.headers)
    if exc.error_id is not None:
        headers["x-request-id"] = exc.error_id
    return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code,
                          headers or None)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    return await _api_error(request, validation_error(exc))  # type: ignore[arg-type]


async def _value_error(request: Request, exc: Exception) -> JSONResponse:
    return await _api_error(request, value_error(exc))  # type: ignore[arg-type]


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    detail = exc.detail if exc.detail and exc.detail != phrase else None
    headers = exc.headers
    if status == 404:
        message = f"Not found: {request.method} {request.url.path}"
        code = "not_found"
    elif status == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
        code = "method_not_allowed"
        # Starlette names the methods of the first route on the path; a path has several.
        headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
    else:
        message = detail or phrase
        code = phrase.lower().replace(" ", "_")
    kind = "invalid_request_error" if status < 500 else "server_error"
    return error_response(status, message, kind, None, code, headers=headers)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app serves on the request's path."""
    methods: set[str] = set()
    for route in getattr(request.app, "routes", ()):
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


async def _to_api_error(request: Request, exc: Exception) -> JSONResponse:
    return await _api_error(request, to_api_error(exc))


async def _engine_dead(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, str(exc), "server_error", None, "engine_dead")


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return await _api_error(request, internal_error(exc, f"{request.method} {request.url.path}"))


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    ValidationError: _validation_error,
    AdapterNotFoundError: _to_api_error,
    AdapterLoadError: _to_api_error,
    ValueError: _value_error,
    HTTPException: _http_exception,
    EngineDeadError: _engine_dead,
    RequestTimeoutError: _to_api_error,
    RequestFailedError: _to_api_error,
    Exception: _internal_error,
}


class InternalErrorMiddleware:
    """Turns an exception no handler took into the generic 500 (`internal_error`) with
    `Connection: close`, instead of letting it reach the server, which would drop the connection
    without a response. A response that has started already can only be cut short: the
    connection is closed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:
            error = internal_error(e, f"{scope.get('method')} {scope.get('path')}")
            if started:
                raise
            response = error_response(error.status_code, error.message, error.type,
                                      code=error.code,
                                      headers={"x-request-id": error.error_id or "",
                                               "Connection": "close"})
            await response(scope, receive, send)
