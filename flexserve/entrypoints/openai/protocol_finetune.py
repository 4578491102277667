"""Files and fine-tuning jobs over HTTP: pydantic models with OpenAI's exact names and shapes.

Objects: `file`, `fine_tuning.job`, `fine_tuning.job.event`, `fine_tuning.job.checkpoint`, and
`list` pages with `has_more`. Extension fields (what OpenAI does not have, the `openai` client
keeps as extra attributes): `lora` on a job request and response, `adapter_path` (the server-local
PEFT directory) on jobs and checkpoints, `deleted_at` on checkpoints (retention deleted it from
disk), and every hyper-parameter of flexserve's fine-tuning
(`learning_rate`, `lr_scheduler`, `warmup_steps`, ...) beside OpenAI's three.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from flexserve.entrypoints.openai.protocol import OpenAIModel
from flexserve.finetune.records import CheckpointRecord, EventRecord, FileRecord, JobRecord

FILE_PURPOSES = ("fine-tune",)  # what uploads may have (OpenAI has more)
DEFAULT_LEARNING_RATE_FOR_MULTIPLIER = 1e-4  # learning_rate_multiplier 1.0 means this LR


# ------------------------------------------------------------------------------------- files
class FileObject(OpenAIModel):
    """OpenAI's `file` object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None

    @classmethod
    def from_record(cls, record: FileRecord) -> FileObject:
        return cls(id=record.id, bytes=record.bytes, created_at=record.created_at,
                   filename=record.filename, purpose=record.purpose, status=record.status)


class FileList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[FileObject] = Field(default_factory=list)
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(OpenAIModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# ------------------------------------------------------------------------------- job requests
class SupervisedMethodFields(OpenAIModel):
    hyperparameters: dict[str, Any] | None = None


class DpoMethodFields(OpenAIModel):
    hyperparameters: dict[str, Any] | None = None  # beta and the supervised ones


class MethodFields(OpenAIModel):
    """OpenAI's newer `method`: `supervised` and `dpo` are trained here."""

    type: str
    supervised: SupervisedMethodFields | None = None
    dpo: DpoMethodFields | None = None
    reinforcement: dict[str, Any] | None = None


class FineTuningJobCreateRequest(OpenAIModel):
    """`POST /v1/fine_tuning/jobs` (OpenAI's fields, plus the extension `lora`)."""

    model: str = Field(min_length=1)
    training_file: str = Field(min_length=1)
    validation_file: str | None = None
    hyperparameters: dict[str, Any] | None = None  # checked by Hyperparameters.from_dict
    method: MethodFields | None = None
    suffix: str | None = Field(default=None, max_length=64)
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: dict[str, str] | None = None
    integrations: list[dict[str, Any]] | None = None  # accepted only empty: none are run
    lora: dict[str, Any] | None = None  # extension: {r, alpha, dropout, target_modules,
    # init_adapter}; checked by LoRAHyperparameters.from_dict


# ------------------------------------------------------------------------------ job responses
class JobError(OpenAIModel):
    code: str
    message: str
    param: str | None = None


class JobHyperparameters(OpenAIModel):
    """OpenAI's three, resolved, then flexserve's own (extension fields, accepted by clients)."""

    model_config = ConfigDict(extra="allow", strict=True)

    batch_size: int | Literal["auto"] | None = None
    learning_rate_multiplier: float | Literal["auto"] | None = None
    n_epochs: int | Literal["auto"] | None = None


class SupervisedMethod(OpenAIModel):
    hyperparameters: JobHyperparameters


class DpoMethod(OpenAIModel):
    hyperparameters: JobHyperparameters  # with beta


class Method(OpenAIModel):
    type: Literal["supervised", "dpo"] = "supervised"
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None


class FineTuningJob(OpenAIModel):
    """OpenAI's `fine_tuning.job`, plus the extension fields `lora` and `adapter_path`."""

    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: JobHyperparameters
    method: Method
    model: str
    organization_id: str
    result_files: list[str] = Field(default_factory=list)
    seed: int
    status: Literal["validating_files", "queued", "running", "paused", "succeeded", "failed",
                    "cancelled"]
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    user_provided_suffix: str | None = None
    lora: dict[str, Any] | None = None  # extension: the adapter's settings
    adapter_path: str | None = None  # extension: the newest checkpoint's PEFT directory

    @classmethod
    def from_record(cls, record: JobRecord, estimated_finish: int | None = None
                    ) -> FineTuningJob:
        hp = dict(record.hyperparameters)
        method = hp.pop("method", "supervised")
        if hp.get("beta") is None:
            hp.pop("beta", None)
        learning_rate = hp.get("learning_rate", DEFAULT_LEARNING_RATE_FOR_MULTIPLIER)
        hyperparameters = JobHyperparameters(
            batch_size=hp.get("batch_size"), n_epochs=hp.get("n_epochs"),
            learning_rate_multiplier=learning_rate / DEFAULT_LEARNING_RATE_FOR_MULTIPLIER,
            **{k: v for k, v in hp.items()
               if k not in ("batch_size", "n_epochs", "lora", "seed")})
        return cls(
            id=record.id, created_at=record.created_at,
            error=None if record.error is None else JobError(**record.error),
            fine_tuned_model=record.fine_tuned_model, finished_at=record.finished_at,
            hyperparameters=hyperparameters,
            method=(Method(type="dpo", dpo=DpoMethod(hyperparameters=hyperparameters))
                    if method == "dpo" else
                    Method(supervised=SupervisedMethod(hyperparameters=hyperparameters))),
            model=record.model, organization_id=f"org-{record.tenant}", seed=record.seed,
            status=record.status,  # type: ignore[arg-type]
            trained_tokens=record.trained_tokens, training_file=record.training_file,
            validation_file=record.validation_file, integrations=record.integrations,
            metadata=record.metadata, user_provided_suffix=record.suffix, lora=record.lora,
            adapter_path=record.adapter_path, result_files=list(record.result_files or ()),
            # only a running job has one (the service may still hold a job that just ended)
            estimated_finish=estimated_finish if record.status == "running" else None,
        )


class FineTuningJobList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob] = Field(default_factory=list)
    has_more: bool = False


class FineTuningJobEvent(OpenAIModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None = None
    type: Literal["message", "metrics"] = "message"

    @classmethod
    def from_record(cls, record: EventRecord) -> FineTuningJobEvent:
        return cls(id=record.id, created_at=record.created_at,
                   level=record.level,  # type: ignore[arg-type]
                   message=record.message, data=record.data,
                   type=record.type)  # type: ignore[arg-type]


class FineTuningJobEventList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobEvent] = Field(default_factory=list)
    has_more: bool = False


class CheckpointMetrics(OpenAIModel):
    model_config = ConfigDict(extra="allow", strict=True)

    step: float | None = None
    train_loss: float | None = None
    train_mean_token_accuracy: float | None = None
    valid_loss: float | None = None
    valid_mean_token_accuracy: float | None = None
    full_valid_loss: float | None = None
    full_valid_mean_token_accuracy: float | None = None


class FineTuningJobCheckpoint(OpenAIModel):
    """OpenAI's `fine_tuning.job.checkpoint`, plus the extension field `adapter_path`."""

    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int
    adapter_path: str  # extension: the checkpoint's PEFT directory on the server
    deleted_at: int | None = None  # extension: when retention deleted it (no longer servable)

    @classmethod
    def from_record(cls, record: CheckpointRecord) -> FineTuningJobCheckpoint:
        return cls(id=record.id, created_at=record.created_at,
                   fine_tuned_model_checkpoint=record.fine_tuned_model_checkpoint,
                   fine_tuning_job_id=record.job_id,
                   metrics=CheckpointMetrics(**record.metrics),
                   step_number=record.step_number, adapter_path=record.path,
                   deleted_at=record.deleted_at)


class FineTuningJobCheckpointList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobCheckpoint] = Field(default_factory=list)
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

