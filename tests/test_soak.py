"""The short soak (benchmarks/soak.py) against a real `flexserve serve` subprocess (SmolLM2, CPU):
streaming and plain requests with random client aborts, a LoRA adapter loaded and unloaded under
traffic, a fine-tuning job, a burst over the admission limit. Afterwards: every accepted request
answered or aborted, 429 only over the limit (and with Retry-After), nothing running, waiting or
holding a KV block, the job succeeded, the server's RSS flat from round to round."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import sys

import pytest


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
