"""/openai/v1/files: fine-tuning files, stored as our datasets (api/datasets: the same storage,
tenancy and line checks). A file is a dataset in a record format (chat, prompt_completion or
preference, told by its first record); its id is the dataset's id, which is also its name.

The multipart upload streams: its file part goes through the datasets' line check straight into
storage (the upload as sent, and its records in the engine's shape), never to the API's disk; a
malformed line is refused (400) naming the line, and leaves nothing behind.
"""

from __future__ import annotations

from contextlib import closing
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from megatrain.api.datasets import service as datasets
from megatrain.api.datasets.records import TEXT
from megatrain.api.datasets.router import stored, stream_upload
from megatrain.api.datasets.schemas import DatasetOptions
from megatrain.api.datasets.upload import JsonlCheck
from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.middleware import BODY_CHUNK, stream_body
from megatrain.api.openai.errors import openai_error
from megatrain.api.openai.schemas import FileDeleted, FileList, FileObject
from megatrain.api.registry import visible
from megatrain.db.models import FAILED, READY, Dataset, Tenant, new_id
from megatrain.settings import Settings
from megatrain.storage import open_store, split_url

router = APIRouter(prefix="/files", tags=["openai: files"])
PURPOSE = "fine-tune"
MAX_FIELD_BYTES = 1024
"""A form field other than the file (purpose, expires_after) is a short string."""


def public_file(ds: Dataset) -> FileObject:
    status = {READY: "processed", FAILED: "error"}.get(ds.state, "uploaded")
    return FileObject(
        id=ds.id,
        bytes=ds.input_bytes or 0,
        created_at=int(ds.created_at.timestamp()),
        filename=ds.filename or f"{ds.name}.jsonl",
        status=status,  # type: ignore[arg-type]
        status_details=ds.state_reason if ds.state == FAILED else None,
    )


def find_file(session: Session, tenant: Tenant, file_id: str, param: str = "file_id") -> Dataset:
    """The fine-tuning file (a record dataset) the tenant sees; another tenant's is the same 404."""
    ds = session.scalar(
        select(Dataset).where(
            visible(Dataset, tenant), Dataset.id == file_id[:64], Dataset.record_format != TEXT
        )
    )
    if ds is None:
        raise openai_error(404, f"No such File object: {file_id[:64]}", param=param)
    return ds


class _Form:
    """The multipart body's parts as they stream: the `file` part fed to `check`, the other fields
    kept (short strings). Runs in a worker thread (the check writes to storage)."""

    def __init__(self, check: JsonlCheck):
        self.check = check
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.saw_file = False
        self._headers: dict[bytes, bytes] = {}
        self._field = b""  # the header name being read
        self._name: str | None = None  # the part's form name
        self._value = bytearray()

    def callbacks(self) -> dict[str, Any]:
        """python-multipart's callbacks (data callbacks get a buffer and the slice that is theirs)."""
        return {
            "on_part_begin": self._begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        name = self._field.lower()
        self._headers[name] = self._headers.get(name, b"") + data[start:end]

    def _header_end(self) -> None:
        self._field = b""

    def _begin(self) -> None:
        self._headers, self._name, self._value = {}, None, bytearray()

    def _headers_done(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.saw_file:
                raise openai_error(400, "send one file per upload", param="file")
            self.saw_file = True
            raw = params.get(b"filename")
            self.filename = raw.decode("utf-8", "replace")[:255] if raw else None
            purpose = self.fields.get("purpose")
            if purpose is not None and purpose != PURPOSE:  # sent before the file: refuse early
                raise _bad_purpose(purpose)

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "file":
            self.check.feed(data[start:end])
            return
        self._value += data[start:end]
        if len(self._value) > MAX_FIELD_BYTES:
            raise openai_error(
                400, f"form field {self._name!r} exceeds {MAX_FIELD_BYTES} bytes", param=self._name
            )

    def _end(self) -> None:
        if self._name == "file":
            self.check.finish()
        elif self._name:
            self.fields[self._name] = self._value.decode("utf-8", "replace")


def _bad_purpose(purpose: str) -> Exception:
    return openai_error(
        400, f"purpose {purpose[:64]!r} is not supported here: only {PURPOSE!r}", param="purpose"
    )


async def _read_form(request: Request, settings: Settings, form: _Form) -> None:
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise openai_error(
            400, "send the file as multipart/form-data (fields file and purpose)", param="file"
        )
    parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
    await stream_body(request, settings.max_dataset_upload_bytes, parser.write)
    await run_in_threadpool(parser.finalize)
    if not form.saw_file:
        raise openai_error(400, "the upload has no 'file' part", param="file")
    purpose = form.fields.get("purpose")
    if purpose != PURPOSE:
        raise (
            _bad_purpose(purpose or "")
            if purpose
            else openai_error(400, "purpose is required", param="purpose")
        )


@router.post("", response_model=FileObject)
async def create_file(
    request: Request, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> FileObject:
    """Upload a JSONL fine-tuning file (multipart: `file`, `purpose=fine-tune`): chat, prompt/
    completion or preference records, every line checked (400 naming a bad one)."""
    file_id = new_id("file")
    session.close()  # no connection held while the body streams in
    async with stream_upload(settings, tenant, file_id, records=True, dataset_id=file_id) as target:
        check = JsonlCheck("text", target.source, None, target.records)
        form = _Form(check)
        await _read_form(request, settings, form)
    options = DatasetOptions(name=file_id)
    ds = await run_in_threadpool(
        datasets.register_upload, session, settings, tenant, options, stored(target, check, form.filename)
    )
    return public_file(ds)


@router.get("", response_model=FileList)
def list_files(
    session: SessionDep,
    tenant: CurrentTenant,
    purpose: str | None = None,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    """The tenant's fine-tuning files (and the operator's shared ones) by creation time."""
    if purpose not in (None, PURPOSE):
        return FileList(data=[], has_more=False, first_id="", last_id="")
    q = select(Dataset).where(visible(Dataset, tenant), Dataset.record_format != TEXT)
    key = (Dataset.created_at, Dataset.id)
    if after:
        cursor = find_file(session, tenant, after, "after")
        before = Dataset.created_at < cursor.created_at
        tie = and_(Dataset.created_at == cursor.created_at, Dataset.id < cursor.id)
        if order == "asc":
            before = Dataset.created_at > cursor.created_at
            tie = and_(Dataset.created_at == cursor.created_at, Dataset.id > cursor.id)
        q = q.where(or_(before, tie))
    q = q.order_by(*(k.desc() if order == "desc" else k for k in key)).limit(limit + 1)
    rows = list(session.scalars(q).all())
    data = [public_file(d) for d in rows[:limit]]
    first, last = (data[0].id, data[-1].id) if data else ("", "")
    return FileList(data=data, has_more=len(rows) > limit, first_id=first, last_id=last)


@router.get("/{file_id}", response_model=FileObject)
def get_file(file_id: str, session: SessionDep, tenant: CurrentTenant) -> FileObject:
    return public_file(find_file(session, tenant, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse)
def file_content(file_id: str, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant) -> Any:
    """The file as it was uploaded (a final newline added where it lacked one)."""
    ds = find_file(session, tenant, file_id)
    parent, key = split_url(ds.source_url)
    store = open_store(parent, settings.s3_endpoint_url)
    size = store.stat(key).size

    def body() -> Any:
        with closing(store.open_read(key)) as f:
            while chunk := f.read(BODY_CHUNK):
                yield chunk

    return StreamingResponse(
        body(), media_type="application/octet-stream", headers={"Content-Length": str(size)}
    )


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(
    file_id: str, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> FileDeleted:
    """Delete the file and its objects (409 while an unfinished job trains on it)."""
    ds = find_file(session, tenant, file_id)
    datasets.remove_dataset(session, settings, tenant, ds)
    return FileDeleted(id=file_id, deleted=True)
