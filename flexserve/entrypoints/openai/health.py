"""`GET /health`: "ok", "degraded" (serving, but something needs a look), or 503 (engine dead).

Degraded while the server drains for a shutdown, while it refuses generation requests at its
request limit, and for `RECENT_FAILURE_S` after a fine-tuning job failed (the engine and the other
jobs carry on, but an operator should see it). Load balancers that only read the status code keep
routing to a degraded server; those that read `status` can prefer healthier replicas.

`/health` answers without an API key, so it names no job (a tenant's) unless the operator asked
for job ids (`--metrics-job-ids`); the failed job's own events say why it failed.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Literal

from flexserve.entrypoints.openai.protocol import OpenAIModel

RECENT_FAILURE_S = 300.0  # a failed fine-tuning job degrades /health for this long
_MAX_REMEMBERED_FAILURES = 16


class HealthStatus(OpenAIModel):
    """The body of `GET /health` while the engine runs."""

    status: Literal["ok", "degraded"] = "ok"
    reasons: list[str] = []  # why it is degraded (empty when ok)
    num_requests_in_flight: int = 0  # HTTP requests being served (probes and scrapes aside)
    num_generation_requests_in_flight: int = 0  # completions and chat completions among them
    draining: bool = False  # shutting down: new requests get 503
    num_requests_rejected: dict[str, int] = {}  # refusals since start, by error code (429, 503)


class HealthMonitor:
    """Remembers recent fine-tuning job failures (fed on the engine thread by a fine-tuning
    listener) and builds the `/health` body from them and the admission state."""

    def __init__(self, recent_failure_s: float = RECENT_FAILURE_S, job_ids: bool = False,
                 ) -> None:
        self.recent_failure_s = recent_failure_s
        self.job_ids = job_ids  # name failed jobs (and their errors) in the reasons
        self._lock = threading.Lock()  # the engine thread appends, the event loop reads
        # (time.monotonic(), job id, message) of the newest failures
        self._job_failures: collections.deque[tuple[float, str, str]] = collections.deque(
            maxlen=_MAX_REMEMBERED_FAILURES)

    def on_finetune_updates(self, updates: list[Any]) -> None:
        """An `AsyncLLMEngine` fine-tuning listener: note every "failed" update."""
        now = time.monotonic()
        for update in updates:
            if update.kind == "failed":
                with self._lock:
                    self._job_failures.append((now, update.job_id, update.message or ""))

    def recent_job_failures(self) -> list[tuple[str, str]]:
        """(job id, message) of the jobs that failed within `recent_failure_s`, oldest first."""
        cutoff = time.monotonic() - self.recent_failure_s
        with self._lock:
            return [(job_id, message) for when, job_id, message in self._job_failures
                    if when >= cutoff]

    def status(self, admission: Any | None) -> HealthStatus:
        """The health of a live engine; `admission`: the app's `AdmissionController`."""
        reasons = []
        body = HealthStatus()
        if admission is not None:
            body.num_requests_in_flight = admission.num_in_flight
            body.num_generation_requests_in_flight = admission.num_generation_in_flight
            body.draining = admission.draining
            body.num_requests_rejected = dict(admission.num_rejected)
            if admission.draining:
                reasons.append("shutting down: new requests are refused")
            if admission.saturated:
                reasons.append(f"at the request limit ({admission.limits.max_num_requests} in "
                               "flight): new generation requests get 429")
        for job_id, message in self.recent_job_failures():
            reasons.append(f"fine-tuning job {job_id} failed: {message}" if self.job_ids
                           else "a fine-tuning job failed (its events say why)")
        body.reasons = reasons
        body.status = "degraded" if reasons else "ok"
        return body
