"""`/v1/fine_tuning/jobs`: create, list, retrieve, cancel, pause, resume, events, checkpoints;
OpenAI's shapes.

Creating a job checks everything up front (400 naming the parameter): LoRA is on, `model` is the
served base model (or a fine-tuned model to start from), the files exist and are training files,
the hyper-parameters are valid (OpenAI's names and flexserve's), and the data tokenizes with them.
The job is then stored `queued` and runs as soon as a job slot is free.

A job belongs to the tenant of the key that created it (`auth.owner_tenant`) and uses only that
tenant's files: listings show the caller's jobs only, another tenant's job id is a 404 exactly
like an unknown one, and another tenant's file id in a new job is the 400 of a missing file. The
models jobs produce (`ft:...`) belong to the job's tenant too (`FinetuneService.may_use_model`).

A job started from an adapter (a fine-tuned model, or `lora.init_adapter`) trains that adapter's
rank, alpha and target modules, and reports them in `lora`.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from starlette.requests import Request
from starlette.responses import Response

from flexserve.entrypoints.openai.auth import is_admin, owner_tenant
from flexserve.entrypoints.openai.errors import APIError, bad_request, cursor_not_found
from flexserve.entrypoints.openai.model_access import check_name
from flexserve.entrypoints.openai.offload import Offload
from flexserve.entrypoints.openai.protocol_finetune import (
    FineTuningJob,
    FineTuningJobCheckpoint,
    FineTuningJobCheckpointList,
    FineTuningJobCreateRequest,
    FineTuningJobEvent,
    FineTuningJobEventList,
    FineTuningJobList,
)
from flexserve.entrypoints.openai.request_body import read_json
from flexserve.entrypoints.openai.serving_base import json_response
from flexserve.entrypoints.openai.serving_files import int_query_param
from flexserve.finetune.data import (
    TrainingData,
    TrainingExample,
    check_method_data,
    load_training_data,
)
from flexserve.finetune.hyperparameters import Hyperparameters
from flexserve.finetune.records import JobRecord
from flexserve.finetune.service import FINAL_STATUSES, FinetuneService
from flexserve.finetune.steps import check_plan_size
from flexserve.finetune.store import new_id
from flexserve.peft.peft_io import parse_lora_config, read_adapter_config, resolve_adapter_dir

MAX_PAGE_LIMIT = 1000
_HP_FIELDS = ("batch_size", "learning_rate", "learning_rate_multiplier", "lr_scheduler",
              "warmup_steps", "weight_decay", "max_grad_norm", "n_epochs", "shuffle", "seed",
              "max_seq_len", "beta")
_METHODS = ("supervised", "dpo")


def job_not_found(job_id: str) -> APIError:
    return APIError(404, f"Fine-tuning job {job_id} not found.", param="fine_tuning_job_id",
                    code="not_found")


def _service(request: Request) -> FinetuneService:
    return request.app.state.finetune


# ------------------------------------------------------------------------------------ routes
async def create_job(request: Request) -> Response:
    body = await read_json(FineTuningJobCreateRequest, request)
    service = _service(request)
    tenant = owner_tenant(request)
    record, data, validation = await _validated_job(service, body, tenant, request)
    await service.submit(record, data, validation)
    return await _job_response(service, record.id, tenant)


async def list_jobs(request: Request) -> Response:
    query = request.query_params
    limit = int_query_param(query.get("limit"), "limit", 20, 1, MAX_PAGE_LIMIT)
    try:
        jobs, has_more = await asyncio.to_thread(_service(request).store.list_jobs,
                                                 query.get("after"), limit,
                                                 owner_tenant(request))
    except ValueError as e:
        raise cursor_not_found(e) from e
    service = _service(request)
    return json_response(FineTuningJobList(
        data=[FineTuningJob.from_record(j, service.estimated_finish(j.id)) for j in jobs],
        has_more=has_more))


async def retrieve_job(request: Request) -> Response:
    return await _job_response(_service(request), request.path_params["job_id"],
                               owner_tenant(request))


async def cancel_job(request: Request) -> Response:
    service = _service(request)
    job_id = request.path_params["job_id"]
    record = await _require_job(service, job_id, owner_tenant(request))
    if record.status in FINAL_STATUSES:
        raise bad_request(f"Job {job_id} has already {record.status}: only a queued or running "
                          "job can be cancelled.", param="fine_tuning_job_id",
                          code="job_not_cancellable")
    record = await service.cancel(job_id)
    return json_response(FineTuningJob.from_record(record))


async def pause_job(request: Request) -> Response:
    service = _service(request)
    job_id = request.path_params["job_id"]
    record = await _require_job(service, job_id, owner_tenant(request))
    if record.status not in ("validating_files", "queued", "running"):
        raise bad_request(f"Job {job_id} is {record.status}: only a queued or running job can "
                          "be paused.", param="fine_tuning_job_id", code="job_not_pausable")
    record = await service.pause(job_id)
    return json_response(FineTuningJob.from_record(record, service.estimated_finish(job_id)))


async def resume_job(request: Request) -> Response:
    service = _service(request)
    job_id = request.path_params["job_id"]
    record = await _require_job(service, job_id, owner_tenant(request))
    if record.status != "paused":
        raise bad_request(f"Job {job_id} is {record.status}: only a paused job can be resumed.",
                          param="fine_tuning_job_id", code="job_not_resumable")
    record = await service.resume(job_id)
    return json_response(FineTuningJob.from_record(record, service.estimated_finish(job_id)))


async def list_events(request: Request) -> Response:
    events, has_more = await _job_page(request, "list_events", 20)
    return json_response(FineTuningJobEventList(
        data=[FineTuningJobEvent.from_record(e) for e in events], has_more=has_more))


async def list_checkpoints(request: Request) -> Response:
    checkpoints, has_more = await _job_page(request, "list_checkpoints", 10)
    data = [FineTuningJobCheckpoint.from_record(c) for c in checkpoints]
    return json_response(FineTuningJobCheckpointList(
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
        has_more=has_more))


async def _job_page(request: Request, lister: str, default_limit: int) -> tuple[list, bool]:
    """One page (items, has_more) of a caller's job's events or checkpoints, from the store's
    method `lister`; `limit` and `after` come from the query (400 when invalid)."""
    service, job_id = _service(request), request.path_params["job_id"]
    await _require_job(service, job_id, owner_tenant(request))
    query = request.query_params
    limit = int_query_param(query.get("limit"), "limit", default_limit, 1, MAX_PAGE_LIMIT)
    try:
        return await asyncio.to_thread(getattr(service.store, lister), job_id, query.get("after"),
                                       limit)
    except ValueError as e:
        raise cursor_not_found(e) from e


async def _require_job(service: FinetuneService, job_id: str, tenant: str) -> JobRecord:
    """The caller's job; 404 for an unknown id and for another tenant's (never revealed)."""
    record = await asyncio.to_thread(service.store.get_job, job_id, tenant)
    if record is None:
        raise job_not_found(job_id)
    return record


async def _job_response(service: FinetuneService, job_id: str, tenant: str) -> Response:
    record = await _require_job(service, job_id, tenant)
    return json_response(FineTuningJob.from_record(record, service.estimated_finish(job_id)))


# -------------------------------------------------------------------------------- validation
async def _validated_job(service: FinetuneService, body: FineTuningJobCreateRequest,
                         tenant: str, request: Request,
                         ) -> tuple[JobRecord, TrainingData, list[TrainingExample]]:
    """The job to store, its tokenized training data and validation examples; 400 when bad."""
    engine = service.engine
    if not engine.lora_enabled:
        raise bad_request("Fine-tuning needs LoRA slots: this server runs with --no-enable-lora "
                          "(each running job trains its adapter in a LoRA slot).")
    try:
        engine.engine.check_finetune_supported()
    except ValueError as e:
        raise bad_request(str(e)) from None
    hp = resolve_hyperparameters(body)
    init_adapter = _base_adapter(service, body.model, tenant)
    if init_adapter is not None:
        if hp.lora.init_adapter is not None:
            raise bad_request(f"model {body.model!r} is a fine-tuned model: it is the starting "
                              "adapter already, so lora.init_adapter must not be given",
                              param="lora.init_adapter")
        hp.lora.init_adapter = init_adapter
    elif hp.lora.init_adapter is not None:
        # A loaded adapter's name is stored as its directory, so a restart needs no lookup.
        name = hp.lora.init_adapter
        access = request.app.state.model_access
        loaded = {r.lora_name: r.lora_path for r in engine.list_loras()
                  if access.may_use(r.lora_name, request)}
        if name in loaded:
            hp.lora.init_adapter = loaded[name]
        elif not await asyncio.to_thread(_may_start_from, service, name, tenant,
                                         is_admin(request)):
            # One answer for a missing directory, one outside --allowed-adapter-dir and another
            # tenant's checkpoint: none reveals what exists on the server.
            raise bad_request(f"lora.init_adapter {name!r} is neither a served adapter's name "
                              "nor an adapter directory this server may load",
                              param="lora.init_adapter", code="invalid_value")
    if hp.lora.init_adapter is not None:
        await asyncio.to_thread(_adopt_adapter_settings, hp, hp.lora.init_adapter)
    max_rank = engine.engine.config.lora.max_lora_rank
    if hp.lora.r > max_rank:
        raise bad_request(f"lora.r {hp.lora.r} exceeds the server's max_lora_rank {max_rank} "
                          "(--max-lora-rank): the job's adapter lives in a LoRA slot",
                          param="lora.r")
    capacity = engine.engine.finetune_capacity
    if capacity is not None:
        try:
            capacity.check_fits(hp.lora.r, hp.lora.target_modules)
        except ValueError as e:
            raise bad_request(str(e), param="lora.r", code="invalid_value") from e
    if body.suffix is not None:
        check_name(body.suffix, "suffix", "model name")
        if ":" in body.suffix:
            raise bad_request("suffix must be non-empty, without ':' or whitespace (it becomes "
                              "part of the model name)", param="suffix", code="invalid_value")
    if body.integrations:
        raise bad_request("integrations are not supported by this server (no Weights & Biases "
                          "or other reporting): send none, or an empty list",
                          param="integrations", code="invalid_value")
    if hp.seed is None:
        hp.seed = secrets.randbelow(2**31)  # recorded, so the job can be reproduced
    offload = request.app.state.offload
    data = await _training_data(service, body.training_file, "training_file", hp, tenant,
                                offload)
    validation: list[TrainingExample] = []
    if body.validation_file is not None:
        content = await _file_content(service, body.validation_file, "validation_file", tenant)
        try:
            validation = await offload.run(service.load_validation, content, hp)
        except ValueError as e:
            raise bad_request(f"invalid validation_file {body.validation_file}: {e}",
                              param="validation_file", code="invalid_validation_file") from e
    try:
        num_steps = check_plan_size(data.num_items, hp.batch_size, hp.n_epochs)
    except ValueError as e:
        raise bad_request(f"Invalid hyper-parameters: {e}", param="hyperparameters.n_epochs",
                          code="invalid_value") from e
    record = JobRecord(
        id=new_id("ftjob"), model=body.model, training_file=body.training_file,
        validation_file=body.validation_file, hyperparameters=hp.to_dict(), suffix=body.suffix,
        seed=hp.seed, tenant=tenant, status="queued", created_at=int(time.time()),
        num_steps=num_steps, lora=hp.lora.to_dict(), integrations=body.integrations,
        metadata=body.metadata)
    return record, data, validation


def resolve_hyperparameters(body: FineTuningJobCreateRequest) -> Hyperparameters:
    """OpenAI's `hyperparameters` (or `method.<type>.hyperparameters`), `method.type`, `seed`
    and the extension `lora` as one `Hyperparameters`; 400 naming the parameter when invalid."""
    prefix, values = "hyperparameters", dict(body.hyperparameters or {})
    if "method" in values:
        raise bad_request("the method is `method.type`, not a hyper-parameter",
                          param="hyperparameters.method", code="invalid_value")
    method = "supervised"
    if body.method is not None:
        method = body.method.type
        if method not in _METHODS:
            raise bad_request(f"method.type {method!r} is not supported: this server runs "
                              "supervised and dpo fine-tuning", param="method.type",
                              code="invalid_value")
        for other in ("supervised", "dpo", "reinforcement"):
            if other != method and getattr(body.method, other) is not None:
                raise bad_request(f"method.{other} is given but method.type is {method!r}",
                                  param=f"method.{other}", code="invalid_value")
        section = getattr(body.method, method)
        method_values = section.hyperparameters if section is not None else None
        if method_values:
            if values:
                raise bad_request("give the hyper-parameters in `hyperparameters` or in "
                                  f"`method.{method}.hyperparameters`, not both",
                                  param="hyperparameters")
            if "method" in method_values:
                raise bad_request("the method is `method.type`, not a hyper-parameter",
                                  param=f"method.{method}.hyperparameters.method",
                                  code="invalid_value")
            prefix, values = f"method.{method}.hyperparameters", dict(method_values)
    values["method"] = method
    lora_prefix = f"{prefix}."
    if body.lora is not None:
        if "lora" in values:
            raise bad_request(f"the LoRA settings are given twice (`lora` and `{prefix}.lora`)",
                              param="lora")
        values["lora"], lora_prefix = body.lora, ""
    if body.seed is not None:
        if values.get("seed", body.seed) != body.seed:
            raise bad_request(f"seed and {prefix}.seed differ", param="seed")
        values["seed"] = body.seed
    try:
        return Hyperparameters.from_dict(values)
    except ValueError as e:
        word = str(e).split(" ", 1)[0].rstrip(":")
        if word.startswith("lora."):
            param = lora_prefix + word
        elif word in _HP_FIELDS:
            param = f"{prefix}.{word}"
        else:
            param = prefix
        raise bad_request(f"Invalid hyper-parameters: {e}", param=param,
                          code="invalid_value") from e


def _may_start_from(service: FinetuneService, path: str, tenant: str, admin: bool) -> bool:
    """Whether a job may start from the adapter directory `path`: the rules of loading one
    (`--allowed-adapter-dir`, checkpoints of the tenant's own jobs only)."""
    lora = service.engine.engine.config.lora
    if not admin and not service.may_load_path(path, tenant):
        return False
    try:
        resolve_adapter_dir(path, lora.allowed_dir_for(path))
    except ValueError:
        return False
    return True


def _adopt_adapter_settings(hp: Hyperparameters, path: str) -> None:
    """The job trains the initial adapter as it is: its rank, alpha and targets become the
    job's LoRA settings (what it reports, and what a resume checks)."""
    try:
        config = parse_lora_config(read_adapter_config(path))
    except ValueError as e:
        raise bad_request(f"the initial adapter cannot be read: {e}",
                          param="lora.init_adapter") from e
    hp.lora.r, hp.lora.alpha = config["r"], float(config["lora_alpha"])
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)) and targets:
        hp.lora.target_modules = sorted(targets)


def _base_adapter(service: FinetuneService, model: str, tenant: str) -> str | None:
    """None for the served base model; the adapter directory of a served fine-tuned model."""
    if model == service.base_model:
        return None
    if model.startswith("ft:") and service.may_use_model(model, tenant):
        for lora in service.engine.list_loras():
            if lora.lora_name == model:
                return lora.lora_path
    raise bad_request(f"Model {model!r} is not available for fine-tuning: use the served model "
                      f"{service.base_model!r} or one of its fine-tuned models (ft:...).",
                      param="model", code="model_not_available")


async def _file_content(service: FinetuneService, file_id: str, param: str,
                        tenant: str) -> bytes:
    """A file of `tenant` for a new job; another tenant's file is as missing as an unknown id."""
    record = await asyncio.to_thread(service.store.get_file, file_id, tenant)
    if record is None:
        raise bad_request(f"invalid {param}: no such file {file_id}", param=param,
                          code=f"invalid_{param}")
    if record.purpose != "fine-tune":
        raise bad_request(f"invalid {param}: file {file_id} has purpose {record.purpose!r}, not "
                          "'fine-tune'", param=param, code=f"invalid_{param}")
    try:
        return await asyncio.to_thread(service.store.read_file, file_id, tenant)
    except KeyError:  # deleted meanwhile
        raise bad_request(f"invalid {param}: no such file {file_id}", param=param,
                          code=f"invalid_{param}") from None


async def _training_data(service: FinetuneService, file_id: str, param: str,
                         hp: Hyperparameters, tenant: str, offload: Offload) -> TrainingData:
    content = await _file_content(service, file_id, param, tenant)
    max_len = min(hp.max_seq_len, service.max_finetune_len)
    try:
        data = await offload.run(load_training_data, content, service.engine.tokenizer, max_len)
        check_method_data(hp.method, data.format)
        return data
    except ValueError as e:
        raise bad_request(f"invalid {param} {file_id}: {e}", param=param,
                          code=f"invalid_{param}") from e
