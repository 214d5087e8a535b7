"""/v1/jobs/{job_id}/checkpoints: list a job's checkpoints and download one."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from megatrain.api.checkpoints import service
from megatrain.api.deps import SessionDep, SettingsDep
from megatrain.api.jobs.router import OwnedJob
from megatrain.api.jobs.schemas import CheckpointPublic

router = APIRouter(prefix="/v1/jobs/{job_id}/checkpoints", tags=["checkpoints"])


@router.get("", response_model=list[CheckpointPublic])
def list_checkpoints(job: OwnedJob, session: SessionDep) -> list[Any]:
    """Complete checkpoints the job has saved, by step."""
    return service.list_checkpoints(session, job.id)


@router.get(
    "/{step}/download",
    responses={
        200: {
            "content": {"application/x-tar": {}, "application/json": {}},
            "description": "A tar stream, or a JSON listing of presigned URLs",
        }
    },
)
def download_checkpoint(
    job: OwnedJob,
    session: SessionDep,
    settings: SettingsDep,
    step: Annotated[int, Path(ge=0, le=10**9)],
    format: Annotated[service.DownloadFormat, Query()] = "auto",  # noqa: A002 - the query name
    weights_only: Annotated[bool, Query()] = False,
) -> Any:
    """Download the checkpoint saved at `step`.

    - `format=tar`: an uncompressed tar streamed through the API (`application/x-tar`), whose single
      top folder `iter_{step:07d}/` holds the checkpoint's files (manifest.json included), with
      `Content-Length` and `Content-Disposition: attachment; filename="{job_id}-iter_{step:07d}.tar"`.
      Works on every storage backend; on S3 the API reads the objects one after the other.
    - `format=urls`: JSON `{"job_id", "step", "expires_in_s", "files": [{"path", "size", "url"}]}`
      with a presigned GET URL per file, so large checkpoints go straight from S3 to the client.
      Storage without presigned URLs (file://) answers 422.
    - `format=auto` (default): `urls` where the storage presigns (s3://), else `tar`.

    With `weights_only=true` only the files a model needs are offered (model_*.bin, metadata.json,
    trainer_state.json, spec.json, manifest.json; `megatrain.checkpoint_files.WEIGHT_FILES`), not
    the optimizer state (state_*.bin): `load_checkpoint` loads such a copy, a resume cannot.

    Clients tell the two apart by Content-Type, verify files against manifest.json, and 404 means
    no complete checkpoint at that step.
    """
    files = service.locate(session, settings, job.id, step, weights_only)
    return service.download_response(files, job.id, step, format)
