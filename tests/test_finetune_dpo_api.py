"""DPO over HTTP with the official `openai` client: `method={"type": "dpo", ...}` on a real server
(SmolLM2 fp32 on CPU); the job echoes its method, reports DPO metrics per step and at each
checkpoint (on the validation file too), and bad preference data or `method` bodies are 400s that
name the line or the field (the data on upload, as for every format)."""

from __future__ import annotations

import json

import openai
import pytest

import test_finetune_api as api

MODEL = "smollm2"
server, client = api.server, api.client  # the fixtures: this module's own server
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def pair(question: str, chosen: str, rejected: str) -> dict:
    return {"input": {"messages": [{"role": "user", "content": question}]},
            "preferred_output": [{"role": "assistant", "content": chosen}],
            "non_preferred_output": [{"role": "assistant", "content": rejected}]}


PAIRS = [pair("2 + 2 =", "4", "5"), pair("Opposite of hot?", "Cold.", "Warm.")]


def jsonl(records: list) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def pairs_file(client) -> str:
    return client.files.create(file=("pairs.jsonl", jsonl(PAIRS)), purpose="fine-tune").id


def test_a_dpo_job_echoes_its_method_and_reports_dpo_metrics(client, pairs_file):
    job = client.fine_tuning.jobs.create(
        model=MODEL, training_file=pairs_file, validation_file=pairs_file, seed=0,
        method={"type": "dpo", "dpo": {"hyperparameters": {
            "beta": 0.2, "n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 10}}},
        extra_body={"lora": LORA})
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.2
    assert job.method.dpo.hyperparameters.n_epochs == 2 and job.method.supervised is None
    job = api.wait_for(client, job.id, lambda j: j.status in ("succeeded", "failed"), 300)
    assert job.status == "succeeded", job.error
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data
               if e.type == "metrics" and "train_loss" in e.data]
    assert sorted(m["step"] for m in metrics) == [1, 2]
    for m in metrics:
        assert m["train_reward_margin"] == pytest.approx(
            m["train_rewards_chosen"] - m["train_rewards_rejected"])
        assert 0.0 <= m["train_preference_accuracy"] <= 1.0
    first = next(m for m in metrics if m["step"] == 1)
    assert first["train_loss"] == pytest.approx(0.6931, abs=1e-3)  # starts at the reference
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert len(checkpoints) == 2
    for checkpoint in checkpoints:
        m = checkpoint.metrics.model_dump()
        for key in ("train_loss", "train_reward_margin", "train_preference_accuracy",
                    "valid_loss", "valid_reward_margin", "valid_preference_accuracy"):
            assert isinstance(m[key], float), (key, m)
    # After step 1 the validation pairs (the training pairs) moved toward the preferred side.
    step1 = next(c for c in checkpoints if c.step_number == 1).metrics.model_dump()
    assert step1["valid_reward_margin"] > 0 and step1["valid_loss"] < 0.6931
    supervised = client.fine_tuning.jobs.retrieve(job.id)
    assert supervised.method.type == "dpo"


@pytest.mark.parametrize("changes, param", [
    ({"method": {"type": "reinforcement"}}, "method.type"),
    ({"method": {"type": "supervised", "dpo": {"hyperparameters": {"beta": 0.1}}}},
     "method.dpo"),
    ({"method": {"type": "dpo", "supervised": {"hyperparameters": {}}}}, "method.supervised"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": -1}}}},
     "method.dpo.hyperparameters.beta"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 0}}}},
     "method.dpo.hyperparameters.n_epochs"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}},
      "hyperparameters": {"n_epochs": 1}}, "hyperparameters"),
    ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"method": "supervised"}}}},
     "method.dpo.hyperparameters.method"),
    ({"method": {"type": "supervised"}}, "training_file"),  # preference pairs need dpo
    ({"hyperparameters": {"beta": 0.1}}, "hyperparameters.beta"),
])
def test_bad_method_bodies_are_400_naming_the_field(client, pairs_file, changes, param):
    request = {"model": MODEL, "training_file": pairs_file, "extra_body": {"lora": LORA},
               **changes}
    with pytest.raises(openai.BadRequestError) as e:
        client.fine_tuning.jobs.create(**request)
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("record, message", [
    ({"input": PAIRS[0]["input"], "preferred_output": PAIRS[0]["preferred_output"]},
     "line 2: missing key(s) non_preferred_output"),
    (dict(PAIRS[0], preferred_output=[{"role": "assistant", "content": ""}]),
     "line 2: preferred_output[0]: empty content"),
    (dict(PAIRS[0], non_preferred_output=[{"role": "system", "content": "x"}]),
     "line 2: non_preferred_output[0] has role 'system'"),
])
def test_bad_preference_data_is_400_naming_the_line(client, record, message):
    with pytest.raises(openai.BadRequestError) as e:  # checked on upload, like every format
        client.files.create(file=("bad.jsonl", jsonl([PAIRS[0], record])), purpose="fine-tune")
    assert e.value.body["param"] == "file"
    assert message in e.value.body["message"], e.value.body
