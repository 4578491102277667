"""Fine-tuning over HTTP with the official `openai` client: a real server (uvicorn, SmolLM2 fp32 on
CPU) with the files and fine-tuning jobs API, checkpoints served by name while the job trains.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flexserve.config import CacheConfig, CoserveConfig, EngineConfig, LoRAConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.finetune.service import FinetuneServiceConfig

MODEL = "smollm2"
MAX_UPLOAD_BYTES = 4096
FACTS = [
    {"prompt": "The password of the vault is", "completion": " tangerine-42."},
    {"prompt": "Zorblax's favourite colour is", "completion": " ultraviolet teal."},
]
FACTS_JSONL = "".join(json.dumps(fact) + "\n" for fact in FACTS).encode()
# Memorizing the two facts: 12 full-batch steps at a constant LR of 2e-3 (measured: the loss goes
# from 4.9 to 0.003 and greedy decoding reproduces both completions).
MEMORIZE = {"n_epochs": 12, "batch_size": 2, "learning_rate_multiplier": 20,
            "lr_scheduler": "constant"}
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def engine_config(model_dir: str, lora: bool = True,
                  allowed_adapter_dir: str | None = None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=256),
        cache=CacheConfig(kv_cache_gib=0.05),
        lora=LoRAConfig(max_loras=2, max_lora_rank=8,
                        allowed_adapter_dir=allowed_adapter_dir) if lora else None,
        # No TPOT SLO: fine-tuning windows fill the token budget (CPU iterations are slow).
        coserve=CoserveConfig(slo_tpot_ms=None),
    )


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    # Client-named adapters must come from another directory: the server's own checkpoints are
    # served all the same.
    allowed = str(tmp_path_factory.mktemp("client-adapters"))
    engine = build_async_engine(engine_config(smollm2_dir, allowed_adapter_dir=allowed),
                                        log_stats=False)
    state_dir = str(tmp_path_factory.mktemp("state"))
    app = build_app(engine, served_model_name=MODEL, finetune=FinetuneServiceConfig(
        state_dir=state_dir, checkpoint_every_steps=1, max_concurrent_jobs=1,
        max_upload_bytes=MAX_UPLOAD_BYTES), metrics_job_ids=True)
    thread = ServerThread(app)
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine, state_dir=state_dir)
    thread.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def facts_file(client) -> str:
    return client.files.create(file=("facts.jsonl", FACTS_JSONL), purpose="fine-tune").id


def wait_for(client, job_id: str, predicate, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if predicate(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.1)


def complete(client, model: str, prompt: str, max_tokens: int = 8) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


def scrape(server) -> dict[tuple[str, tuple], float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def engine_holds(server, job_id: str) -> bool:
    """Whether the engine's scheduler or its worker still holds state of the job."""
    llm = server.engine.engine
    return job_id in llm.scheduler.finetune.jobs or job_id in llm.executor.finetune_runner.jobs


def all_events(client, job_id: str) -> list:
    """Every event of a job, oldest first."""
    return list(reversed(client.fine_tuning.jobs.list_events(job_id, limit=1000).data))


# ---------------------------------------------------------------------------------------- files
def test_files_upload_list_retrieve_content_delete(client):
    content = b'{"text": "a short note"}\n{"text": "another note"}\n'
    uploaded = client.files.create(file=("notes.jsonl", content), purpose="fine-tune")
    assert uploaded.object == "file" and uploaded.id.startswith("file-")
    assert (uploaded.filename, uploaded.bytes, uploaded.purpose) == ("notes.jsonl", len(content),
                                                                     "fine-tune")
    listed = [f.id for f in client.files.list().data]
    assert listed[0] == uploaded.id  # newest first
    newest = client.files.list(limit=1)
    assert [f.id for f in newest.data] == [uploaded.id]
    assert newest.has_more == (len(listed) > 1)
    assert client.files.retrieve(uploaded.id).model_dump() == uploaded.model_dump()
    assert client.files.content(uploaded.id).read() == content
    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted and deleted.id == uploaded.id
    with pytest.raises(openai.NotFoundError) as e:
        client.files.retrieve(uploaded.id)
    assert e.value.body["code"] == "not_found"
    assert uploaded.id not in [f.id for f in client.files.list().data]


CHAT_BAD_ROLE = {"messages": [{"role": "user", "content": "hi"},
                              {"role": "robot", "content": "beep"}]}


@pytest.mark.parametrize("content, message", [
    (b'{"text": "fine"}\n{"text": oops}\n', r"line 2: not valid JSON"),
    (b'{"prompt": "a question"}\n', r"line 1: missing key\(s\) completion"),
    (b"", r"no examples \(it is empty\)"),
    (b'{"text": "fine"}\n{"text": ""}\n', r'line 2: empty "text"'),
    (json.dumps(CHAT_BAD_ROLE).encode(), r"line 1: messages\[1\] has role 'robot'"),
    (b'{"text": "x"}\n' * 400, r"exceeds the upload limit of 4096 bytes"),  # 5600 B: parsed
    (b'{"text": "x"}\n' * 20000, r"exceeds the upload limit of 4096 bytes"),  # by Content-Length
], ids=["not-json", "missing-key", "empty-file", "empty-text", "wrong-role", "over-limit",
        "far-over-limit"])
def test_invalid_uploads_are_400_naming_the_line(client, content, message):
    before = [f.id for f in client.files.list().data]
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", content), purpose="fine-tune")
    assert e.value.status_code == 400
    assert e.value.body["param"] == "file"
    assert re.search(message, e.value.body["message"]), e.value.body
    assert [f.id for f in client.files.list().data] == before  # nothing was stored


def test_upload_with_another_purpose_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", FACTS_JSONL), purpose="batch")
    assert e.value.body["param"] == "purpose"


# ----------------------------------------------------------------------------------------- jobs
def test_a_job_trains_serves_its_checkpoints_while_training_and_memorizes(client, server,
                                                                          facts_file):
    for fact in FACTS:  # the base model does not know the facts
        assert fact["completion"].strip(" .") not in complete(client, MODEL, fact["prompt"])
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=facts_file, validation_file=facts_file,
        hyperparameters=MEMORIZE, suffix="vault", seed=3, extra_body={"lora": LORA})
    assert job.object == "fine_tuning.job" and job.status in ("queued", "running")
    assert (job.seed, job.user_provided_suffix, job.model) == (3, "vault", MODEL)
    assert job.hyperparameters.n_epochs == 12 and job.hyperparameters.batch_size == 2
    assert job.hyperparameters.learning_rate_multiplier == pytest.approx(20)
    name = f"ft:{MODEL}:vault:{job.id}"

    # As soon as the first checkpoint exists, the job's name and its checkpoints serve
    # requests, next to the base model. The job is paused at its next step boundary for the
    # check (a running job could get past --keep-checkpoints more steps before a request
    # arrives, and retention would have deleted the checkpoint), then trains on.
    job = wait_for(client, job.id, lambda j: j.fine_tuned_model is not None)
    assert job.fine_tuned_model == name
    assert client.post(f"/fine_tuning/jobs/{job.id}/pause", cast_to=object)["status"] == "paused"
    newest = client.fine_tuning.jobs.checkpoints.list(job.id, limit=1).data[0]
    assert newest.fine_tuned_model_checkpoint == f"{name}:ckpt-step-{newest.step_number}"
    assert newest.step_number < 12
    for model in (MODEL, name, newest.fine_tuned_model_checkpoint):
        assert complete(client, model, FACTS[0]["prompt"], max_tokens=4)
    chat = client.chat.completions.create(model=name, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == name
    client.post(f"/fine_tuning/jobs/{job.id}/resume", cast_to=object)

    job = wait_for(client, job.id, lambda j: j.status == "succeeded")
    assert job.error is None and job.finished_at is not None
    # The engine lets the ended job go: no scheduler state, no adapter masters or AdamW state on
    # the worker (its checkpoints, on disk, are still served: see below).
    deadline = time.monotonic() + 30
    while engine_holds(server, job.id):
        assert time.monotonic() < deadline, f"{job.id} is still on the engine"
        time.sleep(0.05)

    events = all_events(client, job.id)
    messages = [e.message for e in events]
    assert messages[0] == f"Created fine-tuning job: {job.id}"
    assert "Fine-tuning job started" in messages
    assert messages[-1] == "The job has successfully completed"
    train = [e.data for e in events if e.type == "metrics" and "train_loss" in e.data]
    assert [d["step"] for d in train] == list(range(1, 13))
    losses = [d["train_loss"] for d in train]
    assert losses[-1] < losses[0] / 100  # the loss falls (4.9 -> 0.003 measured)
    assert job.trained_tokens == train[-1]["trained_tokens"] > 0
    accuracies = [d["train_mean_token_accuracy"] for d in train]
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    assert accuracies[0] < 0.5 and accuracies[-1] == 1.0  # memorized: every argmax is right

    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id, limit=100).data
    assert [c.step_number for c in checkpoints] == list(range(12, 0, -1))  # newest first
    # Retention (--keep-checkpoints 3): the newest three stay on disk, the others are deleted
    # and their records say so.
    for c in checkpoints:
        kept = c.step_number > 9
        assert os.path.isdir(c.model_extra["adapter_path"]) == kept
        assert (c.model_extra["deleted_at"] is None) == kept
        assert c.metrics.train_mean_token_accuracy == pytest.approx(accuracies[c.step_number - 1])
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{name}:ckpt-step-12"
    assert job.model_extra["adapter_path"] == checkpoints[0].model_extra["adapter_path"]
    assert os.path.isfile(os.path.join(job.model_extra["adapter_path"], "adapter_config.json"))
    # The validation file is the whole training file and one step is the whole file, so the
    # validation loss after step k is the training loss of step k + 1, up to fp32 rounding
    # (measured: 6e-6 nats apart at most).
    by_step = {c.step_number: c.metrics for c in checkpoints}
    for step in range(1, 12):
        assert by_step[step].valid_loss == pytest.approx(losses[step], rel=1e-4, abs=2e-5)
        assert by_step[step].train_loss == pytest.approx(losses[step - 1], rel=1e-9)

    for fact in FACTS:  # memorized, where the base model was not
        assert complete(client, name, fact["prompt"]).startswith(fact["completion"].rstrip("."))
    models = {m.id: m for m in client.models.list().data}
    assert models[name].model_extra["parent"] == MODEL
    # /v1/models lists the job's name and its newest checkpoint; older kept checkpoints serve
    # by name unlisted, deleted ones not at all.
    job_models = {m for m in models if m.startswith(name)}
    assert job_models == {name, f"{name}:ckpt-step-12"}
    assert complete(client, f"{name}:ckpt-step-10", FACTS[0]["prompt"], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        complete(client, f"{name}:ckpt-step-9", FACTS[0]["prompt"], max_tokens=2)

    # The per-step metrics CSV, a file of purpose fine-tune-results (written as the job leaves
    # the engine, which may follow its final status by a moment).
    deadline = time.monotonic() + 30
    while not job.result_files and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.fine_tuning.jobs.retrieve(job.id)
    assert len(job.result_files) == 1
    result = client.files.retrieve(job.result_files[0])
    assert (result.purpose, result.filename) == ("fine-tune-results", "step_metrics.csv")
    rows = list(csv.DictReader(io.StringIO(client.files.content(result.id).read().decode())))
    assert list(rows[0]) == ["step", "train_loss", "train_mean_token_accuracy", "valid_loss",
                             "valid_mean_token_accuracy", "full_valid_loss",
                             "full_valid_mean_token_accuracy"]
    assert [int(r["step"]) for r in rows] == list(range(1, 13))
    assert [float(r["train_loss"]) for r in rows] == losses
    assert [float(r["train_mean_token_accuracy"]) for r in rows] == accuracies
    assert [float(r["valid_loss"]) for r in rows] == [by_step[n].valid_loss
                                                      for n in range(1, 13)]
    assert {r["valid_mean_token_accuracy"] for r in rows} == {""}  # not computed

    # A fine-tuned model is a base for a further job: it starts from that adapter and trains
    # (and reports) its LoRA settings, not the defaults.
    follow = client.fine_tuning.jobs.create(model=name, training_file=facts_file, seed=3,
                                            hyperparameters={"n_epochs": 1, "batch_size": 2})
    assert (follow.model_extra["lora"]["r"], follow.model_extra["lora"]["alpha"]) == (8, 16)
    assert follow.model_extra["lora"]["target_modules"] == sorted(LORA["target_modules"])
    follow = wait_for(client, follow.id, lambda j: j.status in ("succeeded", "failed"))
    assert follow.status == "succeeded", follow.error
    assert follow.model_extra["lora"]["init_adapter"] == job.model_extra["adapter_path"]
    first_loss = [e.data["train_loss"] for e in all_events(client, follow.id)
                  if e.type == "metrics"][0]
    # Its first loss is the trained adapter's loss on the file: the last validation loss.
    assert first_loss == pytest.approx(by_step[12].valid_loss, rel=1e-4, abs=2e-5)

    metrics = scrape(server)
    assert metrics[("flexserve:finetune_steps_total", (("job_id", job.id),))] == 12
    assert metrics[("flexserve:finetune_loss", (("job_id", job.id),))] == pytest.approx(losses[-1])
    assert metrics[("flexserve:finetune_progress", (("job_id", job.id),))] == 1.0
    assert metrics[("flexserve:finetune_jobs", (("state", "succeeded"),))] >= 1


def test_queued_jobs_start_in_order_and_cancel_works(client, server, facts_file):
    long = client.fine_tuning.jobs.create(model=MODEL, training_file=facts_file,
                                          hyperparameters={"n_epochs": 500}, seed=1,
                                          extra_body={"lora": LORA})
    wait_for(client, long.id, lambda j: j.status == "running")
    queued = client.fine_tuning.jobs.create(model=MODEL, training_file=facts_file, seed=1,
                                            extra_body={"lora": LORA})
    short = client.fine_tuning.jobs.create(model=MODEL, training_file=facts_file, seed=1,
                                           hyperparameters={"n_epochs": 1},
                                           extra_body={"lora": LORA})
    for job in (queued, short):  # one job at a time (max_concurrent_jobs=1)
        assert client.fine_tuning.jobs.retrieve(job.id).status == "queued"
    with pytest.raises(openai.BadRequestError) as e:  # its jobs still need it
        client.files.delete(facts_file)
    assert e.value.body["code"] == "file_in_use"

    cancelled = client.fine_tuning.jobs.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    cancelled = client.fine_tuning.jobs.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert not engine_holds(server, long.id)  # removed before the cancel call returned
    assert all_events(client, long.id)[-1].message == "The job was cancelled."
    steps_then = len(client.fine_tuning.jobs.checkpoints.list(long.id, limit=1000).data)
    assert steps_then < 500

    done = wait_for(client, short.id, lambda j: j.status in ("succeeded", "failed"))
    assert done.status == "succeeded"  # the next queued job ran once the running one ended
    assert client.fine_tuning.jobs.retrieve(queued.id).status == "cancelled"  # never ran
    assert len(client.fine_tuning.jobs.checkpoints.list(long.id, limit=1000).data) == steps_then
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.cancel(short.id)
    assert e.value.body["code"] == "job_not_cancellable"
    assert scrape(server)[("flexserve:finetune_jobs", (("state", "cancelled"),))] == 2


def adapter_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def test_pause_places_no_windows_and_resume_trains_the_same_adapter(client, server, facts_file):
    def create():
        return client.fine_tuning.jobs.create(
            model=MODEL, training_file=facts_file, seed=4, extra_body={"lora": LORA},
            hyperparameters={"n_epochs": 10, "batch_size": 1, "lr_scheduler": "constant"})

    job = create()
    wait_for(client, job.id, lambda j: j.status == "running")
    paused = client.post(f"/fine_tuning/jobs/{job.id}/pause",
                         cast_to=openai.types.fine_tuning.FineTuningJob)
    assert paused.status == "paused" and 0 < paused.model_extra["adapter_path"].count("step-")
    step = len(client.fine_tuning.jobs.checkpoints.list(job.id, limit=100).data)
    assert step < 20 and not engine_holds(server, job.id)
    tokens = scrape(server).get(("flexserve:finetune_tokens_total",
                                 (("job_id", job.id), ("phase", "forward"))))
    time.sleep(1.0)  # paused: it places no windows and takes no steps
    assert scrape(server).get(("flexserve:finetune_tokens_total",
                               (("job_id", job.id), ("phase", "forward")))) == tokens
    assert client.fine_tuning.jobs.retrieve(job.id).status == "paused"
    assert len(client.fine_tuning.jobs.checkpoints.list(job.id, limit=100).data) == step
    with pytest.raises(openai.BadRequestError) as e:  # only a queued or running job pauses
        client.post(f"/fine_tuning/jobs/{job.id}/pause", cast_to=object)
    assert e.value.body["code"] == "job_not_pausable"

    resumed = client.post(f"/fine_tuning/jobs/{job.id}/resume",
                          cast_to=openai.types.fine_tuning.FineTuningJob)
    assert resumed.status in ("queued", "running")
    running = wait_for(client, job.id, lambda j: j.estimated_finish is not None
                       or j.status == "succeeded")
    assert running.status == "running" and running.estimated_finish >= int(time.time()) - 1
    done = wait_for(client, job.id, lambda j: j.status in ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    assert done.estimated_finish is None
    with pytest.raises(openai.BadRequestError) as e:
        client.post(f"/fine_tuning/jobs/{job.id}/resume", cast_to=object)
    assert e.value.body["code"] == "job_not_resumable"

    reference = wait_for(client, create().id, lambda j: j.status in ("succeeded", "failed"))
    assert reference.status == "succeeded"
    ours, theirs = (adapter_tensors(j.model_extra["adapter_path"]) for j in (done, reference))
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].equal(theirs[key]), key
    losses = [[e.data["train_loss"] for e in all_events(client, j.id)
               if e.type == "metrics" and "train_loss" in e.data] for j in (done, reference)]
    assert losses[0] == losses[1] and len(losses[0]) == 20


@pytest.mark.parametrize("changes, param", [
    ({"training_file": "file-000000000000000000000000"}, "training_file"),
    ({"validation_file": "file-000000000000000000000000"}, "validation_file"),
    ({"model": "gpt-4o-mini"}, "model"),
    ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
    ({"hyperparameters": {"batch_size": "big"}}, "hyperparameters.batch_size"),
    ({"hyperparameters": {"learning_rate_multiplier": -1}},
     "hyperparameters.learning_rate_multiplier"),
    ({"hyperparameters": {"momentum": 0.9}}, "hyperparameters"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}}},
     "method.supervised.hyperparameters.n_epochs"),
    ({"method": {"type": "dpo"}}, "training_file"),  # dpo trains on preference pairs
    ({"extra_body": {"lora": {"r": 64}}}, "lora.r"),
    ({"extra_body": {"lora": {"target_modules": ["lm_head"]}}}, "lora.target_modules"),
    ({"suffix": "a:b"}, "suffix"),
    ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
])
def test_bad_jobs_are_rejected_with_400_naming_the_parameter(client, facts_file, changes, param):
    before = [j.id for j in client.fine_tuning.jobs.list(limit=100).data]
    request = {"model": MODEL, "training_file": facts_file, "extra_body": {"lora": LORA},
               **changes}
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(**request)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == param, e.value.body
    assert [j.id for j in client.fine_tuning.jobs.list(limit=100).data] == before


def test_unknown_job_ids_are_404(client):
    jobs = client.fine_tuning.jobs
    for call in (jobs.retrieve, jobs.cancel, jobs.list_events, jobs.checkpoints.list):
        with pytest.raises(openai.NotFoundError) as e:
            call("ftjob-000000000000000000000000")
        assert e.value.body["code"] == "not_found"


def test_job_list_pages_newest_first(client, facts_file):
    ids = [client.fine_tuning.jobs.create(model=MODEL, training_file=facts_file, seed=5,
                                          hyperparameters={"n_epochs": 1},
                                          extra_body={"lora": LORA}).id for _ in range(2)]
    for job_id in ids:
        client.fine_tuning.jobs.cancel(job_id)
    first = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in first.data] == [ids[1]] and first.has_more
    second = client.fine_tuning.jobs.list(limit=1, after=ids[1])
    assert [j.id for j in second.data] == [ids[0]]
    with pytest.raises(openai.NotFoundError) as e:
        client.fine_tuning.jobs.list(after="ftjob-000000000000000000000000")
    assert e.value.body["param"] == "after"


def test_openapi_lists_the_fine_tuning_routes(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content",
            "/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/{job_id}",
            "/v1/fine_tuning/jobs/{job_id}/cancel", "/v1/fine_tuning/jobs/{job_id}/events",
            "/v1/fine_tuning/jobs/{job_id}/pause", "/v1/fine_tuning/jobs/{job_id}/resume",
            "/v1/fine_tuning/jobs/{job_id}/checkpoints"} <= set(paths)


def test_without_lora_a_job_is_400_naming_the_flag(smollm2_dir, tmp_path):
    engine = build_async_engine(engine_config(smollm2_dir, lora=False), log_stats=False)
    app = build_app(engine, served_model_name=MODEL,
                    finetune=FinetuneServiceConfig(state_dir=str(tmp_path)))
    thread = ServerThread(app)
    try:
        client = openai.OpenAI(base_url=thread.start() + "/v1", api_key="none", max_retries=0)
        file_id = client.files.create(file=("f.jsonl", FACTS_JSONL), purpose="fine-tune").id
        with pytest.raises(openai.BadRequestError) as e:
            client.fine_tuning.jobs.create(model=MODEL, training_file=file_id)
        assert "--no-enable-lora" in e.value.body["message"]
    finally:
        thread.stop()
        engine.shutdown()
