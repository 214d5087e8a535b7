"""Checkpoints of a job: the list, and a download as a streamed tar or as presigned URLs.

The folder is located by the storage layout (`{storage}/jobs/{job_id}/checkpoints/iter_{step:07d}`),
never by a URL read back from the database, and only a folder whose manifest.json exists (written
last by the engine) counts as a checkpoint.
"""

from __future__ import annotations

import contextlib
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

from fastapi import HTTPException
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.api.errors import FieldError
from megatrain.checkpoint_files import is_weight_file
from megatrain.db.models import TERMINAL_STATES, Checkpoint, CheckpointTaskColumns, Job
from megatrain.settings import Settings
from megatrain.storage import ObjectInfo, Store, open_store

BLOCK = 512
CHUNK = 1 << 20
PRESIGN_EXPIRES_S = 3600


def list_checkpoints(session: Session, job_id: str) -> list[Checkpoint]:
    q = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
    return list(session.scalars(q).all())


def no_checkpoints(job_id: str, status: str | None) -> str:
    """Says a job has no checkpoint; "yet" only while it may still save one."""
    if status in TERMINAL_STATES:
        return f"job {job_id} {status} without saving a checkpoint"
    return f"job {job_id} has no checkpoints yet"


def missing_step(job_id: str, step: int, steps: list[int], status: str | None = None) -> str:
    """The 404's message, naming the steps the job has (retention may have deleted the one asked)."""
    if not steps:
        return no_checkpoints(job_id, status)
    return f"job {job_id} has no checkpoint at step {step}; its checkpoints: {', '.join(map(str, steps))}"


def resolve_step(session: Session, settings: Settings, job_id: str, step: int | None) -> int:
    """The step of a complete checkpoint of the job (the latest for None) for background work on it;
    404 naming the steps that exist otherwise, or when its files are incomplete or deleted."""
    steps = [c.step for c in list_checkpoints(session, job_id)]
    if step is None and steps:
        step = steps[-1]
    if step is None or step not in steps:
        status = session.scalar(select(Job.status).where(Job.id == job_id))
        raise HTTPException(404, missing_step(job_id, -1 if step is None else step, steps, status))
    store = open_store(settings.resolved_storage_url, settings.s3_endpoint_url)
    if not store.exists(f"jobs/{job_id}/checkpoints/iter_{step:07d}/manifest.json"):
        raise HTTPException(
            404, f"the checkpoint at step {step} of job {job_id} is incomplete or was deleted"
        )
    return step


TaskRow = TypeVar("TaskRow", bound=CheckpointTaskColumns)


def get_task(session: Session, model: type[TaskRow], job_id: str, task_id: str, noun: str) -> TaskRow:
    """The job's row of background work on a checkpoint (an export, a sample) by id; 404 naming
    the `noun` otherwise (another job's row is no row of this one)."""
    row = session.scalar(select(model).where(model.id == task_id, model.job_id == job_id))  # type: ignore[attr-defined]
    if row is None:
        raise HTTPException(404, f"job {job_id} has no {noun} {task_id[:64]!r}")
    return row


@dataclass
class CheckpointFiles:
    store: Store
    prefix: str
    """Key of the iter_{step:07d} folder within the store."""
    folder: str
    """Its name (iter_0000050), the single top folder of the tar."""
    objects: list[ObjectInfo]

    def relative(self, obj: ObjectInfo) -> str:
        return obj.key[len(self.prefix) + 1 :]


def locate(
    session: Session, settings: Settings, job_id: str, step: int, weights_only: bool = False
) -> CheckpointFiles:
    """The files of a complete checkpoint (with weights_only, only those a model needs, not the
    optimizer state); 404 when there is no such (complete) checkpoint."""
    steps = [c.step for c in list_checkpoints(session, job_id)]
    if step not in steps:
        status = session.scalar(select(Job.status).where(Job.id == job_id))
        raise HTTPException(404, missing_step(job_id, step, steps, status))
    store = open_store(settings.resolved_storage_url, settings.s3_endpoint_url)
    folder = f"iter_{step:07d}"
    prefix = f"jobs/{job_id}/checkpoints/{folder}"
    if not store.exists(f"{prefix}/manifest.json"):
        raise HTTPException(
            404, f"the checkpoint at step {step} of job {job_id} is incomplete or was deleted"
        )
    files = folder_files(store, prefix, folder)
    if weights_only:
        files.objects = [o for o in files.objects if is_weight_file(files.relative(o))]
    return files


def folder_files(store: Store, prefix: str, folder: str) -> CheckpointFiles:
    """Every object under `prefix`/ (a checkpoint's or an export's folder), for a download."""
    objects = [o for o in store.list(prefix) if o.key.startswith(prefix + "/")]
    return CheckpointFiles(store, prefix, folder, objects)


DownloadFormat = Literal["auto", "tar", "urls"]


def download_response(files: CheckpointFiles, job_id: str, step: int, fmt: DownloadFormat) -> Response:
    """The folder as presigned URLs (JSON) where asked and possible, else as a streamed tar named
    `{job_id}-{folder}.tar` (see the checkpoint download endpoint for the contract)."""
    if fmt in ("auto", "urls"):
        listing = presigned_listing(files, job_id, step)
        if listing is not None:
            return JSONResponse(listing)
        if fmt == "urls":
            raise FieldError("format", "this server's storage cannot presign URLs; use format=tar")
    headers = tar_headers(files)
    return StreamingResponse(
        stream_tar(files, headers),
        media_type="application/x-tar",
        headers={
            "Content-Disposition": f'attachment; filename="{job_id}-{files.folder}.tar"',
            "Content-Length": str(tar_size(files, headers)),
        },
    )


def tar_headers(files: CheckpointFiles) -> list[bytes]:
    now = int(time.time())
    headers = []
    for obj in files.objects:
        info = tarfile.TarInfo(f"{files.folder}/{files.relative(obj)}")
        info.size, info.mode, info.mtime = obj.size, 0o644, now
        headers.append(info.tobuf(format=tarfile.PAX_FORMAT))
    return headers


def tar_size(files: CheckpointFiles, headers: list[bytes]) -> int:
    body = sum(len(h) + o.size + (-o.size % BLOCK) for h, o in zip(headers, files.objects, strict=True))
    return body + 2 * BLOCK  # two zero blocks end the archive


def stream_tar(files: CheckpointFiles, headers: list[bytes]) -> Iterator[bytes]:
    """An uncompressed tar of the folder, written member by member (constant memory, any size).

    Each member's size is fixed by its header: a file that shrank since it was listed is padded
    with zeros (the manifest check on the client then fails loudly) and one that grew is cut.
    """
    for header, obj in zip(headers, files.objects, strict=True):
        yield header
        remaining = obj.size
        with contextlib.closing(files.store.open_read(obj.key)) as f:
            while remaining > 0:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
                yield chunk
        if remaining:
            yield b"\0" * remaining
        yield b"\0" * (-obj.size % BLOCK)
    yield b"\0" * (2 * BLOCK)


def presigned_listing(files: CheckpointFiles, job_id: str, step: int) -> dict[str, object] | None:
    """{"job_id", "step", "expires_in_s", "files": [{"path", "size", "url"}]}; None without presigning."""
    entries = []
    for obj in files.objects:
        url = files.store.presigned_url(obj.key, PRESIGN_EXPIRES_S)
        if url is None:
            return None
        entries.append({"path": files.relative(obj), "size": obj.size, "url": url})
    return {"job_id": job_id, "step": step, "expires_in_s": PRESIGN_EXPIRES_S, "files": entries}
