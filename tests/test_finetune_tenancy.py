"""Tenant isolation of the files and fine-tuning jobs API over HTTP, with the `openai` client: a
server with per-tenant API keys (a tiny random Llama on CPU with a byte-level tokenizer). Each
tenant lists only its own files and jobs; every route on another tenant's file or job answers
exactly what an unknown id answers; a job cannot train on another tenant's file; two keys of one
tenant see the same things; the fine-tuned models are served to every tenant. Without API keys
everything belongs to the one default tenant, as before tenancy.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from flexserve.config import CacheConfig, CoserveConfig, EngineConfig, LoRAConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.entrypoints.openai.auth import APIKeyTable
from flexserve.finetune.service import FinetuneServiceConfig

from _tokenizer import tiny_byte_level_tokenizer

MODEL = "tiny"
KEYS = {"alice": "sk-alice-1", "alice2": "sk-alice-2", "bob": "sk-bob-1", "plain": "sk-plain"}
KEY_FILE = "alice:sk-alice-1\nalice:sk-alice-2\nbob:sk-bob-1\nsk-plain\n"
UNKNOWN_FILE, UNKNOWN_JOB = "file-" + "0" * 24, "ftjob-" + "0" * 24
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def jsonl(*texts: str) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


@pytest.fixture(scope="module")
def model_dir(tiny_config, tiny_checkpoint):
    path = tiny_checkpoint(tiny_config("llama", vocab_size=320, max_position_embeddings=128),
                           seed=5)
    tiny_byte_level_tokenizer().save_pretrained(path)
    return path


def start_server(model_dir: str, state_dir: str, api_keys: APIKeyTable | None):
    config = EngineConfig(model=ModelConfig(model=model_dir, max_model_len=128),
                          cache=CacheConfig(kv_cache_gib=0.01),
                          lora=LoRAConfig(max_loras=2, max_lora_rank=4),
                          coserve=CoserveConfig(slo_tpot_ms=None))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name=MODEL, api_keys=api_keys,
                                    finetune=FinetuneServiceConfig(state_dir=state_dir)))
    return engine, thread, thread.start()


@pytest.fixture(scope="module")
def clients(model_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(KEY_FILE)
    key_file.chmod(0o600)
    engine, thread, url = start_server(model_dir, str(tmp_path_factory.mktemp("state")),
                                       APIKeyTable.from_sources(None, str(key_file)))
    yield {name: openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
           for name, key in KEYS.items()}
    thread.stop()
    engine.shutdown()


def wait_for(client, job_id: str, predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate(job := client.fine_tuning.jobs.retrieve(job_id)):
        assert time.monotonic() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.05)
    return job


def error_of(call, *args, **kwargs) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        call(*args, **kwargs)
    return e.value.status_code, e.value.body


def same_as_unknown(call, other_id: str, unknown_id: str, **kwargs) -> tuple[int, dict]:
    """`call` on another tenant's id answers what it answers for an unknown id (the id aside)."""
    status, body = error_of(call, other_id, **kwargs)
    unknown_status, unknown_body = error_of(call, unknown_id, **kwargs)
    assert (status, body) == (unknown_status,
                              json.loads(json.dumps(unknown_body).replace(unknown_id, other_id)))
    return status, body


def test_each_tenant_sees_and_touches_only_its_own_files_and_jobs(clients):
    alice, alice2, bob, plain = (clients[name] for name in ("alice", "alice2", "bob", "plain"))
    file_a = alice.files.create(file=("a.jsonl", jsonl("alice's private notes")),
                                purpose="fine-tune")
    file_b = bob.files.create(file=("b.jsonl", jsonl("the quick brown fox", "bob's data")),
                              purpose="fine-tune")
    file_d = plain.files.create(file=("d.jsonl", jsonl("no tenant")), purpose="fine-tune")
    assert [f.id for f in alice.files.list().data] == [file_a.id]
    assert [f.id for f in alice2.files.list().data] == [file_a.id]  # one tenant, two keys
    assert [f.id for f in bob.files.list().data] == [file_b.id]
    assert [f.id for f in plain.files.list().data] == [file_d.id]  # the default tenant
    assert alice2.files.content(file_a.id).read() == jsonl("alice's private notes")

    for other, own in ((bob, file_a.id), (alice, file_b.id), (plain, file_a.id)):
        for call in (other.files.retrieve, other.files.delete):
            status, body = same_as_unknown(call, own, UNKNOWN_FILE)
            assert status == 404 and body["code"] == "not_found"
        status, _ = same_as_unknown(lambda file_id: other.files.content(file_id).read(), own,
                                    UNKNOWN_FILE)
        assert status == 404
        same_as_unknown(lambda file_id: other.files.list(after=file_id), own, UNKNOWN_FILE)
    assert alice.files.retrieve(file_a.id).id == file_a.id  # nothing was deleted

    # A job trains on its own tenant's files only: another's is a missing file.
    for param in ("training_file", "validation_file"):
        files = {"training_file": file_b.id, param: file_a.id}
        status, body = same_as_unknown(
            lambda file_id: bob.fine_tuning.jobs.create(
                model=MODEL, **{**files, param: file_id}, extra_body={"lora": LORA}),
            file_a.id, UNKNOWN_FILE)
        assert status == 400 and body["param"] == param

    long_job = alice.fine_tuning.jobs.create(model=MODEL, training_file=file_a.id, seed=1,
                                             hyperparameters={"n_epochs": 1000},
                                             extra_body={"lora": LORA})
    assert long_job.organization_id == "org-alice"
    wait_for(alice, long_job.id, lambda j: j.status == "running")
    bob_job = bob.fine_tuning.jobs.create(model=MODEL, training_file=file_b.id, seed=2,
                                          hyperparameters={"n_epochs": 2, "batch_size": 2},
                                          suffix="bob", extra_body={"lora": LORA})
    assert [j.id for j in alice.fine_tuning.jobs.list().data] == [long_job.id]
    assert [j.id for j in alice2.fine_tuning.jobs.list().data] == [long_job.id]
    assert [j.id for j in bob.fine_tuning.jobs.list().data] == [bob_job.id]
    assert plain.fine_tuning.jobs.list().data == []
    assert alice2.fine_tuning.jobs.retrieve(long_job.id).status == "running"

    jobs = bob.fine_tuning.jobs
    for call in (jobs.retrieve, jobs.cancel, jobs.list_events, jobs.checkpoints.list):
        status, body = same_as_unknown(call, long_job.id, UNKNOWN_JOB)
        assert status == 404 and body["code"] == "not_found"
    same_as_unknown(lambda job_id: jobs.list(after=job_id), long_job.id, UNKNOWN_JOB)
    assert alice.fine_tuning.jobs.retrieve(long_job.id).status == "running"  # not cancelled
    status, body = error_of(alice.files.delete, file_a.id)  # its own running job uses it
    assert status == 400 and body["code"] == "file_in_use" and long_job.id in body["message"]

    cancelled = alice2.fine_tuning.jobs.cancel(long_job.id)  # either key of the tenant
    assert cancelled.status == "cancelled"
    done = wait_for(bob, bob_job.id, lambda j: j.status in ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    # A fine-tuned model is its tenant's: to another tenant it is an unknown model.
    answer = bob.completions.create(model=done.fine_tuned_model, prompt="the quick",
                                    max_tokens=3, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    assert done.fine_tuned_model in {m.id for m in bob.models.list().data}
    for client in (alice, plain):
        status, body = error_of(client.completions.create, model=done.fine_tuned_model,
                                prompt="the quick", max_tokens=3)
        assert status == 404 and body["code"] == "model_not_found"
        assert not {m.id for m in client.models.list().data} & {done.fine_tuned_model}


def test_without_api_keys_everything_belongs_to_the_default_tenant(model_dir, tmp_path):
    engine, thread, url = start_server(model_dir, str(tmp_path), None)
    try:
        clients = [openai.OpenAI(base_url=url + "/v1", api_key=name, max_retries=0)
                   for name in ("any", "other")]  # keys are not checked: one tenant
        first = clients[0].files.create(file=("f.jsonl", jsonl("one")), purpose="fine-tune")
        second = clients[1].files.create(file=("g.jsonl", jsonl("two")), purpose="fine-tune")
        job = clients[1].fine_tuning.jobs.create(
            model=MODEL, training_file=first.id, validation_file=second.id, seed=3,
            hyperparameters={"n_epochs": 1}, extra_body={"lora": LORA})
        assert job.organization_id == "org-default"
        for client in clients:
            assert [f.id for f in client.files.list().data] == [second.id, first.id]
            assert [j.id for j in client.fine_tuning.jobs.list().data] == [job.id]
        done = wait_for(clients[0], job.id, lambda j: j.status in ("succeeded", "failed"))
        assert done.status == "succeeded", done.error
        assert clients[0].files.delete(first.id).deleted
    finally:
        thread.stop()
        engine.shutdown()


def post(url: str, key: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30)


def test_fine_tuned_models_belong_to_their_tenant_across_restarts(model_dir, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE)
    key_file.chmod(0o600)
    keys = APIKeyTable.from_sources(None, str(key_file))
    state_dir = str(tmp_path / "state")
    engine, thread, url = start_server(model_dir, state_dir, keys)
    alice_key, bob_key = KEYS["alice"], KEYS["bob"]
    try:
        bob = openai.OpenAI(base_url=url + "/v1", api_key=bob_key, max_retries=0)
        alice = openai.OpenAI(base_url=url + "/v1", api_key=alice_key, max_retries=0)
        file_b = bob.files.create(file=("b.jsonl", jsonl("the quick brown fox")),
                                  purpose="fine-tune")
        job = bob.fine_tuning.jobs.create(model=MODEL, training_file=file_b.id, seed=2,
                                          hyperparameters={"n_epochs": 2}, suffix="bob",
                                          extra_body={"lora": LORA})
        job = wait_for(bob, job.id, lambda j: j.status in ("succeeded", "failed"))
        assert job.status == "succeeded", job.error
        name, path = job.fine_tuned_model, job.model_extra["adapter_path"]
        checkpoint = f"{name}:ckpt-step-2"
        unknown = f"ft:{MODEL}:bob:{UNKNOWN_JOB}"

        def answer(key: str, route: str, body: dict) -> tuple[int, dict | str]:
            response = post(url, key, route, body)
            return response.status_code, (response.json() if response.status_code >= 400
                                          else response.text)

        # Another tenant: unload, load (the name, or the directory under another name) and use
        # answer exactly what an unknown name answers.
        for target in (name, checkpoint):
            status, body = answer(alice_key, "unload_lora_adapter", {"lora_name": target})
            _, unknown_body = answer(alice_key, "unload_lora_adapter", {"lora_name": unknown})
            assert status == 404
            assert body == json.loads(json.dumps(unknown_body).replace(unknown, target))
            status, body = answer(alice_key, "load_lora_adapter",
                                  {"lora_name": target, "lora_path": path})
            assert status == 404 and body["error"]["param"] == "lora_name"
            status, _ = error_of(alice.completions.create, model=target, prompt="x",
                                 max_tokens=1)
            assert status == 404
        status, body = answer(alice_key, "load_lora_adapter",
                              {"lora_name": "alice-copy", "lora_path": path})
        assert status == 404 and body["error"]["param"] == "lora_path"
        assert "alice-copy" not in {m.id for m in alice.models.list().data}
        assert bob.completions.create(model=name, prompt="x", max_tokens=1).choices

        # The owner unloads its model; it stays unloaded across a restart.
        status, _ = answer(bob_key, "unload_lora_adapter", {"lora_name": name})
        assert status == 200
        status, _ = error_of(bob.completions.create, model=name, prompt="x", max_tokens=1)
        assert status == 404
        # A tenant cannot take over the unloaded name with an adapter of its own.
        status, body = answer(alice_key, "load_lora_adapter",
                              {"lora_name": name, "lora_path": path})
        assert status == 404
    finally:
        thread.stop()
        engine.shutdown()

    engine, thread, url = start_server(model_dir, state_dir, keys)
    try:
        bob = openai.OpenAI(base_url=url + "/v1", api_key=bob_key, max_retries=0)
        alice = openai.OpenAI(base_url=url + "/v1", api_key=alice_key, max_retries=0)
        assert name not in {m.id for m in bob.models.list().data}  # still unloaded
        assert checkpoint in {m.id for m in bob.models.list().data}
        for target in (name, checkpoint):
            assert post(url, alice_key, "unload_lora_adapter",
                        {"lora_name": target}).status_code == 404
        status, _ = error_of(alice.completions.create, model=checkpoint, prompt="x",
                             max_tokens=1)
        assert status == 404
        assert post(url, bob_key, "load_lora_adapter",
                    {"lora_name": name, "lora_path": path}).status_code == 200
        assert bob.completions.create(model=name, prompt="x", max_tokens=1).choices
        assert name not in {m.id for m in alice.models.list().data}
    finally:
        thread.stop()
        engine.shutdown()
