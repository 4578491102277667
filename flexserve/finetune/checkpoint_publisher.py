"""A fine-tuning job's checkpoints as the service publishes them: saved on the engine thread at
a step boundary, served by name at once (the newest also under the job's model name), evaluated on
the job's validation data, recorded with their metrics, and deleted past the newest
`keep_checkpoints` that nothing uses; after a restart, the recorded ones are served again."""

from __future__ import annotations

import asyncio
import logging
import shutil
from typing import Any

from flexserve.engine.adapter_manager import AdapterNotFoundError
from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.finetune.adapters import (
    checkpoint_model_name,
    example_logprobs,
    fine_tuned_model_name,
    serve_checkpoint,
    validation_dpo,
    validation_loss,
)
from flexserve.finetune.dpo import metric_fields
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.finetune.records import UNFINISHED_STATUSES, JobRecord
from flexserve.finetune.store import StateStore

logger = logging.getLogger(__name__)


class CheckpointPublisher:
    """The checkpoints of the service's jobs. `active` arguments are the service's running-job
    state (its fine-tuned model name, record, validation data and cached reference
    log-probabilities)."""

    def __init__(self, engine: AsyncLLMEngine, store: StateStore, base_model: str,
                 keep_checkpoints: int) -> None:
        self.engine = engine
        self.store = store
        self.base_model = base_model
        self.keep_checkpoints = keep_checkpoints
        self.newest: dict[str, str] = {}  # job id -> its newest checkpoint's name
        self.explicit_models: set[str] = set()  # job checkpoints a client loaded by name

    def save(self, update: Any) -> tuple[str | None, dict | None]:
        """Engine thread: write the checkpoint of a step update; (its path, None), or (None, the
        job's error) when it cannot be written (the job is cancelled on the engine)."""
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

    async def publish(self, job_id: str, active: Any, update: Any, path: str) -> None:
        """Serve a saved checkpoint, evaluate it, record it and apply the retention."""
        name = checkpoint_model_name(active.fine_tuned_model, update.step)
        await serve_checkpoint(self.engine, name, active.fine_tuned_model, path)
        metrics: dict[str, Any] = {"step": update.step, "train_loss": update.loss}
        if update.accuracy is not None:
            metrics["train_mean_token_accuracy"] = update.accuracy
        if update.dpo is not None:
            metrics.update(metric_fields(update.dpo, "train"))
            if active.validation:
                valid = await self._validation_dpo(job_id, active, name)
                metrics.update(valid)
                await asyncio.to_thread(
                    self.store.add_event, job_id,
                    f"Step {update.step}/{update.num_steps}: validation loss="
                    f"{valid['valid_loss']:.4f}, reward margin={valid['valid_reward_margin']:.4f}"
                    f", preference accuracy={valid['valid_preference_accuracy']:.4f}",
                    "info", "metrics", {"step": update.step, "total_steps": update.num_steps,
                                        **valid})
        elif active.validation:
            valid_loss = await validation_loss(self.engine, name, active.validation,
                                               active.record.tenant)
            metrics["valid_loss"] = valid_loss
            await asyncio.to_thread(
                self.store.add_event, job_id,
                f"Step {update.step}/{update.num_steps}: validation loss={valid_loss:.4f}",
                "info", "metrics", {"step": update.step, "valid_loss": valid_loss,
                                    "total_steps": update.num_steps})
        await asyncio.to_thread(self._record, job_id, active, update, metrics, name,
                                path)
        self.newest[job_id] = name
        await self.apply_retention(job_id)

    async def _validation_dpo(self, job_id: str, active: Any, name: str
                              ) -> dict[str, float]:
        """valid_loss and the valid_ reward fields of a DPO checkpoint served as `name`. The
        reference log-probabilities come first, once per run of the job: under the base model,
        or under its initial adapter served for that pass alone."""
        hp = Hyperparameters.from_dict(active.record.hyperparameters)
        tenant = active.record.tenant
        if active.reference_logprobs is None:
            init = hp.lora.init_adapter
            reference_name = None if init is None else f"{job_id}:reference"
            if reference_name is not None:
                await self.engine.add_lora(reference_name, init)
            try:
                active.reference_logprobs = await example_logprobs(
                    self.engine, reference_name, active.validation, tenant)
            finally:
                if reference_name is not None:
                    await self.engine.remove_lora(reference_name)
        mean = await validation_dpo(self.engine, name, active.validation,
                                    active.reference_logprobs, hp.beta, tenant)
        return {"valid_loss": mean["loss"], **metric_fields(mean, "valid")}

    async def apply_retention(self, job_id: str) -> None:
        """Delete the job's checkpoints past the newest `keep_checkpoints` that nothing uses."""
        kept = await asyncio.to_thread(self.store.kept_checkpoints, job_id)
        if len(kept) <= self.keep_checkpoints:
            return
        unfinished = await asyncio.to_thread(self.store.jobs_with_status, *UNFINISHED_STATUSES)
        starts = {(job.lora or {}).get("init_adapter") for job in unfinished}
        for checkpoint in kept[self.keep_checkpoints:]:
            if checkpoint.path in starts:
                continue
            retired = await self.engine.call(_retire_on_engine, self.engine.engine,
                                             checkpoint.fine_tuned_model_checkpoint,
                                             checkpoint.path)
            if not retired:
                continue
            self.explicit_models.discard(checkpoint.fine_tuned_model_checkpoint)
            await asyncio.to_thread(shutil.rmtree, checkpoint.path, True)
            await asyncio.to_thread(self.store.mark_checkpoint_deleted, checkpoint.id)

    def _record(self, job_id: str, active: Any, update: Any, metrics: dict,
                           name: str, path: str) -> None:
        self.store.add_checkpoint(job_id, update.step, metrics, name, path)
        self.store.update_job(job_id, fine_tuned_model=active.fine_tuned_model, adapter_path=path,
                              step=update.step, trained_tokens=update.num_trained_tokens)
        self.store.add_event(job_id, f"Checkpoint created at step {update.step}: {name}",
                             data={"step": update.step, "fine_tuned_model_checkpoint": name})

    async def serve_recorded(self, job: JobRecord, unloaded: set[str]) -> None:
        fine_tuned_model = fine_tuned_model_name(self.base_model, job.suffix, job.id)
        checkpoints = await asyncio.to_thread(self.store.kept_checkpoints, job.id)
        if checkpoints:
            self.newest[job.id] = checkpoints[0].fine_tuned_model_checkpoint
        for checkpoint in checkpoints:  # newest first: it alone gets the job's name too
            name = checkpoint.fine_tuned_model_checkpoint
            job_name = (fine_tuned_model if checkpoint is checkpoints[0]
                        and fine_tuned_model not in unloaded else None)
            try:
                if name not in unloaded:
                    await serve_checkpoint(self.engine, name, job_name, checkpoint.path)
                elif job_name is not None:
                    await self.engine.add_lora(job_name, checkpoint.path)
            except ValueError as e:  # e.g. the server now runs another base model
                logger.error("cannot serve checkpoint %s again: %s",
                             checkpoint.fine_tuned_model_checkpoint, e)


def _retire_on_engine(llm: Any, name: str, path: str) -> bool:
    """Engine thread: stop serving checkpoint `name` (from `path`) unless a request uses that
    directory or it is served under another name; True when its directory may be deleted."""
    num_requests, names = llm.scheduler.adapter_manager.users_of_path(path)
    if num_requests or names - {name}:
        return False
    if name in names:
        try:
            llm.remove_lora(name)
        except AdapterNotFoundError:
            pass
    return True
