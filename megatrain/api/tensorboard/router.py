"""/v1/jobs/{job_id}/tensorboard: download a job's TensorBoard event files."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from megatrain.api.checkpoints.service import DownloadFormat
from megatrain.api.deps import SessionDep, SettingsDep
from megatrain.api.jobs.router import OwnedJob
from megatrain.api.tensorboard import service

router = APIRouter(prefix="/v1/jobs/{job_id}/tensorboard", tags=["tensorboard"])


@router.get(
    "",
    responses=service.DOWNLOAD_RESPONSES,
)
def download_tensorboard(
    job: OwnedJob,
    session: SessionDep,
    settings: SettingsDep,
    format: Annotated[DownloadFormat, Query()] = "auto",  # noqa: A002 - the query name
) -> Any:
    """Download the job's TensorBoard event files (a spec with `tracking.tensorboard`), as they stand:
    the engine copies them next to the checkpoints every `flush_interval_s` and when it ends.

    The same formats as a checkpoint's download: `tar` (one top folder, `tensorboard/`, named
    `{job_id}-tensorboard.tar`), `urls` (JSON `{"job_id", "expires_in_s", "files": [{"path",
    "size", "url"}]}`, on storage that presigns), `auto` (urls where possible, else tar).
    `tensorboard --logdir FOLDER` reads the files as one run. 404 while there are none.
    """
    files = service.locate(session, settings, job.id)
    return service.download_response(files, job.id, format)
