"""LoRA over HTTP: a real server (uvicorn, SmolLM2 fp32) with adapters at start-up and at run time.

Adapters are written with flexserve's PEFT writer (round-tripped through `peft` in
test_peft_io.py): random A, random non-zero B, so each one changes the model's output.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from flexserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.entrypoints.cli.args import engine_config_from_args, parse_lora_modules
from flexserve.entrypoints.cli.main import build_parser
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.peft.bypass import target_shapes
from flexserve.peft.lora import LoRAAdapter
from flexserve.peft.peft_io import ADAPTER_CONFIG_NAME, save_peft_adapter

MODEL = "smollm2"
MAX_LORA_RANK = 16
PROMPT = "The capital of France is"


def write_adapter(path, hf_config, rank: int = 8, targets=("q_proj", "v_proj", "down_proj"),
                  seed: int = 0, **config_changes) -> str:
    generator = torch.Generator().manual_seed(seed)
    adapter = LoRAAdapter.create(target_shapes(hf_config), hf_config.num_hidden_layers, rank,
                                 2.0 * rank, targets, generator=generator)
    for _, b in adapter.weights.values():
        b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
    save_peft_adapter(adapter, str(path))
    if config_changes:
        config_path = os.path.join(path, ADAPTER_CONFIG_NAME)
        with open(config_path) as f:
            data = json.load(f)
        data.update(config_changes)
        with open(config_path, "w") as f:
            json.dump(data, f)
    return str(path)


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tiny_config, tmp_path_factory):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(smollm2_dir)
    allowed = tmp_path_factory.mktemp("allowed")
    outside = tmp_path_factory.mktemp("outside")
    paths = SimpleNamespace(allowed=str(allowed))
    paths.startup = write_adapter(allowed / "startup", hf_config, seed=1)
    paths.hot = write_adapter(allowed / "hot", hf_config, seed=2)
    paths.other = write_adapter(allowed / "other", hf_config, seed=3, rank=4,
                                targets=("k_proj", "o_proj", "gate_proj", "up_proj"))
    paths.outside = write_adapter(outside / "adapter", hf_config, seed=4)
    paths.wrong_shapes = write_adapter(allowed / "tiny", tiny_config("llama"), seed=5)
    paths.rank_too_big = write_adapter(allowed / "r32", hf_config, rank=32, seed=6)
    paths.bad_target = write_adapter(allowed / "lm_head", hf_config, seed=7,
                                     target_modules=["q_proj", "lm_head"])
    paths.dora = write_adapter(allowed / "dora", hf_config, seed=8, use_dora=True)
    (allowed / "no_config").mkdir()
    paths.no_config = str(allowed / "no_config")
    return paths


@pytest.fixture(scope="module")
def server(smollm2_dir, adapters):
    config = EngineConfig(
        model=ModelConfig(model=smollm2_dir, max_model_len=512),
        cache=CacheConfig(kv_cache_gib=0.1),
        lora=LoRAConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=MAX_LORA_RANK,
                        allowed_adapter_dir=adapters.allowed,
                        lora_modules={"startup": adapters.startup}),
    )
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name=MODEL))
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine)
    thread.stop()
    engine.shutdown()


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def complete(server, model: str, prompt: str = PROMPT, max_tokens: int = 12) -> str:
    response = post(server, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def scrape(server) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def lora_gauges(server) -> tuple[dict[str, float], dict[str, float]]:
    running, loaded = {}, {}
    for (name, labels), value in scrape(server).items():
        labels = dict(labels)
        if name == "flexserve:lora_requests_running":
            running[labels["lora_name"]] = value
        elif name == "flexserve:lora_adapters_loaded":
            loaded[labels["where"]] = value
    return running, loaded


def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def models(server) -> dict[str, dict]:
    return {card["id"]: card for card in httpx.get(server.url + "/v1/models").json()["data"]}


def test_models_list_startup_adapters_with_their_parent(server, adapters):
    cards = models(server)
    assert cards[MODEL]["parent"] is None
    assert cards["startup"]["parent"] == MODEL
    assert cards["startup"]["root"] == adapters.startup
    assert cards["startup"]["object"] == "model"


def test_an_adapter_changes_completions_and_chat(server):
    base = complete(server, MODEL)
    tuned = complete(server, "startup")
    assert tuned != base
    assert complete(server, "startup") == tuned  # greedy: deterministic
    chat = post(server, "/v1/chat/completions", {
        "model": "startup", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0})
    assert chat.status_code == 200 and chat.json()["model"] == "startup"


def test_unknown_adapter_names_are_404(server):
    for path, body in (
        ("/v1/completions", {"model": "nope", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
    ):
        response = post(server, path, body)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert response.status_code == 404
    assert "'nope' cannot be found" in response.json()["error"]["message"]


@pytest.mark.parametrize("attr, reason", [
    ("missing", "does not exist"),
    ("no_config", "adapter_config.json is missing"),
    ("wrong_shapes", "does not fit the base model"),
    ("rank_too_big", "rank 32 exceeds max_lora_rank 16"),
    ("outside", "outside the allowed adapter directory"),
    ("bad_target", "unsupported LoRA target module.*lm_head"),
    ("dora", "DoRA"),
])
def test_bad_adapter_directories_are_400_with_the_reason(server, adapters, attr, reason):
    path = getattr(adapters, attr, os.path.join(adapters.allowed, "missing"))
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and error["type"] == "invalid_request_error"
    assert re.search(reason, error["message"]), error
    assert "bad" not in models(server)


def test_load_requests_that_are_refused(server, adapters):
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "startup",
                                                       "lora_path": adapters.hot})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_name"
    assert "has already been loaded" in response.json()["error"]["message"]
    response = post(server, "/v1/load_lora_adapter", {"lora_name": MODEL,
                                                       "lora_path": adapters.hot})
    assert response.status_code == 400 and "base model" in response.json()["error"]["message"]
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path"


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                  max_tokens: int, first_chunk: asyncio.Event | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    text, finish = "", None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            if first_chunk is not None:
                first_chunk.set()
    return {"text": text, "finish_reason": finish}


def test_load_use_unload_reload_under_concurrent_traffic(server, adapters):
    url = server.url
    other_text = None

    async def scenario() -> None:
        nonlocal other_text
        async with httpx.AsyncClient(timeout=120) as client:
            background = [  # keep base and startup traffic in flight throughout
                asyncio.create_task(_stream(client, url, model, f"Story {i}:", 40))
                for i, model in enumerate([MODEL, "startup", MODEL, "startup"])
            ]
            load = await client.post(url + "/v1/load_lora_adapter",
                                     json={"lora_name": "hot", "lora_path": adapters.hot})
            assert load.status_code == 200, load.text
            assert load.text == "Success: LoRA adapter 'hot' added successfully."
            started = asyncio.Event()
            in_flight = asyncio.create_task(_stream(client, url, "hot", "Once", 30, started))
            await started.wait()
            unload = await client.post(url + "/v1/unload_lora_adapter",
                                       json={"lora_name": "hot"})
            assert unload.status_code == 200, unload.text
            assert "1 request(s) already using it will finish first" in unload.text
            refused = await client.post(url + "/v1/completions", json={
                "model": "hot", "prompt": "x", "max_tokens": 2})
            assert refused.status_code == 404
            # Reload the name with other weights while the old registration still drains.
            reload = await client.post(url + "/v1/load_lora_adapter",
                                       json={"lora_name": "hot", "lora_path": adapters.other})
            assert reload.status_code == 200, reload.text
            other = await client.post(url + "/v1/load_lora_adapter",
                                      json={"lora_name": "other", "lora_path": adapters.other})
            assert other.status_code == 200, other.text
            finished = await in_flight
            assert finished["finish_reason"] == "length" and finished["text"]
            after = await asyncio.gather(
                _stream(client, url, "hot", PROMPT, 12), _stream(client, url, "other", PROMPT, 12),
                _stream(client, url, "startup", PROMPT, 12))
            assert after[0]["text"] == after[1]["text"]  # 'hot' now has other's weights
            other_text = after[1]["text"]
            for result in await asyncio.gather(*background):
                assert result["finish_reason"] == "length" and result["text"]

    asyncio.run(scenario())
    # The prefix cache holds the prompt's KV under the old 'hot' too: the new one must not hit it.
    assert complete(server, "hot") == other_text != complete(server, "startup")
    assert set(models(server)) == {MODEL, "startup", "hot", "other"}

    def settled() -> bool:
        samples = scrape(server)
        return (samples[("flexserve:kv_cache_usage_perc", ())] == 0.0
                and samples[("flexserve:num_requests_running", ())] == 0.0)

    wait_until(settled)
    running, loaded = lora_gauges(server)
    assert running == {"startup": 0.0, "hot": 0.0, "other": 0.0}
    assert loaded["gpu"] == 2.0  # max_loras slots, all holding an adapter
    assert loaded["cpu"] == 2.0  # bounded by max_cpu_loras
    adapters_manager = server.engine.engine.scheduler.adapter_manager
    adapters_manager.check_invariants()
    assert len(adapters_manager._by_id) == 3  # the drained 'hot' was freed

    for name in ("hot", "other"):
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    wait_until(lambda: set(lora_gauges(server)[0]) == {"startup"})
    assert set(models(server)) == {MODEL, "startup"}


def test_lora_requests_running_gauge_counts_in_flight_requests(server):
    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            started = asyncio.Event()
            task = asyncio.create_task(_stream(client, server.url, "startup", "Hi", 40, started))
            await started.wait()
            running, _ = lora_gauges(server)
            assert running["startup"] == 1.0
            await task

    asyncio.run(scenario())
    wait_until(lambda: lora_gauges(server)[0]["startup"] == 0.0)


def test_openapi_documents_the_adapter_routes(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert "/v1/load_lora_adapter" in paths and "/v1/unload_lora_adapter" in paths


# ------------------------------------------------------------------------------------ CLI
def test_cli_lora_options():
    parser = build_parser()
    args = parser.parse_args(["serve"])
    lora = engine_config_from_args(args).lora  # on by default: fine-tuning needs no flag
    assert (lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == (4, 8, 64)
    assert engine_config_from_args(parser.parse_args(["serve", "--no-enable-lora"])).lora is None
    for extra in (["--max-loras", "2"], ["--lora-modules", "a=/x/a"]):
        with pytest.raises(ValueError, match=f"--no-enable-lora turns LoRA off, so {extra[0]}"):
            engine_config_from_args(parser.parse_args(["serve", "--no-enable-lora", *extra]))
    args = parser.parse_args(["serve", "--max-loras", "3"])
    lora = engine_config_from_args(args).lora
    assert (lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == (3, 8, 64)
    args = parser.parse_args([
        "serve", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}', "--max-lora-rank",
        "32", "--max-cpu-loras", "5"])
    lora = engine_config_from_args(args).lora
    assert lora.lora_modules == {"a": "/x/a", "b": "/x/b"}
    assert (lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == (4, 5, 32)
    assert engine_config_from_args(parser.parse_args(["serve", "--enable-lora"])).lora is not None
    for bad, reason in ((["a"], "NAME=PATH"), (["a=/p", "a=/q"], "twice"), (["=/p"], "non-empty"),
                        (["{bad json"], "invalid JSON"), (['{"name": "a"}'], "non-empty")):
        with pytest.raises(ValueError, match=reason):
            parse_lora_modules(bad)


def test_adapter_routes_without_lora_are_400():
    from flexserve.engine.llm_engine import LLMEngine
    from flexserve.engine.model_info import ModelInfo

    class NoModel:
        def execute(self, plan):
            raise AssertionError("no request is run")

    info = ModelInfo(name="fake", vocab_size=10, max_model_len=32, eos_token_id=0, num_blocks=4,
                     block_size=16, device="cpu", dtype="float32")
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(), NoModel(), None, info), log_stats=False)
    app = build_app(engine)
    with TestClient(app) as client:
        response = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"})
        assert response.status_code == 400 and "--no-enable-lora" in response.text
        response = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert response.status_code == 400
        assert client.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 404
        metrics = client.get("/metrics").text
        assert "lora" not in metrics
    engine.shutdown()
