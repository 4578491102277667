"""Admission control: bounded work instead of unbounded queues, 429 + Retry-After past a limit.

Every HTTP request except the observability routes (`/health`, `/metrics`, `/version`,
`/openapi.json`) is counted while it is in flight; a graceful shutdown waits for that count to
drain. Generation requests (`POST /v1/completions`, `/v1/chat/completions`) are also counted
per tenant (the API key's, `request.state.tenant`; "default" without one) against two limits:

- `max_num_requests`: all tenants together; the server sets it to `max_num_seqs +
  --max-queue-len`, so at most --max-queue-len admitted requests wait for a running slot;
- `max_num_requests_per_tenant` (`--max-requests-per-tenant`): one tenant's share.

A request past either limit is refused before its body is read: 429 in OpenAI's error shape
with `Retry-After` (seconds, the recent mean request duration rounded up, in [1, 60]).

Requests differ in cost, so admitted generation requests are also charged what they queue
(`charge`): their sequences (prompts x `n`) and tokens (each sequence's prompt plus its
`max_tokens`), against

- `max_num_sequences`: all tenants together (the server sets it to `max_num_seqs +
  --max-queue-len`, as for requests);
- `max_num_sequences_per_tenant` (`--max-seqs-per-tenant`) and `max_num_tokens_per_tenant`
  (`--max-tokens-per-tenant`): one tenant's share.

Sequences are charged before the prompts are tokenized, tokens after; past a limit the request is
refused with 429 and Retry-After, and a request that could never fit (alone over a limit) with
400. While the
server drains, every counted request is refused with 503 (and `Connection: close`).

A request's slot is released just before its response's last body chunk is sent, so a client
that has read a whole response never finds its own finished request still counted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flexserve.entrypoints.openai.errors import error_response

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Never limited nor counted: a draining or saturated server must still answer probes and scrapes.
OBSERVABILITY_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json"})
DEFAULT_TENANT = "default"
_MAX_RETRY_AFTER_S = 60
_DURATION_EWMA_WEIGHT = 0.2  # weight of the newest request duration in the Retry-After estimate


@dataclass(slots=True)
class AdmissionLimits:
    """The server's admission limits (None: unbounded)."""

    max_num_requests: int | None = None  # generation requests in flight, all tenants together
    max_num_requests_per_tenant: int | None = None  # generation requests in flight per tenant
    max_num_sequences: int | None = None  # sequences (prompts x n) in flight, all tenants
    max_num_sequences_per_tenant: int | None = None  # sequences in flight per tenant
    max_num_tokens_per_tenant: int | None = None  # prompt + max_tokens of those, per tenant

    def __post_init__(self) -> None:
        for name in ("max_num_requests", "max_num_requests_per_tenant", "max_num_sequences",
                     "max_num_sequences_per_tenant", "max_num_tokens_per_tenant"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


@dataclass(slots=True)
class Rejection:
    """Why a request is refused, as the client will see it."""

    status_code: int  # 429 (over a limit) or 503 (draining)
    message: str  # the error message
    code: str  # OpenAI-style error code
    retry_after_s: int  # the Retry-After header, seconds


@dataclass(slots=True)
class Ticket:
    """One admitted request's hold on the counters; `release` is idempotent."""

    tenant: str  # the tenant it is counted for
    generation: bool  # counted against the generation limits
    start: float  # time.monotonic() at admission
    released: bool = False  # its counts were given back
    num_sequences: int = 0  # sequences charged to it (`charge`)
    num_tokens: int = 0  # tokens charged to it


class AdmissionController:
    """Counts in-flight requests and decides admit / 429 / 503. Event-loop only (not
    thread-safe): the ASGI app runs on one loop."""

    def __init__(self, limits: AdmissionLimits | None = None,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self.on_reject = on_reject  # called with the error code of every refusal (metrics)
        self.num_in_flight = 0  # counted requests of any route
        self.num_generation_in_flight = 0  # generation requests
        self.num_sequences_in_flight = 0  # sequences charged by generation requests
        self.tenant_sequences: Counter[str] = Counter()  # sequences in flight per tenant
        self.tenant_tokens: Counter[str] = Counter()  # tokens in flight per tenant
        self.tenant_in_flight: Counter[str] = Counter()  # generation requests per tenant
        self.num_rejected: Counter[str] = Counter()  # refusals by code
        self.draining = False  # set once by a graceful shutdown; never cleared
        self._mean_duration_s: float | None = None  # EWMA of generation request durations
        self._idle: asyncio.Event | None = None

    # ----------------------------------------------------------------------------- decisions
    def admit(self, tenant: str | None, generation: bool) -> Ticket | Rejection:
        """Count the request in, or say why not."""
        tenant = tenant or DEFAULT_TENANT
        if self.draining:
            return self._reject(503, "The server is shutting down and accepts no new requests; "
                                "retry on another replica or after it restarts.",
                                "server_shutting_down")
        if generation:
            limits = self.limits
            # The tenant's own limit first: when both are hit, it is the one it can act on.
            per_tenant = limits.max_num_requests_per_tenant
            if per_tenant is not None and self.tenant_in_flight[tenant] >= per_tenant:
                return self._reject(
                    429, f"Tenant {tenant!r} has {per_tenant} requests in flight, its limit "
                         "(--max-requests-per-tenant); retry after the Retry-After delay.",
                    "tenant_rate_limit_exceeded")
            if (limits.max_num_requests is not None
                    and self.num_generation_in_flight >= limits.max_num_requests):
                return self._reject(
                    429, f"The server is at its limit of {limits.max_num_requests} requests in "
                         "flight (running plus --max-queue-len queued); retry after the "
                         "Retry-After delay.", "too_many_requests")
            self.num_generation_in_flight += 1
            self.tenant_in_flight[tenant] += 1
        self.num_in_flight += 1
        if self._idle is not None:
            self._idle.clear()
        return Ticket(tenant, generation, time.monotonic())

    def charge(self, ticket: Ticket, num_sequences: int = 0, num_tokens: int = 0,
               ) -> Rejection | None:
        """Charge an admitted request `num_sequences` more sequences and `num_tokens` more
        tokens, or say why not (429 past a limit now, 400 when it could never fit)."""
        if ticket.released:
            return None
        limits, tenant = self.limits, ticket.tenant
        checks = (
            (limits.max_num_sequences_per_tenant, ticket.num_sequences + num_sequences,
             self.tenant_sequences[tenant] + num_sequences, "sequences",
             f"tenant {tenant!r}'s limit (--max-seqs-per-tenant)", "tenant_rate_limit_exceeded"),
            (limits.max_num_tokens_per_tenant, ticket.num_tokens + num_tokens,
             self.tenant_tokens[tenant] + num_tokens, "tokens (prompt plus max_tokens)",
             f"tenant {tenant!r}'s limit (--max-tokens-per-tenant)",
             "tenant_rate_limit_exceeded"),
            (limits.max_num_sequences, ticket.num_sequences + num_sequences,
             self.num_sequences_in_flight + num_sequences, "sequences",
             "the server's limit (running plus --max-queue-len queued)", "too_many_requests"),
        )
        for limit, own, total, what, whose, code in checks:
            if limit is None:
                continue
            if own > limit:
                return self._reject(400, f"The request alone has {own} {what} (prompts x n), "
                                         f"over {whose} of {limit}: split it.",
                                    "request_too_large")
            if total > limit:
                return self._reject(429, f"The request's {what} would exceed {whose} of {limit} "
                                         "in flight; retry after the Retry-After delay.", code)
        ticket.num_sequences += num_sequences
        ticket.num_tokens += num_tokens
        self.num_sequences_in_flight += num_sequences
        self.tenant_sequences[tenant] += num_sequences
        self.tenant_tokens[tenant] += num_tokens
        return None

    def release(self, ticket: Ticket) -> None:
        """Give the request's counts back (once)."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.num_sequences or ticket.num_tokens:
            self.num_sequences_in_flight -= ticket.num_sequences
            for counter, amount in ((self.tenant_sequences, ticket.num_sequences),
                                    (self.tenant_tokens, ticket.num_tokens)):
                counter[ticket.tenant] -= amount
                if counter[ticket.tenant] <= 0:
                    del counter[ticket.tenant]
        self.num_in_flight -= 1
        if ticket.generation:
            self.num_generation_in_flight -= 1
            self.tenant_in_flight[ticket.tenant] -= 1
            if not self.tenant_in_flight[ticket.tenant]:
                del self.tenant_in_flight[ticket.tenant]
            duration = time.monotonic() - ticket.start
            mean = self._mean_duration_s
            self._mean_duration_s = duration if mean is None else (
                (1 - _DURATION_EWMA_WEIGHT) * mean + _DURATION_EWMA_WEIGHT * duration)
        if self.num_in_flight == 0 and self._idle is not None:
            self._idle.set()

    def _reject(self, status_code: int, message: str, code: str) -> Rejection:
        self.num_rejected[code] += 1
        if self.on_reject is not None:
            self.on_reject(code)
        return Rejection(status_code, message, code, self.retry_after_s())

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: the recent mean request duration, in [1, 60]."""
        mean = self._mean_duration_s
        if mean is None:
            return 1
        return max(1, min(_MAX_RETRY_AFTER_S, math.ceil(mean)))

    @property
    def saturated(self) -> bool:
        """A new generation request would be refused for the global limit right now."""
        limit = self.limits.max_num_requests
        return limit is not None and self.num_generation_in_flight >= limit

    # ------------------------------------------------------------------------------ draining
    def begin_draining(self) -> None:
        """Refuse every new counted request from now on (503)."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no counted request is in flight; False when `timeout_s` passed first."""
        if self.num_in_flight == 0:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            return self.num_in_flight == 0
        return True


class AdmissionMiddleware:
    """Applies an `AdmissionController` to every HTTP request (see the module docstring).

    Install it inside the API-key middleware, so that it sees the key's tenant and refuses no
    one before they authenticated.
    """

    def __init__(self, app: ASGIApp, controller: AdmissionController) -> None:
        self.app = app
        self.controller = controller

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OBSERVABILITY_PATHS:
            await self.app(scope, receive, send)
            return
        generation = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        tenant = scope.get("state", {}).get("tenant")
        decision = self.controller.admit(tenant, generation)
        if isinstance(decision, Rejection):
            headers = {"Retry-After": str(decision.retry_after_s)}
            if decision.status_code == 503:
                headers["Connection"] = "close"
            kind = "server_error" if decision.status_code >= 500 else "rate_limit_error"
            response = error_response(decision.status_code, decision.message, kind,
                                      code=decision.code, headers=headers)
            await response(scope, receive, send)
            return
        ticket = decision
        controller = self.controller
        scope.setdefault("state", {})["admission_ticket"] = ticket  # for `charge` by handlers

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                controller.release(ticket)
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            controller.release(ticket)
