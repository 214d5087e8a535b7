"""Datasets: register (an upload or a storage URL) as `pending`, which the scheduler hands to the
workers for preprocessing; list, read, delete; resolve the names a JobSpec uses.

A tenant sees its own datasets and the shared ones (tenant_id NULL, registered by the operator).
Another tenant's dataset is the same 404 as one that does not exist. Each dataset's objects live
under a folder of their own, `{storage}/tenants/{tenant}/datasets/{name}/{id}/` (shared:
`{storage}/datasets/{name}/{id}/`): the uploaded `source.jsonl` and the indexed `data.bin`/`data.idx`
(a record format's `records.jsonl` instead of the index), so a deleted dataset and a new one of
the same name never share an object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

from fastapi import HTTPException
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.api.datasets.records import TEXT, job_kinds
from megatrain.api.datasets.schemas import DatasetCreate, DatasetOptions, DatasetPublic
from megatrain.api.errors import FieldError
from megatrain.api.jobs.data_access import data_url_problem, normalise_data_url
from megatrain.api.registry import find_named, get_named, list_named
from megatrain.db.models import ACTIVE_STATES, PENDING, QUEUED, READY, Dataset, Job, Tenant, new_id, utcnow
from megatrain.settings import Settings
from megatrain.spec import JSONL_SUFFIXES, JobSpec, SpecError
from megatrain.storage import StorageError, open_store, split_url

SOURCE_NAME = "source.jsonl"
RECORDS_NAME = "records.jsonl"
"""A record format's records in the engine's shape (api/datasets/records.py), beside the upload."""
PREFIX_NAME = "data"
"""The indexed dataset is {folder}/data.bin + {folder}/data.idx."""


def folder_key(tenant_name: str | None, name: str, dataset_id: str) -> str:
    """The dataset's folder, relative to the storage root."""
    base = f"tenants/{tenant_name}/datasets" if tenant_name is not None else "datasets"
    return f"{base}/{name}/{dataset_id}"


def public_dataset(ds: Dataset) -> DatasetPublic:
    return DatasetPublic(
        id=ds.id,
        name=ds.name,
        shared=ds.tenant_id is None,
        state=ds.state,
        state_reason=ds.state_reason,
        path=ds.prefix_url,
        source_url=ds.source_url,
        uploaded=ds.uploaded,
        tokenizer=ds.tokenizer,
        json_key=ds.json_key,
        append_eod=ds.append_eod,
        record_format=ds.record_format or TEXT,
        records_url=ds.records_url,
        filename=ds.filename,
        documents=ds.documents,
        tokens=ds.tokens,
        vocab_size=ds.vocab_size,
        input_bytes=ds.input_bytes,
        output_bytes=ds.output_bytes,
        attempt=ds.attempt,
        created_at=ds.created_at,
        updated_at=ds.updated_at,
        finished_at=ds.finished_at,
    )


def find_dataset(session: Session, tenant: Tenant, name: str) -> Dataset | None:
    """The tenant's own dataset called `name`, else the shared one, else None."""
    return find_named(session, Dataset, tenant, name)


def get_dataset(session: Session, tenant: Tenant, name: str) -> Dataset:
    return get_named(session, Dataset, tenant, name, "dataset")


def list_datasets(session: Session, tenant: Tenant) -> list[Dataset]:
    """The tenant's datasets and the shared ones, by name (own before shared for equal names)."""
    return list_named(session, Dataset, tenant)


def check_options(session: Session, settings: Settings, tenant: Tenant, options: DatasetOptions) -> None:
    """What a registration can break before any byte is stored: a name in use (409), a tokenizer
    file the tenant may not read (422)."""
    taken = session.scalar(
        select(Dataset.id).where(Dataset.tenant_id == tenant.id, Dataset.name == options.name)
    )
    if taken is not None:
        raise HTTPException(
            409, f"dataset {options.name!r} already exists; delete it first or choose another name"
        )
    if options.tokenizer.path:
        problem = data_url_problem("tokenizer.path", options.tokenizer.path, settings, tenant.name)
        if problem:
            raise FieldError("tokenizer.path", problem)


@dataclass
class Stored:
    """An upload in storage, checked: what registering it records."""

    dataset_id: str
    source_url: str
    size: int
    record_format: str = TEXT
    records_url: str | None = None
    """Record formats: the engine-shaped records beside the upload."""
    records: int | None = None
    """Record formats: how many (blank lines aside)."""
    filename: str | None = None


def _insert(
    session: Session,
    settings: Settings,
    tenant: Tenant | None,
    options: DatasetOptions,
    dataset_id: str,
    source_url: str,
    uploaded: bool,
    input_bytes: int | None,
    stored: Stored | None = None,
) -> Dataset:
    storage = settings.resolved_storage_url
    folder = folder_key(tenant.name if tenant else None, options.name, dataset_id)
    ds = Dataset(
        id=dataset_id,
        tenant_id=tenant.id if tenant else None,
        name=options.name,
        state=PENDING,
        state_reason="waiting for a worker to preprocess it",
        source_url=source_url,
        uploaded=uploaded,
        prefix_url=f"{storage}/{folder}/{PREFIX_NAME}",
        tokenizer=options.tokenizer.model_dump(mode="json", exclude_none=True),
        json_key=options.json_key,
        append_eod=options.append_eod,
        input_bytes=input_bytes,
    )
    if stored is not None:
        ds.filename = stored.filename
        if stored.record_format != TEXT:
            # Records are read as they are (the engine tokenizes them with the job's tokenizer and
            # template): checked line by line at upload, nothing is left for a worker to do.
            ds.record_format, ds.records_url, ds.documents = (
                stored.record_format,
                stored.records_url,
                stored.records,
            )
            ds.state, ds.finished_at = READY, utcnow()
            ds.state_reason = f"{stored.records} {stored.record_format} records, checked at upload"
    session.add(ds)
    try:
        session.commit()
    except IntegrityError:
        # Another request registered the name between our check and this insert.
        session.rollback()
        raise HTTPException(409, f"dataset {options.name!r} already exists") from None
    return ds


def _check_source(settings: Settings, source_url: str) -> None:
    if not source_url.endswith(JSONL_SUFFIXES):
        raise FieldError("source_url", f"source_url must name a JSONL file ({', '.join(JSONL_SUFFIXES)})")
    parent, key = split_url(source_url)
    try:
        exists = open_store(parent, settings.s3_endpoint_url).exists(key)
    except StorageError as exc:
        raise FieldError("source_url", f"source_url cannot be read: {exc}") from None
    if not exists:
        raise FieldError("source_url", f"source_url={source_url!r} does not exist")


def register_shared(session: Session, settings: Settings, body: DatasetCreate) -> Dataset:
    """An operator's dataset every tenant sees (read-only), stored under {storage}/datasets/.
    Operators may name any source they can reach; the rule for tenants does not apply."""
    taken = session.scalar(select(Dataset.id).where(Dataset.tenant_id.is_(None), Dataset.name == body.name))
    if taken is not None:
        raise HTTPException(409, f"shared dataset {body.name!r} already exists")
    _check_source(settings, body.source_url)
    return _insert(session, settings, None, body, new_id("ds"), body.source_url, False, None)


def register_url(session: Session, settings: Settings, tenant: Tenant, body: DatasetCreate) -> Dataset:
    """A JSONL file already in storage, which the tenant may read, registered as pending."""
    if body.record_format != TEXT:
        # Records are checked (and converted) line by line as they stream in: only uploads are.
        raise FieldError("record_format", f"record_format {body.record_format} is for uploads only")
    check_options(session, settings, tenant, body)
    problem = data_url_problem("source_url", body.source_url, settings, tenant.name)
    if problem:
        raise FieldError("source_url", problem)
    # The URL as checked (symlinks resolved): the worker reads what the rule allowed, even if a
    # link is changed later.
    source = normalise_data_url(body.source_url)
    _check_source(settings, source)
    return _insert(session, settings, tenant, body, new_id("ds"), source, False, None)


@dataclass
class UploadTarget:
    """Where an upload streams: its source object and, for a record format, the engine-shaped records."""

    dataset_id: str
    source_url: str
    source: BinaryIO
    records_url: str | None = None
    records: BinaryIO | None = None


@contextmanager
def upload_writer(
    settings: Settings, tenant: Tenant, name: str, records: bool = False, dataset_id: str | None = None
) -> Iterator[UploadTarget]:
    """The objects of a new upload of the dataset `name`: what is written streams into them, which
    appear whole when the block ends cleanly, and never (nor any part of them) otherwise."""
    dataset_id = dataset_id or new_id("ds")
    folder = folder_key(tenant.name, name, dataset_id)
    storage = settings.resolved_storage_url
    store = open_store(storage, settings.s3_endpoint_url)
    with contextlib.ExitStack() as stack:
        target = UploadTarget(
            dataset_id,
            f"{storage}/{folder}/{SOURCE_NAME}",
            stack.enter_context(store.writer(f"{folder}/{SOURCE_NAME}")),
        )
        if records:
            target.records_url = f"{storage}/{folder}/{RECORDS_NAME}"
            target.records = stack.enter_context(store.writer(f"{folder}/{RECORDS_NAME}"))
        yield target


def register_upload(
    session: Session, settings: Settings, tenant: Tenant, options: DatasetOptions, stored: Stored
) -> Dataset:
    """Register a stored upload (pending; a record format's ready); on any failure its objects
    are removed again."""
    try:
        return _insert(
            session,
            settings,
            tenant,
            options,
            stored.dataset_id,
            stored.source_url,
            True,
            stored.size,
            stored,
        )
    except BaseException:
        delete_objects(settings, tenant.name, options.name, stored.dataset_id)
        raise


def delete_objects(settings: Settings, tenant_name: str | None, name: str, dataset_id: str) -> None:
    store = open_store(settings.resolved_storage_url, settings.s3_endpoint_url)
    store.delete_prefix(folder_key(tenant_name, name, dataset_id))


def _jobs_naming(session: Session, tenant: Tenant, name: str) -> list[str]:
    """The tenant's unfinished jobs whose spec reads the dataset `name`."""
    rows = session.execute(
        select(Job.id, Job.spec).where(Job.tenant_id == tenant.id, Job.status.in_((QUEUED, *ACTIVE_STATES)))
    ).all()

    def reads(spec: dict[str, Any]) -> bool:
        data = spec.get("data") or {}
        return any(s.get("dataset") == name for part in ("train", "valid") for s in data.get(part) or [])

    return [r.id for r in rows if reads(r.spec)]


def delete_dataset(session: Session, settings: Settings, tenant: Tenant, name: str) -> None:
    """Remove the tenant's dataset and its objects; 409 while an unfinished job reads it."""
    remove_dataset(session, settings, tenant, get_dataset(session, tenant, name))


def remove_dataset(session: Session, settings: Settings, tenant: Tenant, ds: Dataset) -> None:
    """delete_dataset of a dataset the tenant sees (403 for a shared one)."""
    name = ds.name
    if ds.tenant_id is None:
        raise HTTPException(403, f"dataset {name!r} is shared by the operator; tenants cannot delete it")
    users = _jobs_naming(session, tenant, name)
    if users:
        raise HTTPException(409, f"dataset {name!r} is read by unfinished jobs: {', '.join(users[:10])}")
    dataset_id = ds.id
    session.delete(ds)
    session.commit()
    # The row goes first: a worker still preprocessing it finds no row and removes what it wrote.
    delete_objects(settings, tenant.name, name, dataset_id)


def reads_records(spec: JobSpec, ds: Dataset) -> bool:
    """Whether the job reads the dataset's JSONL records rather than its indexed tokens: always for
    a record format (chat, prompt_completion, preference). A text dataset's index holds the
    `json_key` text alone, every token of it trained on: right for pretraining and a plain
    fine-tune, wrong for preference pairs (the engine refuses an index for kind dpo) and for
    prompt/response records (a fine-tune would train on the prompts alone, loss on every token).
    Every record holds a string under json_key, so a json_key naming the prompt (or chat) field
    says the file holds records: the engine's own test of a JSONL file's first record."""
    if (ds.record_format or TEXT) != TEXT:
        return True
    record_keys = {spec.data.prompt_key, spec.data.messages_key}
    return spec.kind == "dpo" or (spec.kind == "finetune" and ds.json_key in record_keys)


def _source_problem(spec: JobSpec, ds: Dataset, field: str, name: str) -> str | None:
    """Why the job cannot train on the ready dataset, or None."""
    fmt = ds.record_format or TEXT
    if spec.kind not in job_kinds(fmt):
        kinds = " or ".join(job_kinds(fmt))
        return f"{field}={name!r} holds {fmt} records, which kind {kinds} reads, not kind {spec.kind}"
    tokenizer = spec.data.tokenizer.model_dump(mode="json", exclude_none=True)
    if fmt == TEXT and ds.tokenizer != tokenizer:
        # Token ids mean nothing under another tokenizer: the model would train on noise. (Records
        # are tokenized by the job itself.)
        return f"{field}={name!r} was tokenized with {ds.tokenizer}, but data.tokenizer is {tokenizer}"
    return None


def resolve_datasets(session: Session, spec: JobSpec, tenant: Tenant) -> None:
    """Fill `path` of every `data.train` and `data.valid` source that names a dataset with its
    indexed prefix, or with its JSONL source for a job that reads records (`reads_records`);
    SpecError naming `data.train.N.dataset` (or data.valid's) for one that is unknown, not visible,
    not ready, or tokenized with another tokenizer than the spec's."""
    errors = []
    for source_field, src in spec.data.sources():
        if src.dataset is None:
            continue
        field = f"{source_field}.dataset"
        ds = find_dataset(session, tenant, src.dataset)
        if ds is None:
            errors.append({"field": field, "message": f"{field}={src.dataset!r}: no such dataset"})
        elif ds.state != READY:
            why = f" ({ds.state_reason})" if ds.state_reason else ""
            errors.append(
                {"field": field, "message": f"{field}={src.dataset!r} is {ds.state}, not ready{why}"}
            )
        elif problem := _source_problem(spec, ds, field, src.dataset):
            errors.append({"field": field, "message": problem})
        elif reads_records(spec, ds):
            src.path = ds.records_url or ds.source_url
        else:
            src.path = ds.prefix_url
    if errors:
        raise SpecError(errors)
