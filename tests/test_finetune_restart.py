"""Durability of fine-tuning jobs: `flexserve serve` killed with SIGKILL mid-job and started again
on the same --state-dir. The running job resumes from its newest checkpoint and succeeds with the
planned number of steps; the job queued behind it (the same file, hyper-parameters and seed)
runs uninterrupted after it, and both end with the same adapter. No file, job or event is lost.
"""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest
import torch
from safetensors.torch import load_file

from flexserve.engine.iteration_shape import IterationShape
from flexserve.engine.latency_model import LatencyModel

from _server_process import ServerProcess

MODEL = "smollm2"
FACTS = [
    {"prompt": "The password of the vault is", "completion": " tangerine-42."},
    {"prompt": "Zorblax's favourite colour is", "completion": " ultraviolet teal."},
]
NUM_STEPS = 16  # 2 examples, batch 1, 8 epochs
JOB = dict(hyperparameters={"n_epochs": 8, "batch_size": 1, "learning_rate_multiplier": 10,
                            "lr_scheduler": "linear"},
           seed=7, extra_body={"lora": {"r": 8, "alpha": 16,
                                        "target_modules": ["q_proj", "v_proj", "down_proj"]}})
KILL_AFTER_CHECKPOINTS = 3


def constant_latency_profile(path: str) -> str:
    """A latency profile predicting every iteration to take 1 ms: with a TPOT SLO far above it,
    every fine-tuning window fills the token budget, so both servers cut the same windows (the
    fallback model without a profile starts with small windows and grows them as it measures)."""
    samples = [(IterationShape(prefill_tokens=n, finetune_tokens=m), 1e-3)
               for n in (0, 1, 64, 2048) for m in (0, 16, 2048)]
    LatencyModel.fit(samples, {"source": "test: constant"}).save(path)
    return path


class Server(ServerProcess):
    """The server of these tests: per-step checkpoints, windows cut the same way in every run."""

    def __init__(self, model_dir: str, state_dir: str, log_path: str, profile: str) -> None:
        super().__init__(
            ["--model", model_dir, "--served-model-name", MODEL, "--state-dir", state_dir,
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
             "--max-model-len", "256", "--kv-cache-gib", "0.05", "--checkpoint-every-steps", "1",
             "--max-concurrent-jobs", "1",
             "--latency-profile", profile, "--slo-tpot-ms", "1000000",
             "--disable-log-stats", "--log-level", "warning"], log_path)


def wait_for(client, job_id: str, predicate, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if predicate(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.05)


def train_losses(client, job_id: str) -> dict[int, list[float]]:
    """Step -> the training losses logged for it (one each, if no step is logged twice)."""
    losses: dict[int, list[float]] = {}
    for event in client.fine_tuning.jobs.list_events(job_id, limit=1000).data:
        if event.type == "metrics" and "train_loss" in event.data:
            losses.setdefault(event.data["step"], []).append(event.data["train_loss"])
    return losses


def test_kill_9_mid_job_then_restart_resumes_and_equals_an_uninterrupted_run(smollm2_dir,
                                                                            tmp_path):
    state_dir, log = str(tmp_path / "state"), str(tmp_path / "server.log")
    profile = constant_latency_profile(str(tmp_path / "latency.json"))
    data = "".join(json.dumps(fact) + "\n" for fact in FACTS).encode()
    first = Server(smollm2_dir, state_dir, log, profile)
    try:
        client = first.client
        file_id = client.files.create(file=("facts.jsonl", data), purpose="fine-tune").id
        resumed = client.fine_tuning.jobs.create(model=MODEL, training_file=file_id, **JOB)
        # The reference: the same job, queued behind (--max-concurrent-jobs 1); it runs after the
        # restart from its first step to its last.
        reference = client.fine_tuning.jobs.create(model=MODEL, training_file=file_id, **JOB)
        deadline = time.monotonic() + 120
        while len(client.fine_tuning.jobs.checkpoints.list(resumed.id).data) \
                < KILL_AFTER_CHECKPOINTS:
            assert time.monotonic() < deadline, "no checkpoints"
            time.sleep(0.05)
        before = {job_id: client.fine_tuning.jobs.retrieve(job_id)
                  for job_id in (resumed.id, reference.id)}
        events_before = [e.id for e in
                         client.fine_tuning.jobs.list_events(resumed.id, limit=1000).data]
        first.stop(signal.SIGKILL)
    finally:
        first.stop(signal.SIGKILL)
    assert before[resumed.id].status == "running" and before[reference.id].status == "queued"
    assert before[resumed.id].model_extra["adapter_path"] is not None

    second = Server(smollm2_dir, state_dir, log, profile)
    try:
        client = second.client
        assert [f.id for f in client.files.list().data] == [file_id]
        assert client.files.content(file_id).read() == data
        assert {j.id for j in client.fine_tuning.jobs.list().data} == {resumed.id, reference.id}
        events_after = [e.id for e in
                        client.fine_tuning.jobs.list_events(resumed.id, limit=1000).data]
        assert set(events_before) <= set(events_after)

        done = wait_for(client, resumed.id, lambda j: j.status in ("succeeded", "failed"))
        assert done.status == "succeeded", done.error
        ref = wait_for(client, reference.id, lambda j: j.status in ("succeeded", "failed"))
        assert ref.status == "succeeded", ref.error

        messages = [e.message for e in client.fine_tuning.jobs.list_events(resumed.id,
                                                                           limit=1000).data]
        resume_steps = [int(m.split("resumed from step ")[1].split()[0])
                        for m in messages if "resumed from step" in m]
        assert len(resume_steps) == 1 and resume_steps[0] >= KILL_AFTER_CHECKPOINTS
        checkpoints = client.fine_tuning.jobs.checkpoints.list(resumed.id, limit=100).data
        assert sorted(c.step_number for c in checkpoints) == list(range(1, NUM_STEPS + 1))

        # The same steps with the same losses (to the bit, as the adapters), each logged once.
        losses, ref_losses = train_losses(client, resumed.id), train_losses(client, reference.id)
        assert sorted(losses) == sorted(ref_losses) == list(range(1, NUM_STEPS + 1))
        assert all(len(v) == 1 for v in losses.values())
        for step in losses:
            assert losses[step][0] == ref_losses[step][0]
        assert done.trained_tokens == ref.trained_tokens

        # The resumed job's final adapter equals the uninterrupted one bitwise: the checkpoint
        # holds the fp32 masters, AdamW's moments and the data position exactly, and both runs
        # cut the same windows on the same CPU (measured: max difference 0.0). With windows cut
        # differently (no latency profile) they differ by fp32 rounding, which AdamW amplifies
        # to ~lr on entries whose gradients are near zero (lora_A after B = 0): ~1e-3 here.
        adapter = load_file(os.path.join(done.model_extra["adapter_path"],
                                         "adapter_model.safetensors"))
        ref_adapter = load_file(os.path.join(ref.model_extra["adapter_path"],
                                             "adapter_model.safetensors"))
        assert adapter.keys() == ref_adapter.keys() and len(adapter) > 0
        for key, tensor in adapter.items():
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor, ref_adapter[key]), key
        assert any(t.abs().max() > 0 for k, t in adapter.items() if "lora_B" in k)  # trained
    finally:
        second.stop()

    # A third start: every checkpoint retention kept (the newest, and the older ones, which
    # only the start-up registers again) and the job's name are served; deleted ones are not.
    third = Server(smollm2_dir, state_dir, log, profile)
    try:
        client = third.client
        name = f"ft:{MODEL}::{resumed.id}"
        listed = client.fine_tuning.jobs.checkpoints.list(resumed.id, limit=100).data
        kept = [c for c in listed if c.model_extra.get("deleted_at") is None]
        deleted = [c for c in listed if c.model_extra.get("deleted_at") is not None]
        assert listed[0] in kept and len(kept) >= 2 and deleted
        for model in [c.fine_tuned_model_checkpoint for c in kept] + [name]:
            assert model.startswith(name)
            assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=deleted[0].fine_tuned_model_checkpoint,
                                      prompt="Hi", max_tokens=2)
    finally:
        third.stop()

