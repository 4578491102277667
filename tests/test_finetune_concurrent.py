"""Several fine-tuning jobs on one server, and what an ended job leaves behind.

Over HTTP with the `openai` client (a tiny random Llama on CPU, fp32, LoRA slots for two jobs
and the served checkpoints): two jobs on different data and seeds train in the same iterations,
and each one's final adapter equals the adapter the same job (file, hyper-parameters, seed, init
adapter) trains alone. Bound, as the fine-tuning exactness test's (tests/test_finetune_engine.py):
relative error of the weight change (final - initial, over all adapter tensors) <= 1e-4; measured
0.0 for job a (bitwise equal) and 8.1e-7 for job b (2026-11-22, 2-core CPU). With no TPOT SLO
(`CoserveConfig(slo_tpot_ms=None)`) windows fill the token budget, so each job gets the windows
it gets alone, in the same iterations as the other job's; the runs differ only by the float
rounding of the shared iterations' larger batches (job b's rows come second). Once a job has
ended, the engine's scheduler and the worker hold nothing of it (its LoRA slot, adapter masters
and AdamW state are freed), while its checkpoints stay servable. Offline, `LLM.finetune` keeps its
job until `LLMEngine.remove_finetune_job`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time

import openai
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from flexserve import LLM
from flexserve.config import CacheConfig, CoserveConfig, EngineConfig, LoRAConfig, ModelConfig
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.finetune.service import FinetuneServiceConfig
from flexserve.peft.bypass import target_shapes
from flexserve.peft.lora import LoRAAdapter
from flexserve.peft.peft_io import ADAPTER_WEIGHTS_NAME, save_peft_adapter

from _tokenizer import tiny_byte_level_tokenizer

MODEL = "tiny"
TARGETS = ("q_proj", "v_proj", "down_proj")
DATA = {  # two different training files, four short examples each
    "a": ["the quick brown fox jumps", "over the lazy dog", "the dog jumps over the fox",
          "quick brown dogs"],
    "b": ["héllo wörld café", "café au lait", "wörld of héllo", "the café is quick"],
}
JOB = {"hyperparameters": {"n_epochs": 2, "batch_size": 2, "learning_rate": 2e-3,
                           "lr_scheduler": "constant", "max_grad_norm": 1.0}}
SEEDS = {"a": 1, "b": 2}
MAX_RELATIVE_ERROR = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_config, tiny_checkpoint):
    path = tiny_checkpoint(tiny_config("llama", vocab_size=320, max_position_embeddings=128),
                           seed=7)
    tiny_byte_level_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def init_adapter(model_dir, tmp_path_factory) -> str:
    """Where both jobs start: seeded A and a non-zero B (so every entry gets gradients from the
    first step, and AdamW has no zero gradient to magnify rounding on)."""
    hf_config = AutoConfig.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    adapter = LoRAAdapter.create(target_shapes(hf_config), hf_config.num_hidden_layers, 4, 8,
                                 TARGETS, generator=generator)
    for _, b in adapter.weights.values():
        b.copy_(torch.randn(b.shape, generator=generator) * 0.05)
    path = str(tmp_path_factory.mktemp("init"))
    save_peft_adapter(adapter, path)
    return path


class JobsPerIteration:
    """A stat logger: the fine-tuning jobs that placed windows in each engine step."""

    def __init__(self) -> None:
        self.iterations: list[frozenset[str]] = []

    def record(self, stats) -> None:
        jobs = frozenset(stats.finetune_forward_tokens) | frozenset(stats.finetune_backward_tokens)
        if jobs:
            self.iterations.append(jobs)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    config = EngineConfig(model=ModelConfig(model=model_dir, max_model_len=128),
                          cache=CacheConfig(kv_cache_gib=0.01),
                          lora=LoRAConfig(max_loras=3, max_lora_rank=4),
                          coserve=CoserveConfig(slo_tpot_ms=None))
    engine = build_async_engine(config, log_stats=False)
    jobs_per_iteration = JobsPerIteration()
    engine.add_stat_logger(jobs_per_iteration)
    state_dir = str(tmp_path_factory.mktemp("state"))
    thread = ServerThread(build_app(engine, served_model_name=MODEL, finetune=FinetuneServiceConfig(
        state_dir=state_dir, checkpoint_every_steps=1000, max_concurrent_jobs=2)))
    url = thread.start()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    yield client, engine, jobs_per_iteration
    thread.stop()
    engine.shutdown()


def wait_for(client, job_id: str, predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate(job := client.fine_tuning.jobs.retrieve(job_id)):
        assert time.monotonic() < deadline, f"job {job_id} stuck: {job}"
        time.sleep(0.05)
    return job


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.02)


def engine_holds_no_job(engine: AsyncLLMEngine) -> bool:
    llm = engine.engine
    return not llm.scheduler.finetune.jobs and not llm.executor.finetune_runner.jobs


def create(client, file_ids: dict[str, str], name: str, init_adapter: str):
    return client.fine_tuning.jobs.create(
        model=MODEL, training_file=file_ids[name], seed=SEEDS[name], suffix=name,
        extra_body={"lora": {"r": 4, "alpha": 8, "target_modules": list(TARGETS),
                             "init_adapter": init_adapter}}, **JOB)


def adapter_of(job) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(job.model_extra["adapter_path"], ADAPTER_WEIGHTS_NAME))


def weight_change_error(adapter: dict, alone: dict, init: dict) -> float:
    """||adapter - alone|| / ||alone - init|| over all adapter tensors."""
    assert adapter.keys() == alone.keys() == init.keys() and init
    diff = sum(float(((adapter[k] - alone[k]) ** 2).sum()) for k in init)
    change = sum(float(((alone[k] - init[k]) ** 2).sum()) for k in init)
    assert change > 0  # it trained
    return math.sqrt(diff / change)


def create_both_before_either_starts(client, engine, file_ids, init_adapter, monkeypatch):
    """Create job a, then b, while the engine thread is held, and let it go once both jobs'
    starts wait in its command queue: it then adds both before its next step."""
    queued: list[str] = []
    real_call = engine.call
    start_fn = engine.engine.add_finetune_job

    async def call(fn, *args):
        pending = asyncio.ensure_future(real_call(fn, *args))
        await asyncio.sleep(0)  # `pending` runs first, up to its wait: the command is queued
        if getattr(fn, "func", None) == start_fn:
            queued.append(fn.keywords["job_id"])
        return await pending

    monkeypatch.setattr(engine, "call", call)
    gate = threading.Event()
    holder = threading.Thread(target=asyncio.run, args=(real_call(gate.wait, 60.0),))
    holder.start()
    try:
        jobs = [create(client, file_ids, name, init_adapter) for name in ("a", "b")]
        wait_until(lambda: len(queued) == 2, "both jobs' starts queued")
        assert queued == [job.id for job in jobs]
    finally:
        gate.set()
        holder.join()
        monkeypatch.undo()
    return jobs


def test_two_concurrent_jobs_each_train_the_adapter_they_train_alone(server, init_adapter,
                                                                     monkeypatch):
    client, engine, jobs_per_iteration = server
    file_ids = {name: client.files.create(
        file=(f"{name}.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()),
        purpose="fine-tune").id for name, texts in DATA.items()}

    together = create_both_before_either_starts(client, engine, file_ids, init_adapter,
                                                monkeypatch)
    together = [wait_for(client, job.id, lambda j: j.status in ("succeeded", "failed"))
                for job in together]
    assert [job.status for job in together] == ["succeeded", "succeeded"], together
    # They trained in the same iterations, all of them: each of the 4 optimizer steps is a
    # forward iteration (every sequence of the step whole) and a backward one (every layer).
    assert jobs_per_iteration.iterations == [{job.id for job in together}] * 8
    # Ended jobs leave the engine: no scheduler state, nothing on the worker.
    wait_until(lambda: engine_holds_no_job(engine), "both jobs removed from the engine")
    for job in together:
        answer = client.completions.create(model=job.fine_tuned_model, prompt="the quick",
                                           max_tokens=3, temperature=0)
        assert answer.choices[0].finish_reason == "length"

    num_before = len(jobs_per_iteration.iterations)
    alone = {}
    for name in ("a", "b"):
        job = create(client, file_ids, name, init_adapter)
        alone[name] = wait_for(client, job.id, lambda j: j.status in ("succeeded", "failed"))
        assert alone[name].status == "succeeded", alone[name].error
    assert all(len(jobs) == 1 for jobs in jobs_per_iteration.iterations[num_before:])
    wait_until(lambda: engine_holds_no_job(engine), "the alone jobs removed from the engine")

    init = load_file(os.path.join(init_adapter, ADAPTER_WEIGHTS_NAME))
    for name, job in zip(("a", "b"), together):
        assert job.trained_tokens == alone[name].trained_tokens
        error = weight_change_error(adapter_of(job), adapter_of(alone[name]), init)
        assert error <= MAX_RELATIVE_ERROR, (name, error)


def test_offline_jobs_stay_until_removed(model_dir):
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=4, max_model_len=64)
    engine = llm.engine
    job = llm.finetune([{"text": t} for t in DATA["a"]],
                       lora={"r": 4, "alpha": 8, "target_modules": list(TARGETS)},
                       hyperparameters={"n_epochs": 1, "batch_size": 2, "seed": 1})
    with pytest.raises(ValueError, match="still running"):
        engine.remove_finetune_job(job.id)
    job.wait()
    # The handle keeps working after the job ended: the offline engine removes nothing itself.
    assert (job.status, len(job.losses)) == ("succeeded", 2)
    worker = engine.executor.finetune_runner
    assert job.id in engine.scheduler.finetune.jobs and job.id in worker.jobs
    engine.remove_finetune_job(job.id)
    assert job.id not in engine.scheduler.finetune.jobs and job.id not in worker.jobs
    for call in (engine.remove_finetune_job, engine.get_finetune_job):
        with pytest.raises(ValueError, match="no fine-tuning job"):
            call(job.id)
    # The only LoRA slot takes the next job (it went back when the first job ended).
    second = llm.finetune([{"text": t} for t in DATA["b"]],
                          lora={"r": 4, "alpha": 8, "target_modules": list(TARGETS)},
                          hyperparameters={"n_epochs": 1, "batch_size": 4, "seed": 2})
    engine.cancel_finetune_job(second.id)
    engine.remove_finetune_job(second.id)  # a cancelled job can be removed at once
    assert not engine.scheduler.finetune.jobs and not worker.jobs
