"""/v1/jobs/{job_id}/exports: export a checkpoint (Hugging Face format), follow it, download it."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Response

from megatrain.api.checkpoints.service import DownloadFormat
from megatrain.api.deps import SessionDep, SettingsDep
from megatrain.api.exports import service
from megatrain.api.exports.schemas import ExportCreate, ExportPublic
from megatrain.api.jobs.router import OwnedJob

router = APIRouter(prefix="/v1/jobs/{job_id}/exports", tags=["exports"])
ExportId = Annotated[str, Path(min_length=1, max_length=64)]


@router.post("", response_model=ExportPublic, status_code=202, responses={200: {"model": ExportPublic}})
def create_export(
    job: OwnedJob,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    body: Annotated[ExportCreate | None, Body()] = None,
) -> Any:
    """Export a checkpoint (`step`, or the latest) to `format` in `dtype`, in the background: 202 with
    a pending export, or 200 with the one already pending, running or ready for the same step, form
    and dtype. `form`: the whole model (a LoRA job's merged), or a LoRA job's adapters alone (PEFT's
    folder; 422 naming `form` for a job that trained every weight). 404 when the job has no such
    checkpoint (the message lists the steps it has)."""
    export, created = service.create_export(session, settings, job, body or ExportCreate())
    if not created:
        response.status_code = 200
    return export


@router.get("", response_model=list[ExportPublic])
def list_exports(job: OwnedJob, session: SessionDep) -> list[Any]:
    """The job's exports, oldest first."""
    return service.list_exports(session, job.id)


@router.get("/{export_id}", response_model=ExportPublic)
def get_export(job: OwnedJob, session: SessionDep, export_id: ExportId) -> Any:
    return service.get_export(session, job.id, export_id)


@router.get(
    "/{export_id}/download",
    responses={
        200: {
            "content": {"application/x-tar": {}, "application/json": {}},
            "description": "A tar stream, or a JSON listing of presigned URLs",
        }
    },
)
def download_export(
    job: OwnedJob,
    session: SessionDep,
    settings: SettingsDep,
    export_id: ExportId,
    format: Annotated[DownloadFormat, Query()] = "auto",  # noqa: A002 - the query name
) -> Any:
    """Download a ready export: the same formats as a checkpoint's download (`tar`: one top folder
    `iter_{step:07d}-{dtype}/` with config.json and the safetensors, `iter_{step:07d}-{dtype}-adapter/`
    with adapter_config.json and adapter_model.safetensors; `urls`: presigned S3 URLs;
    `auto`). 409 while the export is not ready."""
    return service.download_export(session, settings, job.id, export_id, format)
