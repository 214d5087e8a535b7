"""Exports of a job's checkpoints: created as `pending` rows (the scheduler hands them to a worker,
worker.exports), read back, and downloaded through the checkpoints' download code.

The folder is located by the storage layout (CheckpointExport.folder_key), never by a URL read back
from the database, and only a folder whose config.json (an adapter's adapter_config.json) exists,
written last, counts as complete.
"""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.api.checkpoints import service as checkpoints
from megatrain.api.errors import FieldError
from megatrain.api.exports.schemas import ExportCreate
from megatrain.db.models import (
    ADAPTER_FORM,
    FAILED,
    PENDING,
    READY,
    CheckpointExport,
    Job,
    new_id,
)
from megatrain.settings import Settings
from megatrain.storage import open_store


def create_export(
    session: Session, settings: Settings, job: Job, body: ExportCreate
) -> tuple[CheckpointExport, bool]:
    """(export, created): a new pending export, or the one already pending, running or ready for the
    same step, format, form and dtype (a failed one is tried again by a new export). An adapter of a
    job that trained every weight is a 422 naming `form`."""
    if body.form == ADAPTER_FORM and training_method(job) != "lora":
        raise FieldError(
            "form",
            f"job {job.id} trained every weight (training.method is 'full'): it has no LoRA adapters "
            "to export, only its whole model",
        )
    step = checkpoints.resolve_step(session, settings, job.id, body.step)
    existing = _live_export(session, job.id, step, body)
    if existing is not None:
        return existing, False
    export = CheckpointExport(
        id=new_id("exp"),
        job_id=job.id,
        step=step,
        format=body.format,
        form=body.form,
        dtype=body.dtype,
        status=PENDING,
    )
    session.add(export)
    try:
        session.commit()
    except IntegrityError:
        # A concurrent request created it first (unique on the live export of a step, form and dtype).
        session.rollback()
        existing = _live_export(session, job.id, step, body)
        if existing is None:
            raise
        return existing, False
    return export, True


def _live_export(session: Session, job_id: str, step: int, body: ExportCreate) -> CheckpointExport | None:
    return session.scalar(
        select(CheckpointExport).where(
            CheckpointExport.job_id == job_id,
            CheckpointExport.step == step,
            CheckpointExport.format == body.format,
            CheckpointExport.form == body.form,
            CheckpointExport.dtype == body.dtype,
            CheckpointExport.status != FAILED,
        )
    )


def training_method(job: Job) -> str:
    """full or lora, as the job's stored spec says (a row from before LoRA has no method: full)."""
    return str((job.spec.get("training") or {}).get("method") or "full")


def list_exports(session: Session, job_id: str) -> list[CheckpointExport]:
    q = select(CheckpointExport).where(CheckpointExport.job_id == job_id)
    return list(session.scalars(q.order_by(CheckpointExport.created_at, CheckpointExport.id)).all())


def get_export(session: Session, job_id: str, export_id: str) -> CheckpointExport:
    return checkpoints.get_task(session, CheckpointExport, job_id, export_id, "export")


def download_export(
    session: Session, settings: Settings, job_id: str, export_id: str, fmt: checkpoints.DownloadFormat
) -> Response:
    """A ready export's folder as a tar stream or presigned URLs; 409 while it is not ready."""
    export = get_export(session, job_id, export_id)
    if export.status != READY:
        why = f": {export.error}" if export.error else ""
        raise HTTPException(409, f"export {export.id} is {export.status}, not ready{why}")
    store = open_store(settings.resolved_storage_url, settings.s3_endpoint_url)
    prefix = export.folder_key
    if not store.exists(f"{prefix}/{export.complete_marker}"):
        raise HTTPException(404, f"the files of export {export.id} are gone from storage")
    files = checkpoints.folder_files(store, prefix, prefix.rsplit("/", 1)[-1])
    return checkpoints.download_response(files, job_id, export.step, fmt)
