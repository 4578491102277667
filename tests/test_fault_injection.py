"""The probes of an attacker and a careless client, kept as regression tests.

On a tiny random Llama (CPU, byte-level tokenizer) with two tenants' keys and an admin key:
adapters loaded through the API belong to their tenant (no hijack, no listing, no server paths,
nothing in /metrics), fine-tuning inputs with huge or missing-but-revealing values are 400s,
non-finite numbers and huge integers anywhere are 400s, a 500 closes its connection, 405 names
every method. On the fake engine: admission charges sequences and tokens per tenant, the `user`
field never changes the account, and tokenization runs off the event loop (`/health` answers
while a tokenizer call is held).
"""

from __future__ import annotations

import copy
import json
import math
import threading

import httpx
import pytest
import torch

from flexserve.config import (
    CacheConfig,
    CoserveConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
)
from flexserve.engine.divergence import COLLAPSED_STEPS, collapsed_reason
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.entrypoints.openai.auth import APIKeyTable
from flexserve.entrypoints.openai.limits import AdmissionLimits
from flexserve.finetune.service import FinetuneServiceConfig
from flexserve.peft.bypass import target_shapes
from flexserve.peft.lora import LoRAAdapter
from flexserve.peft.peft_io import save_peft_adapter

from _fake_engine import MODEL as FAKE_MODEL
from _fake_engine import FakeExecutor, fake_engine, wait_until
from _tokenizer import tiny_byte_level_tokenizer

MODEL = "tiny"
ALICE, BOB, ADMIN = "sk-alice-1", "sk-bob-1", "sk-admin-1"
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def write_adapter(path, hf_config, seed: int = 0) -> str:
    adapter = LoRAAdapter.create(target_shapes(hf_config), hf_config.num_hidden_layers, 4, 8,
                                 ("q_proj", "v_proj"),
                                 generator=torch.Generator().manual_seed(seed))
    save_peft_adapter(adapter, str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tiny_config, tiny_checkpoint, tmp_path_factory):
    config = tiny_config("llama", vocab_size=320, max_position_embeddings=128)
    model_dir = tiny_checkpoint(config, seed=7)
    tiny_byte_level_tokenizer().save_pretrained(model_dir)
    root = tmp_path_factory.mktemp("adapters")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    return {"model_dir": model_dir, "allowed": allowed, "outside": outside,
            "alice": write_adapter(allowed / "alice", config, 1),
            "bob": write_adapter(allowed / "bob", config, 2),
            "shared": write_adapter(allowed / "shared", config, 3),
            "elsewhere": write_adapter(outside / "adapter", config, 4)}


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    config = EngineConfig(
        model=ModelConfig(model=tiny["model_dir"], max_model_len=128),
        cache=CacheConfig(kv_cache_gib=0.01),
        lora=LoRAConfig(max_loras=3, max_lora_rank=4, allowed_adapter_dir=str(tiny["allowed"]),
                        lora_modules={"shared": tiny["shared"]}),
        coserve=CoserveConfig(slo_tpot_ms=None))
    engine = build_async_engine(config, log_stats=False)
    keys = APIKeyTable([(ALICE, "alice"), (BOB, "bob")], admin_keys=[ADMIN])
    state_dir = str(tmp_path_factory.mktemp("state"))
    app = build_app(engine, served_model_name=MODEL, api_keys=keys,
                    finetune=FinetuneServiceConfig(state_dir=state_dir))
    thread = ServerThread(app)
    url = thread.start()
    yield {"url": url, "app": app, "state_dir": state_dir}
    thread.stop()
    engine.shutdown()


def post(server, key: str, route: str, body=None, content: bytes | None = None,
         **kwargs) -> httpx.Response:
    if content is not None:
        return httpx.post(server["url"] + route, content=content, timeout=60,
                          headers={**auth(key), "Content-Type": "application/json"}, **kwargs)
    return httpx.post(server["url"] + route, json=body, headers=auth(key), timeout=60, **kwargs)


def model_ids(server, key: str) -> dict[str, str | None]:
    response = httpx.get(server["url"] + "/v1/models", headers=auth(key))
    assert response.status_code == 200
    return {card["id"]: card["root"] for card in response.json()["data"]}


def load(server, key: str, name: str, path: str) -> httpx.Response:
    return post(server, key, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload(server, key: str, name: str) -> httpx.Response:
    return post(server, key, "/v1/unload_lora_adapter", {"lora_name": name})


def complete(server, key: str, model: str, **extra) -> httpx.Response:
    return post(server, key, "/v1/completions",
                {"model": model, "prompt": "the quick", "max_tokens": 2, **extra})


# ------------------------------------------------------------------------------ adapters
def test_an_adapter_a_tenant_loads_is_its_own(server, tiny):
    assert load(server, ALICE, "mine", tiny["alice"]).status_code == 200
    assert complete(server, ALICE, "mine").status_code == 200
    # Bob can neither use, unload, replace nor see it: exactly an unknown name to him.
    for name in ("mine", "never-loaded"):
        response = complete(server, BOB, name)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
    hijack, unknown = unload(server, BOB, "mine"), unload(server, BOB, "never-loaded")
    assert hijack.status_code == unknown.status_code == 404
    assert hijack.json() == json.loads(unknown.text.replace("never-loaded", "mine"))
    replace = load(server, BOB, "mine", tiny["bob"])
    assert replace.status_code == 404 and replace.json()["error"]["param"] == "lora_name"
    assert "mine" not in model_ids(server, BOB)
    assert complete(server, ALICE, "mine").status_code == 200  # still Alice's weights

    # Listings carry no server paths for tenants; the admin key sees them.
    alice_models = model_ids(server, ALICE)
    assert alice_models == {MODEL: MODEL, "shared": None, "mine": None}
    admin_models = model_ids(server, ADMIN)
    assert admin_models["mine"] == tiny["alice"] and admin_models["shared"] == tiny["shared"]
    assert admin_models[MODEL] == tiny["model_dir"]

    # Nothing anyone can read without a key names a tenant's adapter or a path.
    assert complete(server, ALICE, "mine").status_code == 200
    metrics = httpx.get(server["url"] + "/metrics").text
    assert 'lora_name="private"' in metrics and 'lora_name="shared"' in metrics
    assert "mine" not in metrics and str(tiny["allowed"]) not in metrics

    # Once Alice unloads it, the name is free.
    assert unload(server, ALICE, "mine").status_code == 200
    assert load(server, BOB, "mine", tiny["bob"]).status_code == 200
    assert "mine" not in model_ids(server, ALICE)
    assert unload(server, BOB, "mine").status_code == 200


def test_shared_adapters_are_the_admins(server, tiny):
    response = unload(server, BOB, "shared")
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
    assert complete(server, BOB, "shared").status_code == 200
    assert unload(server, ADMIN, "shared").status_code == 200
    assert load(server, ADMIN, "shared", tiny["shared"]).status_code == 200
    assert "shared" in model_ids(server, BOB)  # an admin's adapter serves every tenant


def test_adapter_names_are_checked(server, tiny):
    for name in ("ft:tiny:x:ftjob-0000", "ft:other", "evil\u202eexe", "nul\x00", " ", "a" * 300):
        response = load(server, BOB, name, tiny["bob"])
        assert response.status_code in (400, 404), name
        assert response.status_code != 404 or name.startswith("ft:tiny:")
    assert set(model_ids(server, BOB)) == {MODEL, "shared"}


def test_init_adapter_reveals_nothing_and_obeys_the_adapter_dir(server, tiny):
    file_id = httpx.post(server["url"] + "/v1/files", headers=auth(BOB),
                         files={"file": ("b.jsonl", b'{"text": "the quick brown fox"}\n')},
                         data={"purpose": "fine-tune"}).json()["id"]
    assert load(server, ALICE, "alices", tiny["alice"]).status_code == 200

    def create(init: str) -> httpx.Response:
        return post(server, BOB, "/v1/fine_tuning/jobs", {
            "model": MODEL, "training_file": file_id, "lora": {**LORA, "init_adapter": init}})

    answers = {}
    for what, init in (("missing", str(tiny["outside"] / "missing")),
                       ("outside", tiny["elsewhere"]),
                       ("another tenant's name", "alices")):
        response = create(init)
        assert response.status_code == 400, what
        answers[what] = response.json()["error"]["message"].replace(repr(init), "<init>")
        assert response.json()["error"]["param"] == "lora.init_adapter"
    assert len(set(answers.values())) == 1, answers
    assert unload(server, ALICE, "alices").status_code == 200


def test_job_suffixes_and_hyperparameters_are_bounded(server):
    file_id = httpx.post(server["url"] + "/v1/files", headers=auth(BOB),
                         files={"file": ("c.jsonl", b'{"text": "jumps over the lazy dog"}\n')},
                         data={"purpose": "fine-tune"}).json()["id"]
    cases = [
        ({"hyperparameters": {"seed": 2**63}}, "hyperparameters.seed"),
        ({"seed": 2**63}, "seed"),
        ({"hyperparameters": {"n_epochs": 1_000_000}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"batch_size": 10**9}}, "hyperparameters.batch_size"),
        ({"hyperparameters": {"warmup_steps": 10**12}}, "hyperparameters.warmup_steps"),
        ({"hyperparameters": {"learning_rate": "1e400"}}, "hyperparameters.learning_rate"),
        ({"suffix": "a\x00b"}, "suffix"),
        ({"suffix": "evil\u202eexe"}, "suffix"),
    ]
    for extra, param in cases:
        body = json.dumps({"model": MODEL, "training_file": file_id, "lora": LORA, **extra})
        response = post(server, BOB, "/v1/fine_tuning/jobs",
                        content=body.replace('"1e400"', "1e400").encode())
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.json())


@pytest.mark.parametrize("line", [
    b'{"text": "a\\ud800b"}', b'{"text": "x", "extra": NaN}', b'{"text": "x", "w": 1e400}',
    b'{"prompt": "\\udfff", "completion": "y"}',
])
def test_uploads_with_broken_text_or_numbers_are_400(server, line):
    response = httpx.post(server["url"] + "/v1/files", headers=auth(BOB),
                          files={"file": ("bad.jsonl", b'{"text": "fine"}\n' + line + b"\n")},
                          data={"purpose": "fine-tune"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_file_format" and "line 2" in error["message"]


# ------------------------------------------------------------------------------ bad values
BAD_BODIES = [
    (b'"temperature": NaN', "temperature"), (b'"temperature": Infinity', "temperature"),
    (b'"temperature": 1e400', "temperature"), (b'"temperature": -Infinity', "temperature"),
    (b'"repetition_penalty": NaN', "repetition_penalty"),
    (b'"repetition_penalty": Infinity', "repetition_penalty"),
    (b'"top_p": NaN', "top_p"), (b'"presence_penalty": 1e999', "presence_penalty"),
    (b'"seed": 99999999999999999999999', "seed"), (b'"top_k": 1e400', "top_k"),
    (b'"stop_token_ids": [1, 36893488147419103232]', "stop_token_ids.1"),
    (b'"logit_bias": {"1": NaN}', "logit_bias.1"),
]


@pytest.mark.parametrize(("field", "param"), BAD_BODIES)
def test_non_finite_and_huge_numbers_are_400(server, field, param):
    for route, base in (("/v1/completions", b'"prompt": "hi"'),
                        ("/v1/chat/completions",
                         b'"messages": [{"role": "user", "content": "hi"}]')):
        body = b'{"model": "tiny", ' + base + b", " + field + b"}"
        response = post(server, ALICE, route, content=body)
        assert response.status_code == 400, (route, field, response.text)
        assert response.json()["error"]["param"] == param


def test_huge_token_ids_and_lone_surrogates_are_400(server):
    for body in (b'{"model": "tiny", "prompt": [1, 2, 18446744073709551616]}',
                 b'{"model": "tiny", "prompt": "a\\ud800b"}',
                 b'{"model": "tiny", "prompt": [[1, 2]], "user": "\\udc00"}'):
        response = post(server, ALICE, "/v1/completions", content=body)
        assert response.status_code == 400, (body, response.text)


def test_a_500_closes_its_connection_and_the_next_request_works(server, monkeypatch):
    state = server["app"].state

    async def broken(request, raw_request):
        raise RuntimeError("/secret/path exploded")

    monkeypatch.setattr(state.completions, "create_completion", broken)
    with httpx.Client(base_url=server["url"], headers=auth(ALICE), timeout=60) as client:
        failed = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert failed.status_code == 500
        assert failed.headers["connection"] == "close"
        assert failed.json()["error"]["code"] == "internal_error"
        assert "/secret" not in failed.text
        assert failed.headers["x-request-id"] in failed.json()["error"]["message"]
        # The pooled client opens a new connection instead of reusing a dead one.
        assert client.get("/v1/models").status_code == 200


def test_405_lists_every_method_of_the_path(server):
    for method, path, allowed in (("PUT", "/v1/files", {"GET", "HEAD", "POST"}),
                                  ("POST", "/v1/files/file-x", {"DELETE", "GET", "HEAD"}),
                                  ("GET", "/v1/completions", {"POST"})):
        response = httpx.request(method, server["url"] + path, headers=auth(ALICE))
        assert response.status_code == 405
        assert set(response.headers["allow"].split(", ")) == allowed
        assert response.json()["error"]["code"] == "method_not_allowed"


def test_openapi_states_the_sampling_ranges(server):
    document = httpx.get(server["url"] + "/openapi.json").json()
    fields = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["temperature"]["minimum"] == 0
    assert (fields["top_p"]["exclusiveMinimum"], fields["top_p"]["maximum"]) == (0, 1)
    assert (fields["presence_penalty"]["minimum"], fields["presence_penalty"]["maximum"]) == (
        -2, 2)
    assert fields["repetition_penalty"]["exclusiveMinimum"] == 0
    assert fields["max_tokens"]["minimum"] == 0  # 0 with echo: the prompt's logprobs only
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_completion_tokens"]["minimum"] == 1
    assert fields["n"]["anyOf"][0]["maximum"] == 128
    # every integer states the 64-bit range the server accepts
    assert fields["top_k"]["anyOf"][0]["maximum"] == 2**63 - 1
    # token ids: the model's vocabulary; new tokens: the context
    token_ids = fields["prompt"]["anyOf"][2]["items"]
    models = httpx.get(server["url"] + "/v1/models", headers=auth(ALICE)).json()
    assert token_ids["minimum"] == 0 and 0 < token_ids["maximum"] < 2**20
    assert fields["max_tokens"]["maximum"] == models["data"][0]["max_model_len"] - 1


# --------------------------------------------------------------------- admission by cost
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")


@pytest.fixture
def fake_server():
    executor = FakeExecutor()
    tokenizer = copy.deepcopy(tiny_byte_level_tokenizer())  # the cached one stays as it is
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = fake_engine(executor, tokenizer=tokenizer, max_model_len=256)
    keys = APIKeyTable([(ALICE, "alice"), (BOB, "bob")])
    limits = AdmissionLimits(max_num_requests=64, max_num_sequences=40,
                             max_num_sequences_per_tenant=8, max_num_tokens_per_tenant=400)
    app = build_app(engine, api_keys=keys, limits=limits)
    thread = ServerThread(app)
    url = thread.start()
    yield url, executor, engine, app.state.admission
    executor.gate.set()
    thread.stop()
    engine.shutdown()


def fake_complete(url: str, key: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=auth(key), timeout=60,
                      json={"model": FAKE_MODEL, "max_tokens": 4, **body})


def test_admission_charges_sequences_and_tokens_per_tenant(fake_server):
    url, executor, _, admission = fake_server
    # Alone over a limit: it could never run, so it is a 400, not a 429.
    alone = fake_complete(url, ALICE, prompt=[[1, 2]] * 3, n=3)
    assert alone.status_code == 400 and alone.json()["error"]["code"] == "request_too_large"
    alone = fake_complete(url, ALICE, prompt=[1] * 200, max_tokens=4, n=2)  # 408 tokens
    assert alone.status_code == 400
    many = fake_complete(url, ALICE, prompt=[[1, 2]] * 50_000, n=16, max_tokens=1)
    assert many.status_code == 400 and many.json()["error"]["param"] == "prompt"

    executor.gate.clear()  # requests stay in flight
    held: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: held.append(
        fake_complete(url, ALICE, prompt=[[1, 2]] * 2, n=3)))]  # 6 sequences, 36 tokens
    threads[0].start()
    try:
        wait_until(lambda: admission.tenant_tokens["alice"] == 36, what="alice's request held")
        assert admission.tenant_sequences["alice"] == 6
        over = fake_complete(url, ALICE, prompt=[[3, 4]] * 3)  # 6 + 3 > 8 sequences
        assert over.status_code == 429
        assert over.json()["error"]["code"] == "tenant_rate_limit_exceeded"
        assert int(over.headers["retry-after"]) >= 1
        threads.append(threading.Thread(target=lambda: held.append(
            fake_complete(url, BOB, prompt=[5]))))
        threads[1].start()  # another tenant's share is its own
        wait_until(lambda: admission.tenant_tokens["bob"] == 5, what="bob's request held")
    finally:
        executor.gate.set()
        for thread in threads:
            thread.join(60)
    assert sorted(r.status_code for r in held) == [200, 200]
    wait_until(lambda: not admission.tenant_sequences, what="every sequence released")
    assert not admission.tenant_tokens and admission.num_sequences_in_flight == 0
    assert fake_complete(url, ALICE, prompt=[[3, 4]] * 3).status_code == 200


def test_the_user_field_never_changes_the_account(fake_server):
    url, executor, _, _ = fake_server
    response = fake_complete(url, ALICE, prompt=[1, 2], user="bob")
    assert response.status_code == 200
    request_id = response.json()["id"]
    tenants = {tenant for rid, tenant in executor.tenants.items() if rid.startswith(request_id)}
    assert tenants == {"alice"}


def test_tokenization_runs_off_the_event_loop(fake_server, monkeypatch):
    url, _, engine, _ = fake_server
    tokenizer = engine.engine.input_processor.tokenizer
    entered, release = threading.Event(), threading.Event()
    real_encode = tokenizer.encode

    def held_encode(text, *args, **kwargs):
        if text.startswith("HOLD"):
            entered.set()
            release.wait(60)
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    answers = []
    thread = threading.Thread(target=lambda: answers.append(
        fake_complete(url, ALICE, prompt="HOLD the line")))
    thread.start()
    try:
        assert entered.wait(60)
        # The tokenizer is busy with that prompt, yet the server answers.
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        assert fake_complete(url, BOB, prompt=[1, 2]).status_code == 200
    finally:
        release.set()
        thread.join(60)
    assert answers[0].status_code == 200


def test_a_10mb_prompt_is_refused_without_tokenizing_it(fake_server, monkeypatch):
    url, _, engine, _ = fake_server
    tokenizer = engine.engine.input_processor.tokenizer
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or [1])
    prompt = "word " * (9 * 1024 * 1024 // 5)  # 9 MB: under the 10 MB body limit
    response = fake_complete(url, ALICE, prompt=prompt)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    chat = httpx.post(url + "/v1/chat/completions", headers=auth(ALICE), timeout=60, json={
        "model": FAKE_MODEL, "messages": [{"role": "user", "content": prompt}]})
    assert chat.status_code == 400
    assert calls == []


# ------------------------------------------------------------------------------ divergence
def test_a_collapsed_job_is_diverged():
    vocab = 320
    uniform = math.log(vocab)
    assert collapsed_reason([uniform] * COLLAPSED_STEPS, [0.0] * COLLAPSED_STEPS, vocab)
    assert collapsed_reason([uniform] * COLLAPSED_STEPS, [0.0] * COLLAPSED_STEPS, None) is None
    # fewer steps, a moving gradient, or a loss away from ln(vocab): still learning
    assert collapsed_reason([uniform] * 2, [0.0] * 2, vocab) is None
    assert collapsed_reason([uniform] * 3, [0.0, 1e-3, 0.0], vocab) is None
    assert collapsed_reason([uniform - 0.5] * 3, [0.0] * 3, vocab) is None


def test_a_job_at_a_huge_learning_rate_fails_instead_of_succeeding(server):
    file_id = httpx.post(server["url"] + "/v1/files", headers=auth(BOB),
                         files={"file": ("d.jsonl", b'{"text": "the quick brown fox jumps"}\n')},
                         data={"purpose": "fine-tune"}).json()["id"]
    job = post(server, BOB, "/v1/fine_tuning/jobs", {
        "model": MODEL, "training_file": file_id, "lora": LORA, "seed": 3,
        "hyperparameters": {"learning_rate": 1e30, "n_epochs": 8, "batch_size": 1}}).json()
    url = f"{server['url']}/v1/fine_tuning/jobs/{job['id']}"
    wait_until(lambda: httpx.get(url, headers=auth(BOB)).json()["status"] in (
        "succeeded", "failed", "cancelled"), timeout=120, what="the job ended")
    done = httpx.get(url, headers=auth(BOB)).json()
    assert done["status"] == "failed", done
    assert done["error"]["code"] == "training_failed"
    # a finite loss of ln(320) with a zero gradient: the collapse, not a NaN
    assert "uniform distribution" in done["error"]["message"], done["error"]
    assert f"{math.log(320):.4f}" in done["error"]["message"]
