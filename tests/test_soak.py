"""The short soak (benchmarks/soak.py) against a real `flexserve serve` subprocess (SmolLM2, CPU):
streaming and plain requests with random client aborts, a LoRA adapter loaded and unloaded under
traffic, a fine-tuning job, a burst over the admission limit. Afterwards: every accepted request
answered or aborted, 429 only over the limit (and with Retry-After), nothing running, waiting or
holding a KV block, the job succeeded, the server's RSS flat from round to round. And, in process on a
tiny model, 1,000 client aborts beside two fine-tuning jobs, after which the engine's KV blocks,
requests, jobs and admission counters are back where they started."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import pathlib
import sys

import pytest

from flexserve.config import CacheConfig, CoserveConfig, EngineConfig, LoRAConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.entrypoints.openai.limits import AdmissionLimits
from flexserve.finetune.service import FinetuneServiceConfig

from _tokenizer import tiny_byte_level_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}")


@pytest.fixture(scope="module")
def soak():
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_short_soak_leaves_the_server_whole(soak, smollm2_dir, tmp_path):
    config = soak.SoakConfig(max_num_seqs=3, max_queue_len=3, rounds=2, requests_per_round=12,
                             max_tokens=8, seed=1)
    config.adapter_dir = soak.write_adapter(smollm2_dir, str(tmp_path / "adapter"))
    log = str(tmp_path / "server.log")
    with soak.serve(smollm2_dir, str(tmp_path / "state"), config, log) as (url, pid):
        report = asyncio.run(soak.soak(url, config, pid))
    assert report.violations == [], report.summary() + "\n" + open(log).read()[-3000:]
    mixed, burst = report.counts("mixed"), report.counts("burst")
    # the run did what it claims: aborts, answers, refusals, adapter churn, a job
    assert mixed["answered"] > 0 and mixed["aborted"] > 0 and mixed["rejected"] == 0
    assert sum(mixed.values()) == config.rounds * config.requests_per_round
    assert burst["rejected"] > 0 and burst["answered"] >= config.limit
    assert sum(burst.values()) == config.burst_factor * config.limit
    assert report.num_adapter_cycles >= 1
    assert report.job_status == "succeeded"
    assert len(report.rss_mib) == config.rounds
    assert report.final_metrics["flexserve:kv_cache_usage_perc"] == 0.0


@pytest.mark.slow
def test_1000_random_aborts_beside_two_jobs_leave_nothing_behind(soak, tiny_config,
                                                                  tiny_checkpoint, tmp_path):
    hf_config = tiny_config("llama", vocab_size=320, max_position_embeddings=256)
    model_dir = tiny_checkpoint(hf_config, seed=11)
    tokenizer = copy.deepcopy(tiny_byte_level_tokenizer())
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    config = soak.SoakConfig(max_num_seqs=8, max_queue_len=8, rounds=5, requests_per_round=250,
                             abort_probability=1.0, stream_probability=1.0, max_tokens=12,
                             num_jobs=2, job_epochs=3, seed=2)
    config.adapter_dir = soak.write_adapter(model_dir, str(tmp_path / "adapter"), seed=5)
    engine = build_async_engine(EngineConfig(
        model=ModelConfig(model=model_dir, max_model_len=256),
        cache=CacheConfig(kv_cache_gib=0.02),
        lora=LoRAConfig(max_loras=4, max_lora_rank=4),
        coserve=CoserveConfig(slo_tpot_ms=None)), log_stats=False)
    app = build_app(engine, served_model_name=soak.MODEL,
                    limits=AdmissionLimits(max_num_requests=config.limit),
                    finetune=FinetuneServiceConfig(state_dir=str(tmp_path / "state"),
                                                   max_concurrent_jobs=2))
    thread = ServerThread(app)
    url = thread.start()
    try:
        scheduler = engine.engine.scheduler
        free_blocks = scheduler.kv_cache_manager.num_free_blocks
        report = asyncio.run(soak.soak(url, config))
        assert report.violations == [], report.summary()
        mixed = report.counts("mixed")
        # every stream is dropped after a few chunks, but for those on an adapter unloaded
        # under them (answered with model_not_found)
        assert mixed["aborted"] >= 1000
        assert mixed["aborted"] + mixed["answered"] == config.rounds * config.requests_per_round
        assert report.job_statuses.count("succeeded") >= 2
        # the engine's own books: every block free, nothing queued, no slot held by a job
        assert scheduler.kv_cache_manager.num_free_blocks == free_blocks
        assert not scheduler.requests and not scheduler.finetune.jobs
        adapters = scheduler.adapter_manager
        adapters.check_invariants()
        assert not any(adapters.num_running_by_name().values())  # no slot pinned
        assert app.state.admission.num_in_flight == 0
        assert app.state.admission.num_sequences_in_flight == 0
    finally:
        thread.stop()
        engine.shutdown()
