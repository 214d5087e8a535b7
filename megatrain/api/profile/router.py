"""/v1/jobs/{job_id}/profile: download a job's profiler traces (training.profile_steps)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import StreamingResponse

from megatrain.api.checkpoints.service import DownloadFormat
from megatrain.api.deps import SessionDep, SettingsDep
from megatrain.api.jobs.router import OwnedJob
from megatrain.api.tensorboard import service

FOLDER = "profile"
"""The folder beside `checkpoints/` (megatrain.engine.profiling.FOLDER)."""
TRACE_NAME = re.compile(r"trace\.rank\d{1,6}\.json\.gz")
"""A rank's trace (megatrain.engine.profiling.trace_name)."""
CHUNK = 1 << 20

router = APIRouter(prefix="/v1/jobs/{job_id}/profile", tags=["profile"])


@router.get(
    "",
    responses=service.DOWNLOAD_RESPONSES,
)
def download_profile(
    job: OwnedJob,
    session: SessionDep,
    settings: SettingsDep,
    format: Annotated[DownloadFormat, Query()] = "auto",  # noqa: A002 - the query name
) -> Any:
    """Download the job's torch.profiler traces, one Chrome trace per rank
    (`trace.rank{R}.json.gz`, written next to the checkpoints when the profiled steps end): each
    opens in Perfetto (ui.perfetto.dev) or chrome://tracing. The same formats as a checkpoint's
    download: `tar` (one top folder, `profile/`, named `{job_id}-profile.tar`), `urls` (JSON
    `{"job_id", "expires_in_s", "files": [{"path", "size", "url"}]}`, on storage that presigns),
    `auto` (urls where possible, else tar). 404 while there are none."""
    files = service.locate(session, settings, job.id, FOLDER)
    return service.download_response(files, job.id, format, FOLDER)


@router.get(
    "/{name}",
    responses={200: {"content": {"application/gzip": {}}, "description": "One rank's trace"}},
)
def download_trace(job: OwnedJob, session: SessionDep, settings: SettingsDep, name: str) -> Any:
    """One rank's trace, `trace.rank{R}.json.gz` (the `files` of the job's `profiled` event), as
    gzip-compressed Chrome trace JSON. 404 when the job has no such file."""
    if not TRACE_NAME.fullmatch(name):
        raise HTTPException(404, f"{name!r} is not a trace's name (trace.rank{{R}}.json.gz)")
    files = service.locate(session, settings, job.id, FOLDER)
    obj = next((o for o in files.objects if files.relative(o) == name), None)
    if obj is None:
        ranks = ", ".join(files.relative(o) for o in files.objects)
        raise HTTPException(404, f"job {job.id} has no {name} (it has {ranks})")

    def body() -> Iterator[bytes]:
        with files.store.open_read(obj.key) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    return StreamingResponse(
        body(),
        media_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="{job.id}-{name}"',
            "Content-Length": str(obj.size),
        },
    )
