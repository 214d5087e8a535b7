"""A job's TensorBoard event files (`{storage}/jobs/{job_id}/tensorboard/`, written next to its
checkpoints by the engine's TensorBoard tracker), downloaded as a streamed tar or presigned URLs; the
same for any folder the engine writes beside the checkpoints (its profiler traces, `profile/`).

Located by the storage layout, like a checkpoint; a file there is offered as soon as the engine's
first copy lands (event files only grow, and TensorBoard reads a cut-off last record as not yet
written)."""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.api.checkpoints.service import (
    PRESIGN_EXPIRES_S,
    CheckpointFiles,
    DownloadFormat,
    folder_files,
    stream_tar,
    tar_headers,
    tar_size,
)
from megatrain.api.errors import FieldError
from megatrain.db.models import TERMINAL_STATES, Job
from megatrain.settings import Settings
from megatrain.storage import open_store

DOWNLOAD_RESPONSES = {
    200: {
        "content": {"application/x-tar": {}, "application/json": {}},
        "description": "A tar stream, or a JSON listing of presigned URLs",
    }
}
"""OpenAPI's description of a folder's download (the tar or the URLs)."""

FOLDER = "tensorboard"
"""The folder beside `checkpoints/` (megatrain.engine.tracking.tensorboard_writer.FOLDER)."""


def locate(session: Session, settings: Settings, job_id: str, folder: str = FOLDER) -> CheckpointFiles:
    """The job's files in `folder` (beside its checkpoints); 404 saying why there are none."""
    store = open_store(settings.resolved_storage_url, settings.s3_endpoint_url)
    files = folder_files(store, f"jobs/{job_id}/{folder}", folder)
    if not files.objects:
        status = session.scalar(select(Job.status).where(Job.id == job_id))
        what, need = MISSING[folder]
        ended = f"{status} without writing any {what}" if status in TERMINAL_STATES else f"has no {what} yet"
        raise HTTPException(404, f"job {job_id} {ended} (they need {need} in its spec)")
    return files


MISSING = {
    FOLDER: ("TensorBoard event files", "tracking.tensorboard"),
    "profile": ("profiler traces", "training.profile_steps"),
}
"""What a 404 names, by folder: the files, and the spec field that asks for them."""


def download_response(
    files: CheckpointFiles, job_id: str, fmt: DownloadFormat, folder: str = FOLDER
) -> Response:
    """Presigned URLs where asked and the store signs them, else a tar named `{job_id}-{folder}.tar`
    whose one top folder, `{folder}/`, holds the files."""
    if fmt in ("auto", "urls"):
        entries = []
        for obj in files.objects:
            url = files.store.presigned_url(obj.key, PRESIGN_EXPIRES_S)
            if url is None:
                break
            entries.append({"path": files.relative(obj), "size": obj.size, "url": url})
        else:
            return JSONResponse({"job_id": job_id, "expires_in_s": PRESIGN_EXPIRES_S, "files": entries})
        if fmt == "urls":
            raise FieldError("format", "this server's storage cannot presign URLs; use format=tar")
    headers = tar_headers(files)
    return StreamingResponse(
        stream_tar(files, headers),
        media_type="application/x-tar",
        headers={
            "Content-Disposition": f'attachment; filename="{job_id}-{folder}.tar"',
            "Content-Length": str(tar_size(files, headers)),
        },
    )
