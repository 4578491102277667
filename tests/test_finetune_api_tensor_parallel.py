"""Fine-tuning over HTTP on a tensor-parallel server: SmolLM2 at 3 ranks (fp32, CPU, gloo)
memorizes two facts through the files and fine-tuning jobs API, and serves the result by name;
a pipeline-parallel server refuses jobs with a 400 that says why."""

from __future__ import annotations

import dataclasses

import openai
import pytest

from flexserve.config import ParallelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.finetune.service import FinetuneServiceConfig
from test_finetune_api import (
    FACTS,
    FACTS_JSONL,
    LORA,
    MEMORIZE,
    MODEL,
    complete,
    engine_config,
    wait_for,
)


def serve(smollm2_dir, tmp_path, **parallel):
    config = dataclasses.replace(engine_config(smollm2_dir),
                                 parallel=ParallelConfig(**parallel))
    engine = build_async_engine(config, log_stats=False)
    app = build_app(engine, served_model_name=MODEL, finetune=FinetuneServiceConfig(
        state_dir=str(tmp_path), checkpoint_every_steps=4))
    thread = ServerThread(app)
    url = thread.start()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    return client, thread, engine


@pytest.mark.slow
def test_a_job_memorizes_facts_at_3_ranks_and_is_served(smollm2_dir, tmp_path):
    client, thread, engine = serve(smollm2_dir, tmp_path, tensor_parallel_size=3)
    try:
        training = client.files.create(file=("facts.jsonl", FACTS_JSONL), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model=MODEL, training_file=training.id,
                                             hyperparameters=MEMORIZE, suffix="tp3", seed=3,
                                             extra_body={"lora": LORA})
        job = wait_for(client, job.id, lambda j: j.status in ("succeeded", "failed"),
                       timeout=600)
        assert job.status == "succeeded", job.error
        for fact in FACTS:  # the adapter the ranks trained, served by the job's name
            answer = complete(client, job.fine_tuned_model, fact["prompt"])
            assert fact["completion"].strip(" .") in answer, answer
    finally:
        thread.stop()
        engine.shutdown()


def test_a_pipeline_parallel_server_refuses_jobs(smollm2_dir, tmp_path):
    client, thread, engine = serve(smollm2_dir, tmp_path, pipeline_parallel_size=2)
    try:
        training = client.files.create(file=("facts.jsonl", FACTS_JSONL), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError, match="pipeline parallelism"):
            client.fine_tuning.jobs.create(model=MODEL, training_file=training.id,
                                           extra_body={"lora": LORA})
        assert complete(client, MODEL, FACTS[0]["prompt"], max_tokens=4)  # still serving
    finally:
        thread.stop()
        engine.shutdown()
