"""Prometheus metrics of the serving loop, vLLM's names with the `flexserve:` prefix.

The only module (with the package `__init__`) that imports prometheus_client. Each
`PrometheusStatLogger` owns its metrics in its own `CollectorRegistry`, so several apps (tests)
can live in one process; every metric carries a `model_name` label.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from flexserve.engine.serving_stats import FinishedRequestStats, IterationStats
from flexserve.metrics.finetune_metrics import ALL_JOBS

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                             0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
FINISH_REASONS = ("stop", "length", "abort")


# No `*_created` series next to every counter and histogram (vLLM does the same); this is a
# process-wide switch of prometheus_client, which only this package uses.
disable_created_metrics()


def iteration_tokens_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 8, 16, 32, ... doubling up to the token budget of one iteration (inclusive)."""
    buckets = [1]
    size = 8
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_num_batched_tokens)
    return tuple(sorted(set(buckets)))


class PrometheusStatLogger:
    """Turns the engine loop's `IterationStats` into Prometheus metrics (a `StatLogger`)."""

    def __init__(
        self,
        model_name: str,
        max_num_batched_tokens: int = 2048,
        registry: CollectorRegistry | None = None,
        enable_lora: bool = False,
        slo_ttft_s: float = 5.0,
        slo_tpot_s: float = 0.05,
        slo_window_s: float = 60.0,
        job_id_labels: bool = True,
        public_lora_name: Callable[[str], str] | None = None,
    ) -> None:
        self.model_name = model_name
        # Job ids and tenants' adapter names are tenants' data: with `job_id_labels` off, every
        # job's counters go to job_id="all", and `public_lora_name` maps an adapter's name to
        # the label it is shown under (counts of names mapped alike are summed).
        self.job_id_labels = job_id_labels
        self.public_lora_name = public_lora_name
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.time_to_first_token = histogram(
            "flexserve:time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "flexserve:inter_token_latency_seconds",
            "Seconds between consecutive generated tokens of a completion.", ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "flexserve:e2e_request_latency_seconds",
            "Seconds from arrival to the last token of requests that finished (not aborted).",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "flexserve:request_queue_time_seconds",
            "Seconds from arrival until the scheduler first admitted the request.",
            REQUEST_LATENCY_BUCKETS)
        self.iteration_latency = histogram(
            "flexserve:iteration_latency_seconds",
            "Wall seconds of one engine iteration (schedule + execute + update).",
            ITERATION_LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "flexserve:iteration_tokens",
            "Tokens in one iteration's forward (prefill chunks + decodes).",
            iteration_tokens_buckets(max_num_batched_tokens))

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r, multiprocess_mode="mostrecent").labels(
                model_name)

        self.num_requests_running = gauge(
            "flexserve:num_requests_running", "Sequences holding KV blocks (being generated).")
        self.num_requests_waiting = gauge(
            "flexserve:num_requests_waiting", "Sequences queued for admission (new or preempted).")
        self.kv_cache_usage = gauge(
            "flexserve:kv_cache_usage_perc",
            "Fraction of KV cache blocks held by requests (1 means 100 percent).")
        self.prefix_cache_hit_rate = gauge(
            "flexserve:prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up, since start.")

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.prompt_tokens = counter(
            "flexserve:prompt_tokens",
            "Prompt tokens of requests that produced a first token (each prompt once).")
        self.generation_tokens = counter(
            "flexserve:generation_tokens", "Generated tokens, over all completions.")
        self.num_preemptions = counter(
            "flexserve:num_preemptions", "Requests preempted (KV freed, recomputed later).")
        request_success = Counter(
            "flexserve:request_success",
            "Completions that ended, by finish reason (each of a request's n choices).",
            labels + ["finished_reason"], registry=r)
        self.request_success = {
            reason: request_success.labels(model_name, reason) for reason in FINISH_REASONS
        }
        self._request_success_family = request_success

        # Co-serving: SLO attainment of finished requests and the fine-tuning work per iteration.
        self.slo_s = {"ttft": slo_ttft_s, "tpot": slo_tpot_s}
        self.slo_window_s = slo_window_s
        self._slo_window: deque[tuple[float, dict[str, bool]]] = deque()  # (time, slo -> met)
        attainment = Gauge(
            "flexserve:slo_attainment",
            f"Fraction of the requests finished in the last {slo_window_s:g} s that met the SLO "
            "(ttft: time to first token, tpot: time per output token).",
            labels + ["slo"], registry=r, multiprocess_mode="mostrecent")
        met = Counter(
            "flexserve:requests_slo_met",
            "Finished requests that met the SLO (ttft, tpot).", labels + ["slo"], registry=r)
        self._slo_attainment_family = attainment  # children appear with the first finished request
        self.requests_slo_met = {slo: met.labels(model_name, slo) for slo in self.slo_s}
        self.slo_feasible = Gauge(
            "flexserve:slo_feasible",
            "1 while the device can meet the SLO with inference alone, 0 when it cannot "
            "(tpot: a decode step, predicted by the latency profile at start-up and measured "
            "on decode-only iterations, against --slo-tpot-ms less --slo-margin); absent until "
            "known.", labels + ["slo"], registry=r, multiprocess_mode="mostrecent")
        self.finetune_window_tokens = histogram(
            "flexserve:finetune_window_tokens",
            "Fine-tuning forward-window tokens in one iteration (iterations with fine-tuning).",
            iteration_tokens_buckets(max_num_batched_tokens))
        self._finetune_tokens = Counter(
            "flexserve:finetune_tokens",
            "Fine-tuning tokens processed: phase=forward (window tokens), phase=backward "
            "(layer-window tokens, one per token and layer).",
            labels + ["job_id", "phase"], registry=r)
        self.latency_model_error_ratio = gauge(
            "flexserve:latency_model_error_ratio",
            "Rolling mean of |predicted - measured| / measured iteration time of the latency "
            "model that sizes fine-tuning windows.")
        self.latency_model_scale = gauge(
            "flexserve:latency_model_scale",
            "The latency model's online correction of the forward's terms: measured / "
            "predicted iteration time, averaged (1 = the profile holds).")
        self.latency_model_backward_scale = gauge(
            "flexserve:latency_model_backward_scale",
            "The latency model's online correction of the backward windows' terms (1 = the "
            "profile holds).")
        self.iteration_overhead = gauge(
            "flexserve:iteration_overhead_seconds",
            "Average host time between two back-to-back iterations while requests run (output "
            "processing; the fine-tuning window sizing takes it off the TPOT limit).")

        self._requests_rejected = Counter(
            "flexserve:requests_rejected",
            "Requests refused before reaching the engine, by error code (429 too_many_requests "
            "or tenant_rate_limit_exceeded, 503 server_shutting_down).",
            labels + ["code"], registry=r)

        # LoRA families exist only when LoRA is enabled: a base-only server exposes none.
        self.lora_requests_running: Gauge | None = None
        self.lora_adapters_loaded: dict[str, Gauge] = {}
        self._lora_names: set[str] = set()  # adapter names with a lora_requests_running child
        if enable_lora:
            self.lora_requests_running = Gauge(
                "flexserve:lora_requests_running",
                "Running requests per LoRA adapter (0 for a loaded adapter that is idle).",
                labels + ["lora_name"], registry=r, multiprocess_mode="mostrecent")
            loaded = Gauge(
                "flexserve:lora_adapters_loaded",
                "LoRA adapters loaded: where=gpu in device slots, where=cpu in host memory.",
                labels + ["where"], registry=r, multiprocess_mode="mostrecent")
            self.lora_adapters_loaded = {
                where: loaded.labels(model_name, where) for where in ("gpu", "cpu")}

    def record(self, stats: IterationStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        if stats.step_latency is not None:
            self.iteration_latency.observe(stats.step_latency)
            self.iteration_tokens.observe(stats.num_batched_tokens)
        if self.lora_requests_running is not None and stats.lora_requests_running is not None:
            self._record_lora(stats)
        self._record_finetune(stats)
        if stats.slo_tpot_feasible is not None:
            self.slo_feasible.labels(self.model_name, "tpot").set(int(stats.slo_tpot_feasible))
        for ttft in stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in stats.finished_requests:
            for reason in finished.finish_reasons:
                child = self.request_success.get(reason)
                if child is None:
                    child = self.request_success[reason] = self._request_success_family.labels(
                        self.model_name, reason)
                child.inc()
            if finished.aborted:
                continue
            self.e2e_request_latency.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.request_queue_time.observe(finished.queue_time)
            self._record_slo(stats.now, finished)
        self._expire_slo_window(stats.now)

    def _record_slo(self, now: float, finished: FinishedRequestStats) -> None:
        """A request's TTFT and TPOT against the SLOs (a request with one token meets TPOT)."""
        met = {
            "ttft": finished.ttft is not None and finished.ttft <= self.slo_s["ttft"],
            "tpot": finished.tpot is None or finished.tpot <= self.slo_s["tpot"],
        }
        for slo, ok in met.items():
            if ok:
                self.requests_slo_met[slo].inc()
        self._slo_window.append((now, met))

    def _expire_slo_window(self, now: float) -> None:
        window = self._slo_window
        while window and window[0][0] < now - self.slo_window_s:
            window.popleft()
        if window:
            for slo in self.slo_s:
                self._slo_attainment_family.labels(self.model_name, slo).set(
                    sum(met[slo] for _, met in window) / len(window))

    def _record_finetune(self, stats: IterationStats) -> None:
        if stats.latency_model_error_ratio is not None:
            self.latency_model_error_ratio.set(stats.latency_model_error_ratio)
        if stats.latency_model_scale is not None:
            self.latency_model_scale.set(stats.latency_model_scale)
        if stats.latency_model_backward_scale is not None:
            self.latency_model_backward_scale.set(stats.latency_model_backward_scale)
        if stats.iteration_overhead is not None:
            self.iteration_overhead.set(stats.iteration_overhead)
        if stats.finetune_forward_tokens or stats.finetune_backward_tokens:
            self.finetune_window_tokens.observe(sum(stats.finetune_forward_tokens.values()))
        for phase, tokens in (("forward", stats.finetune_forward_tokens),
                              ("backward", stats.finetune_backward_tokens)):
            for job_id, num_tokens in tokens.items():
                label = job_id if self.job_id_labels else ALL_JOBS
                self._finetune_tokens.labels(self.model_name, label, phase).inc(num_tokens)

    def record_rejection(self, code: str) -> None:
        """One request refused by admission control (called on the server's event loop)."""
        self._requests_rejected.labels(self.model_name, code).inc()

    def _record_lora(self, stats: IterationStats) -> None:
        assert self.lora_requests_running is not None
        running = stats.lora_requests_running or {}
        if self.public_lora_name is not None:
            public: dict[str, int] = {}
            for name, count in running.items():
                label = self.public_lora_name(name)
                public[label] = public.get(label, 0) + count
            running = public
        for name, count in running.items():
            self.lora_requests_running.labels(self.model_name, name).set(count)
        for name in self._lora_names - running.keys():  # unloaded: drop the series
            self.lora_requests_running.remove(self.model_name, name)
        self._lora_names = set(running)
        self.lora_adapters_loaded["gpu"].set(stats.num_loras_gpu)
        self.lora_adapters_loaded["cpu"].set(stats.num_loras_cpu)

    def render(self) -> tuple[bytes, str]:
        """The exposition text of this logger's registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
