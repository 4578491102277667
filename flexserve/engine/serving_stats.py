"""Per-request timing and per-iteration statistics of the serving loop, and the periodic stats log.

Everything here runs on the engine thread of `AsyncLLMEngine`. Stat loggers (the periodic log
line, Prometheus in `flexserve.metrics`) receive one `IterationStats` per pass of the loop.
Times are `time.monotonic()` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from flexserve.engine.llm_engine import PreparedRequest
from flexserve.outputs import RequestOutput

logger = logging.getLogger("flexserve.stats")


@dataclass(slots=True)
class FinishedRequestStats:
    """One prompt that ended (all of its n completions), or was aborted."""

    finish_reasons: list[str]  # one per completion: "stop", "length" or "abort"
    e2e_latency: float  # seconds from arrival to the last output (or the abort)
    queue_time: float | None  # seconds from arrival to first scheduling; None if never scheduled
    num_prompt_tokens: int  # prompt length (counted once, whatever n is)
    num_generation_tokens: int  # tokens generated over all completions
    aborted: bool  # ended by an abort rather than by its own stop condition
    ttft: float | None = None  # seconds from arrival to the first token; None if none came
    tpot: float | None = None  # seconds per output token after the first, of its slowest
    # completion; None when no completion got two tokens


@dataclass(slots=True)
class IterationStats:
    """What one pass of the engine loop did (a step, or only adds/aborts, or an idle wake-up)."""

    now: float = 0.0  # time.monotonic() at the end of the pass
    num_running: int = 0  # scheduler requests holding KV blocks
    num_waiting: int = 0  # scheduler requests queued (new or preempted)
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests, [0, 1]
    prefix_cache_hit_rate: float = 0.0  # cumulative hit tokens / queried tokens, [0, 1]
    num_preemptions: int = 0  # preemptions since the previous pass
    step_latency: float | None = None  # seconds of the engine step; None when no step ran
    num_batched_tokens: int = 0  # tokens in the step's forward (prefill chunks + decodes)
    num_prompt_tokens: int = 0  # prompt tokens of prompts that got their first token this pass
    num_generation_tokens: int = 0  # tokens generated this pass, over all completions
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, one per prompt
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, one per token
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # LoRA (None / 0 when disabled): running requests per adapter name, every servable name listed
    lora_requests_running: dict[str, int] | None = None
    num_loras_gpu: int = 0  # adapters loaded in device slots
    num_loras_cpu: int = 0  # adapters held in host memory
    # fine-tuning (empty when the step had none): job id -> tokens of its windows this step
    finetune_forward_tokens: dict[str, int] = field(default_factory=dict)
    finetune_backward_tokens: dict[str, int] = field(default_factory=dict)  # layer-window tokens
    latency_model_error_ratio: float | None = None  # rolling |predicted - measured| / measured
    latency_model_scale: float | None = None  # the latency model's online correction factor
    latency_model_backward_scale: float | None = None  # its correction of backward windows'
    iteration_overhead: float | None = None  # seconds: EWMA of host time between steps
    # whether a decode step alone fits the TPOT limit (TPOTFeasibility); None: no SLO or unknown
    slo_tpot_feasible: bool | None = None


class StatLogger(Protocol):
    """Consumes the stats of each engine-loop pass; called on the engine thread, must be quick."""

    def record(self, stats: IterationStats) -> None: ...


class RequestTracker:
    """Engine-thread bookkeeping of one in-flight prompt: where its outputs go, and its timings."""

    __slots__ = (
        "prepared", "request_id", "loop", "queue", "arrival_time", "first_scheduled_time",
        "first_token_time", "last_output_time", "num_tokens", "last_token_times", "finish_reasons",
    )

    def __init__(self, prepared: PreparedRequest, loop: asyncio.AbstractEventLoop,
                 outputs: asyncio.Queue) -> None:
        n = prepared.params.n
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.loop = loop  # the event loop of the handler that consumes the outputs
        self.queue = outputs  # RequestOutput | exception | abort marker, consumed on `loop`
        self.arrival_time = prepared.arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_output_time = prepared.arrival_time
        self.num_tokens = [0] * n  # tokens seen so far, per completion
        self.last_token_times: list[float | None] = [None] * n  # per completion
        self.finish_reasons: list[str | None] = [None] * n  # per completion

    def deliver(self, item: Any) -> None:
        """Hand an item to the consumer's event loop (dropped if that loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop was closed: nobody is listening any more
            pass

    def note_scheduled(self, scheduler: Any, step_start: float, had_output: bool) -> None:
        """Record when the scheduler first admitted this prompt.

        `LLMEngine` names the children `<id>` (n = 1) or `<id>-<i>`; child 0 is admitted first.
        A prompt admitted and finished within one step has already left the scheduler, but then
        it was admitted by that step's schedule(), which ran at `step_start`.
        """
        child_id = self.request_id if len(self.num_tokens) == 1 else f"{self.request_id}-0"
        request = scheduler.get_request(child_id)
        scheduled = getattr(request, "first_scheduled_time", None) if request is not None else None
        if scheduled is not None:
            self.first_scheduled_time = scheduled
        elif had_output:
            self.first_scheduled_time = step_start

    def observe(self, output: RequestOutput, now: float, stats: IterationStats) -> None:
        """Fold a new cumulative output into the timings and `stats`."""
        for completion in output.outputs:
            i = completion.index
            num_new = len(completion.token_ids) - self.num_tokens[i]
            if completion.finish_reason is not None:
                self.finish_reasons[i] = completion.finish_reason
            if num_new <= 0:
                continue
            if self.first_token_time is None:
                self.first_token_time = now
                stats.time_to_first_tokens.append(now - self.arrival_time)
                stats.num_prompt_tokens += len(output.prompt_token_ids)
            last = self.last_token_times[i]
            if last is not None:
                stats.inter_token_latencies.extend([(now - last) / num_new] * num_new)
            self.last_token_times[i] = now
            self.num_tokens[i] += num_new
            stats.num_generation_tokens += num_new
        self.last_output_time = now

    def mark_aborted(self, now: float) -> None:
        self.finish_reasons = [reason or "abort" for reason in self.finish_reasons]
        self.last_output_time = now

    def finished_stats(self) -> FinishedRequestStats:
        queue_time = None
        if self.first_scheduled_time is not None:
            queue_time = max(self.first_scheduled_time - self.arrival_time, 0.0)
        reasons = [reason or "abort" for reason in self.finish_reasons]
        ttft = tpot = None
        if self.first_token_time is not None:
            ttft = self.first_token_time - self.arrival_time
            tpots = [(last - self.first_token_time) / (n - 1)
                     for n, last in zip(self.num_tokens, self.last_token_times)
                     if n > 1 and last is not None]
            tpot = max(tpots, default=None)
        return FinishedRequestStats(
            finish_reasons=reasons,
            e2e_latency=self.last_output_time - self.arrival_time,
            queue_time=queue_time,
            num_prompt_tokens=len(self.prepared.prompt_token_ids),
            num_generation_tokens=sum(self.num_tokens),
            aborted="abort" in reasons,
            ttft=ttft,
            tpot=tpot,
        )


class LoggingStatLogger:
    """Logs one line every `interval_s` while there is activity (requests or tokens).

    A window starts at the last idle moment, so rates after a quiet spell are not diluted by it.
    """

    def __init__(self, interval_s: float = 5.0, log: logging.Logger = logger) -> None:
        self.interval_s = interval_s
        self.log = log
        self._window_start: float | None = None
        self._previous: IterationStats | None = None
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_preemptions = 0
        self._num_preemptions_total = 0
        self._num_finetune_tokens = 0

    def record(self, stats: IterationStats) -> None:
        previous = self._previous
        self._previous = stats
        if previous is None:
            self._window_start = stats.now
            return
        if not (self._num_prompt_tokens or self._num_generation_tokens or self._num_preemptions
                or previous.num_running or previous.num_waiting):
            self._window_start = previous.now  # nothing happened in this window yet
        self._num_prompt_tokens += stats.num_prompt_tokens
        self._num_generation_tokens += stats.num_generation_tokens
        self._num_preemptions += stats.num_preemptions
        self._num_preemptions_total += stats.num_preemptions
        self._num_finetune_tokens += sum(stats.finetune_forward_tokens.values())
        elapsed = stats.now - self._window_start
        if elapsed < self.interval_s:
            return
        active = (stats.num_running or stats.num_waiting or self._num_prompt_tokens
                  or self._num_generation_tokens or self._num_preemptions
                  or self._num_finetune_tokens)
        if active:
            finetune = ""
            if self._num_finetune_tokens:
                finetune = (f", fine-tuning throughput: "
                            f"{self._num_finetune_tokens / elapsed:.1f} tok/s")
            self.log.info(
                "running: %d reqs, waiting: %d reqs, KV cache usage: %.1f%%, "
                "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, "
                "preemptions: %d (total %d), prefix cache hit rate: %.1f%%%s",
                stats.num_running, stats.num_waiting, 100.0 * stats.kv_cache_usage,
                self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
                self._num_preemptions, self._num_preemptions_total,
                100.0 * stats.prefix_cache_hit_rate, finetune,
            )
        self._window_start = stats.now
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_preemptions = 0
        self._num_finetune_tokens = 0
