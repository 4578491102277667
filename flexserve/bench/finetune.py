"""The LoRA fine-tuning job that `flexserve bench serve --finetune-file` runs beside the traffic.

`FinetuneMonitor` uploads the training file, starts the job before the traffic, samples it over
the inference run window (first request sent to last request done) and cancels it at the end
unless kept. The window's fine-tuning tokens per second (`finetune_tokens_per_s`) come from
`/metrics` (`flexserve:finetune_tokens_total{phase="forward"}` of the job, or of `all` on a server
that does not export job ids), else from the job's `trained_tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx

from flexserve.metrics.finetune_metrics import ALL_JOBS

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
            raise ValueError(f"{method} {path}: {error_message(response, response.content)}")
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
                    # Servers without --metrics-job-ids count every job under "all": the
                    # monitor's job is the only one running (one job per measurement).
                    if s.name == "flexserve:finetune_tokens_total" \
                            and s.labels.get("job_id") in (self.job_id, ALL_JOBS):
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


def error_message(response: httpx.Response, body: bytes) -> str:
    """`HTTP <status>: <message>` of a failed response, the message from OpenAI's error shape
    when the body has one, else the body's start."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:300]
    return f"HTTP {response.status_code}: {message}"
