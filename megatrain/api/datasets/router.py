"""/v1/datasets: register a corpus (upload or storage URL), list, read, delete.

POST takes either
  - a JSON body (`DatasetCreate`): a JSONL file already in storage, by URL; or
  - the JSONL file itself as the body (Content-Type application/x-ndjson, application/jsonl,
    text/plain or application/octet-stream) with the options in the query:
    `?name=NAME&tokenizer=byte&json_key=text&append_eod=true&record_format=text`.
An upload streams through a line-by-line check straight into storage (an S3 multipart upload, or a
temporary file beside the object on file://), never spooled on the API's disk; only a complete,
valid upload becomes an object and is registered (201, state `pending`), a refused or abandoned one
is aborted. The workers preprocess it
into an indexed dataset and mark it `ready` with its statistics, or `failed` with the reason.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from megatrain.api.datasets import service
from megatrain.api.datasets.records import TEXT
from megatrain.api.datasets.schemas import (
    DatasetCreate,
    DatasetList,
    DatasetOptions,
    DatasetPublic,
    RecordFormat,
)
from megatrain.api.datasets.upload import JsonlCheck
from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.errors import FieldError
from megatrain.api.middleware import RequestTooLarge
from megatrain.api.middleware import stream_body as stream_to
from megatrain.db.models import Tenant
from megatrain.settings import Settings
from megatrain.spec import NAME_PATTERN, SpecError

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

UPLOAD_TYPES = {"application/x-ndjson", "application/jsonl", "text/plain", "application/octet-stream"}
JSON_TYPES = {"application/json"}


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _options(model: type[DatasetOptions], data: Any) -> Any:
    """`data` as `model`, or a SpecError naming each bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [
            {
                "field": ".".join(str(p) for p in e["loc"]) or "body",
                "message": str(e["msg"]).removeprefix("Value error, "),
            }
            for e in exc.errors()
        ]
        raise SpecError(errors) from None


async def _json_body(request: Request, settings: Settings) -> Any:
    """The JSON body, within the API's usual request limit (this route lifts it for uploads)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > settings.max_request_bytes:
            raise RequestTooLarge(settings.max_request_bytes)
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise FieldError("body", f"not valid JSON: {str(exc)[:300]}") from None


async def stream_body(request: Request, settings: Settings, check: JsonlCheck) -> None:
    """Check the body and write it on, refusing it past the upload cap (also when no Content-Length
    announced its size)."""
    cap = settings.max_dataset_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > cap:
        raise RequestTooLarge(cap)
    await stream_to(request, cap, check.feed)
    await run_in_threadpool(check.finish)


@router.post(
    "",
    status_code=201,
    response_model=DatasetPublic,
    responses={
        409: {"description": "The name is taken"},
        413: {"description": "The upload exceeds max_dataset_upload_bytes"},
    },
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/DatasetCreate"}},
                "application/x-ndjson": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
)
async def create_dataset(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    tenant: CurrentTenant,
    name: Annotated[str | None, Query(pattern=NAME_PATTERN)] = None,
    tokenizer: Annotated[str, Query(max_length=2048)] = "byte",
    json_key: Annotated[str, Query(min_length=1, max_length=128)] = "text",
    append_eod: bool = True,
    record_format: RecordFormat = "text",
) -> DatasetPublic:
    """Register a dataset from a JSON body naming `source_url`, or from the JSONL file sent as the
    body (options in the query); 201 with the pending dataset (a record format's is ready at
    once: see `record_format`). Bad uploads (not JSON, a line without a non-empty string under
    `json_key` or not a record of its format, empty, over the cap) are 422/413 naming the line or
    the cap, and leave nothing behind."""
    ctype = _content_type(request)
    if ctype in JSON_TYPES or ctype.endswith("+json"):
        body = _options(DatasetCreate, await _json_body(request, settings))
        ds = await run_in_threadpool(service.register_url, session, settings, tenant, body)
        return service.public_dataset(ds)
    if ctype not in UPLOAD_TYPES:
        raise FieldError(
            "content-type",
            f"unsupported Content-Type {ctype!r}: send the JSONL file as application/x-ndjson, "
            "or a JSON body naming source_url",
            status=415,
        )
    if name is None:
        raise FieldError("name", "an upload needs ?name=NAME")
    fields = {"name": name, "tokenizer": tokenizer, "json_key": json_key, "append_eod": append_eod}
    options = _options(DatasetOptions, fields | {"record_format": record_format})
    await run_in_threadpool(service.check_options, session, settings, tenant, options)
    session.close()  # no connection held while the body streams in
    records = options.record_format != TEXT
    async with stream_upload(settings, tenant, options.name, records) as target:
        check = JsonlCheck(options.json_key, target.source, options.record_format, target.records)
        await stream_body(request, settings, check)
    ds = await run_in_threadpool(
        service.register_upload, session, settings, tenant, options, stored(target, check)
    )
    return service.public_dataset(ds)


@asynccontextmanager
async def stream_upload(
    settings: Settings, tenant: Tenant, name: str, records: bool, dataset_id: str | None = None
) -> AsyncIterator[service.UploadTarget]:
    """service.upload_writer driven from the event loop: the storage writers are entered, fed and
    left from worker threads, one step at a time; on any error (a bad line, the cap, a client
    gone) aborted, so no part of the upload stays in storage."""
    writing = service.upload_writer(settings, tenant, name, records, dataset_id)
    target = await run_in_threadpool(writing.__enter__)
    try:
        yield target
    except BaseException as exc:
        # Shielded, as a cancelled request would otherwise skip the cleanup.
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(writing.__exit__, type(exc), exc, exc.__traceback__)
        raise
    await run_in_threadpool(writing.__exit__, None, None, None)  # the objects are whole and visible


def stored(target: service.UploadTarget, check: JsonlCheck, filename: str | None = None) -> service.Stored:
    """What registering a checked, stored upload records."""
    fmt = check.record_format or TEXT
    records = check.documents if fmt != TEXT else None
    return service.Stored(
        target.dataset_id, target.source_url, check.size, fmt, target.records_url, records, filename
    )


@router.get("", response_model=DatasetList)
def list_datasets(session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    """The tenant's datasets and the shared ones, by name."""
    return {"items": [service.public_dataset(d) for d in service.list_datasets(session, tenant)]}


@router.get("/{name}", response_model=DatasetPublic)
def get_dataset(name: str, session: SessionDep, tenant: CurrentTenant) -> DatasetPublic:
    return service.public_dataset(service.get_dataset(session, tenant, name))


@router.delete("/{name}", status_code=204, response_class=Response)
def delete_dataset(name: str, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant) -> Response:
    """Delete the tenant's dataset and its objects (409 while an unfinished job reads it)."""
    service.delete_dataset(session, settings, tenant, name)
    return Response(status_code=204)
