"""The fine-tuning job service: durable jobs on the serving engine, checkpoints served by name.

It owns the `StateStore` (files, jobs, events, checkpoints under `--state-dir`) and the queue of
jobs. Jobs start in creation order as long as the engine has room for them: a fine-tuning LoRA slot
and memory for the job's training state (`flexserve.engine.finetune_capacity`). The first job that
finds no room stays `queued`, with an event saying what it waits for, and the jobs behind it wait
too, until running jobs end; `max_concurrent_jobs`, when set, caps the jobs on the engine. Engine
work happens on the engine thread: a job starts there (`AsyncLLMEngine.call`), and a listener there
gets the jobs' updates after every step. At a "step" update the job is at an optimizer-step
boundary, so the listener saves a checkpoint (adapter + optimizer state + data position) every
`checkpoint_every_steps` and at the last step, synchronously, into `store.checkpoint_dir(job,
step)`; everything else (events, metrics, serving the checkpoint, validation loss, status) runs on
the event loop, one task per job, in update order.

Names: a job's adapter is served as `ft:<base>:<suffix>:<job_id>` (the newest checkpoint,
hot-swapped: unregister + register in one engine-thread call) and every checkpoint as
`ft:<base>:<suffix>:<job_id>:ckpt-step-<N>`. A checkpoint's record is written after it is servable
(and after its validation loss), so a recorded checkpoint is always complete.

Cleanup: once a job's final status is recorded (after its last checkpoint, or the events of its
cancellation or failure), the engine forgets it (`LLMEngine.remove_finetune_job`, on the engine
thread): its scheduler state and the worker's adapter masters and AdamW state are freed. What
stays is on disk and in the store: checkpoints, served by name, and the job's record and events.

Retention: after each checkpoint only the newest `keep_checkpoints` of the job stay on disk; older
ones are unserved and deleted, and their records get `deleted_at`. The newest (the final model
once the job ends) always stays, and so does a checkpoint a request is still using, one loaded
under another name, or one a queued, running or paused job starts from (they are tried again at
the job's next checkpoint).

Models belong to the job's tenant: `may_use_model` says whether a tenant may use, list, load or
unload a name in the pattern of a job's models (only the job's own tenant may). `/v1/models` lists
a job's name and its newest checkpoint; older kept checkpoints serve by name without being listed
(unless a client loaded them explicitly). A model its owner unloaded stays unloaded after a
restart, until it is loaded again or the job publishes a newer checkpoint.

Pause (`pause`): a running job stops at its next optimizer-step boundary with a checkpoint there
and leaves the engine (its LoRA slot and memory are free); its status is `paused` in the store, so
it stays paused across restarts. `resume` queues it again and it continues from that checkpoint,
exactly as a restarted job does. When a job leaves the engine (it ends or pauses), its per-step
metrics CSV (`results.py`) is written as a file of its tenant and listed in `result_files`.

Restart (even after kill -9): running jobs resume from their newest recorded checkpoint (from
scratch when they have none) and end with the same steps; queued jobs queue again; every
checkpoint name and each job's newest adapter are registered again before any job resumes.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from flexserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from flexserve.engine.finetune_capacity import FinetuneCapacityError
from flexserve.finetune.adapters import (
    fine_tuned_model_name,
    parse_job_model_name,
)
from flexserve.finetune.checkpoint_publisher import CheckpointPublisher
from flexserve.finetune.data import (
    TrainingData,
    TrainingExample,
    check_method_data,
    load_training_data,
)
from flexserve.finetune.dpo import metric_fields
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.finetune.records import JOB_STATUSES, JobRecord
from flexserve.finetune.results import RESULTS_FILENAME, RESULTS_PURPOSE, step_metrics_csv
from flexserve.finetune.steps import plan_training_steps
from flexserve.finetune.store import StateStore

logger = logging.getLogger(__name__)

FINAL_STATUSES = ("succeeded", "failed", "cancelled")
DEFAULT_KEEP_CHECKPOINTS = 3
_CAPACITY_RETRY_S = 0.5  # a job that found no fine-tuning slot or memory tries again after this


@dataclass(slots=True)
class FinetuneServiceConfig:
    """How the job service runs (the server's `--state-dir`, `--checkpoint-every-steps`, ...)."""

    state_dir: str  # files, jobs, events and checkpoints live under <state_dir>/finetune
    checkpoint_every_steps: int = 10  # a checkpoint every this many optimizer steps, and the last
    max_concurrent_jobs: int | None = None  # at most this many jobs on the engine at once;
    # None: as many as the fine-tuning slots and memory hold
    max_upload_bytes: int = 100 * 1024 * 1024  # largest file POST /v1/files accepts
    keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS  # newest checkpoints of a job kept on disk

    def __post_init__(self) -> None:
        for name in ("checkpoint_every_steps", "max_concurrent_jobs", "max_upload_bytes",
                     "keep_checkpoints"):
            value = getattr(self, name)
            if value is None and name == "max_concurrent_jobs":
                continue
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class _Item:
    """One engine update for a job's task (or a terminal event the service made itself)."""

    kind: str  # step | succeeded | failed | cancelled
    update: Any = None  # the engine's FinetuneUpdate (None for a service-made item)
    checkpoint_path: str | None = None  # saved at this step
    pause: bool = False  # graceful shutdown: the job stopped on the engine after this step
    error: dict | None = None  # failed: {"code", "message", "param"}


@dataclass(eq=False)
class _ActiveJob:
    """A job the service started on the engine (or is starting)."""

    record: JobRecord | None = None  # as it was when it started (None while it is read)
    fine_tuned_model: str = ""  # the name its newest checkpoint is served under
    validation: list[TrainingExample] = field(default_factory=list)  # empty: no validation file
    items: asyncio.Queue = field(default_factory=asyncio.Queue)  # engine updates, in order
    done: asyncio.Future | None = None  # set when the job reached a final status
    task: asyncio.Task | None = None  # consumes `items`
    on_engine: bool = False  # the engine accepted the job
    cancel_requested: bool = False  # cancelled while starting
    num_logged_steps: int = 0  # steps whose metrics event is in the log (a resumed job skips)
    waiting: str | None = None  # why the engine has no room for it yet (it stays queued)
    paused: asyncio.Future | None = None  # shutdown: set once its pause checkpoint is recorded
    user_pause: asyncio.Future | None = None  # pause(): set once the job is `paused`
    num_total_tokens: int = 0  # forward tokens of all its steps (trained_tokens at the end)
    rate_origin: tuple[float, int] | None = None  # (time, trained tokens) at its first step here
    estimated_finish: int | None = None  # unix seconds, from the measured token rate
    # a DPO job with a validation file: its pairs' log-probabilities under the reference model
    # (computed at its first checkpoint)
    reference_logprobs: list[float] | None = None


class FinetuneService:
    """Files and fine-tuning jobs of one server (see the module docstring)."""

    def __init__(self, engine: AsyncLLMEngine, base_model: str, config: FinetuneServiceConfig,
                 metrics: Any | None = None) -> None:
        self.engine = engine
        self.base_model = base_model
        self.config = config
        self.metrics = metrics  # a FinetuneMetrics, or None
        self.store = StateStore(config.state_dir)
        lora = engine.engine.config.lora
        if lora is not None:
            # The server writes these adapters itself, so they are servable even when
            # --allowed-adapter-dir points elsewhere.
            if self.store.checkpoints_dir not in lora.internal_adapter_dirs:
                lora.internal_adapter_dirs.append(self.store.checkpoints_dir)
        self.prepared: dict[str, tuple[TrainingData, list[TrainingExample]]] = {}  # by job id
        self._queue: collections.deque[str] = collections.deque()  # queued job ids, in order
        self._active: dict[str, _ActiveJob] = {}  # starting or running jobs
        self._counts: collections.Counter[str] = collections.Counter()  # jobs per status
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._pausing = False  # graceful shutdown: jobs stop at their next step boundary
        self._paused_ids: set[str] = set()  # engine thread: jobs paused on the engine
        self._job_tenants: dict[str, str | None] = {}  # job id -> tenant (None: no such job)
        self.checkpoints = CheckpointPublisher(engine, self.store, base_model,
                                               config.keep_checkpoints)
        engine.add_finetune_listener(self._on_updates)

    @property
    def max_finetune_len(self) -> int:
        llm = self.engine.engine
        return llm.config.finetune.max_finetune_len or llm.info.max_model_len

    # --------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Recover after a (re)start: serve every checkpoint again, then queue and resume jobs."""
        self._loop = asyncio.get_running_loop()
        jobs = await asyncio.to_thread(self.store.jobs_with_status, *JOB_STATUSES)
        self._counts.update(job.status for job in jobs)
        self._publish_counts()
        unloaded = await asyncio.to_thread(self.store.unloaded_models)
        for job in jobs:
            if job.adapter_path is not None and self.engine.lora_enabled:
                await self.checkpoints.serve_recorded(job, unloaded)
        resumed = [job.id for job in jobs if job.status == "running"]
        queued = [job.id for job in jobs if job.status in ("queued", "validating_files")]
        if (resumed or queued) and not self.engine.lora_enabled:
            logger.warning("%d fine-tuning job(s) wait for a server with LoRA slots (this one "
                           "runs with --no-enable-lora)",
                           len(resumed) + len(queued))
            return
        self._queue.extend(resumed + queued)
        if resumed:
            logger.info("resuming %d fine-tuning job(s) after a restart: %s", len(resumed),
                        ", ".join(resumed))
        self._pump()

    async def close(self) -> None:
        """Stop the job tasks; running jobs stay `running` in the store and resume next start."""
        self._closed = True
        tasks = [active.task for active in self._active.values() if active.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.store.close()

    # -------------------------------------------------------------------------------- jobs
    async def submit(self, record: JobRecord, data: TrainingData,
                     validation: list[TrainingExample]) -> JobRecord:
        """Store a validated job as `queued` (with its truncation warnings) and queue it."""
        await asyncio.to_thread(self._add_job, record, data)
        self.prepared[record.id] = (data, validation)
        self._counts[record.status] += 1
        self._publish_counts()
        self._queue.append(record.id)
        self._pump()
        return record

    def _add_job(self, record: JobRecord, data: TrainingData) -> None:
        self.store.add_job(record)
        self.store.add_event(record.id, f"Created fine-tuning job: {record.id}")
        for event in data.events:
            self.store.add_event(record.id, f"Training file {event.message}", level="warn")

    async def cancel(self, job_id: str) -> JobRecord:
        """Cancel a queued or running job; returns it as stored once it is `cancelled`."""
        if job_id in self._queue:
            self._queue.remove(job_id)
            self.prepared.pop(job_id, None)
            await self._set_status(job_id, "cancelled", "The job was cancelled.",
                                   finished_at=int(time.time()))
        elif job_id in self._active:
            active = self._active[job_id]
            active.cancel_requested = True
            if active.on_engine:
                await self.engine.call(_cancel_on_engine, self.engine.engine, job_id)
                active.items.put_nowait(_Item("cancelled"))
            await asyncio.shield(active.done)
        elif (await asyncio.to_thread(self.store.get_job, job_id)).status == "paused":
            await self._set_status(job_id, "cancelled", "The job was cancelled.",
                                   finished_at=int(time.time()))
        return await asyncio.to_thread(self.store.get_job, job_id)

    async def pause(self, job_id: str) -> JobRecord:
        """Pause a queued or running job; returns it as stored once it is `paused` (a running
        job pauses at its next optimizer-step boundary, with a checkpoint there; one at its last
        step succeeds instead)."""
        if job_id in self._queue:
            self._queue.remove(job_id)
            self.prepared.pop(job_id, None)
            await self._set_status(job_id, "paused", "Fine-tuning job paused.")
        elif job_id in self._active:
            active = self._active[job_id]
            if active.user_pause is None:
                active.user_pause = self._loop.create_future()
            await asyncio.wait([active.user_pause, active.done],
                               return_when=asyncio.FIRST_COMPLETED)
        return await asyncio.to_thread(self.store.get_job, job_id)

    async def resume(self, job_id: str) -> JobRecord:
        """Queue a paused job again: it continues from its pause checkpoint. The metrics file
        written at the pause goes: the job's final one replaces it when it ends, and until then
        `result_files` names nothing about to disappear."""
        await asyncio.to_thread(self._drop_results, job_id)
        await self._set_status(job_id, "queued", "Fine-tuning job resumed: queued.")
        self._queue.append(job_id)
        self._pump()
        return await asyncio.to_thread(self.store.get_job, job_id)

    def estimated_finish(self, job_id: str) -> int | None:
        """Unix seconds at which a running job should end, at its measured token rate."""
        active = self._active.get(job_id)
        return None if active is None else active.estimated_finish

    # ------------------------------------------------------------------------------ models
    def _job_tenant(self, job_id: str) -> str | None:
        if job_id not in self._job_tenants:
            record = self.store.get_job(job_id)
            self._job_tenants[job_id] = None if record is None else record.tenant
        return self._job_tenants[job_id]

    def may_use_model(self, name: str, tenant: str) -> bool:
        """Whether `tenant` may use, list, load or unload the model `name`: any name outside
        the pattern of a job's models, and a job's models only for the job's own tenant."""
        parsed = parse_job_model_name(self.base_model, name)
        return parsed is None or self._job_tenant(parsed[0]) == tenant

    def may_load_path(self, path: str, tenant: str) -> bool:
        """Whether `tenant` may load an adapter from `path`: a directory under the checkpoints
        only when it is a checkpoint of one of its own jobs."""
        root = os.path.realpath(self.store.checkpoints_dir)
        real = os.path.realpath(path)
        if os.path.commonpath([root, real]) != root or real == root:
            return True
        return self._job_tenant(os.path.relpath(real, root).split(os.sep)[0]) == tenant

    def is_listed(self, name: str) -> bool:
        """Whether `/v1/models` lists a served name: all but a job's older checkpoints (those
        serve by name unless a client loaded them explicitly)."""
        parsed = parse_job_model_name(self.base_model, name)
        if parsed is None or parsed[1] is None or name in self.checkpoints.explicit_models:
            return True
        return self.checkpoints.newest.get(parsed[0]) == name

    async def model_loaded(self, name: str) -> None:
        """A client loaded `name`: listed, and served again after a restart."""
        parsed = parse_job_model_name(self.base_model, name)
        if parsed is not None:
            self.checkpoints.explicit_models.add(name)
            await asyncio.to_thread(self.store.set_model_unloaded, name, parsed[0], False)

    async def model_unloaded(self, name: str) -> None:
        """A client unloaded `name`: a restart does not serve it again."""
        parsed = parse_job_model_name(self.base_model, name)
        if parsed is not None:
            self.checkpoints.explicit_models.discard(name)
            await asyncio.to_thread(self.store.set_model_unloaded, name, parsed[0], True)

    # --- graceful shutdown (entrypoints/shutdown.py) ---
    async def checkpoint_running_jobs(self, timeout_s: float) -> list[str]:
        """Shutdown: every job running on the engine saves a checkpoint at its next optimizer-
        step boundary (whatever --checkpoint-every-steps says) and stops there. Its record stays
        `running`, so the next start resumes it from that checkpoint; queued jobs stay queued
        and no new one starts. Returns the ids of the jobs so checkpointed within `timeout_s`;
        the others resume from their newest earlier checkpoint."""
        self._pausing = True
        waiting = {}
        for job_id, active in self._active.items():
            if active.on_engine and not active.done.done():
                active.paused = self._loop.create_future()
                waiting[job_id] = active.paused
        if waiting:
            await asyncio.wait(list(waiting.values()), timeout=timeout_s)
        return [job_id for job_id, future in waiting.items() if future.done()]
    # --- end graceful shutdown ---

    def _pump(self) -> None:
        """Start queued jobs in order while none waits for room on the engine (and fewer than
        max_concurrent_jobs run, where set)."""
        if self._closed or self._pausing or self._loop is None:
            return
        cap = self.config.max_concurrent_jobs
        while (self._queue and (cap is None or len(self._active) < cap)
               and not any(active.waiting for active in self._active.values())):
            job_id = self._queue.popleft()
            active = _ActiveJob(done=self._loop.create_future())
            self._active[job_id] = active
            active.task = self._loop.create_task(self._run(job_id, active),
                                                 name=f"finetune-{job_id}")

    async def _run(self, job_id: str, active: _ActiveJob) -> None:
        try:
            if await self._start_on_engine(job_id, active):
                await self._consume(job_id, active)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:  # the server is going down: the job resumes at restart
            logger.error("fine-tuning job %s stopped with the engine: %s", job_id, e)
        except Exception as e:  # a bug or an I/O error must not leave the job hanging
            logger.exception("fine-tuning job %s failed in the service", job_id)
            await self._end_failed(job_id, active, "internal_error", f"{type(e).__name__}: {e}")
        finally:
            if self._active.get(job_id) is active and active.done.done():
                del self._active[job_id]
                self._pump()

    async def _start_on_engine(self, job_id: str, active: _ActiveJob) -> bool:
        """Start (or resume) a job on the engine; False when it ended before running."""
        record = await asyncio.to_thread(self.store.get_job, job_id)
        active.record = record
        active.fine_tuned_model = fine_tuned_model_name(self.base_model, record.suffix, job_id)
        hp = Hyperparameters.from_dict(record.hyperparameters)
        latest = await asyncio.to_thread(self.store.latest_checkpoint, job_id)
        try:
            data, active.validation = await asyncio.to_thread(self._job_data, record, hp)
        except (ValueError, KeyError) as e:
            await self._end_failed(job_id, active, "invalid_training_file", str(e),
                                   "training_file")
            return False
        # Every epoch trains every example once (`finetune.steps.plan_training_steps`).
        active.num_total_tokens = hp.n_epochs * sum(len(e.input_ids) for e in data.examples)
        step_plan = await asyncio.to_thread(_step_plan, data.num_items, hp)
        self._paused_ids.discard(job_id)  # paused earlier, resumed now
        if latest is not None:
            active.num_logged_steps = await asyncio.to_thread(self._num_logged_steps, job_id)
        # A resumed job's adapter comes from its checkpoint; init_adapter is where it began.
        init = hp.lora.init_adapter if latest is None else None
        start = functools.partial(
            self.engine.engine.add_finetune_job, data, hp, job_id=job_id, init_adapter_path=init,
            resume_from=None if latest is None else latest.path, tenant=record.tenant,
            step_plan=step_plan)
        while True:
            try:
                await self.engine.call(start)
                break
            except ValueError as e:
                if active.cancel_requested:
                    await self._set_status(job_id, "cancelled", "The job was cancelled.",
                                           finished_at=int(time.time()))
                    await self._let_go(job_id, active)
                elif isinstance(e, FinetuneCapacityError) and active.user_pause is not None:
                    await self._set_status(job_id, "paused", "Fine-tuning job paused.")
                    await self._let_go(job_id, active)
                    active.user_pause.set_result(None)
                elif isinstance(e, FinetuneCapacityError):  # running jobs hold the room: wait
                    if active.waiting != str(e):
                        active.waiting = str(e)
                        await asyncio.to_thread(
                            self.store.add_event, job_id,
                            f"Queued: waiting for room on the engine: {e}.")
                    await asyncio.sleep(_CAPACITY_RETRY_S)
                    continue
                else:
                    await self._end_failed(job_id, active, "invalid_job", str(e))
                return False
        if active.waiting is not None:
            active.waiting = None
            self._pump()  # the jobs behind it may try now
        active.on_engine = True
        if active.cancel_requested:
            await self.engine.call(_cancel_on_engine, self.engine.engine, job_id)
            active.items.put_nowait(_Item("cancelled"))
        message = (f"Fine-tuning job resumed from step {latest.step_number} (checkpoint "
                   f"{latest.fine_tuned_model_checkpoint})" if latest is not None
                   else "Fine-tuning job started")
        await self._set_status(job_id, "running", message)
        return True

    def _job_data(self, record: JobRecord, hp: Hyperparameters,
                  ) -> tuple[TrainingData, list[TrainingExample]]:
        prepared = self.prepared.pop(record.id, None)
        if prepared is not None:
            return prepared
        tokenizer = self.engine.tokenizer
        data = load_training_data(self.store.read_file(record.training_file), tokenizer,
                                  min(hp.max_seq_len, self.max_finetune_len))
        validation = []
        if record.validation_file is not None:
            validation = self.load_validation(self.store.read_file(record.validation_file), hp)
        return data, validation

    def load_validation(self, content: bytes, hp: Hyperparameters) -> list[TrainingExample]:
        """Validation examples, cut so that prompt + one generated token fit the context."""
        max_len = min(hp.max_seq_len, self.max_finetune_len,
                      self.engine.info.max_model_len - 1)
        data = load_training_data(content, self.engine.tokenizer, max_len)
        check_method_data(hp.method, data.format)
        return data.examples

    def _num_logged_steps(self, job_id: str) -> int:
        events = _every_page(functools.partial(self.store.list_events, job_id))
        return max((int(e.data["step"]) for e in events
                    if e.type == "metrics" and e.data and "train_loss" in e.data), default=0)

    # ------------------------------------------------------------------- engine-thread side
    def _on_updates(self, updates: list[Any]) -> None:
        """Engine thread, after a step: checkpoint where due, hand every update to its job."""
        loop = self._loop
        if self._closed or loop is None:
            return
        for update in updates:
            active = self._active.get(update.job_id)
            if active is None:  # a job of the offline API, or one this service let go
                continue
            if update.job_id in self._paused_ids:
                continue  # paused for the shutdown: its "cancelled" is no cancellation
            item = _Item(update.kind, update)
            # Shutdown: pause at this boundary, unless it was the last step (then it succeeds).
            pause = (update.kind == "step" and update.step < update.num_steps
                     and (active.paused is not None or active.user_pause is not None))
            if update.kind == "step" and (update.step % self.config.checkpoint_every_steps == 0
                                          or update.step == update.num_steps or pause):
                item.checkpoint_path, item.error = self.checkpoints.save(update)
            if pause and item.error is None:
                item.pause = True
                self._paused_ids.add(update.job_id)
                self.engine.engine.cancel_finetune_job(update.job_id)  # frees its KV at once
            loop.call_soon_threadsafe(active.items.put_nowait, item)

    # --------------------------------------------------------------------- event-loop side
    async def _consume(self, job_id: str, active: _ActiveJob) -> None:
        while True:
            item: _Item = await active.items.get()
            if item.kind == "step":
                await self._on_step(job_id, active, item)
                if item.error is not None:
                    await self._end_failed(job_id, active, **item.error)
                    return
                if item.pause and active.user_pause is not None:
                    await self._set_status(job_id, "paused", f"Fine-tuning job paused at step "
                                           f"{item.update.step}.")
                    await self._let_go(job_id, active)
                    if active.paused is not None:
                        active.paused.set_result(item.update.step)
                    active.user_pause.set_result(None)
                    return
                if item.pause:  # its checkpoint is recorded: it resumes from it at the restart
                    await asyncio.to_thread(
                        self.store.add_event, job_id, f"Paused at step {item.update.step} for "
                        "a server shutdown; the job resumes from this checkpoint at the restart.")
                    active.paused.set_result(item.update.step)
                    return
            elif item.kind == "succeeded":
                update = item.update
                await self._set_status(job_id, "succeeded", "The job has successfully completed",
                                       finished_at=int(time.time()),
                                       trained_tokens=update.num_trained_tokens)
                await self._let_go(job_id, active)
                return
            elif item.kind == "cancelled":
                await self._set_status(job_id, "cancelled", "The job was cancelled.",
                                       finished_at=int(time.time()))
                await self._let_go(job_id, active)
                return
            else:
                message = getattr(item.update, "message", None) or "training failed"
                await self._end_failed(job_id, active, "training_failed", message)
                return

    async def _on_step(self, job_id: str, active: _ActiveJob, item: _Item) -> None:
        update = item.update
        if self.metrics is not None:
            self.metrics.observe_step(job_id, update.loss, update.step, update.num_steps)
        self._estimate_finish(active, update.num_trained_tokens)
        if update.step > active.num_logged_steps:
            active.num_logged_steps = update.step
            data = {"step": update.step, "train_loss": update.loss,
                    "train_mean_token_accuracy": update.accuracy,
                    "total_steps": update.num_steps, "grad_norm": update.grad_norm,
                    "trained_tokens": update.num_trained_tokens}
            message = f"Step {update.step}/{update.num_steps}: training loss={update.loss:.4f}"
            if update.dpo is not None:
                data.update(metric_fields(update.dpo, "train"))
                message += (f", reward margin={update.dpo['rewards/margin']:.4f}, preference "
                            f"accuracy={update.dpo['rewards/accuracy']:.4f}")
            await asyncio.to_thread(self.store.add_event, job_id, message, "info", "metrics",
                                    data)
        if item.checkpoint_path is not None:
            await self.checkpoints.publish(job_id, active, update, item.checkpoint_path)

    @staticmethod
    def _estimate_finish(active: _ActiveJob, num_trained_tokens: int) -> None:
        """The job's end at the token rate measured since its first step on this run."""
        now = time.time()
        if active.rate_origin is None:
            active.rate_origin = (now, num_trained_tokens)
            return
        start, start_tokens = active.rate_origin
        if now > start and num_trained_tokens > start_tokens:
            rate = (num_trained_tokens - start_tokens) / (now - start)
            remaining = max(active.num_total_tokens - num_trained_tokens, 0)
            active.estimated_finish = int(now + remaining / rate)

    # ------------------------------------------------------------------------------- status
    async def _set_status(self, job_id: str, status: str, message: str, level: str = "info",
                          **fields: Any) -> None:
        old = await asyncio.to_thread(self._write_status, job_id, status, message, level, fields)
        self._counts[old] -= 1
        self._counts[status] += 1
        self._publish_counts()

    def _write_status(self, job_id: str, status: str, message: str, level: str,
                      fields: dict) -> str:
        old = self.store.get_job(job_id).status
        if old != status or fields:
            self.store.update_job(job_id, status=status, **fields)
        self.store.add_event(job_id, message, level=level)
        return old

    async def _end_failed(self, job_id: str, active: _ActiveJob, code: str, message: str,
                          param: str | None = None) -> None:
        if active.on_engine:
            try:
                await self.engine.call(_cancel_on_engine, self.engine.engine, job_id)
            except Exception:  # the engine may be gone; the job is failed all the same
                logger.exception("cannot stop fine-tuning job %s on the engine", job_id)
        await self._set_status(job_id, "failed", f"The job failed: {message}", "error",
                               finished_at=int(time.time()),
                               error={"code": code, "message": message, "param": param})
        await self._let_go(job_id, active)

    async def _let_go(self, job_id: str, active: _ActiveJob) -> None:
        """The job's final status and events are recorded (and its last checkpoint, which came
        before them): the engine forgets the job, then whoever waits for it (`cancel`) wakes."""
        if active.on_engine:
            try:
                await self.engine.call(_remove_from_engine, self.engine.engine, job_id)
            except EngineDeadError:  # the engine, and all it held, is gone already
                pass
            except Exception:  # it only costs memory; the job's outcome stands
                logger.exception("cannot remove fine-tuning job %s from the engine", job_id)
        try:
            await asyncio.to_thread(self._write_results, job_id)
        except Exception:  # the job's outcome stands without its CSV
            logger.exception("cannot write the result file of fine-tuning job %s", job_id)
        if not active.done.done():
            active.done.set_result(None)

    def _drop_results(self, job_id: str) -> None:
        job = self.store.get_job(job_id)
        if job.result_files:
            self.store.update_job(job_id, result_files=[])
            for old in job.result_files:
                self.store.delete_file(old)

    def _write_results(self, job_id: str) -> None:
        """Store the job's per-step metrics CSV as a file of its tenant, replacing an older
        one (a paused job that resumed)."""
        events = _every_page(functools.partial(self.store.list_events, job_id))
        if not any(e.type == "metrics" for e in events):
            return
        job = self.store.get_job(job_id)
        record = self.store.add_file(RESULTS_FILENAME, RESULTS_PURPOSE, step_metrics_csv(events),
                                     job.tenant)
        self.store.update_job(job_id, result_files=[record.id])
        for old in job.result_files or ():
            self.store.delete_file(old)

    def _publish_counts(self) -> None:
        if self.metrics is not None:
            self.metrics.set_job_counts(self._counts)


def _step_plan(num_items: int, hp: Hyperparameters) -> list[list[int]]:
    """The examples of every step, planned off the event loop and the engine thread."""
    seed = hp.seed if hp.seed is not None else 0
    return [list(step.example_indices) for step in plan_training_steps(
        num_items, hp.batch_size, hp.n_epochs, hp.shuffle, seed)]


def _cancel_on_engine(llm: Any, job_id: str) -> None:
    """Engine thread: stop the job, if the engine still holds it (it may have ended and been
    removed since the caller looked)."""
    if _engine_job(llm, job_id) is not None:
        llm.cancel_finetune_job(job_id)


def _remove_from_engine(llm: Any, job_id: str) -> None:
    """Engine thread: forget an ended job (nothing to do when the engine holds it no more)."""
    job = _engine_job(llm, job_id)
    if job is not None and job.finished:
        llm.remove_finetune_job(job_id)


def _engine_job(llm: Any, job_id: str) -> Any | None:
    try:
        return llm.get_finetune_job(job_id)
    except ValueError:
        return None


def _every_page(list_page: Any) -> list:
    """Every record of a newest-first store listing `list_page(after=, limit=)`."""
    records, after = [], None
    while True:
        page, has_more = list_page(after=after, limit=1000)
        records.extend(page)
        if not has_more:
            return records
        after = page[-1].id
