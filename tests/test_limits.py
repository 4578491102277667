"""Admission control and request limits: 429 + Retry-After past the global and per-tenant limits
(and never below them), request timeouts that abort and free the KV blocks, max_tokens bounded by
the context. The engine is real (scheduler, KV blocks, async bridge, HTTP app); the executor is a
fake that samples token 5, held inside a step by a gate so requests stay in flight on cue."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.entrypoints.openai.auth import APIKeyTable
from flexserve.entrypoints.openai.limits import (
    AdmissionController,
    AdmissionLimits,
    Rejection,
    Ticket,
)

from _fake_engine import MODEL, FakeExecutor, fake_engine, wait_until

KEYS = {"alice": "sk-alice-0123", "bob": "sk-bob-4567"}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def body(max_tokens: int | None = 4, **extra) -> dict:
    payload = {"model": MODEL, "prompt": [1, 2, 3], **extra}
    if max_tokens is not None:
        payload["max_tokens"] = max_tokens
    return payload


# ------------------------------------------------------------------------------ the controller
def test_controller_counts_limits_and_releases_once():
    controller = AdmissionController(AdmissionLimits(max_num_requests=3,
                                                     max_num_requests_per_tenant=2))
    a1, a2 = controller.admit("a", True), controller.admit("a", True)
    assert isinstance(a1, Ticket) and isinstance(a2, Ticket)
    over_tenant = controller.admit("a", True)
    assert isinstance(over_tenant, Rejection) and over_tenant.status_code == 429
    assert over_tenant.code == "tenant_rate_limit_exceeded"
    files = controller.admit("a", False)  # not a generation request: never limited
    assert isinstance(files, Ticket)
    b1 = controller.admit("b", True)
    assert isinstance(b1, Ticket) and controller.saturated
    over_all = controller.admit("c", True)
    assert isinstance(over_all, Rejection) and over_all.code == "too_many_requests"
    assert (controller.num_in_flight, controller.num_generation_in_flight) == (4, 3)
    controller.release(a1)
    controller.release(a1)  # idempotent
    assert controller.tenant_in_flight == {"a": 1, "b": 1}
    assert isinstance(controller.admit("a", True), Ticket)
    assert controller.num_rejected == {"tenant_rate_limit_exceeded": 1, "too_many_requests": 1}


def test_retry_after_follows_recent_request_durations():
    controller = AdmissionController()
    assert controller.retry_after_s() == 1  # nothing measured yet
    ticket = controller.admit(None, True)
    ticket.start -= 7.2  # as if it had run 7.2 s
    controller.release(ticket)
    assert controller.retry_after_s() == 8
    slow = controller.admit(None, True)
    slow.start -= 10_000
    controller.release(slow)
    assert controller.retry_after_s() == 60  # capped


def test_draining_refuses_everything_and_wait_idle_sees_the_last_release():
    import asyncio

    async def scenario() -> tuple[bool, bool, Rejection]:
        controller = AdmissionController()
        ticket = controller.admit(None, False)
        controller.begin_draining()
        refused = controller.admit(None, False)
        early = await controller.wait_idle(0.01)
        asyncio.get_running_loop().call_later(0.05, controller.release, ticket)
        late = await controller.wait_idle(30)
        return early, late, refused

    early, late, refused = asyncio.run(scenario())
    assert (early, late) == (False, True)
    assert refused.status_code == 503 and refused.code == "server_shutting_down"


def test_bad_limits_are_value_errors():
    with pytest.raises(ValueError, match="max_num_requests"):
        AdmissionLimits(max_num_requests=0)
    with pytest.raises(ValueError, match="max_num_requests_per_tenant"):
        AdmissionLimits(max_num_requests_per_tenant=-1)


# ----------------------------------------------------------------------------------- over HTTP
@pytest.fixture()
def gated():
    executor = FakeExecutor()
    engine = fake_engine(executor)
    app = build_app(engine, api_keys=APIKeyTable([(k, t) for t, k in KEYS.items()]),
                    limits=AdmissionLimits(max_num_requests=3, max_num_requests_per_tenant=2))
    thread = ServerThread(app)
    url = thread.start()
    yield url, app, executor, engine
    executor.gate.set()
    thread.stop()
    engine.shutdown()


def test_429_with_retry_after_only_past_the_limits(gated):
    url, app, executor, engine = gated
    admission = app.state.admission
    num_free_blocks = engine.engine.scheduler.kv_cache_manager.num_free_blocks
    executor.gate.clear()  # requests now stay in flight
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = [pool.submit(httpx.post, url + "/v1/completions", json=body(), headers=auth(t),
                            timeout=60) for t in ("alice", "alice", "bob")]
        wait_until(lambda: admission.num_generation_in_flight == 3, what="3 requests in flight")
        # alice is at her limit of 2; the server at its limit of 3
        over_tenant = httpx.post(url + "/v1/completions", json=body(), headers=auth("alice"))
        over_all = httpx.post(url + "/v1/chat/completions", headers=auth("bob"), json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        # not generation requests: never limited
        models = httpx.get(url + "/v1/models", headers=auth("bob"))
        health = httpx.get(url + "/health").json()
        executor.gate.set()
        answers = [future.result() for future in held]
    assert over_tenant.status_code == 429
    assert over_tenant.json()["error"]["code"] == "tenant_rate_limit_exceeded"
    assert "alice" in over_tenant.json()["error"]["message"]
    assert over_all.status_code == 429 and over_all.json()["error"]["code"] == "too_many_requests"
    for refused in (over_tenant, over_all):
        assert int(refused.headers["retry-after"]) >= 1
        assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert models.status_code == 200
    assert health["status"] == "degraded" and health["num_generation_requests_in_flight"] == 3
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [4, 4, 4]
    # the tenants reached the scheduler from the keys
    assert sorted(executor.tenants.values()) == ["alice", "alice", "bob"]
    wait_until(lambda: admission.num_in_flight == 0, what="all requests released")
    assert admission.tenant_in_flight == {}
    assert httpx.get(url + "/health").json() == {
        "status": "ok", "reasons": [], "num_requests_in_flight": 0,
        "num_generation_requests_in_flight": 0, "draining": False,
        "num_requests_rejected": {"tenant_rate_limit_exceeded": 1, "too_many_requests": 1}}
    rejected = {s.labels["code"]: s.value
                for family in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                if family.name == "flexserve:requests_rejected" for s in family.samples
                if s.name.endswith("_total")}
    assert rejected == {"tenant_rate_limit_exceeded": 1.0, "too_many_requests": 1.0}
    # back under the limits: everyone is served again
    for tenant in ("alice", "alice", "bob"):
        assert httpx.post(url + "/v1/completions", json=body(),
                          headers=auth(tenant)).status_code == 200
    scheduler = engine.engine.scheduler
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert scheduler.kv_cache_manager.num_free_blocks == num_free_blocks


def test_requests_over_the_time_limit_are_aborted_with_408_and_free_their_blocks():
    executor = FakeExecutor(step_s=0.01)  # 2000 tokens would take 20 s
    engine = fake_engine(executor, request_timeout_s=0.3)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    try:
        scheduler = engine.engine.scheduler
        num_free_blocks = scheduler.kv_cache_manager.num_free_blocks
        slow = httpx.post(url + "/v1/completions", json=body(2000), timeout=60)
        assert slow.status_code == 408
        error = slow.json()["error"]
        assert error["code"] == "request_timeout" and "--request-timeout-s" in error["message"]
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json=body(2000, stream=True, logprobs=0)) as response:
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        assert response.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert len(events) > 3  # tokens streamed before the limit hit
        wait_until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0,
                   what="the timed-out requests aborted")
        wait_until(lambda: scheduler.kv_cache_manager.num_free_blocks == num_free_blocks,
                   what="their KV blocks freed")
        quick = httpx.post(url + "/v1/completions", json=body(3))
        assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 3
    finally:
        thread.stop()
        engine.shutdown()


def test_max_tokens_is_bounded_by_the_context():
    engine = fake_engine(FakeExecutor(), max_model_len=64)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    try:
        # omitted: OpenAI's default of 16 for (legacy) completions
        default = httpx.post(url + "/v1/completions", json=body(None))
        assert default.status_code == 200
        assert default.json()["usage"]["completion_tokens"] == 16
        # prompt + max_tokens over the context: 400 naming max_tokens, nothing runs
        over = httpx.post(url + "/v1/completions", json=body(62))
        assert over.status_code == 400
        assert over.json()["error"]["code"] == "context_length_exceeded"
        assert over.json()["error"]["param"] == "max_tokens"
        # exactly the context: runs to its end
        whole = httpx.post(url + "/v1/completions", json=body(61))
        assert whole.status_code == 200
        assert whole.json()["usage"]["completion_tokens"] == 64 - 3
        assert whole.json()["choices"][0]["finish_reason"] == "length"
    finally:
        thread.stop()
        engine.shutdown()
