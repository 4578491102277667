"""/metrics parses with prometheus-client's parser; counters move by exactly what was served."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.engine.serving_stats import FinishedRequestStats, IterationStats
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.metrics import PrometheusStatLogger
from flexserve.metrics.prometheus import iteration_tokens_buckets

MODEL = "smollm2"

HISTOGRAMS = {
    "flexserve:time_to_first_token_seconds", "flexserve:inter_token_latency_seconds",
    "flexserve:e2e_request_latency_seconds", "flexserve:request_queue_time_seconds",
    "flexserve:iteration_latency_seconds", "flexserve:iteration_tokens",
    "flexserve:finetune_window_tokens",
}
GAUGES = {
    "flexserve:num_requests_running", "flexserve:num_requests_waiting",
    "flexserve:kv_cache_usage_perc", "flexserve:prefix_cache_hit_rate",
    "flexserve:slo_attainment", "flexserve:latency_model_error_ratio",
    "flexserve:latency_model_scale", "flexserve:latency_model_backward_scale",
    "flexserve:iteration_overhead_seconds", "flexserve:slo_feasible",
}
COUNTERS = {  # family names: the exposition adds `_total`
    "flexserve:prompt_tokens", "flexserve:generation_tokens", "flexserve:request_success",
    "flexserve:num_preemptions", "flexserve:requests_slo_met", "flexserve:finetune_tokens",
    "flexserve:requests_rejected",
}


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = EngineConfig(model=ModelConfig(model=smollm2_dir, max_model_len=1024),
                          cache=CacheConfig(kv_cache_gib=0.25))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name=MODEL))
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine)
    thread.stop()
    engine.shutdown()


def scrape(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels without model_name): value}; checks the label."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL, sample
            samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_parse_with_their_documented_names(server):
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert HISTOGRAMS | GAUGES | COUNTERS == set(families)
    for name in HISTOGRAMS:
        assert families[name].type == "histogram"
    for name in GAUGES:
        assert families[name].type == "gauge"
    for name in COUNTERS:
        assert families[name].type == "counter"
    assert "flexserve:prompt_tokens_total{" in response.text
    reasons = {s.labels["finished_reason"] for s in families["flexserve:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    scrape(response.text)  # every sample carries model_name


def test_counters_move_by_exactly_the_served_amounts(server):
    before = scrape(httpx.get(server.url + "/metrics").text)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    completion = client.completions.create(
        model=MODEL, prompt="Counting sheep:", max_tokens=5, n=2, temperature=0.8, seed=7,
        extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 10 and chat.usage.completion_tokens == 3

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    # Stats reach the metrics right after the outputs reach the handlers: poll briefly.
    deadline = time.monotonic() + 5
    while True:
        after = scrape(httpx.get(server.url + "/metrics").text)
        if delta("flexserve:request_success_total", finished_reason="length") == 3:
            break
        assert time.monotonic() < deadline, "request_success_total did not reach +3"
        time.sleep(0.02)

    prompt_tokens = completion.usage.prompt_tokens + chat.usage.prompt_tokens
    assert delta("flexserve:prompt_tokens_total") == prompt_tokens
    assert delta("flexserve:generation_tokens_total") == 13
    assert delta("flexserve:request_success_total", finished_reason="stop") == 0
    assert delta("flexserve:request_success_total", finished_reason="abort") == 0
    assert delta("flexserve:num_preemptions_total") == 0
    assert delta("flexserve:time_to_first_token_seconds_count") == 2
    assert delta("flexserve:e2e_request_latency_seconds_count") == 2
    assert delta("flexserve:request_queue_time_seconds_count") == 2
    # One latency per token after each completion's first: (5 - 1) * 2 + (3 - 1).
    assert delta("flexserve:inter_token_latency_seconds_count") == 10
    num_steps = delta("flexserve:iteration_latency_seconds_count")
    assert num_steps >= 5 and delta("flexserve:iteration_tokens_count") == num_steps
    assert delta("flexserve:iteration_tokens_sum") >= 13
    assert delta("flexserve:e2e_request_latency_seconds_sum") > 0
    for gauge in ("flexserve:num_requests_running", "flexserve:num_requests_waiting",
                  "flexserve:kv_cache_usage_perc"):
        assert value(after, gauge) == 0.0
    assert 0.0 <= value(after, "flexserve:prefix_cache_hit_rate") <= 1.0


def test_stat_logger_maps_iteration_stats_exactly():
    metrics = PrometheusStatLogger(MODEL, max_num_batched_tokens=512)
    metrics.record(IterationStats(
        now=1.0, num_running=3, num_waiting=2, kv_cache_usage=0.5, prefix_cache_hit_rate=0.25,
        num_preemptions=2, step_latency=0.03, num_batched_tokens=40, num_prompt_tokens=30,
        num_generation_tokens=4, time_to_first_tokens=[0.2, 0.3], inter_token_latencies=[0.05],
        finished_requests=[
            FinishedRequestStats(["stop", "length"], 1.5, 0.1, 10, 6, aborted=False),
            FinishedRequestStats(["abort"], 0.7, None, 20, 1, aborted=True),
        ],
    ))
    metrics.record(IterationStats(now=2.0, num_running=1))  # an iteration without a step
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    s = scrape(text.decode())
    assert value(s, "flexserve:num_requests_running") == 1
    assert value(s, "flexserve:num_requests_waiting") == 0
    assert value(s, "flexserve:kv_cache_usage_perc") == 0.0
    assert value(s, "flexserve:prompt_tokens_total") == 30
    assert value(s, "flexserve:generation_tokens_total") == 4
    assert value(s, "flexserve:num_preemptions_total") == 2
    assert value(s, "flexserve:request_success_total", finished_reason="stop") == 1
    assert value(s, "flexserve:request_success_total", finished_reason="length") == 1
    assert value(s, "flexserve:request_success_total", finished_reason="abort") == 1
    assert value(s, "flexserve:time_to_first_token_seconds_count") == 2
    assert value(s, "flexserve:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(s, "flexserve:inter_token_latency_seconds_count") == 1
    # Aborted requests are left out of the latency histograms.
    assert value(s, "flexserve:e2e_request_latency_seconds_count") == 1
    assert value(s, "flexserve:e2e_request_latency_seconds_sum") == 1.5
    assert value(s, "flexserve:request_queue_time_seconds_sum") == pytest.approx(0.1)
    assert value(s, "flexserve:iteration_latency_seconds_count") == 1
    assert value(s, "flexserve:iteration_tokens_sum") == 40
    assert value(s, "flexserve:iteration_tokens_bucket", le="32.0") == 0
    assert value(s, "flexserve:iteration_tokens_bucket", le="64.0") == 1
    assert value(s, "flexserve:time_to_first_token_seconds_bucket", le="0.25") == 1


def test_each_stat_logger_has_its_own_registry():
    first, second = PrometheusStatLogger(MODEL), PrometheusStatLogger(MODEL)
    first.record(IterationStats(num_generation_tokens=5))
    assert value(scrape(first.render()[0].decode()), "flexserve:generation_tokens_total") == 5
    assert value(scrape(second.render()[0].decode()), "flexserve:generation_tokens_total") == 0


def test_iteration_tokens_buckets_double_up_to_the_budget():
    assert iteration_tokens_buckets(100) == (1, 8, 16, 32, 64, 100)
    assert iteration_tokens_buckets(2048)[-1] == 2048


def test_coserving_metrics_map_slo_attainment_and_fine_tuning_work():
    metrics = PrometheusStatLogger(MODEL, max_num_batched_tokens=512, slo_ttft_s=1.0,
                                   slo_tpot_s=0.05, slo_window_s=10.0)

    def finished(ttft, tpot):
        return FinishedRequestStats(["length"], 2.0, 0.1, 10, 5, aborted=False, ttft=ttft,
                                    tpot=tpot)

    metrics.record(IterationStats(
        now=100.0, finished_requests=[finished(0.5, 0.04), finished(1.5, 0.04),
                                      finished(0.2, 0.08), finished(0.3, None)],
        finetune_forward_tokens={"ftjob-a": 30, "ftjob-b": 10},
        finetune_backward_tokens={"ftjob-a": 96}, latency_model_error_ratio=0.12,
        latency_model_scale=1.5, latency_model_backward_scale=2.5, iteration_overhead=0.004))
    s = scrape(metrics.render()[0].decode())
    assert value(s, "flexserve:requests_slo_met_total", slo="ttft") == 3
    assert value(s, "flexserve:requests_slo_met_total", slo="tpot") == 3  # one token: met
    assert value(s, "flexserve:slo_attainment", slo="ttft") == 0.75
    assert value(s, "flexserve:slo_attainment", slo="tpot") == 0.75
    assert value(s, "flexserve:finetune_tokens_total", job_id="ftjob-a", phase="forward") == 30
    assert value(s, "flexserve:finetune_tokens_total", job_id="ftjob-a", phase="backward") == 96
    assert value(s, "flexserve:finetune_tokens_total", job_id="ftjob-b", phase="forward") == 10
    assert value(s, "flexserve:finetune_window_tokens_sum") == 40
    assert value(s, "flexserve:latency_model_error_ratio") == 0.12
    assert value(s, "flexserve:latency_model_scale") == 1.5
    assert value(s, "flexserve:latency_model_backward_scale") == 2.5
    assert value(s, "flexserve:iteration_overhead_seconds") == 0.004
    # The attainment window rolls: after 10 s only the newer requests count.
    metrics.record(IterationStats(now=105.0, finished_requests=[finished(2.0, 0.2)]))
    s = scrape(metrics.render()[0].decode())
    assert value(s, "flexserve:slo_attainment", slo="ttft") == 0.6
    metrics.record(IterationStats(now=111.0, finished_requests=[finished(0.1, 0.01)]))
    s = scrape(metrics.render()[0].decode())
    assert value(s, "flexserve:slo_attainment", slo="ttft") == 0.5  # 2.0 (miss) and 0.1 (met)
    assert value(s, "flexserve:requests_slo_met_total", slo="ttft") == 4


def test_slo_feasible_gauge_follows_the_engine_verdict():
    metrics = PrometheusStatLogger(MODEL)
    metrics.record(IterationStats(now=1.0))  # not known yet: no series
    assert b"flexserve:slo_feasible{" not in metrics.render()[0]
    for verdict, expected in ((False, 0.0), (True, 1.0)):
        metrics.record(IterationStats(now=2.0, slo_tpot_feasible=verdict))
        families = {f.name: f for f in text_string_to_metric_families(
            metrics.render()[0].decode())}
        (sample,) = families["flexserve:slo_feasible"].samples
        assert sample.labels == {"model_name": MODEL, "slo": "tpot"}
        assert sample.value == expected
