"""The fine-tuning job service: durable jobs on the serving engine, checkpoints served by name.

It owns the `StateStore` (files, jobs, events, checkpoints under `--state-dir`) and the queue of
jobs. At most `max_concurrent_jobs` run on the engine at once; the others stay `queued` and start
in creation order as running ones end. Engine work happens on the engine thread: a job starts
there (`AsyncLLMEngine.call`), and a listener there gets the jobs' updates after every step. At a
"step" update the job is at an optimizer-step boundary, so the listener saves a checkpoint
(adapter + optimizer state + data position) every `checkpoint_every_steps` and at the last step,
synchronously, into `store.checkpoint_dir(job, step)`; everything else (events, metrics, serving
the checkpoint, validation loss, status) runs on the event loop, one task per job, in update order.

Names: a job's adapter is served as `ft:<base>:<suffix>:<job_id>` (the newest checkpoint,
hot-swapped: unregister + register in one engine-thread call) and every checkpoint as
`ft:<base>:<suffix>:<job_id>:ckpt-step-<N>`. A checkpoint's record is written after it is servable
(and after its validation loss), so a recorded checkpoint is always complete.

Cleanup: once a job's final status is recorded (after its last checkpoint, or the events of its
cancellation or failure), the engine forgets it (`LLMEngine.remove_finetune_job`, on the engine
thread): its scheduler state and the worker's adapter masters and AdamW state are freed. What
stays is on disk and in the store: checkpoints, served by name, and the job's record and events.

Restart (even after kill -9): running jobs resume from their newest recorded checkpoint (from
scratch when they have none) and end with the same steps; queued jobs queue again; every
checkpoint name and each job's newest adapter are registered again before any job resumes.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flexserve.engine.adapter_manager import NoFreeSlotError
from flexserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from flexserve.finetune.adapters import (
    checkpoint_model_name,
    fine_tuned_model_name,
    serve_checkpoint,
    validation_loss,
)
from flexserve.finetune.data import TrainingData, TrainingExample, load_training_data
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.finetune.records import JOB_STATUSES, JobRecord
from flexserve.finetune.store import StateStore

logger = logging.getLogger(__name__)

FINAL_STATUSES = ("succeeded", "failed", "cancelled")
_SLOT_RETRY_S = 0.5  # a job that found every LoRA slot pinned by requests tries again after this


@dataclass(slots=True)
class FinetuneServiceConfig:
    """How the job service runs (the server's `--state-dir`, `--checkpoint-every-steps`, ...)."""

    state_dir: str  # files, jobs, events and checkpoints live under <state_dir>/finetune
    checkpoint_every_steps: int = 10  # a checkpoint every this many optimizer steps, and the last
    max_concurrent_jobs: int = 1  # jobs on the engine at once; the others stay queued
    max_upload_bytes: int = 100 * 1024 * 1024  # largest file POST /v1/files accepts

    def __post_init__(self) -> None:
        for name in ("checkpoint_every_steps", "max_concurrent_jobs", "max_upload_bytes"):
            value = getattr(self, name)
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
    paused: asyncio.Future | None = None  # shutdown: set once its pause checkpoint is recorded


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
            if config.max_concurrent_jobs >= lora.max_loras:
                self.store.close()
                raise ValueError(
                    f"--max-concurrent-jobs {config.max_concurrent_jobs} needs --max-loras > "
                    f"{config.max_concurrent_jobs}: each running job holds a LoRA slot and "
                    f"serving its checkpoints needs another (max_loras is {lora.max_loras})")
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
        for job in jobs:
            if job.adapter_path is not None and self.engine.lora_enabled:
                await self._serve_recorded_checkpoints(job)
        resumed = [job.id for job in jobs if job.status == "running"]
        queued = [job.id for job in jobs if job.status in ("queued", "validating_files")]
        if (resumed or queued) and not self.engine.lora_enabled:
            logger.warning("%d fine-tuning job(s) wait for a server with --enable-lora",
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
        return await asyncio.to_thread(self.store.get_job, job_id)

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
        """Start queued jobs while fewer than max_concurrent_jobs run."""
        if self._closed or self._pausing or self._loop is None:
            return
        while self._queue and len(self._active) < self.config.max_concurrent_jobs:
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
        if latest is not None:
            active.num_logged_steps = await asyncio.to_thread(self._num_logged_steps, job_id)
        # A resumed job's adapter comes from its checkpoint; init_adapter is where it began.
        init = hp.lora.init_adapter if latest is None else None
        start = functools.partial(
            self.engine.engine.add_finetune_job, data, hp, job_id=job_id, init_adapter_path=init,
            resume_from=None if latest is None else latest.path, tenant=record.tenant)
        while True:
            try:
                await self.engine.call(start)
                break
            except ValueError as e:
                if active.cancel_requested:
                    await self._set_status(job_id, "cancelled", "The job was cancelled.",
                                           finished_at=int(time.time()))
                    await self._let_go(job_id, active)
                elif isinstance(e, NoFreeSlotError):  # requests pin every slot now: wait
                    await asyncio.sleep(_SLOT_RETRY_S)
                    continue
                else:
                    await self._end_failed(job_id, active, "invalid_job", str(e))
                return False
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
        return load_training_data(content, self.engine.tokenizer, max_len).examples

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
            pause = (update.kind == "step" and active.paused is not None
                     and update.step < update.num_steps)
            if update.kind == "step" and (update.step % self.config.checkpoint_every_steps == 0
                                          or update.step == update.num_steps or pause):
                item.checkpoint_path, item.error = self._save_checkpoint(update)
            if pause and item.error is None:
                item.pause = True
                self._paused_ids.add(update.job_id)
                self.engine.engine.cancel_finetune_job(update.job_id)  # frees its KV at once
            loop.call_soon_threadsafe(active.items.put_nowait, item)

    def _save_checkpoint(self, update: Any) -> tuple[str | None, dict | None]:
        path = self.store.checkpoint_dir(update.job_id, update.step)
        llm = self.engine.engine
        try:  # atomic: a checkpoint left there by a crash before its record is replaced
            llm.save_finetune_checkpoint(update.job_id, path)
            return path, None
        except Exception as e:  # a full disk fails this job, not the engine
            logger.exception("cannot save the checkpoint of %s at step %d", update.job_id,
                             update.step)
            llm.cancel_finetune_job(update.job_id)
            return None, {"code": "checkpoint_failed", "param": None,
                          "message": f"cannot save the checkpoint at step {update.step}: {e}"}

    # --------------------------------------------------------------------- event-loop side
    async def _consume(self, job_id: str, active: _ActiveJob) -> None:
        while True:
            item: _Item = await active.items.get()
            if item.kind == "step":
                await self._on_step(job_id, active, item)
                if item.error is not None:
                    await self._end_failed(job_id, active, **item.error)
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
            self.metrics.observe_step(job_id, update.loss, update.step)
        if update.step > active.num_logged_steps:
            active.num_logged_steps = update.step
            data = {"step": update.step, "train_loss": update.loss,
                    "total_steps": update.num_steps, "grad_norm": update.grad_norm,
                    "trained_tokens": update.num_trained_tokens}
            await asyncio.to_thread(
                self.store.add_event, job_id,
                f"Step {update.step}/{update.num_steps}: training loss={update.loss:.4f}",
                "info", "metrics", data)
        if item.checkpoint_path is not None:
            await self._publish_checkpoint(job_id, active, update, item.checkpoint_path)

    async def _publish_checkpoint(self, job_id: str, active: _ActiveJob, update: Any,
                                  path: str) -> None:
        name = checkpoint_model_name(active.fine_tuned_model, update.step)
        await serve_checkpoint(self.engine, name, active.fine_tuned_model, path)
        metrics: dict[str, Any] = {"step": update.step, "train_loss": update.loss}
        if active.validation:
            valid_loss = await validation_loss(self.engine, name, active.validation,
                                               active.record.tenant)
            metrics["valid_loss"] = valid_loss
            await asyncio.to_thread(
                self.store.add_event, job_id,
                f"Step {update.step}/{update.num_steps}: validation loss={valid_loss:.4f}",
                "info", "metrics", {"step": update.step, "valid_loss": valid_loss,
                                    "total_steps": update.num_steps})
        await asyncio.to_thread(self._record_checkpoint, job_id, active, update, metrics, name,
                                path)

    def _record_checkpoint(self, job_id: str, active: _ActiveJob, update: Any, metrics: dict,
                           name: str, path: str) -> None:
        self.store.add_checkpoint(job_id, update.step, metrics, name, path)
        self.store.update_job(job_id, fine_tuned_model=active.fine_tuned_model, adapter_path=path,
                              step=update.step, trained_tokens=update.num_trained_tokens)
        self.store.add_event(job_id, f"Checkpoint created at step {update.step}: {name}",
                             data={"step": update.step, "fine_tuned_model_checkpoint": name})

    async def _serve_recorded_checkpoints(self, job: JobRecord) -> None:
        fine_tuned_model = fine_tuned_model_name(self.base_model, job.suffix, job.id)
        checkpoints = await asyncio.to_thread(
            _every_page, functools.partial(self.store.list_checkpoints, job.id))
        for checkpoint in checkpoints:  # newest first: it alone gets the job's name too
            try:
                await serve_checkpoint(self.engine, checkpoint.fine_tuned_model_checkpoint,
                                       fine_tuned_model if checkpoint is checkpoints[0] else None,
                                       checkpoint.path)
            except ValueError as e:  # e.g. the server now runs another base model
                logger.error("cannot serve checkpoint %s again: %s",
                             checkpoint.fine_tuned_model_checkpoint, e)

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
        if not active.done.done():
            active.done.set_result(None)

    def _publish_counts(self) -> None:
        if self.metrics is not None:
            self.metrics.set_job_counts(self._counts)


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
