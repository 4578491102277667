"""A failure stays where it happened.

- A fine-tuning job whose loss or gradients turn NaN, or that runs out of device memory (faults
  injected with `FinetuneRunner.inject_fault`), fails alone with a clear error; a second job
  trains on to the same losses it has alone, inference next to them gives the tokens it gives
  alone, and every KV block and activation byte comes back (tiny Llama, CPU, fp32).
- An exception while processing one request's output fails that request alone (500 or an
  in-band error, with no internal detail); concurrent requests finish, the engine stays healthy.
- Over HTTP with the job service (SmolLM2): the failed job is `failed` with the reason in its
  error and events, the other job succeeds, and /health reports "degraded" naming the job.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from flexserve import LLM, SamplingParams
from flexserve.engine.finetune_scheduler import FinetuneJobStatus
from flexserve.engine.output_processor import OutputProcessor
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.finetune.data import TrainingData, TrainingExample
from flexserve.finetune.hyperparameters import Hyperparameters

from _fake_engine import MODEL, FakeExecutor, fake_engine, wait_until

PROMPT_IDS = [3, 17, 42, 7, 99, 12]
MESSAGES = {
    "nan_loss": "the training loss is nan",
    "nan_grad": "the gradient norm is nan",
    "oom": "out of device memory",
}


@pytest.fixture(scope="module")
def model_dir(tiny_config, tiny_checkpoint):
    return tiny_checkpoint(tiny_config("llama", max_position_embeddings=128), seed=11)


def data(seed: int, lengths=(9, 12, 7, 10, 8, 11)) -> TrainingData:
    g = torch.Generator().manual_seed(seed)
    examples = [TrainingExample(i + 1, torch.randint(0, 256, (n,), generator=g).tolist(),
                                [False] + [True] * (n - 1)) for i, n in enumerate(lengths)]
    return TrainingData("text", examples, [], sum(lengths), sum(n - 1 for n in lengths))


def hp() -> Hyperparameters:  # 3 steps of 2 sequences
    return Hyperparameters.from_dict({
        "batch_size": 2, "n_epochs": 1, "shuffle": False, "seed": 1, "learning_rate": 1e-2,
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}})


def new_llm(model_dir: str) -> LLM:
    return LLM(model_dir, enable_lora=True, max_loras=3, max_lora_rank=4, max_model_len=128,
               max_num_batched_tokens=16, kv_cache_gib=0.01)


def run(llm: LLM, jobs, request_ids) -> dict[str, list[int]]:
    """Step until every job ended and every request finished; the requests' token ids."""
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    while not all(job.finished for job in jobs) or len(tokens) < len(request_ids):
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        engine.pop_finetune_updates()
    return tokens


@pytest.fixture(scope="module")
def alone(model_dir) -> dict:
    """Job B alone, and the inference request alone: the references."""
    llm = new_llm(model_dir)
    job = llm.engine.add_finetune_job(data(2), hp(), job_id="b")
    run(llm, [job], [])
    assert job.status == FinetuneJobStatus.SUCCEEDED
    llm.engine.add_request("r", PROMPT_IDS, SamplingParams(temperature=0, max_tokens=12))
    tokens = run(llm, [], ["r"])
    return {"losses": list(job.losses), "tokens": tokens["r"]}


@pytest.mark.parametrize("kind", ["nan_loss", "nan_grad", "oom"])
def test_a_poisoned_job_fails_alone(model_dir, alone, kind):
    llm = new_llm(model_dir)
    engine = llm.engine
    kv = engine.scheduler.kv_cache_manager
    num_free_blocks = kv.num_free_blocks
    bad = engine.add_finetune_job(data(1), hp(), job_id="a")
    good = engine.add_finetune_job(data(2), hp(), job_id="b")
    runner = engine.executor.finetune_runner
    while bad.step_index < 1:  # the fault hits a job that has trained already
        engine.step()
    runner.inject_fault("a", kind)
    engine.add_request("r", PROMPT_IDS, SamplingParams(temperature=0, max_tokens=12))
    tokens = run(llm, [bad, good], ["r"])
    assert bad.status == FinetuneJobStatus.FAILED
    assert MESSAGES[kind] in bad.error
    assert bad.step_index >= 1 and len(bad.losses) < bad.num_steps
    assert good.status == FinetuneJobStatus.SUCCEEDED
    assert good.losses == pytest.approx(alone["losses"], rel=1e-4)
    assert all(loss == loss for loss in good.losses)  # finite, not NaN
    assert tokens["r"] == alone["tokens"]
    assert kv.num_free_blocks == num_free_blocks
    assert runner.num_activation_bytes == 0
    # the engine serves on: a new job trains to the end
    again = engine.add_finetune_job(data(2), hp(), job_id="c")
    run(llm, [again], [])
    assert again.status == FinetuneJobStatus.SUCCEEDED
    assert again.losses == pytest.approx(alone["losses"], rel=1e-4)


def test_unknown_fault_is_a_value_error(model_dir):
    llm = new_llm(model_dir)
    llm.engine.add_finetune_job(data(1), hp(), job_id="a")
    with pytest.raises(ValueError, match="unknown fault"):
        llm.engine.executor.finetune_runner.inject_fault("a", "gremlins")


# --------------------------------------------------------------------- one request's processing
def test_an_output_processing_error_fails_that_request_alone(monkeypatch):
    real_update = OutputProcessor._update

    def update(self, completion, params, request, result):
        if params.max_tokens == 7 and len(request.output_token_ids) >= 3:
            raise RuntimeError("detokenizer exploded at /srv/secret/tokenizer.json")
        return real_update(self, completion, params, request, result)

    monkeypatch.setattr(OutputProcessor, "_update", update)
    executor = FakeExecutor(step_s=0.005)
    engine = fake_engine(executor)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    try:
        scheduler = engine.engine.scheduler
        num_free_blocks = scheduler.kv_cache_manager.num_free_blocks
        body = {"model": MODEL, "prompt": [1, 2, 3]}
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={**body, "max_tokens": 40, "stream": True, "logprobs": 0}) as ok:
            lines = ok.iter_lines()
            first = next(line for line in lines if line)  # the healthy stream is running
            failed = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 7})
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    **body, "max_tokens": 7, "stream": True, "logprobs": 0}) as broken:
                broken_events = [line.removeprefix("data: ")
                                 for line in broken.iter_lines() if line]
            events = [line.removeprefix("data: ") for line in [first, *lines] if line]
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "request_failed"
        assert "/srv" not in failed.text and "exploded" not in failed.text
        assert broken_events[-1] == "[DONE]"
        assert json.loads(broken_events[-2])["error"]["code"] == "request_failed"
        # the healthy stream ran to its end
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        num_tokens = sum(len(json.loads(e)["choices"][0]["logprobs"]["tokens"])
                         for e in events[:-1])
        assert num_tokens == 40
        assert engine.is_healthy
        again = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 5})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
        wait_until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0,
                   what="no request left")
        assert scheduler.kv_cache_manager.num_free_blocks == num_free_blocks
    finally:
        thread.stop()
        engine.shutdown()


# --------------------------------------------------------------------- over HTTP, with the service
FACTS = [{"prompt": "The vault code is", "completion": " 42."},
         {"prompt": "The sky on Zorb is", "completion": " green."}]
JOB = dict(hyperparameters={"n_epochs": 3, "batch_size": 1}, seed=3,
           extra_body={"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})


def test_over_http_a_nan_job_fails_alone_and_health_says_degraded(smollm2_dir, tmp_path):
    from flexserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from flexserve.finetune.service import FinetuneServiceConfig

    config = EngineConfig(model=ModelConfig(model=smollm2_dir, max_model_len=128),
                          cache=CacheConfig(kv_cache_gib=0.05),
                          lora=LoRAConfig(max_loras=3, max_lora_rank=4))
    engine = build_async_engine(config, log_stats=False)
    app = build_app(engine, served_model_name="smollm2", finetune=FinetuneServiceConfig(
        state_dir=str(tmp_path), max_concurrent_jobs=2, checkpoint_every_steps=100),
        metrics_job_ids=True)
    thread = ServerThread(app)
    url = thread.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        lines = "".join(json.dumps(fact) + "\n" for fact in FACTS).encode()
        file_id = client.files.create(file=("facts.jsonl", lines), purpose="fine-tune").id
        runner = engine.engine.executor._finetune()  # what the first job would create
        bad = client.fine_tuning.jobs.create(model="smollm2", training_file=file_id, **JOB)
        runner.inject_fault(bad.id, "nan_loss")  # before its first window's loss
        good = client.fine_tuning.jobs.create(model="smollm2", training_file=file_id, **JOB)
        answer = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=4,
                                           temperature=0)
        assert answer.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 120
        while True:
            jobs = [client.fine_tuning.jobs.retrieve(j.id) for j in (bad, good)]
            if all(j.status in ("succeeded", "failed", "cancelled") for j in jobs):
                break
            assert time.monotonic() < deadline, f"jobs stuck: {jobs}"
            time.sleep(0.1)
        bad_job, good_job = jobs
        assert bad_job.status == "failed" and good_job.status == "succeeded"
        assert bad_job.error.code == "training_failed"
        assert "the training loss is nan" in bad_job.error.message
        events = [e.message for e in client.fine_tuning.jobs.list_events(bad.id).data]
        assert any("the training loss is nan" in message for message in events)
        health = httpx.get(url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert any(bad.id in reason for reason in health.json()["reasons"])
        assert engine.is_healthy
    finally:
        thread.stop()
        engine.shutdown()
