"""`AsyncLLMEngine`: the bridge between asyncio request handlers and the synchronous `LLMEngine`.

The engine loop runs in one dedicated thread, so device work never blocks the event loop. Handlers
talk to it through a thread-safe command queue (add, abort, and calls such as registering a LoRA
adapter, run between two steps); the thread hands each request's outputs back to the handler's
own event loop with `call_soon_threadsafe` into an asyncio queue.
All engine state, the per-request timing included, is touched by the engine thread alone.

If the engine loop raises, every in-flight request fails with `EngineDeadError` and the engine
reports itself unhealthy instead of leaving callers hanging. A failure confined to one request (its
output processing raised) fails that request alone with `RequestFailedError`; a request running
past `request_timeout_s` is aborted (KV blocks freed) with `RequestTimeoutError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from flexserve.engine.adapter_manager import AdapterLoadError
from flexserve.engine.llm_engine import LLMEngine, PreparedRequest
from flexserve.engine.lora_request import LoRARequest
from flexserve.engine.model_info import ModelInfo
from flexserve.engine.serving_stats import (
    FinishedRequestStats,
    IterationStats,
    LoggingStatLogger,
    RequestTracker,
    StatLogger,
)
from flexserve.outputs import RequestOutput
from flexserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_IDLE_WAKEUP_S = 1.0  # an idle engine thread still wakes this often so periodic logs flush
_STALLED_WAIT_S = 0.01  # fine-tuning work that placed nothing this pass waits this long for
# commands, instead of spinning (its KV blocks or window budget free up in a later pass)
_ABORTED = object()  # queue item: the request was aborted from elsewhere; the stream just ends


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crashed or shut down); no request can be served."""


class RequestTimeoutError(RuntimeError):
    """The request ran longer than the server's per-request limit and was aborted."""


class RequestFailedError(RuntimeError):
    """Processing this request failed on the server; it alone was aborted."""


class AsyncLLMEngine:
    """Serves an `LLMEngine` to asyncio code: `prepare`, `generate`, `abort`.

    One engine thread, any number of event loops: each request remembers the loop it came from.
    """

    def __init__(
        self,
        engine: LLMEngine,
        log_stats: bool | None = None,
        stats_log_interval_s: float = 5.0,
        request_timeout_s: float | None = None,
    ) -> None:
        """`request_timeout_s`: a request still unfinished this long after its arrival is
        aborted with `RequestTimeoutError` (None: no limit)."""
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive, got {request_timeout_s}")
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self._stop_reason: str | None = None  # the EngineDeadError message of a clean stop
        if log_stats is None:
            log_stats = not getattr(engine.config, "disable_log_stats", False)
        self._stat_loggers: list[StatLogger] = []
        if log_stats:
            self._stat_loggers.append(LoggingStatLogger(stats_log_interval_s))
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "is the engine dead?" against enqueuing an add
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None  # time.monotonic() of the running step's start
        self._dead_error: EngineDeadError | None = None
        self._ids = itertools.count()
        # Engine-thread state: parent request id -> its tracker (queue, loop, timings).
        self._trackers: dict[str, RequestTracker] = {}
        self._num_preemptions_seen = 0
        self._pending_finished: list[FinishedRequestStats] = []  # aborts, reported next pass
        # Engine-thread callbacks that get the fine-tuning jobs' updates after every pass.
        self._finetune_listeners: list[Callable[[list[Any]], None]] = []

    # ------------------------------------------------------------------------------ properties
    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    @property
    def input_processor(self) -> Any:
        return self.engine.input_processor

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        """The engine thread is alive and has not failed."""
        return self._dead_error is None and self.is_running

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine stopped, once it has."""
        return self._dead_error

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Get an `IterationStats` after every pass of the engine loop (on the engine thread)."""
        self._stat_loggers.append(stat_logger)

    # ------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; a no-op when it is already running."""
        with self._lock:
            if self._dead_error is not None:
                raise self._dead_error
            if self.is_running:
                return
            self._thread = threading.Thread(target=self._run, name="flexserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0, reason: str | None = None) -> None:
        """Stop the engine thread, then the executor's worker processes (tensor parallelism);
        in-flight requests fail with `EngineDeadError(reason)`."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(("stop", reason))
            thread.join(timeout)
        self.engine.shutdown()

    # ------------------------------------------------------------------------------ requests
    def next_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def prepare(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        prompt_text: str | None = None,
        lora_name: str | None = None,
        tenant: str = "default",
    ) -> PreparedRequest:
        """Tokenize and validate a prompt off the engine thread; raises ValueError on bad input."""
        return self.engine.process_inputs(
            request_id, prompt, params, prompt_text, lora_name=lora_name, tenant=tenant)

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Enqueue a prepared request and yield its cumulative outputs until it finishes.

        Outputs are cumulative, so when the consumer falls behind only the newest is yielded.
        Closing or cancelling the iterator before the final output aborts the request at once
        (its KV blocks are freed on the engine thread's next pass). An abort from elsewhere ends
        the iteration without a final output. Raises `EngineDeadError` if the engine fails.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        tracker = RequestTracker(prepared, loop, outputs)
        with self._lock:
            if self._dead_error is not None:
                raise self._dead_error
            if not self.is_running:
                raise EngineDeadError("the engine is not running; call start() first")
            self._commands.put(("add", tracker))
        finished = False
        deadline = (None if self.request_timeout_s is None
                    else prepared.arrival_time + self.request_timeout_s)
        try:
            while True:
                item = await self._next_item(outputs, deadline)
                while (
                    isinstance(item, RequestOutput)
                    and not item.finished
                    and not outputs.empty()
                ):
                    item = outputs.get_nowait()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort on a dead engine
                    raise item
                if item is _ABORTED:
                    finished = True
                    return
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(prepared.request_id)

    async def _next_item(self, outputs: asyncio.Queue[Any], deadline: float | None) -> Any:
        """The next queue item; `RequestTimeoutError` once `deadline` (monotonic) passed."""
        if deadline is None:
            return await outputs.get()
        if time.monotonic() < deadline:
            if not outputs.empty():  # a busy stream must time out too: check before taking
                return outputs.get_nowait()
        try:
            return await asyncio.wait_for(outputs.get(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise RequestTimeoutError(
                f"The request ran longer than the server's limit of {self.request_timeout_s:g} s "
                "(--request-timeout-s) and was aborted; ask for fewer tokens or retry later."
            ) from None

    def abort(self, request_id: str) -> None:
        """Cancel a request by id; thread-safe, and a no-op for unknown or finished ids."""
        if self._dead_error is None:
            self._commands.put(("abort", request_id))

    # ------------------------------------------------------------------------------ LoRA
    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_enabled

    def list_loras(self) -> tuple[LoRARequest, ...]:
        """The servable adapters (a snapshot; any thread)."""
        return self.engine.list_loras()

    async def add_lora(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Load an adapter and make it servable; ValueError with the reason when it cannot be.

        Reading and validating the files runs in a worker thread, so neither the event loop nor
        the engine loop waits on the disk; only the registration runs on the engine thread.
        """
        engine = self.engine
        lora_request = engine.new_lora_request(lora_name, lora_path)
        await asyncio.to_thread(engine.load_lora, lora_request)
        await self.call(engine.register_lora, lora_request)
        logger.info("loaded LoRA adapter %r from %s", lora_name, lora_path)
        return lora_request

    async def remove_lora(self, lora_name: str) -> int:
        """Stop serving an adapter; returns how many accepted requests still finish with it.

        Raises `AdapterNotFoundError` for an unknown name.
        """
        return await self.call(self.engine.remove_lora, lora_name)

    # ------------------------------------------------------------------------------ fine-tuning
    def add_finetune_listener(self, listener: Callable[[list[Any]], None]) -> None:
        """Call `listener(updates)` on the engine thread after every pass of the engine loop
        that has any, with `LLMEngine.pop_finetune_updates()`: right after the step, before the
        next one, so at a "step" update the job is still at that optimizer-step boundary (a
        listener may save a checkpoint then). A listener's exception is logged, never fatal."""
        self._finetune_listeners.append(listener)

    def _deliver_finetune_updates(self) -> None:
        updates = self.engine.pop_finetune_updates()  # popped even unheard: they never pile up
        if not updates:
            return
        for listener in self._finetune_listeners:
            try:
                listener(updates)
            except Exception:  # a broken listener must not take the engine down
                logger.exception("fine-tuning listener %r failed", listener)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the engine thread between two steps; its result or exception."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._dead_error is not None:
                raise self._dead_error
            if not self.is_running:
                raise EngineDeadError("the engine is not running; call start() first")
            self._commands.put(("call", (fn, args, future)))
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        self._prepare_thread()
        trace = self.engine.scheduler.hybrid.trace
        if trace is not None:
            trace.start_stall_watchdog(lambda: self._step_started)
        try:
            stalled = False  # the last step had fine-tuning work but placed nothing
            while True:
                block = not self._has_work()
                if not self._process_commands(block, _STALLED_WAIT_S if stalled else None):
                    break
                stats = self._new_stats()
                stalled = False
                if self._has_work():
                    self._step(stats)
                    stalled = (self.engine.last_step_stats is None
                               and not self.engine.has_unfinished_requests())
                self._deliver_finetune_updates()
                self._finish_stats(stats)
            self._fail_all(EngineDeadError(self._stop_reason or "the engine was shut down"))
        except BaseException as e:  # a crashed engine must not leave clients waiting forever
            logger.exception("the engine loop failed; failing all in-flight requests")
            self._fail_all(EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}"))

    def _prepare_thread(self) -> None:
        """The engine's per-thread start-up on this thread (cuDNN's attention plans for the
        fine-tuning backward); a failure there only costs speed, so it is logged, not raised."""
        prepare = getattr(self.engine, "prepare_thread", None)
        if prepare is None:
            return
        try:
            prepare()
        except Exception:
            logger.exception("per-thread engine start-up failed; continuing without it")

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or self.engine.has_finetune_work()

    def _process_commands(self, block: bool, wait_s: float | None = None) -> bool:
        """Apply queued adds and aborts; False on a stop command. `wait_s`: wait this long for
        a first command even when not blocking."""
        try:
            if block:
                command = self._commands.get(timeout=_IDLE_WAKEUP_S)
            elif wait_s is not None:
                command = self._commands.get(timeout=wait_s)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            if block:  # idle: still let stat loggers flush their periodic line
                self._finish_stats(self._new_stats())
            return True
        while True:
            kind, payload = command
            if kind == "stop":
                self._stop_reason = payload
                return False
            if kind == "add":
                self._add(payload)
            elif kind == "call":
                fn, args, future = payload
                try:
                    future.set_result(fn(*args))
                except Exception as e:  # the caller gets it; the engine carries on
                    future.set_exception(e)
            else:
                self._abort(payload)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, tracker: RequestTracker) -> None:
        request_id = tracker.request_id
        if request_id in self._trackers:
            tracker.deliver(ValueError(f"request id {request_id!r} is already in use"))
            return
        try:
            self.engine.add_prepared_request(tracker.prepared)
        except ValueError as e:  # fail this request only (adding is all or nothing)
            tracker.deliver(e)
            return
        self._trackers[request_id] = tracker

    def _abort(self, request_id: str) -> None:
        tracker = self._trackers.pop(request_id, None)
        if tracker is None:
            return
        self.engine.abort_request(request_id)
        tracker.mark_aborted(time.monotonic())
        self._pending_finished.append(tracker.finished_stats())
        tracker.deliver(_ABORTED)

    def _step(self, stats: IterationStats) -> None:
        start = self._step_started = time.monotonic()
        try:
            outputs = self.engine.step()
        finally:
            self._step_started = None
        now = time.monotonic()
        step_stats = self.engine.last_step_stats
        if step_stats is not None:
            stats.step_latency = step_stats.latency
            stats.num_batched_tokens = step_stats.num_batched_tokens
            stats.finetune_forward_tokens = step_stats.finetune_forward_tokens
            stats.finetune_backward_tokens = step_stats.finetune_backward_tokens
            stats.latency_model_error_ratio = step_stats.latency_model_error_ratio
            stats.latency_model_scale = step_stats.latency_model_scale
            stats.latency_model_backward_scale = step_stats.latency_model_backward_scale
            stats.iteration_overhead = step_stats.iteration_overhead
        for request_id, reason in self.engine.pop_failed_requests().items():
            tracker = self._trackers.pop(request_id, None)
            if tracker is not None:
                tracker.mark_aborted(now)
                stats.finished_requests.append(tracker.finished_stats())
                tracker.deliver(AdapterLoadError(reason))
        scheduler = self.engine.scheduler
        # Requests whose output processing raised: they ended (finish reason "abort", KV freed);
        # their clients get an error instead of that final output.
        failed = self.engine.output_processor.pop_failed_requests()
        output_ids = {output.request_id for output in outputs}
        for tracker in self._trackers.values():
            if tracker.first_scheduled_time is None:
                tracker.note_scheduled(scheduler, start, tracker.request_id in output_ids)
        for output in outputs:
            tracker = self._trackers.get(output.request_id)
            if tracker is None:
                continue
            reason = failed.get(output.request_id)
            try:
                if reason is None:
                    tracker.observe(output, now, stats)
                    if output.finished:
                        del self._trackers[output.request_id]
                        stats.finished_requests.append(tracker.finished_stats())
                    tracker.deliver(output)
                    continue
            except Exception:  # one request's bookkeeping must not take the engine down
                logger.exception("request %s: handing out its output failed", output.request_id)
                reason = "handing out the request's output failed"
            self._trackers.pop(output.request_id, None)
            self.engine.abort_request(output.request_id)  # a no-op once it finished
            tracker.mark_aborted(now)
            stats.finished_requests.append(tracker.finished_stats())
            try:  # a client whose event loop is gone has nobody to tell
                tracker.deliver(RequestFailedError(
                    f"The server failed while processing this request ({reason}) and aborted "
                    f"it; see the server log for request {output.request_id}."))
            except RuntimeError:
                logger.warning("request %s: its client is gone", output.request_id)

    def _new_stats(self) -> IterationStats:
        stats = IterationStats()
        stats.finished_requests.extend(self._pending_finished)
        self._pending_finished.clear()
        return stats

    def _finish_stats(self, stats: IterationStats) -> None:
        scheduler = self.engine.scheduler
        stats.now = time.monotonic()
        stats.num_running = scheduler.num_running
        stats.num_waiting = scheduler.num_waiting
        stats.kv_cache_usage = scheduler.kv_cache_usage
        stats.prefix_cache_hit_rate = scheduler.prefix_cache_hit_rate
        stats.slo_tpot_feasible = scheduler.hybrid.tpot_feasible
        total = scheduler.num_preemptions_total
        stats.num_preemptions = total - self._num_preemptions_seen
        self._num_preemptions_seen = total
        if self.engine.lora_enabled:
            (stats.lora_requests_running, stats.num_loras_gpu,
             stats.num_loras_cpu) = self.engine.lora_stats()
        for stat_logger in self._stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:  # a broken logger must not take the engine down
                logger.exception("stat logger %r failed", stat_logger)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            self._dead_error = error
            while True:  # adds that raced with the failure fail too
                try:
                    kind, payload = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    payload.deliver(error)
                elif kind == "call":
                    payload[2].set_exception(error)
        for tracker in self._trackers.values():
            tracker.deliver(error)
        self._trackers.clear()
