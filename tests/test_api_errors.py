"""Bad requests get the right 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.engine.llm_engine import LLMEngine
from flexserve.engine.model_info import ModelInfo
from flexserve.engine.plan import BatchPlan, StepResult, TokenLogprobs
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app

MODEL = "smollm2"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 1024
MAX_BODY = 64 * 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}

COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def completion(**changes):
    body = {**COMPLETION, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


def chat(**changes):
    body = {**CHAT, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()
C, CH = "/v1/completions", "/v1/chat/completions"

# (id, method, path, body (dict: JSON; bytes: raw), headers, status, param, message fragment)
CASES = [
    ("malformed-json", "POST", C, b'{"model": "smollm2", "prompt": ', AUTH, 400, None, "JSON"),
    ("body-not-an-object", "POST", C, b"[1, 2, 3]", AUTH, 400, None, "object"),
    ("empty-body", "POST", CH, b"", AUTH, 400, None, "JSON"),
    ("missing-model", "POST", C, completion(model=_DROP), AUTH, 400, "model", "model"),
    ("missing-prompt", "POST", C, completion(prompt=_DROP), AUTH, 400, "prompt", "prompt"),
    ("missing-messages", "POST", CH, chat(messages=_DROP), AUTH, 400, "messages", "messages"),
    ("prompt-wrong-type", "POST", C, completion(prompt=123), AUTH, 400, "prompt", "prompt"),
    ("max-tokens-string", "POST", C, completion(max_tokens="8"), AUTH, 400, "max_tokens",
     "integer"),
    ("n-float", "POST", C, completion(n=1.5), AUTH, 400, "n", "n"),
    ("stop-wrong-type", "POST", C, completion(stop=5), AUTH, 400, "stop", "stop"),
    ("max-tokens-negative", "POST", C, completion(max_tokens=-1), AUTH, 400, "max_tokens",
     "max_tokens"),
    ("max-tokens-zero", "POST", CH, chat(max_tokens=0), AUTH, 400, "max_tokens", "max_tokens"),
    ("max-tokens-huge", "POST", C, completion(max_tokens=10**6), AUTH, 400, "max_tokens",
     "1024"),
    ("temperature-negative", "POST", C, completion(temperature=-0.5), AUTH, 400, "temperature",
     "temperature"),
    ("top-p-zero", "POST", CH, chat(top_p=0), AUTH, 400, "top_p", "top_p"),
    ("presence-penalty-out-of-range", "POST", C, completion(presence_penalty=3.0), AUTH, 400,
     "presence_penalty", "presence_penalty"),
    ("n-zero", "POST", C, completion(n=0), AUTH, 400, "n", "n"),
    ("completion-logprobs-over-5", "POST", C, completion(logprobs=6), AUTH, 400, "logprobs",
     "logprobs"),
    ("chat-top-logprobs-over-20", "POST", CH, chat(logprobs=True, top_logprobs=21), AUTH, 400,
     "top_logprobs", "top_logprobs"),
    ("top-logprobs-without-logprobs", "POST", CH, chat(top_logprobs=2), AUTH, 400,
     "top_logprobs", "logprobs"),
    ("stream-options-without-stream", "POST", C,
     completion(stream_options={"include_usage": True}), AUTH, 400, "stream_options", "stream"),
    ("empty-messages", "POST", CH, chat(messages=[]), AUTH, 400, "messages", "messages"),
    ("unknown-role", "POST", CH, chat(messages=[{"role": "wizard", "content": "hi"}]), AUTH, 400,
     "messages.0.role", "role"),
    ("image-content-part", "POST", CH,
     chat(messages=[{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     AUTH, 400, "messages.0.content.0.type", "image_url"),
    ("empty-prompt", "POST", C, completion(prompt=""), AUTH, 400, "prompt", "at least 1"),
    ("token-id-outside-vocab", "POST", C, completion(prompt=[10**7]), AUTH, 400, "prompt",
     "vocabulary"),
    ("logit-bias-outside-vocabulary", "POST", C, completion(logit_bias={"50256": -100}), AUTH, 400,
     "logit_bias", "logit_bias"),
    ("unknown-model", "POST", C, completion(model="gpt-5"), AUTH, 404, "model", "gpt-5"),
    ("prompt-over-context", "POST", C, completion(prompt=[1000] * 1100), AUTH, 400, "prompt",
     "1100"),
    ("prompt-plus-max-tokens-over-context", "POST", C,
     completion(prompt=[1000] * 1000, max_tokens=100), AUTH, 400, "max_tokens",
     "1100 tokens (1000 in the prompt, 100 in the completion)"),
    ("wrong-api-key", "POST", C, completion(), {"Authorization": "Bearer nope"}, 401, None,
     "API key"),
    ("missing-api-key", "GET", "/v1/models", None, {}, 401, None, "API key"),
    ("oversized-body", "POST", C, completion(prompt="x" * (MAX_BODY + 1)), AUTH, 413, None,
     str(MAX_BODY)),
    ("unknown-route", "GET", "/v1/nothing-here", None, AUTH, 404, None, "/v1/nothing-here"),
    ("wrong-method", "GET", C, None, AUTH, 405, None, "GET"),
]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = EngineConfig(model=ModelConfig(model=smollm2_dir, max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(kv_cache_gib=0.25))
    engine = build_async_engine(config, log_stats=False)
    app = build_app(engine, served_model_name=MODEL, api_key=API_KEY,
                    max_request_body_bytes=MAX_BODY)
    thread = ServerThread(app)
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine)
    thread.stop()
    engine.shutdown()


def send(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.request(method, url + path, content=body,
                             headers={**headers, "Content-Type": "application/json"})
    return httpx.request(method, url + path, json=body, headers=headers)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_its_4xx_in_openai_error_shape(server, case):
    _, method, path, body, headers, status, param, fragment = case
    response = send(server.url, method, path, body, headers)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    payload = response.json()
    assert set(payload) == {"error"}
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and fragment in error["message"], error
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


def test_context_length_error_names_both_numbers_and_the_limit(server):
    response = send(server.url, "POST", C, completion(prompt=[1000] * 1000, max_tokens=100), AUTH)
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    for number in ("1024", "1100", "1000", "100"):
        assert number in error["message"]


def test_openai_client_raises_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_server_answers_correctly_after_bad_requests(server):
    for case in CASES:  # replay the whole table, then a good request must work
        send(server.url, *case[1:5])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    response = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=6,
                                         temperature=0)
    assert response.choices[0].text.startswith(" 6, 7")
    chat_response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert chat_response.usage.completion_tokens >= 1
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed off /v1
    scheduler = server.engine.engine.scheduler
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0


class BreakableExecutor:
    """Emits token 5 (logprob 0) for every row, 10 ms a step, until told to fail."""

    def __init__(self) -> None:
        self.fail = False

    def execute(self, plan: BatchPlan) -> StepResult:
        if self.fail:
            raise RuntimeError("the device fell off the bus")
        time.sleep(0.01)
        result = StepResult()
        for row in plan.sequences:
            if row.needs_sample:
                result.sampled_token_ids[row.request_id] = 5
                result.logprobs[row.request_id] = TokenLogprobs([5], [0.0], [1])
        return result


def test_engine_failure_is_a_503_and_fails_open_streams_in_band():
    executor = BreakableExecutor()
    info = ModelInfo(name="fake", vocab_size=50, max_model_len=2048, eos_token_id=0,
                     num_blocks=600, block_size=4, device="cpu", dtype="float32")
    engine = AsyncLLMEngine(
        LLMEngine(EngineConfig(cache=CacheConfig(block_size=4)), executor, None, info),
        log_stats=False)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    try:
        ok = httpx.post(url + C, json={"model": "fake", "prompt": [1, 2, 3], "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 1000, "stream": True,
                "logprobs": 0}  # no tokenizer, so no text: logprobs make the chunks
        with httpx.stream("POST", url + C, json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
            executor.fail = True
            events = [line.removeprefix("data: ") for line in lines if line]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and "fell off the bus" in error["message"]
        dead = httpx.post(url + C, json={"model": "fake", "prompt": [1], "max_tokens": 2})
        assert dead.status_code == 503 and dead.json()["error"]["code"] == "engine_dead"
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
    finally:
        thread.stop()
        engine.shutdown()
