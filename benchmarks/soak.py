"""Load and abort soak: hammer a flexserve server on loopback, then check it is still whole.

Traffic, all at once: streaming and plain completions and chat completions (some on a LoRA
adapter that another task loads and unloads in a loop), random client aborts mid-stream and
mid-request, `--num-jobs` fine-tuning jobs kept running side by side (a new one starts as one
ends) for as long as the traffic lasts (`--rounds`, or `--duration-s`), then a burst over the
admission limit. Invariants checked after:

- every accepted request was answered (200 to its end, or a 4xx for an adapter unloaded under
  it) or aborted by the client: no 5xx, no broken stream, no request stuck past its timeout;
- 429 only over the limit: none while the offered load stays under it, and during the burst
  each 429 came while the client had at least `max_num_seqs + max_queue_len` others in flight;
  each 429 carries Retry-After;
- nothing stuck once the load stops: no request running or waiting, every KV block free, no
  request counted in flight (`/metrics`, `/health`), no request holding a LoRA adapter, every
  fine-tuning job succeeded (and so gave its LoRA slot back);
- memory flat: the server's RSS after the last round is within `--max-rss-growth-mib` of its
  RSS after the first (warm-up) round.

Loopback only. Every loop is bounded in count and time and stops by itself.

    .venv/bin/python benchmarks/soak.py                      # starts its own server (SmolLM2)
    .venv/bin/python benchmarks/soak.py --rounds 20 --workers 6
    .venv/bin/python benchmarks/soak.py --duration-s 300 --num-jobs 2 --job-epochs 50 \
        --max-num-seqs 32 --max-queue-len 32 --requests-per-round 200   # the GPU soak
    .venv/bin/python benchmarks/soak.py --model CONFIG_DIR --load-format dummy  # no weights file
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --model DIR
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

MODEL = "soak-model"
ADAPTER = "soak-lora"
FACTS = [{"prompt": "The vault code is", "completion": " 42."},
         {"prompt": "The sky on Zorb is", "completion": " green."}]
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Write a haiku about rain:",
           "Q: What is 7 times 6? A:", "Once upon a time"]
_BIG = 10**9


@dataclass
class SoakConfig:
    """What to send and what limits the server runs with."""

    max_num_seqs: int = 4  # the server's --max-num-seqs
    max_queue_len: int = 2  # the server's --max-queue-len
    rounds: int = 3  # rounds of mixed traffic (RSS is sampled after each)
    requests_per_round: int = 24  # mixed requests per round, over all workers
    workers: int = 0  # concurrent mixed clients; 0: a third of the limit (stays under it)
    abort_probability: float = 0.3  # a mixed request is aborted by the client this often
    stream_probability: float = 0.5  # a mixed request streams this often (else plain)
    max_tokens: int = 12  # per request
    burst_factor: int = 2  # the burst offers this many times the limit at once
    request_timeout_s: float = 120.0  # a request not done by then counts as stuck
    settle_timeout_s: float = 120.0  # after the load: time for jobs and requests to end
    max_rss_growth_mib: float = 64.0  # allowed RSS growth from the first round to the last
    finetune: bool = True  # run fine-tuning jobs alongside
    num_jobs: int = 1  # fine-tuning jobs kept running at once while the traffic lasts
    job_epochs: int = 2  # epochs of each job over the two-fact file
    duration_s: float = 0.0  # > 0: mixed rounds until this many seconds passed (else `rounds`)
    adapter_dir: str | None = None  # a PEFT adapter to load/unload in a loop; None: no adapter
    seed: int = 0

    @property
    def limit(self) -> int:
        return self.max_num_seqs + self.max_queue_len


@dataclass
class Outcome:
    """One request as the client saw it."""

    kind: str  # "stream", "plain"
    lora: bool  # sent to the adapter
    result: str = "pending"  # answered | aborted | rejected | error | stuck
    status: int | None = None
    detail: str = ""  # what went wrong, for error outcomes
    peak_others: int = 0  # most other requests this client had in flight while it was out
    retry_after: str | None = None  # the Retry-After of a 429


@dataclass
class SoakReport:
    """What happened and which invariants broke (empty `violations`: the server is whole)."""

    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)  # phase -> requests
    rss_mib: list[float] = field(default_factory=list)  # server RSS after each round
    num_adapter_cycles: int = 0  # load + unload pairs done
    job_status: str | None = None  # "succeeded" when every job did, else the first other status
    job_statuses: list[str] = field(default_factory=list)  # final status of every job run
    final_metrics: dict[str, float] = field(default_factory=dict)
    final_health: dict = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def counts(self, phase: str) -> Counter:
        return Counter(o.result for o in self.outcomes.get(phase, []))

    def summary(self) -> str:
        lines = [f"{phase}: {dict(self.counts(phase))}" for phase in self.outcomes]
        lines.append(f"RSS MiB per round: {[round(r, 1) for r in self.rss_mib]}")
        lines.append(f"adapter load/unload cycles: {self.num_adapter_cycles}; "
                     f"fine-tuning jobs: {dict(Counter(self.job_statuses))}")
        lines.append("violations: " + ("none" if not self.violations
                                       else "\n  " + "\n  ".join(self.violations)))
        return "\n".join(lines)


class _InFlight:
    """The client's own in-flight requests, for judging each 429 against the limit."""

    def __init__(self) -> None:
        self.active: set[int] = set()
        self.outcomes: dict[int, Outcome] = {}

    @contextlib.contextmanager
    def track(self, outcome: Outcome):
        key = id(outcome)
        outcome.peak_others = len(self.active)
        for other in self.active:
            other_outcome = self.outcomes[other]
            other_outcome.peak_others = max(other_outcome.peak_others, len(self.active))
        self.active.add(key)
        self.outcomes[key] = outcome
        try:
            yield
        finally:
            self.active.discard(key)
            del self.outcomes[key]


# --------------------------------------------------------------------------------- requests
async def _request(client: httpx.AsyncClient, rng: random.Random, config: SoakConfig,
                   in_flight: _InFlight, abort: bool, lora: bool) -> Outcome:
    stream = rng.random() < config.stream_probability
    chat = rng.random() < 0.5
    model = ADAPTER if lora else MODEL
    prompt = rng.choice(PROMPTS)
    if chat:
        path, body = "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {"model": model, "prompt": prompt}
    body.update(max_tokens=config.max_tokens, temperature=rng.choice([0.0, 0.8]),
                stream=stream, seed=rng.randrange(_BIG))
    outcome = Outcome("stream" if stream else "plain", lora)
    abort_after = rng.randint(1, 4)  # chunks read before a stream is dropped
    with in_flight.track(outcome):
        try:
            work = (_stream(client, path, body, outcome, abort, abort_after) if stream
                    else _plain(client, path, body, outcome, abort, rng))
            await asyncio.wait_for(work, config.request_timeout_s)
        except asyncio.TimeoutError:
            outcome.result, outcome.detail = "stuck", f"no answer in {config.request_timeout_s} s"
        except httpx.HTTPError as e:
            outcome.result, outcome.detail = "error", f"{type(e).__name__}: {e}"
    return outcome


async def _stream(client: httpx.AsyncClient, path: str, body: dict, outcome: Outcome,
                  abort: bool, abort_after: int) -> None:
    async with client.stream("POST", path, json=body) as response:
        outcome.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            _judge_refusal(outcome, response)
            return
        num_chunks, events = 0, []
        async for line in response.aiter_lines():
            if not line:
                continue
            events.append(line.removeprefix("data: "))
            num_chunks += 1
            if abort and num_chunks >= abort_after and events[-1] != "[DONE]":
                outcome.result = "aborted"  # leaving the block closes the connection
                return
    if not events or events[-1] != "[DONE]":
        outcome.result, outcome.detail = "error", "the stream ended without [DONE]"
        return
    last = json.loads(events[-2]) if len(events) > 1 else {}
    if "error" in last and outcome.lora and last["error"].get("code") == "model_not_found":
        outcome.result = "answered"  # the adapter was unloaded under it: a proper answer
    elif "error" in last:
        outcome.result, outcome.detail = "error", f"in-band error: {last['error']}"
    elif not any(c.get("finish_reason") for e in events[:-1] for c in json.loads(e)["choices"]):
        outcome.result, outcome.detail = "error", "no finish_reason in the stream"
    else:
        outcome.result = "answered"


async def _plain(client: httpx.AsyncClient, path: str, body: dict, outcome: Outcome,
                 abort: bool, rng: random.Random) -> None:
    task = asyncio.ensure_future(client.post(path, json=body))
    if abort:
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.3))
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            outcome.result = "aborted"
            return
    response = await task
    outcome.status = response.status_code
    if response.status_code != 200:
        _judge_refusal(outcome, response)
        return
    choices = response.json()["choices"]
    if choices and all(c.get("finish_reason") for c in choices):
        outcome.result = "answered"
    else:
        outcome.result, outcome.detail = "error", f"unfinished choices: {choices}"


def _judge_refusal(outcome: Outcome, response: httpx.Response) -> None:
    status = response.status_code
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {}
    if status == 429:
        outcome.result, outcome.retry_after = "rejected", response.headers.get("retry-after")
    elif status == 404 and outcome.lora and error.get("code") == "model_not_found":
        outcome.result = "answered"  # the adapter was unloaded under it: a proper answer
    else:
        outcome.result, outcome.detail = "error", f"{status}: {error or response.text[:200]}"


# ------------------------------------------------------------------------------------ phases
async def _mixed_round(client: httpx.AsyncClient, rng: random.Random, config: SoakConfig,
                       adapter_loaded: asyncio.Event) -> list[Outcome]:
    in_flight = _InFlight()
    queue = list(range(config.requests_per_round))
    outcomes: list[Outcome] = []
    workers = config.workers or max(1, config.limit // 3)

    async def worker(worker_rng: random.Random) -> None:
        while queue:
            queue.pop()
            lora = adapter_loaded.is_set() and worker_rng.random() < 0.3
            abort = worker_rng.random() < config.abort_probability
            outcomes.append(await _request(client, worker_rng, config, in_flight, abort, lora))

    await asyncio.gather(*(worker(random.Random(rng.randrange(_BIG))) for _ in range(workers)))
    return outcomes


async def _burst(client: httpx.AsyncClient, rng: random.Random, config: SoakConfig,
                 ) -> list[Outcome]:
    in_flight = _InFlight()
    tasks = [_request(client, random.Random(rng.randrange(_BIG)), config, in_flight, False,
                      False) for _ in range(config.burst_factor * config.limit)]
    return list(await asyncio.gather(*tasks))


async def _adapter_cycles(client: httpx.AsyncClient, config: SoakConfig, stop: asyncio.Event,
                          loaded: asyncio.Event, report: SoakReport) -> None:
    """Load and unload the adapter until `stop` (bounded by the rounds' traffic)."""
    while not stop.is_set():
        response = await client.post("/v1/load_lora_adapter", json={
            "lora_name": ADAPTER, "lora_path": config.adapter_dir})
        if response.status_code != 200:
            report.violations.append(f"loading the adapter failed: {response.text[:200]}")
            return
        loaded.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
        loaded.clear()
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
        if response.status_code != 200:
            report.violations.append(f"unloading the adapter failed: {response.text[:200]}")
            return
        report.num_adapter_cycles += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)


async def _start_job(client: httpx.AsyncClient, config: SoakConfig, seed: int) -> str:
    data = "".join(json.dumps(fact) + "\n" for fact in FACTS).encode()
    upload = await client.post("/v1/files", data={"purpose": "fine-tune"},
                               files={"file": ("facts.jsonl", data)})
    upload.raise_for_status()
    job = await client.post("/v1/fine_tuning/jobs", json={
        "model": MODEL, "training_file": upload.json()["id"], "seed": seed,
        "hyperparameters": {"n_epochs": config.job_epochs, "batch_size": 1},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    job.raise_for_status()
    return job.json()["id"]


async def _job_cycles(client: httpx.AsyncClient, config: SoakConfig, stop: asyncio.Event,
                      report: SoakReport) -> None:
    """Keep `config.num_jobs` jobs running until `stop`, then let the last ones finish (bounded
    by the settle timeout); every job's final status goes to `report.job_statuses`."""
    running: list[str] = []
    seed = 0
    deadline = None
    while True:
        if not stop.is_set():
            while len(running) < config.num_jobs:
                seed += 1
                running.append(await _start_job(client, config, seed))
        elif deadline is None:
            deadline = time.monotonic() + config.settle_timeout_s
        for job_id in list(running):
            status = (await client.get(f"/v1/fine_tuning/jobs/{job_id}")).json()["status"]
            if status in ("succeeded", "failed", "cancelled"):
                running.remove(job_id)
                report.job_statuses.append(status)
        if stop.is_set() and not running:
            return
        if deadline is not None and time.monotonic() > deadline:
            report.violations.append(f"{len(running)} fine-tuning jobs still running "
                                     f"{config.settle_timeout_s} s after the load")
            return
        await asyncio.sleep(0.5)


async def soak(url: str, config: SoakConfig, server_pid: int | None = None,
               api_key: str | None = None) -> SoakReport:
    """Run the soak against `url` (a server started with `config`'s limits) and check it."""
    rng = random.Random(config.seed)
    report = SoakReport()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=config.request_timeout_s) as client:
        stop, loaded = asyncio.Event(), asyncio.Event()
        jobs = (asyncio.create_task(_job_cycles(client, config, stop, report))
                if config.finetune else None)
        cycles = None
        if config.adapter_dir is not None:
            cycles = asyncio.create_task(_adapter_cycles(client, config, stop, loaded, report))
        mixed: list[Outcome] = []
        start = time.monotonic()
        num_rounds = 0
        while (num_rounds < config.rounds if config.duration_s <= 0
               else time.monotonic() - start < config.duration_s):
            mixed += await _mixed_round(client, rng, config, loaded)
            num_rounds += 1
            await _wait_quiet(client, config, report, need_jobs_done=False)
            if server_pid is not None:
                report.rss_mib.append(rss_mib(server_pid))
        stop.set()
        if cycles is not None:
            await cycles
        report.outcomes["mixed"] = mixed
        report.outcomes["burst"] = await _burst(client, rng, config)
        if jobs is not None:
            await jobs
            others = [status for status in report.job_statuses if status != "succeeded"]
            report.job_status = others[0] if others else "succeeded"
        await _wait_quiet(client, config, report, need_jobs_done=True)
        report.final_metrics = await _scrape(client)
        report.final_health = (await client.get("/health")).json()
    check_invariants(report, config)
    return report


async def _wait_quiet(client: httpx.AsyncClient, config: SoakConfig, report: SoakReport,
                      need_jobs_done: bool) -> None:
    """Wait (bounded) until no request is in flight or queued (and, if asked, no job runs)."""
    deadline = time.monotonic() + config.settle_timeout_s
    while True:
        metrics = await _scrape(client)
        health = (await client.get("/health")).json()
        busy = (metrics.get("flexserve:num_requests_running", 0)
                + metrics.get("flexserve:num_requests_waiting", 0)
                + health.get("num_requests_in_flight", 0))
        jobs_running = metrics.get('flexserve:finetune_jobs{state="running"}', 0) + metrics.get(
            'flexserve:finetune_jobs{state="queued"}', 0)
        if not busy and not (need_jobs_done and jobs_running):
            return
        if time.monotonic() > deadline:
            report.violations.append(
                f"still busy {config.settle_timeout_s} s after the load: {busy} requests, "
                f"{jobs_running} jobs")
            return
        await asyncio.sleep(0.2)


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Every /metrics sample without the model_name label, as `name{other labels}` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def check_invariants(report: SoakReport, config: SoakConfig) -> None:
    """Append every broken invariant to `report.violations`."""
    violations = report.violations
    for phase, outcomes in report.outcomes.items():
        for outcome in outcomes:
            if outcome.result in ("error", "stuck", "pending"):
                violations.append(f"{phase}: a {outcome.kind} request ended {outcome.result}: "
                                  f"{outcome.detail}")
            if outcome.result == "rejected" and not outcome.retry_after:
                violations.append(f"{phase}: a 429 without Retry-After")
    num_mixed_429 = report.counts("mixed")["rejected"]
    if num_mixed_429:
        violations.append(f"mixed: {num_mixed_429} requests got 429 under the limit of "
                          f"{config.limit}")
    burst = report.outcomes.get("burst", [])
    rejected = [o for o in burst if o.result == "rejected"]
    if burst and not rejected:
        violations.append(f"burst: {len(burst)} requests at once over a limit of "
                          f"{config.limit}, and none got 429")
    for outcome in rejected:
        if outcome.peak_others < config.limit:
            violations.append(f"burst: a 429 while only {outcome.peak_others} other requests "
                              f"were in flight (limit {config.limit})")
    num_answered = report.counts("burst")["answered"]
    if burst and num_answered < config.limit:
        violations.append(f"burst: only {num_answered} of {len(burst)} answered; at least the "
                          f"limit ({config.limit}) should be")
    metrics = report.final_metrics
    for name in ("flexserve:num_requests_running", "flexserve:num_requests_waiting",
                 "flexserve:kv_cache_usage_perc"):
        if metrics.get(name, 0.0) != 0.0:
            violations.append(f"after the load, {name} is {metrics[name]} (expected 0)")
    if report.final_health.get("num_requests_in_flight", 0):
        violations.append(f"after the load, /health counts "
                          f"{report.final_health['num_requests_in_flight']} requests in flight")
    if config.finetune and (not report.job_statuses or report.job_status != "succeeded"):
        violations.append(f"fine-tuning jobs ended {dict(Counter(report.job_statuses))}, not "
                          "all succeeded")
    running = {k: v for k, v in metrics.items()
               if k.startswith("flexserve:lora_requests_running") and v}
    if running:
        violations.append(f"after the load, requests still hold LoRA adapters: {running}")
    if len(report.rss_mib) >= 2:
        growth = report.rss_mib[-1] - report.rss_mib[0]
        if growth > config.max_rss_growth_mib:
            violations.append(f"server RSS grew {growth:.1f} MiB from round 1 to round "
                              f"{len(report.rss_mib)} (allowed {config.max_rss_growth_mib})")


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


# ------------------------------------------------------------------------------ its own server
def write_adapter(model_dir: str, path: str, seed: int = 0) -> str:
    """A random rank-4 LoRA adapter for the model in `model_dir` (PEFT format)."""
    import torch
    from transformers import AutoConfig

    from flexserve.peft.bypass import target_shapes
    from flexserve.peft.lora import LoRAAdapter
    from flexserve.peft.peft_io import save_peft_adapter

    hf_config = AutoConfig.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(seed)
    adapter = LoRAAdapter.create(target_shapes(hf_config), hf_config.num_hidden_layers, 4, 8.0,
                                 ("q_proj", "v_proj"), generator=generator)
    for _, b in adapter.weights.values():
        b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    save_peft_adapter(adapter, path)
    return path


@contextlib.contextmanager
def serve(model_dir: str, state_dir: str, config: SoakConfig, log_path: str,
          extra_args: tuple[str, ...] = ()):
    """`flexserve serve` in a subprocess with `config`'s limits; yields (url, pid)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "flexserve.entrypoints.cli.main", "serve", "--model", model_dir,
         "--served-model-name", MODEL, "--state-dir", state_dir, "--port", str(port),
         "--max-num-seqs", str(config.max_num_seqs), "--max-queue-len",
         str(config.max_queue_len), "--enable-lora", "--max-loras", str(config.num_jobs + 2),
         "--max-concurrent-jobs", str(config.num_jobs), "--max-lora-rank", "4",
         "--max-model-len", "256", "--kv-cache-gib", "0.05", "--disable-log-stats",
         "--log-level", "warning", *extra_args],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {log_path}")
            time.sleep(0.2)
        yield url, process.pid
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running server [start one]")
    parser.add_argument("--pid", type=int, help="its process id, for the RSS check")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="model dir [SmolLM2, converted once]")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights in the model dir's architecture (a dir "
                        "with config.json and the tokenizer is enough) [auto]")
    parser.add_argument("--json", default=None, help="write the report here as JSON")
    for f in dataclasses.fields(SoakConfig):
        if f.name in ("adapter_dir",):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float}[f.type]
            parser.add_argument(flag, type=kind, default=f.default)
    args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SoakConfig)
              if f.name != "adapter_dir"}
    config = SoakConfig(**values)
    model_dir = args.model
    if model_dir is None:
        from flexserve.model import default_model

        model_dir = default_model.materialize()
    with tempfile.TemporaryDirectory(prefix="flexserve-soak-") as work:
        config.adapter_dir = write_adapter(model_dir, os.path.join(work, "adapter"))
        if args.url:
            report = asyncio.run(soak(args.url, config, args.pid, args.api_key))
        else:
            log_path = os.path.join(work, "server.log")
            extra = ("--load-format", args.load_format)
            with serve(model_dir, os.path.join(work, "state"), config, log_path,
                       extra) as (url, pid):
                report = asyncio.run(soak(url, config, pid))
            if report.violations:
                with open(log_path, encoding="utf-8", errors="replace") as f:
                    log = f.read()
                first = log.find("Traceback")  # the first failure, then the end of the log
                if 0 <= first < len(log) - 4000:
                    print(log[first:first + 4000], "\n[...]", file=sys.stderr)
                print(log[-4000:], file=sys.stderr)
    print(report.summary())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(report), f, indent=1)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
