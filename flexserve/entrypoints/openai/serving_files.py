"""`/v1/files`: upload (multipart), list, retrieve, content, delete; OpenAI's shapes.

An upload is stored only when it is a valid training file: it is parsed and tokenized with the
server's tokenizer (off the event loop), and every problem is a 400 naming the line. A file
belongs to the tenant of the key that uploaded it (`auth.owner_tenant`): listings show the
caller's files only, and another tenant's file id is a 404 exactly like an unknown one.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response

from flexserve.entrypoints.openai.auth import owner_tenant
from flexserve.entrypoints.openai.errors import APIError, bad_request, cursor_not_found
from flexserve.entrypoints.openai.protocol_finetune import (
    FILE_PURPOSES,
    FileDeleted,
    FileList,
    FileObject,
)
from flexserve.entrypoints.openai.serving_base import json_response
from flexserve.finetune.data import load_training_data
from flexserve.finetune.records import UNFINISHED_STATUSES
from flexserve.finetune.service import FinetuneService

MAX_LIST_LIMIT = 10000  # OpenAI's bound on `limit` of GET /v1/files


def upload_too_large(max_upload_bytes: int) -> APIError:
    """The error of an upload over --max-upload-mb (the body-size middleware sends it too)."""
    return bad_request(f"The file exceeds the upload limit of {max_upload_bytes} bytes "
                       f"({max_upload_bytes / 2**20:g} MB, --max-upload-mb).", param="file",
                       code="file_too_large")


def file_not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="file_id", code="not_found")


def _service(request: Request) -> FinetuneService:
    return request.app.state.finetune


async def create_file(request: Request) -> Response:
    service = _service(request)
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("Missing required parameter: 'file' (a multipart file part).",
                              param="file", code="missing_required_parameter")
        if purpose is None:
            raise bad_request("Missing required parameter: 'purpose'.", param="purpose",
                              code="missing_required_parameter")
        if purpose not in FILE_PURPOSES:
            raise bad_request(f"Invalid value for 'purpose': {str(purpose)!r}; this server "
                              f"accepts {', '.join(FILE_PURPOSES)}.", param="purpose",
                              code="invalid_value")
        content = await upload.read()
        filename = upload.filename or "file.jsonl"
    finally:
        await form.close()
    if len(content) > service.config.max_upload_bytes:
        raise upload_too_large(service.config.max_upload_bytes)
    tokenizer = service.engine.tokenizer
    if tokenizer is None:
        raise bad_request("This model has no tokenizer, so training files cannot be read.")
    try:
        await request.app.state.offload.run(load_training_data, content, tokenizer,
                                            service.max_finetune_len)
    except ValueError as e:
        raise bad_request(f"Invalid file format for fine-tuning: {e}", param="file",
                          code="invalid_file_format") from e
    record = await asyncio.to_thread(service.store.add_file, filename, purpose, content,
                                     owner_tenant(request))
    return json_response(FileObject.from_record(record))


async def list_files(request: Request) -> Response:
    store = _service(request).store
    query = request.query_params
    limit = int_query_param(query.get("limit"), "limit", MAX_LIST_LIMIT, 1, MAX_LIST_LIMIT)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"Invalid value for 'order': {order!r}; use asc or desc.", param="order",
                          code="invalid_value")
    try:
        records = await asyncio.to_thread(store.list_files, query.get("purpose"),
                                          query.get("after"), limit + 1, order,
                                          owner_tenant(request))
    except ValueError as e:
        raise cursor_not_found(e) from e
    data = [FileObject.from_record(r) for r in records[:limit]]
    return json_response(FileList(data=data, first_id=data[0].id if data else None,
                                  last_id=data[-1].id if data else None,
                                  has_more=len(records) > limit))


async def retrieve_file(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    record = await asyncio.to_thread(_service(request).store.get_file, file_id,
                                     owner_tenant(request))
    if record is None:
        raise file_not_found(file_id)
    return json_response(FileObject.from_record(record))


async def file_content(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    try:
        content = await asyncio.to_thread(_service(request).store.read_file, file_id,
                                          owner_tenant(request))
    except KeyError:
        raise file_not_found(file_id) from None
    return Response(content, media_type="application/octet-stream")


async def delete_file(request: Request) -> Response:
    service = _service(request)
    file_id, tenant = request.path_params["file_id"], owner_tenant(request)
    if await asyncio.to_thread(service.store.get_file, file_id, tenant) is None:
        raise file_not_found(file_id)
    users = await asyncio.to_thread(service.store.jobs_with_status, *UNFINISHED_STATUSES)
    for job in users:
        if file_id in (job.training_file, job.validation_file):
            # Only a job of the caller is named (a store from before tenancy may hold others').
            user = (f"fine-tuning job {job.id} ({job.status})" if job.tenant == tenant
                    else "a fine-tuning job")
            raise bad_request(f"File {file_id} is used by {user}; cancel the job or let it "
                              "finish first.", param="file_id", code="file_in_use")
    if not await asyncio.to_thread(service.store.delete_file, file_id, tenant):
        raise file_not_found(file_id)
    return json_response(FileDeleted(id=file_id))


def int_query_param(value: str | None, name: str, default: int, minimum: int,
                    maximum: int) -> int:
    """A query-string integer in [minimum, maximum]; 400 naming it otherwise."""
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not minimum <= number <= maximum:
        raise bad_request(f"Invalid value for '{name}': expected an integer in {minimum}.."
                          f"{maximum}, got {value!r}.", param=name, code="invalid_value")
    return number
