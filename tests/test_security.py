"""The security model: API keys on every `/v1/*` route (several keys, tenants, constant-time
matching), adapter paths confined to --allowed-adapter-dir (no `..`, no symlinked directory or
file escaping it), uploads that are never used as paths, error bodies without traces or server
paths, and CORS off unless origins are allowed."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest
import torch
from starlette.routing import Route

from flexserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai import auth
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.entrypoints.openai.auth import APIKeyTable, bearer_token, read_api_key_file
from flexserve.finetune.service import FinetuneServiceConfig
from flexserve.peft.bypass import target_shapes
from flexserve.peft.lora import LoRAAdapter
from flexserve.peft.peft_io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    load_peft_adapter,
    save_peft_adapter,
)

from _fake_engine import MODEL, FakeExecutor, fake_engine

KEY_FILE = """\
# tenants and their keys
alice:sk-alice-0123456789

bob:sk-bob-9876543210
sk-plain-key-without-tenant
"""


# ---------------------------------------------------------------------------------- API keys
def test_key_file_lines_and_errors(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    assert read_api_key_file(str(path)) == [
        ("sk-alice-0123456789", "alice"), ("sk-bob-9876543210", "bob"),
        ("sk-plain-key-without-tenant", None)]
    table = APIKeyTable.from_sources(["sk-cli"], str(path))
    assert len(table) == 4 and table.tenants == {"alice", "bob"}
    assert table.match(b"sk-alice-0123456789").tenant == "alice"
    assert table.match(b"sk-cli").tenant is None
    for wrong in (b"sk-alice-012345678", b"sk-alice-01234567890", b"", b"SK-CLI"):
        assert table.match(wrong) is None
    assert APIKeyTable.from_sources([], None) is None  # no keys: the API is open
    for content, message in [("alice:\n", "line 1"), ("a b\n", "line 1"),
                             ("ok\nbad tenant!:k\n", "line 2: bad tenant"),
                             ("# nothing\n\n", "holds no keys")]:
        path.write_text(content)
        with pytest.raises(ValueError, match=message) as raised:
            read_api_key_file(str(path))
        assert "sk-" not in str(raised.value)  # never echo a key
    with pytest.raises(ValueError, match="twice"):
        APIKeyTable([("k1", "alice"), ("k1", "bob")])
    with pytest.raises(ValueError, match="cannot read"):
        read_api_key_file(str(tmp_path / "missing"))


def test_bearer_parsing():
    assert bearer_token(b"Bearer sk-1") == b"sk-1"
    assert bearer_token(b"bearer  sk-1 ") == b"sk-1"
    for header in (None, b"Basic sk-1", b"Bearer ", b"Bearersk-1", b"sk-1"):
        assert bearer_token(header) is None


def test_matching_compares_every_key_on_equal_length_digests(monkeypatch):
    table = APIKeyTable([(f"sk-{i}" * (i + 1), f"t{i}") for i in range(5)])
    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    assert table.match(b"sk-0").tenant == "t0"  # the first key matches...
    assert len(calls) == 5  # ...and the other four are compared all the same
    assert table.match(b"nope") is None and len(calls) == 10
    assert {lengths for lengths in calls} == {(32, 32)}  # digests: no length leaks


# ------------------------------------------------------------------------- keys over HTTP
@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    from _tokenizer import tiny_byte_level_tokenizer

    state_dir = tmp_path_factory.mktemp("state")
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(KEY_FILE)
    key_file.chmod(0o600)
    engine = fake_engine(FakeExecutor(), tokenizer=tiny_byte_level_tokenizer())
    app = build_app(engine, api_keys=APIKeyTable.from_sources(None, str(key_file)),
                    finetune=FinetuneServiceConfig(state_dir=str(state_dir)))
    thread = ServerThread(app)
    url = thread.start()
    yield url, app, str(state_dir)
    thread.stop()
    engine.shutdown()


def v1_operations(app) -> list[tuple[str, str]]:
    """(method, path with parameters filled in) of every /v1 route the app serves."""
    operations = []
    for route in app.routes:
        if isinstance(route, Route) and route.path.startswith("/v1/"):
            path = re.sub(r"\{[^}]+\}", "x", route.path)
            operations += [(method, path) for method in sorted(route.methods - {"HEAD"})]
    return operations


def test_every_v1_route_needs_a_valid_key(keyed):
    url, app, _ = keyed
    operations = v1_operations(app)
    paths = {path for _, path in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/files",
            "/v1/fine_tuning/jobs", "/v1/load_lora_adapter"} <= paths
    bad_headers = [{}, {"Authorization": "Bearer sk-wrong"},
                   {"Authorization": "Bearer sk-alice-012345678"},  # a prefix of a key
                   {"Authorization": "Basic sk-alice-0123456789"},
                   {"Authorization": "Bearer"}, {"Authorization": "sk-alice-0123456789"}]
    for method, path in operations:
        for headers in bad_headers:
            response = httpx.request(method, url + path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == "invalid_api_key"
        good = httpx.request(method, url + path, json={},
                             headers={"Authorization": "Bearer sk-bob-9876543210"})
        assert good.status_code != 401, (method, path)
    for path in ("/health", "/metrics", "/version", "/openapi.json"):  # probes need no key
        assert httpx.get(url + path).status_code == 200


def test_uploads_are_stored_by_id_and_never_used_as_paths(keyed, tmp_path):
    url, _, state_dir = keyed
    headers = {"Authorization": "Bearer sk-alice-0123456789"}
    line = json.dumps({"prompt": "a", "completion": " b"}).encode() + b"\n"
    evil = "../../../../" + str(tmp_path / "escaped.jsonl").lstrip("/")
    response = httpx.post(url + "/v1/files", headers=headers, data={"purpose": "fine-tune"},
                          files={"file": (evil, line)})
    assert response.status_code == 200, response.text
    record = response.json()
    assert record["filename"] == "escaped.jsonl"  # its last component, for display only
    assert not (tmp_path / "escaped.jsonl").exists()
    stored = [name for _, _, names in os.walk(state_dir) for name in names
              if name.endswith(".jsonl")]
    assert stored == [f"{record['id']}.jsonl"]
    content = httpx.get(url + f"/v1/files/{record['id']}/content", headers=headers)
    assert content.content == line
    for probe in ("..%2F..%2Fstate.sqlite3", "%2E%2E", "..%2Ffiles%2F" + record["id"],
                  record["id"] + "%00"):
        for suffix in ("", "/content"):
            response = httpx.get(url + f"/v1/files/{probe}{suffix}", headers=headers)
            assert response.status_code == 404, probe
            assert state_dir not in response.text


def test_errors_hide_traces_and_server_paths(keyed, monkeypatch):
    url, app, _ = keyed

    async def explode(body, raw_request):
        raise RuntimeError("cannot open /srv/flexserve/secret.bin")

    monkeypatch.setattr(app.state.completions, "create_completion", explode)
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1]},
                          headers={"Authorization": "Bearer sk-bob-9876543210"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "/srv" not in response.text and "Traceback" not in response.text
    assert "RuntimeError" not in response.text
    error_id = response.headers["x-request-id"]
    assert error_id.startswith("err-") and error_id in error["message"]


# ----------------------------------------------------------------------------------- CORS
def test_cors_is_off_unless_origins_are_allowed():
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    for origins, expected in [((), None), (("https://ui.example",), "https://ui.example")]:
        engine = fake_engine(FakeExecutor())
        thread = ServerThread(build_app(engine, api_key="sk-1", allowed_origins=origins))
        url = thread.start()
        try:
            response = httpx.options(url + "/v1/completions", headers=preflight)
            assert response.headers.get("access-control-allow-origin") == expected
            other = httpx.options(url + "/v1/completions",
                                  headers={**preflight, "Origin": "https://evil.example"})
            assert "access-control-allow-origin" not in other.headers
            simple = httpx.get(url + "/v1/models", headers={
                "Origin": "https://ui.example", "Authorization": "Bearer sk-1"})
            assert simple.status_code == 200
            assert simple.headers.get("access-control-allow-origin") == expected
        finally:
            thread.stop()
            engine.shutdown()


# ------------------------------------------------------------------------------ adapter paths
@pytest.fixture(scope="module")
def tiny(tiny_config, tiny_checkpoint):
    config = tiny_config("llama")
    return config, tiny_checkpoint(config, seed=3)


def write_adapter(path, hf_config) -> str:
    adapter = LoRAAdapter.create(target_shapes(hf_config), hf_config.num_hidden_layers, 4, 8,
                                 ("q_proj", "v_proj"), generator=torch.Generator().manual_seed(0))
    save_peft_adapter(adapter, str(path))
    return str(path)


@pytest.fixture(scope="module")
def adapter_dirs(tiny, tmp_path_factory):
    """allowed/{good, dir-link -> outside, file-links/*, config-link/*}, outside/adapter."""
    hf_config, _ = tiny
    root = tmp_path_factory.mktemp("adapters")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    write_adapter(allowed / "good", hf_config)
    write_adapter(outside / "adapter", hf_config)
    os.symlink(outside / "adapter", allowed / "dir-link")
    os.symlink(allowed / "good", allowed / "inner-link")  # stays inside: fine
    (allowed / "weights-link").mkdir()  # a real directory whose weights link outside
    os.symlink(outside / "adapter" / ADAPTER_WEIGHTS_NAME,
               allowed / "weights-link" / ADAPTER_WEIGHTS_NAME)
    os.symlink(allowed / "good" / ADAPTER_CONFIG_NAME,
               allowed / "weights-link" / ADAPTER_CONFIG_NAME)
    (allowed / "config-link").mkdir()  # its config links outside
    os.symlink(outside / "adapter" / ADAPTER_CONFIG_NAME,
               allowed / "config-link" / ADAPTER_CONFIG_NAME)
    os.symlink(allowed / "good" / ADAPTER_WEIGHTS_NAME,
               allowed / "config-link" / ADAPTER_WEIGHTS_NAME)
    return allowed, outside


ESCAPES = ["../outside/adapter", "dir-link", "weights-link", "config-link",
           "good/../../outside/adapter"]


def test_adapter_paths_escaping_the_allowed_dir_are_refused(adapter_dirs):
    allowed, outside = adapter_dirs
    for name in ("good", "inner-link"):
        assert load_peft_adapter(str(allowed / name), allowed_dir=str(allowed)).rank == 4
    for name in ESCAPES:
        with pytest.raises(ValueError, match="outside the allowed adapter directory") as e:
            load_peft_adapter(str(allowed / name), allowed_dir=str(allowed))
        # it names the path as the client gave it, never where it resolved or the allowed dir
        message = str(e.value).replace(repr(str(allowed / name)), "<given>")
        assert str(allowed) not in message and str(outside) not in message
    # without an allowed directory, the same links load (nothing to confine them to)
    assert load_peft_adapter(str(allowed / "weights-link")).rank == 4


def test_load_lora_adapter_route_refuses_escapes(tiny, adapter_dirs):
    _, model_dir = tiny
    allowed, outside = adapter_dirs
    config = EngineConfig(model=ModelConfig(model=model_dir, max_model_len=64),
                          cache=CacheConfig(kv_cache_gib=0.01),
                          lora=LoRAConfig(max_loras=1, max_lora_rank=8,
                                          allowed_adapter_dir=str(allowed)))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    try:
        for index, name in enumerate(ESCAPES):
            response = httpx.post(url + "/v1/load_lora_adapter", json={
                "lora_name": f"escape-{index}", "lora_path": str(allowed / name)})
            assert response.status_code == 400, name
            assert "outside the allowed adapter directory" in response.json()["error"]["message"]
            assert str(outside) not in response.text
        ok = httpx.post(url + "/v1/load_lora_adapter",
                        json={"lora_name": "good", "lora_path": str(allowed / "good")})
        assert ok.status_code == 200
        names = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert names[1:] == ["good"]
    finally:
        thread.stop()
        engine.shutdown()
