"""The OpenAI-compatible server end to end: real uvicorn, the real `openai` client, SmolLM2 fp32.

Every generation is compared with the offline `LLM` built from the same engine configuration.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flexserve import LLM, SamplingParams
from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.engine.detokenizer import decode_token
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app

MODEL = "smollm2"
MAX_MODEL_LEN = 1024
KV_CACHE_GIB = 0.25


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = EngineConfig(model=ModelConfig(model=smollm2_dir, max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(kv_cache_gib=KV_CACHE_GIB))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name=MODEL))
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine)
    thread.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, max_model_len=MAX_MODEL_LEN, kv_cache_gib=KV_CACHE_GIB)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (exact name, e.g. `..._total` or `..._count`)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_completion_equals_offline_generate_token_for_token(llm, client):
    prompt = "The capital of France is"
    ref = llm.generate(prompt, greedy(16), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                         temperature=0, logprobs=0)
    choice = response.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert choice.logprobs.tokens == [decode_token(tokenizer, t) for t in ref.outputs[0].token_ids]
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert response.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert response.model == MODEL and response.object == "text_completion"
    # The same prompt as token ids gives the same tokens.
    by_ids = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=16,
                                       temperature=0)
    assert by_ids.choices[0].text == choice.text


def test_chat_equals_offline_chat_token_for_token(llm, client):
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Name a primary color."}]
    ref = llm.chat(messages, greedy(12), use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    response = client.chat.completions.create(model=MODEL, messages=messages,
                                              max_completion_tokens=12, temperature=0,
                                              logprobs=True)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text
    assert [t.token for t in choice.logprobs.content] == [
        decode_token(tokenizer, t) for t in ref.token_ids]
    assert choice.finish_reason == ref.finish_reason
    assert response.usage.completion_tokens == len(ref.token_ids)
    # Content as a list of text parts is the same conversation.
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
             for m in messages]
    again = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=12,
                                           temperature=0)
    assert again.choices[0].message.content == ref.text


def test_streamed_completion_concatenates_to_the_full_one(client):
    kwargs = dict(model=MODEL, prompt="Write a haiku about the sea.", max_tokens=20,
                  temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_sends_role_then_content_then_done(server, client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}],
            "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    full = client.chat.completions.create(**{k: v for k, v in body.items()
                                             if k not in ("stream", "stream_options")})
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-1])
    assert content == full.choices[0].message.content
    assert chunks[-2]["choices"][0]["finish_reason"] == full.choices[0].finish_reason
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)


def test_continuous_usage_stats_count_every_chunk(server, client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, its
    completion tokens rising to the final count (tokens whose text is held back arrive in a
    later chunk, which then counts them all); without include_usage it is off."""
    for path, extra in (("/v1/completions", {"prompt": "Write a haiku about the sea."}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Count to five."}]})):
        body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                **extra}
        with httpx.stream("POST", server.url + path, json=body) as response:
            chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                      if line and line != "data: [DONE]"]
        final = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and 0 < final["completion_tokens"] <= 16
        counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
        assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in chunks)
        assert counts == sorted(counts) and counts[-1] == final["completion_tokens"]
        assert counts[0] <= 1 and len(counts) > 2
        assert all(c["usage"]["total_tokens"] == final["prompt_tokens"] + n
                   for c, n in zip(chunks, counts))
        body["stream_options"] = {"continuous_usage_stats": True}
        with httpx.stream("POST", server.url + path, json=body) as response:
            chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                      if line and line != "data: [DONE]"]
        assert all(c.get("usage") is None for c in chunks)


def test_n_seed_and_several_prompts_follow_offline_sampling(llm, client):
    prompts = ["Once upon a time", "The weather today is"]
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=8)
    refs = llm.generate(prompts, params, use_tqdm=False)
    kwargs = dict(model=MODEL, prompt=prompts, n=2, temperature=1.0, top_p=0.9, seed=1234,
                  max_tokens=8)
    response = client.completions.create(**kwargs)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for p, ref in enumerate(refs):
        for i in range(2):
            assert response.choices[p * 2 + i].text == ref.outputs[i].text
    assert response.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    num_generated = sum(len(o.token_ids) for r in refs for o in r.outputs)
    assert response.usage.completion_tokens == num_generated
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in response.choices]
    other = client.completions.create(**{**kwargs, "seed": 4321})
    assert [c.text for c in other.choices] != [c.text for c in response.choices]


def test_stop_strings_cut_the_text(client):
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    assert " 8" in full, full
    stopped = client.completions.create(**kwargs, stop=" 8").choices[0]
    assert stopped.text == full[:full.index(" 8")]
    assert stopped.finish_reason == "stop"
    listed = client.completions.create(**kwargs, stop=["never", " 7"]).choices[0]
    assert listed.text == full[:full.index(" 7")] and listed.finish_reason == "stop"


def test_echo_with_logprobs_covers_prompt_and_completion(client):
    prompt = "Hello, my name is"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                         temperature=0, echo=True, logprobs=2)
    choice = response.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == response.usage.prompt_tokens + response.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert logprob <= 0.0 and token in top and 2 <= len(top) <= 3
    n_prompt = response.usage.prompt_tokens
    for logprob, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the best token


def test_chat_top_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_max_tokens_null_fills_the_context(client):
    prompt = [1000] * (MAX_MODEL_LEN - 6)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=None,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 6
    assert response.choices[0].finish_reason == "length"


def test_models_health_version_and_openapi(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(server.url + "/v1/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "flexserve"
    assert card["parent"] is None and card["max_model_len"] == MAX_MODEL_LEN and card["root"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    spec = httpx.get(server.url + "/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    refs = []

    def walk(node):
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    assert refs and all(r.removeprefix("#/components/schemas/") in schemas for r in refs)


def test_32_concurrent_streams_and_cancelling_half_frees_the_kv_cache(server, client):
    prompts = ["The quick brown fox", "Story number one:"]
    refs = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
            .choices[0].text for p in prompts]
    aborted_before = metric(server.url, "flexserve:request_success_total",
                            finished_reason="abort")

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        async def one(i: int) -> str | None:
            stream = await aclient.completions.create(
                model=MODEL, prompt=prompts[i % 2], max_tokens=8, temperature=0, stream=True)
            text, num_chunks = "", 0
            async for chunk in stream:
                text += chunk.choices[0].text
                num_chunks += 1
                if i >= 16 and num_chunks == 2:
                    await stream.close()  # disconnect mid-stream
                    return None
            return text

        return await asyncio.gather(*[one(i) for i in range(32)])

    texts = asyncio.run(main())
    assert texts[:16] == [refs[i % 2] for i in range(16)]
    scheduler = server.engine.engine.scheduler
    wait_until(lambda: metric(server.url, "flexserve:kv_cache_usage_perc") == 0.0)
    wait_until(lambda: metric(server.url, "flexserve:request_success_total",
                              finished_reason="abort") == aborted_before + 16)
    assert scheduler.num_running == 0 and scheduler.num_waiting == 0
    assert scheduler.kv_cache_usage == 0.0


def test_client_gone_before_a_non_streaming_answer_aborts_it(server):
    scheduler = server.engine.engine.scheduler
    body = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 600,
            "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    start = time.monotonic()
    wait_until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0, timeout=5)
    assert time.monotonic() - start < 5  # 600 tokens would take far longer
    assert scheduler.kv_cache_usage == 0.0


def test_serve_options_build_the_engine_config():
    from flexserve.entrypoints.cli.args import engine_config_from_args
    from flexserve.entrypoints.cli.main import build_parser

    args = build_parser().parse_args([
        "serve", "--model", "some-dir", "--max-model-len", "512", "--block-size", "32",
        "--kv-cache-gib", "0.5", "--no-enable-prefix-caching", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--seed", "3", "--served-model-name", "mine",
        "--dtype", "float32", "--load-format", "dummy", "--api-key", "k", "--port", "9001",
    ])
    config = engine_config_from_args(args)
    model = config.model
    assert (model.model, model.max_model_len, model.seed) == ("some-dir", 512, 3)
    assert model.served_model_name == "mine" and model.load_format == "dummy"
    assert (config.cache.block_size, config.cache.kv_cache_gib) == (32, 0.5)
    assert config.cache.enable_prefix_caching is False
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 256)
    assert (args.api_key, args.port, args.host) == ("k", 9001, "127.0.0.1")
    with pytest.raises(ValueError, match="block_size"):
        engine_config_from_args(build_parser().parse_args(["serve", "--block-size", "0"]))
