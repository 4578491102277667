"""`flexserve bench serve`: an online serving benchmark against a running OpenAI-compatible server.

vLLM's `benchmark_serving` semantics: requests are sent at arrival times drawn from a gamma process
(`--burstiness` is the shape k: 1 is Poisson, k < 1 burstier, with mean inter-arrival 1/rate), each
streamed over SSE, and the client measures per request TTFT (to the first chunk carrying text),
TPOT = (e2e - ttft) / (output_tokens - 1), every inter-chunk gap (ITL) and E2E. Output tokens are
counted from the stream's usage chunk. Goodput is the completed requests per second that meet
every given SLO; the attainment of one SLO is the fraction of completed requests meeting it.

With `--finetune-file` it also uploads the file, starts a LoRA fine-tuning job before the traffic
and reports the job's fine-tuning tokens per second over the inference run window (first request
sent to last request done), from `/metrics` (`flexserve:finetune_tokens_total{phase="forward"}`
of the job), else from the job's `trained_tokens`. `--num-prompts 0 --duration S` measures the
job alone for S seconds.

The arrival process, dataset sampling and metric aggregation are plain functions (no server).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

DATASET_NAMES = ("random", "sharegpt-like", "jsonl")
# ShareGPT-like lengths: log-normal, parameters fitted by eye to published ShareGPT statistics
# (vLLM and DistServe papers, Llama tokenizers: mean prompt ~160-230 tokens, mean output
# ~200-340, both heavy-tailed). With mu = ln(median): mean = median * exp(sigma^2 / 2), so
# 211 prompt and 264 output tokens before clipping.
SHAREGPT_INPUT_MEDIAN = 128
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_MEDIAN = 160
SHAREGPT_OUTPUT_SIGMA = 1.0
# The bounds vLLM's ShareGPT sampler filters by: at least 4 tokens each, prompts up to 1024.
MIN_SAMPLED_LEN = 4
MAX_SAMPLED_INPUT_LEN = 1024
# Common English words, each one token (with its leading space) in GPT-2, Llama-3 and SmolLM2
# style BPE vocabularies, so a prompt of N random words is about N tokens.
PROMPT_WORDS = tuple("""
the of and to in is it you that he was for on are with as his they be at one have this from or
had by word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form great think say help low line turn cause much mean before move right boy old
too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off
need house picture try us again animal point mother world near build self earth father head stand
own page should country found answer school grow study still learn plant cover food sun four
thought let keep eye never last door between city tree cross since hard start might story saw far
sea draw left late run while press close night real life few stop open seem together next white
children begin got walk example ease paper often always music those both mark book letter until
mile river car feet care second group carry took rain eat room friend began idea fish mountain
north once base hear horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose leave song measure
state product black short class wind question happen complete ship area half rock order
fire south problem piece told knew pass farm top whole king size heard best hour better true
during hundred am remember step early hold west ground interest reach fast five sing listen six
table travel less morning ten simple several vowel toward war lay against pattern slow center love
person money serve appear road map science rule govern pull cold notice voice fall power town fine
certain fly unit lead cry dark machine note wait plan figure star box noun field rest correct able
pound done beauty drive stood contain front teach week final gave green oh quick develop sleep
warm free minute strong special mind behind clear tail produce fact street inch lot nothing course
stay wheel full force blue object decide surface deep moon island foot yet busy test record boat
common gold possible plane age dry wonder laugh thousand ago ran check game shape yes hot miss
brought heat snow bed bring sit perhaps fill east weight language among""".split())


# ------------------------------------------------------------------------------------ datasets
@dataclass(slots=True, frozen=True)
class SampledRequest:
    """One request to send, as the dataset made it."""

    prompt: str  # the completion prompt, or the user message on the chat endpoint
    prompt_len: int  # prompt tokens aimed for (words of a synthetic prompt); 0 when unknown
    output_len: int  # max_tokens asked for (generated exactly when EOS is ignored)


def random_text(rng: random.Random, num_words: int) -> str:
    """`num_words` words drawn uniformly from PROMPT_WORDS, space separated."""
    return " ".join(rng.choices(PROMPT_WORDS, k=num_words))


def iter_random_requests(input_len: int, output_len: int, seed: int) -> Iterator[SampledRequest]:
    """Endless prompts of `input_len` random words, each asking for `output_len` tokens."""
    _check_min("input-len", input_len, 1)
    _check_min("output-len", output_len, 1)
    rng = random.Random(f"random-{seed}")
    while True:
        yield SampledRequest(random_text(rng, input_len), input_len, output_len)


def sharegpt_like_lengths(seed: int, max_model_len: int) -> Iterator[tuple[int, int]]:
    """Endless (prompt, output) lengths from the SHAREGPT_* log-normals, clipped so that
    4 <= prompt <= min(1024, max_model_len // 2) and 4 <= output <= max_model_len - prompt."""
    _check_min("max-model-len", max_model_len, 2 * MIN_SAMPLED_LEN)
    rng = random.Random(f"sharegpt-like-{seed}")
    max_input = min(MAX_SAMPLED_INPUT_LEN, max_model_len // 2)
    while True:
        prompt = rng.lognormvariate(math.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA)
        output = rng.lognormvariate(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA)
        num_prompt = min(max(round(prompt), MIN_SAMPLED_LEN), max_input)
        num_output = min(max(round(output), MIN_SAMPLED_LEN), max_model_len - num_prompt)
        yield num_prompt, num_output


def iter_sharegpt_like_requests(seed: int, max_model_len: int,
                                max_output_len: int | None = None) -> Iterator[SampledRequest]:
    """Endless random-word prompts with ShareGPT-like lengths (see `sharegpt_like_lengths`);
    `max_output_len` caps the outputs further (a benchmark's drain time)."""
    rng = random.Random(f"sharegpt-like-text-{seed}")
    for num_prompt, num_output in sharegpt_like_lengths(seed, max_model_len):
        if max_output_len is not None:
            num_output = min(num_output, max_output_len)
        yield SampledRequest(random_text(rng, num_prompt), num_prompt, num_output)


def load_jsonl_requests(path: str, output_len: int) -> list[SampledRequest]:
    """`{"prompt": text}` per line, optionally with `"output_len": n` (else `output_len`);
    ValueError naming the file and line of a bad one."""
    requests: list[SampledRequest] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from e
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) \
                    or not item["prompt"]:
                raise ValueError(f'{where}: expected {{"prompt": "non-empty text"}}, optionally '
                                 f'with "output_len": n')
            unknown = sorted(set(item) - {"prompt", "output_len"})
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
            n = item.get("output_len", output_len)
            if type(n) is not int or n < 1:
                raise ValueError(f"{where}: output_len must be an integer >= 1, got {n!r}")
            requests.append(SampledRequest(item["prompt"], 0, n))
    if not requests:
        raise ValueError(f"{path} has no prompts")
    return requests


# ------------------------------------------------------------------------------------ arrivals
def iter_arrival_times(request_rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Endless send times in seconds from the start: gamma inter-arrivals of shape `burstiness`
    and mean 1 / `request_rate` (burstiness 1: a Poisson process); all 0 for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        yield from itertools.repeat(0.0)
        return
    rng = random.Random(f"arrivals-{seed}")
    scale = 1.0 / (request_rate * burstiness)  # mean of gamma(k, theta) is k * theta
    t = 0.0
    while True:
        t += rng.gammavariate(burstiness, scale)
        yield t


def arrival_times(num_requests: int, request_rate: float, burstiness: float,
                  seed: int) -> list[float]:
    """The first `num_requests` send times of `iter_arrival_times`."""
    return list(itertools.islice(iter_arrival_times(request_rate, burstiness, seed),
                                 num_requests))


# ------------------------------------------------------------------------------------ metrics
@dataclass(slots=True)
class RequestRecord:
    """What the client measured for one request (times in seconds)."""

    index: int  # position in the send order
    tenant: str | None  # the `user` field it was sent with
    scheduled_s: float  # planned send time, from the benchmark start
    expected_prompt_len: int  # prompt tokens the dataset aimed for (0: unknown)
    max_tokens: int  # output tokens asked for
    sent_s: float = 0.0  # actual send time, from the benchmark start
    ttft_s: float | None = None  # to the first chunk carrying text
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks
    e2e_s: float | None = None  # to the end of the stream
    prompt_tokens: int = 0  # from the usage chunk
    output_tokens: int = 0  # from the usage chunk, else the number of text chunks
    error: str | None = None  # why it failed; None when it completed

    @property
    def success(self) -> bool:
        return self.error is None and self.e2e_s is not None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1); None for failed or one-token requests."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_s": self.tpot_s}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std and each `p<q>` of `values`; None everywhere when there are none."""
    keys = ["mean", "median", "std", *(f"p{q:g}" for q in percentiles)]
    if not values:
        return dict.fromkeys(keys)
    mean = sum(values) / len(values)
    stats: dict[str, float | None] = {
        "mean": mean, "median": percentile(values, 50),
        "std": math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)),
    }
    stats.update({f"p{q:g}": percentile(values, q) for q in percentiles})
    return stats


def aggregate_metrics(records: Sequence[RequestRecord], duration_s: float,
                      percentiles: Sequence[float] = (50, 90, 99),
                      slo_ttft_ms: float | None = None,
                      slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Totals, throughputs, latency statistics (ms), SLO attainment and goodput of a run.

    A one-token request has no TPOT (it is left out of the TPOT statistics) and meets any TPOT
    SLO, as in vLLM. Attainment is over completed requests; failed ones are counted apart.
    """
    done = [r for r in records if r.success]
    ms = lambda values: [v * 1000.0 for v in values]  # noqa: E731
    num_input = sum(r.prompt_tokens for r in done)
    num_output = sum(r.output_tokens for r in done)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    slos = {"ttft": slo_ttft_ms, "tpot": slo_tpot_ms}
    meets: dict[str, list[bool]] = {}
    for name, slo in slos.items():
        if slo is not None:
            value = (lambda r: r.ttft_s) if name == "ttft" else (lambda r: r.tpot_s or 0.0)
            meets[name] = [value(r) * 1000.0 <= slo for r in done]
    num_good = sum(all(ok) for ok in zip(*meets.values())) if meets else None
    return {
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(num_output),
        "total_token_throughput": per_s(num_input + num_output),
        "ttft_ms": summarize(ms(r.ttft_s for r in done), percentiles),
        "tpot_ms": summarize(ms(tpots), percentiles),
        "itl_ms": summarize(ms(g for r in done for g in r.itl_s), percentiles),
        "e2e_ms": summarize(ms(r.e2e_s for r in done), percentiles),
        "slo_ms": {k: v for k, v in slos.items() if v is not None},
        "slo_attainment": {k: (sum(v) / len(v) if v else None) for k, v in meets.items()},
        "goodput": None if num_good is None else per_s(num_good),
    }


def format_report(result: dict[str, Any]) -> str:
    """vLLM-style text table of a result (`benchmark`'s return value)."""
    m = result["metrics"]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else (format(value, fmt) if fmt else str(value))
        lines.append(f"{label:<40} {text:>9}")

    row("Successful requests:", m["num_completed"], "")
    row("Failed requests:", m["num_failed"], "")
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"], "")
    row("Total generated tokens:", m["total_output_tokens"], "")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name, slo in m["slo_ms"].items():
        row(f"{name.upper()} SLO attainment (<= {slo:g} ms):",
            None if m["slo_attainment"][name] is None else 100 * m["slo_attainment"][name], ".1f")
    if m["goodput"] is not None:
        row("Request goodput (req/s):", m["goodput"])
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"),
                              ("e2e_ms", "End-to-end Latency", "E2EL")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, value in m[key].items():
            if stat != "std":
                label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
                row(f"{label} {short} (ms):", value)
    finetune = result.get("finetune")
    if finetune:
        lines.append("{s:{c}^50}".format(s="Fine-tuning", c="-"))
        row("Job:", finetune["job_id"], "")
        row("Status at the end:", finetune["status"], "")
        row("Trained tokens in the window:", finetune["trained_tokens"], "")
        row("Fine-tuning throughput (tok/s):", finetune["tokens_per_s"])
        if finetune.get("error"):
            lines.append(f"Job error: {finetune['error']}")
    if result["errors"]:
        lines.append("{s:{c}^50}".format(s="First errors", c="-"))
        lines.extend(result["errors"])
    lines.append("=" * 50)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- fine-tuning
_PENDING_JOB_STATES = ("validating_files", "queued")
_ENDED_JOB_STATES = ("succeeded", "failed", "cancelled")


@dataclass(slots=True, frozen=True)
class FinetuneSample:
    """One look at the fine-tuning job."""

    time_s: float  # time.perf_counter() when it was read
    status: str  # the job's status
    trained_tokens: int | None  # the job object's; None when it reports none
    metrics_tokens: dict[str, float]  # flexserve:finetune_tokens_total of the job, per phase


def finetune_tokens_per_s(first: FinetuneSample, last: FinetuneSample) -> tuple[int, float, str]:
    """(tokens, tokens/s, source) between two samples. /metrics' forward-phase counter of the
    job comes first: it moves with every window, while a job object's trained_tokens moves only
    at checkpoints and at the end (OpenAI's semantics). Without either, 0 from "none"."""
    elapsed = last.time_s - first.time_s
    if "forward" in last.metrics_tokens:
        num = int(last.metrics_tokens["forward"] - first.metrics_tokens.get("forward", 0.0))
        source = "metrics.finetune_tokens_total"
    elif first.trained_tokens is not None and last.trained_tokens is not None:
        num, source = last.trained_tokens - first.trained_tokens, "job.trained_tokens"
    else:
        num, source = 0, "none"
    return num, (num / elapsed if elapsed > 0 else 0.0), source


class FinetuneMonitor:
    """Uploads a training file, starts a LoRA job, samples its progress, and cancels it."""

    def __init__(self, client: httpx.AsyncClient, model: str, path: str,
                 hyperparameters: dict[str, Any], lora: dict[str, Any], seed: int,
                 poll_interval_s: float = 1.0, keep: bool = False) -> None:
        if not os.path.isfile(path):
            raise ValueError(f"--finetune-file {path!r} is not a file")
        self.client, self.model, self.path = client, model, path
        self.hyperparameters, self.lora, self.seed = hyperparameters, lora, seed
        self.poll_interval_s, self.keep = poll_interval_s, keep
        self.job_id = ""
        self.samples: list[FinetuneSample] = []
        self._error: str | None = None  # the job's error message, once it has one
        self._poller: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()  # set at the end of the window: the poller returns

    @classmethod
    def from_args(cls, client: httpx.AsyncClient, model: str,
                  args: argparse.Namespace) -> FinetuneMonitor:
        hyperparameters = {"n_epochs": args.finetune_n_epochs,
                           "batch_size": args.finetune_batch_size}
        if args.finetune_max_seq_len is not None:
            hyperparameters["max_seq_len"] = args.finetune_max_seq_len
        lora = {"r": args.finetune_lora_r, "alpha": args.finetune_lora_alpha,
                "target_modules": list(args.finetune_target_modules)}
        return cls(client, model, args.finetune_file, hyperparameters, lora, args.seed,
                   args.finetune_poll_interval, args.finetune_keep)

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self.client.request(method, path, **kwargs)
        if response.status_code != 200:
            raise ValueError(f"{method} {path}: {_error_message(response, response.content)}")
        return response.json()

    async def submit(self, timeout_s: float = 300.0) -> str:
        """Upload, create the job, and wait until it leaves validating_files/queued."""
        with open(self.path, "rb") as f:
            content = f.read()
        uploaded = await self._call(
            "POST", "/v1/files", data={"purpose": "fine-tune"},
            files={"file": (os.path.basename(self.path), content, "application/jsonl")})
        job = await self._call("POST", "/v1/fine_tuning/jobs", json={
            "model": self.model, "training_file": uploaded["id"],
            "hyperparameters": self.hyperparameters, "suffix": "bench-serve",
            "seed": self.seed, "lora": self.lora})
        self.job_id = job["id"]
        deadline = time.monotonic() + timeout_s
        while job["status"] in _PENDING_JOB_STATES:
            if time.monotonic() > deadline:
                raise ValueError(f"fine-tuning job {self.job_id} is still {job['status']} "
                                 f"after {timeout_s:g} s")
            await asyncio.sleep(0.2)
            job = await self._call("GET", f"/v1/fine_tuning/jobs/{self.job_id}")
        return self.job_id

    async def sample(self) -> FinetuneSample:
        """The job's status and trained tokens now, with its /metrics counters."""
        job = await self._call("GET", f"/v1/fine_tuning/jobs/{self.job_id}")
        phases: dict[str, float] = {}
        response = await self.client.get("/metrics")
        if response.status_code == 200:
            from prometheus_client.parser import text_string_to_metric_families

            for family in text_string_to_metric_families(response.text):
                for s in family.samples:
                    if s.name == "flexserve:finetune_tokens_total" \
                            and s.labels.get("job_id") == self.job_id:
                        phase = s.labels.get("phase", "")
                        phases[phase] = phases.get(phase, 0.0) + s.value
        trained = job.get("trained_tokens")
        sample = FinetuneSample(time.perf_counter(), job["status"],
                                None if trained is None else int(trained), phases)
        self.samples.append(sample)
        error = job.get("error")
        self._error = error.get("message") if isinstance(error, dict) else error
        return sample

    async def _poll(self, stop: asyncio.Event) -> None:
        # Stopped between samples, never inside one, so every job read is in `samples`.
        while True:
            try:
                await asyncio.wait_for(stop.wait(), self.poll_interval_s)
                return
            except asyncio.TimeoutError:
                pass
            if (await self.sample()).status in _ENDED_JOB_STATES:
                return

    async def begin_window(self) -> None:
        """First sample of the measured window; then a sample every poll interval."""
        self.samples.clear()
        await self.sample()
        self._stop = asyncio.Event()
        self._poller = asyncio.create_task(self._poll(self._stop))

    async def end_window(self) -> dict[str, Any]:
        """Last sample, cancel the job (unless kept), and the window's report."""
        if self._poller is not None:
            self._stop.set()
            # A failed poll is not fatal: the last sample below reads the job again.
            await asyncio.gather(self._poller, return_exceptions=True)
        last = await self.sample()
        first = self.samples[0]
        cancelled = False
        if not self.keep and last.status not in _ENDED_JOB_STATES:
            await self._call("POST", f"/v1/fine_tuning/jobs/{self.job_id}/cancel")
            cancelled = True
        num, rate, source = finetune_tokens_per_s(first, last)
        return {
            "job_id": self.job_id, "status": last.status, "error": self._error,
            "cancelled_at_end": cancelled, "window_s": last.time_s - first.time_s,
            "trained_tokens": num, "tokens_per_s": rate, "source": source,
            "hyperparameters": self.hyperparameters, "lora": self.lora,
            "samples": [{"t_s": s.time_s - first.time_s, "status": s.status,
                         "trained_tokens": s.trained_tokens, "metrics_tokens": s.metrics_tokens}
                        for s in self.samples],
        }

    async def cancel_quietly(self) -> None:
        """Cancel the job if one was created (a benchmark that failed); errors are ignored."""
        if self._poller is not None:
            self._poller.cancel()
        if self.job_id and not self.keep:
            try:
                await self.client.post(f"/v1/fine_tuning/jobs/{self.job_id}/cancel")
            except httpx.HTTPError:
                pass


def add_finetune_arguments(parser: argparse.ArgumentParser) -> None:
    """`--finetune-*`: the job `bench serve` runs alongside the traffic."""
    group = parser.add_argument_group("fine-tuning job during the run")
    group.add_argument("--finetune-file", default=None,
                       help="training JSONL: upload it and start a LoRA job before the traffic")
    group.add_argument("--finetune-lora-r", type=int, default=16, help="[%(default)s]")
    group.add_argument("--finetune-lora-alpha", type=float, default=32.0, help="[%(default)s]")
    group.add_argument("--finetune-target-modules", nargs="+", default=["down_proj"],
                       help="[down_proj, FlexLLM's setup]")
    group.add_argument("--finetune-n-epochs", type=int, default=1, help="[%(default)s]")
    group.add_argument("--finetune-batch-size", type=int, default=8, help="[%(default)s]")
    group.add_argument("--finetune-max-seq-len", type=int, default=None,
                       help="longer examples are truncated [the server's default]")
    group.add_argument("--finetune-poll-interval", type=float, default=1.0,
                       help="seconds between samples of the job [%(default)s]")
    group.add_argument("--finetune-keep", action="store_true",
                       help="leave the job running at the end (default: cancel it)")


# ------------------------------------------------------------------------------------ client
def _error_message(response: httpx.Response, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:300]
    return f"HTTP {response.status_code}: {message}"


def _request_body(endpoint: str, model: str, sampled: SampledRequest, tenant: str | None,
                  ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0.0, "ignore_eos": ignore_eos,
    }
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": sampled.prompt}],
                    max_completion_tokens=sampled.output_len)
    else:
        body.update(prompt=sampled.prompt, max_tokens=sampled.output_len)
    if tenant is not None:
        body["user"] = tenant
    return body


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any],
                       record: RequestRecord, start: float) -> RequestRecord:
    """Stream one request, filling `record`'s timings and token counts (or its error)."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    sent = time.perf_counter()
    record.sent_s = sent - start
    num_text_chunks, last, usage, done = 0, sent, None, False
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                record.error = _error_message(response, await response.aread())
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    record.error = f"in stream: {message}"
                    return record
                usage = chunk.get("usage") or usage
                if _chunk_text(chunk, endpoint):
                    if record.ttft_s is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    num_text_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if not done:
        record.error = "the stream ended without data: [DONE]"
        return record
    record.e2e_s = time.perf_counter() - sent
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens", 0))
        record.output_tokens = int(usage.get("completion_tokens", 0))
    else:
        record.output_tokens = num_text_chunks
    if record.ttft_s is None:  # the output decoded to no text: the end is all we saw
        record.ttft_s = record.e2e_s
    return record


async def _served_model(client: httpx.AsyncClient, model: str | None) -> tuple[str, int | None]:
    """The model to benchmark (default: the first listed) and its max_model_len if listed."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {client.base_url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"GET /v1/models: {_error_message(response, response.content)}")
    cards = response.json().get("data") or []
    if model is None:
        if not cards:
            raise ValueError("the server lists no models; pass --model")
        return cards[0]["id"], cards[0].get("max_model_len")
    card = next((c for c in cards if c.get("id") == model), {})
    return model, card.get("max_model_len")


def _request_stream(args: argparse.Namespace, max_model_len: int) -> Iterator[SampledRequest]:
    if args.dataset_name == "random":
        return iter_random_requests(args.input_len, args.output_len, args.seed)
    if args.dataset_name == "sharegpt-like":
        return iter_sharegpt_like_requests(args.seed, max_model_len, args.sharegpt_max_output_len)
    if not args.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    return itertools.cycle(load_jsonl_requests(args.dataset_path, args.output_len))


def _check_min(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"--{name} must be >= {minimum}, got {value}")


def _check_args(args: argparse.Namespace) -> int | None:
    """The number of requests to send (None: until --duration); ValueError on bad options."""
    if args.endpoint not in ("completions", "chat"):
        raise ValueError(f"--endpoint must be completions or chat, got {args.endpoint!r}")
    if args.duration is not None and not (args.duration > 0 and math.isfinite(args.duration)):
        raise ValueError(f"--duration must be a finite number of seconds > 0, got "
                         f"{args.duration}")
    num = args.num_prompts
    if num is None:
        num = None if args.duration is not None else 1000
    elif num < 0:
        raise ValueError(f"--num-prompts must be >= 0, got {num}")
    if num is None and math.isinf(args.request_rate):
        raise ValueError("--request-rate inf with --duration needs --num-prompts")
    if num == 0 and (args.duration is None or not args.finetune_file):
        raise ValueError("--num-prompts 0 measures a fine-tuning job alone: it needs "
                         "--finetune-file and --duration")
    if args.max_concurrency is not None:
        _check_min("max-concurrency", args.max_concurrency, 1)
    if args.tenants is not None:
        _check_min("tenants", args.tenants, 1)
    return num


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark the options describe; the result dict (`--output-json`'s content)."""
    num_requests = _check_args(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No connection cap unless --max-concurrency: httpx's default of 100 would queue requests
    # client-side and hide the server's queueing from TTFT.
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=60.0)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                 limits=limits, timeout=timeout) as client:
        model, listed_max_len = await _served_model(client, args.model)
        max_model_len = args.max_model_len or listed_max_len or 2048
        sampled = _request_stream(args, max_model_len)
        monitor = None
        if args.finetune_file:
            monitor = FinetuneMonitor.from_args(client, model, args)
        try:
            records, duration_s = await _send_all(args, client, model, num_requests, sampled,
                                                  monitor)
            finetune = None if monitor is None else await monitor.end_window()
        except BaseException:
            if monitor is not None:  # no job left running behind a failed benchmark
                await monitor.cancel_quietly()
            raise
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
        "settings": {k: v for k, v in vars(args).items()
                     if k not in ("handler", "api_key") and not callable(v)},
        "num_requests": len(records),
        "metrics": aggregate_metrics(records, duration_s, args.metric_percentiles,
                                     args.slo_ttft_ms, args.slo_tpot_ms),
        "errors": [f"request {r.index}: {r.error}" for r in records if r.error][:5],
        "finetune": finetune,
        "requests": [r.to_dict() for r in records],
    }


async def _send_all(args: argparse.Namespace, client: httpx.AsyncClient, model: str,
                    num_requests: int | None, sampled: Iterator[SampledRequest],
                    monitor: FinetuneMonitor | None) -> tuple[list[RequestRecord], float]:
    """Send at the arrival times until the count or the duration is reached; the records and
    the seconds from the first send to the last completion."""
    from tqdm.auto import tqdm

    if monitor is not None:
        await monitor.submit()
    arrivals = iter_arrival_times(args.request_rate, args.burstiness, args.seed)
    semaphore = asyncio.Semaphore(args.max_concurrency or 1 << 30)
    progress = tqdm(total=num_requests, disable=args.disable_tqdm, desc="requests")

    async def run(record: RequestRecord, body: dict[str, Any]) -> RequestRecord:
        async with semaphore:
            await send_request(client, args.endpoint, body, record, start)
        progress.update(1)
        return record

    if monitor is not None:
        await monitor.begin_window()
    start = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []
    for index, (request, arrival) in enumerate(zip(sampled, arrivals)):
        if num_requests is not None and index >= num_requests:
            break
        if args.duration is not None and arrival >= args.duration:
            break
        delay = start + arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tenant = None if args.tenants is None else f"tenant-{index % args.tenants}"
        record = RequestRecord(index, tenant, arrival, request.prompt_len, request.output_len)
        body = _request_body(args.endpoint, model, request, tenant, args.ignore_eos)
        tasks.append(asyncio.create_task(run(record, body)))
    if not tasks and args.duration is not None:  # the fine-tuning job alone
        await asyncio.sleep(max(0.0, start + args.duration - time.perf_counter()))
    try:
        records = list(await asyncio.gather(*tasks))
    finally:
        progress.close()
    return records, time.perf_counter() - start


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """`benchmark` from synchronous code; writes `--output-json` when given."""
    result = asyncio.run(benchmark(args))
    if args.output_json:
        directory = os.path.dirname(os.path.abspath(args.output_json))
        os.makedirs(directory, exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


def run_bench_serve(args: argparse.Namespace) -> int:
    """The `flexserve bench serve` handler: run, print the table, write the JSON."""
    print(format_report(run_benchmark(args)))
    return 0


# ------------------------------------------------------------------------------------ options
def _percentiles(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from e
    if not values or not all(0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `flexserve bench serve` (vLLM's names where it has them)."""
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="[%(default)s]")
    group.add_argument("--model", default=None, help="[the first of GET /v1/models]")
    group.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                       help="/v1/completions or /v1/chat/completions [%(default)s]")
    group.add_argument("--api-key",
                       default=os.environ.get("FLEXSERVE_API_KEY") or os.environ.get(
                           "OPENAI_API_KEY"),
                       help="sent as `Authorization: Bearer KEY` [$FLEXSERVE_API_KEY, else "
                            "$OPENAI_API_KEY, else none]")
    group.add_argument("--request-timeout", type=float, default=3600.0,
                       help="seconds one request may take [%(default)s]")
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                       help="random: fixed lengths; sharegpt-like: log-normal prompt and output "
                            f"lengths (medians {SHAREGPT_INPUT_MEDIAN}/{SHAREGPT_OUTPUT_MEDIAN}, "
                            f"sigma {SHAREGPT_INPUT_SIGMA:g}/{SHAREGPT_OUTPUT_SIGMA:g}); "
                            'jsonl: {"prompt", optional "output_len"} lines [%(default)s]')
    group.add_argument("--dataset-path", default=None, help="the JSONL file (jsonl)")
    group.add_argument("--input-len", type=int, default=512,
                       help="random: prompt words, about one token each [%(default)s]")
    group.add_argument("--output-len", type=int, default=128,
                       help="random, and jsonl lines without output_len: max_tokens "
                            "[%(default)s]")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="sharegpt-like: prompt + output bound [the server's, else 2048]")
    group.add_argument("--sharegpt-max-output-len", type=int, default=None,
                       help="sharegpt-like: cap outputs further [none]")
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                       help="generate exactly max_tokens per request [on]")
    group.add_argument("--num-prompts", type=int, default=None,
                       help="requests to send [1000; unbounded with --duration]")
    group.add_argument("--duration", type=float, default=None,
                       help="stop sending after this many seconds (in-flight requests finish)")
    group.add_argument("--request-rate", type=float, default=float("inf"),
                       help="mean requests/s; inf sends all at once [%(default)s]")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier "
                            "[%(default)s]")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="requests in flight at most [unbounded]")
    group.add_argument("--tenants", type=int, default=None,
                       help="round-robin the requests over users tenant-0..N-1 (the `user` field)")
    group.add_argument("--seed", type=int, default=0, help="arrivals and prompts [%(default)s]")
    group = parser.add_argument_group("report")
    group.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput")
    group.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput")
    group.add_argument("--metric-percentiles", type=_percentiles, default=[50.0, 90.0, 99.0],
                       help="comma-separated [50,90,99]")
    group.add_argument("--output-json", default=None,
                       help="write settings, statistics and per-request records here")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    group.add_argument("--log-level", default="warning",
                       choices=("critical", "error", "warning", "info", "debug"))
    add_finetune_arguments(parser)


def add_bench_serve_parser(kinds: Any) -> None:
    """Register `serve` on `flexserve bench`'s subparsers (a client: no engine options)."""
    parser = kinds.add_parser(
        "serve", help="online serving benchmark against a running server",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_bench_serve_arguments(parser)
    parser.set_defaults(handler=run_bench_serve, command="bench")


def parse_bench_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """The options of `flexserve bench serve ARGV...`, for running it programmatically."""
    parser = argparse.ArgumentParser(prog="flexserve bench serve")
    add_bench_serve_arguments(parser)
    return parser.parse_args(list(argv))
