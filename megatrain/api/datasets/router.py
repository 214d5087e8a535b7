"""/v1/datasets: register a corpus (upload or storage URL), list, read, delete.

POST takes either
  - a JSON body (`DatasetCreate`): a JSONL file already in storage, by URL; or
  - the JSONL file itself as the body (Content-Type application/x-ndjson, application/jsonl,
    text/plain or application/octet-stream) with the options in the query:
    `?name=NAME&tokenizer=byte&json_key=text&append_eod=true`.
An upload streams through a line-by-line check straight into storage (an S3 multipart upload, or a
temporary file beside the object on file://), never spooled on the API's disk; only a complete,
valid upload becomes an object and is registered (201, state `pending`), a refused or abandoned one
is aborted. The workers preprocess it
into an indexed dataset and mark it `ready` with its statistics, or `failed` with the reason.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from megatrain.api.datasets import service
from megatrain.api.datasets.schemas import DatasetCreate, DatasetList, DatasetOptions, DatasetPublic
from megatrain.api.datasets.upload import JsonlCheck
from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.errors import FieldError
from megatrain.api.middleware import RequestTooLarge
from megatrain.settings import Settings
from megatrain.spec import NAME_PATTERN, SpecError

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

UPLOAD_TYPES = {"application/x-ndjson", "application/jsonl", "text/plain", "application/octet-stream"}
JSON_TYPES = {"application/json"}
BODY_CHUNK = 1 << 20
"""Bytes gathered from the body before a worker thread checks them and writes them on."""


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


async def _stream(request: Request, settings: Settings, check: JsonlCheck) -> None:
    """Check the body and write it on, refusing it past the upload cap (also when no Content-Length
    announced its size)."""
    cap = settings.max_dataset_upload_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > cap:
        raise RequestTooLarge(cap)
    pending = bytearray()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > cap:
            raise RequestTooLarge(cap)
        pending += chunk
        if len(pending) >= BODY_CHUNK:
            await run_in_threadpool(check.feed, bytes(pending))
            pending.clear()
    await run_in_threadpool(check.feed, bytes(pending))
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
) -> DatasetPublic:
    """Register a dataset from a JSON body naming `source_url`, or from the JSONL file sent as the
    body (options in the query); 201 with the pending dataset. Bad uploads (not JSON, a line
    without a non-empty string under `json_key`, empty, over the cap) are 422/413 naming the line
    or the cap, and leave nothing behind."""
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
    options = _options(
        DatasetOptions, {"name": name, "tokenizer": tokenizer, "json_key": json_key, "append_eod": append_eod}
    )
    await run_in_threadpool(service.check_options, session, settings, tenant, options)
    session.close()  # no connection held while the body streams in
    # The storage writer is entered, fed and left from worker threads, one step at a time.
    writing = service.upload_writer(settings, tenant, options)
    dataset_id, url, sink = await run_in_threadpool(writing.__enter__)
    check = JsonlCheck(options.json_key, sink)
    try:
        await _stream(request, settings, check)
    except BaseException as exc:
        # A bad line, the cap, a client gone: abort, so no part of it stays in storage. Shielded,
        # as a cancelled request would otherwise skip the cleanup.
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(writing.__exit__, type(exc), exc, exc.__traceback__)
        raise
    await run_in_threadpool(writing.__exit__, None, None, None)  # the object is whole and visible
    ds = await run_in_threadpool(
        service.register_upload, session, settings, tenant, options, dataset_id, url, check.size
    )
    return service.public_dataset(ds)


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
