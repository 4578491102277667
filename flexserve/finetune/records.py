"""The records of the fine-tuning service's state store: files, jobs, events and checkpoints as
plain dataclasses (what `StateStore` reads and writes, and what the API shapes are built from)."""

from __future__ import annotations

from dataclasses import dataclass

from flexserve.finetune.store_schema import DEFAULT_TENANT

JOB_STATUSES = ("validating_files", "queued", "running", "paused", "succeeded", "failed",
                "cancelled")
UNFINISHED_STATUSES = ("validating_files", "queued", "running", "paused")  # may still train
EVENT_LEVELS = ("info", "warn", "error")
EVENT_TYPES = ("message", "metrics")


@dataclass(slots=True)
class FileRecord:
    """An uploaded file as the Files API sees it."""

    id: str  # "file-" + 24 hex chars
    filename: str  # display name as uploaded: basename only, sanitized; never used as a path
    purpose: str  # "fine-tune" (uploads) or "fine-tune-results" (a job's metrics CSV)
    bytes: int  # content size
    created_at: int  # unix seconds
    path: str  # server-local path of the content (never shown to clients)
    status: str = "processed"  # OpenAI's file status
    tenant: str = DEFAULT_TENANT  # who uploaded it: only that tenant sees or uses it


@dataclass(slots=True)
class JobRecord:
    """A fine-tuning job: what was asked, where it stands, and what it produced."""

    id: str  # "ftjob-" + 24 hex
    model: str  # base model name
    training_file: str  # file id
    validation_file: str | None  # file id or None
    hyperparameters: dict  # resolved hyper-parameters (JSON-serializable)
    suffix: str | None  # user suffix of the fine-tuned model name
    seed: int  # data order and adapter init seed
    tenant: str  # who submitted it (fairness, API-key scoping)
    status: str  # validating_files | queued | running | paused | succeeded | failed | cancelled
    created_at: int  # unix seconds
    finished_at: int | None = None  # unix seconds when it reached a final status
    fine_tuned_model: str | None = None  # servable name of the final adapter
    trained_tokens: int | None = None  # tokens the loss was computed on, all epochs
    error: dict | None = None  # {"code": str, "message": str, "param": str | None}
    adapter_path: str | None = None  # newest checkpoint's PEFT dir (server-local)
    num_steps: int | None = None  # optimizer steps planned
    step: int = 0  # optimizer steps done as of the newest checkpoint
    lora: dict | None = None  # extension field: {r, alpha, dropout, target_modules, init_adapter}
    integrations: list | None = None  # OpenAI's integrations, as sent
    metadata: dict | None = None  # OpenAI's job metadata (str -> str)
    result_files: list | None = None  # file ids of its results (the per-step metrics CSV)


@dataclass(slots=True)
class EventRecord:
    """One line of a job's event log."""

    id: str  # "ftevent-" + 24 hex
    job_id: str  # the job it belongs to
    created_at: int  # unix seconds
    level: str  # "info" | "warn" | "error"
    message: str  # human-readable text
    type: str = "message"  # "message" | "metrics"
    data: dict | None = None  # e.g. {"step": 3, "train_loss": 1.23, "total_steps": 10}


@dataclass(slots=True)
class CheckpointRecord:
    """A saved adapter of a job at one optimizer step, servable by name."""

    id: str  # "ftckpt-" + 24 hex
    job_id: str  # the job it belongs to
    created_at: int  # unix seconds
    step_number: int  # optimizer steps done when it was saved
    metrics: dict  # {"step": n, "train_loss": x, "valid_loss": y?, ...}
    fine_tuned_model_checkpoint: str  # the servable model name of this checkpoint
    path: str  # server-local checkpoint directory
    deleted_at: int | None = None  # unix seconds when retention deleted it from disk
