"""/v1/jobs/{job_id}/samples: generate text from a job's checkpoint on the workers, and read it back."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from megatrain.api.deps import SessionDep, SettingsDep
from megatrain.api.jobs.router import OwnedJob
from megatrain.api.samples import service
from megatrain.api.samples.schemas import SampleCreate, SamplePublic

router = APIRouter(prefix="/v1/jobs/{job_id}/samples", tags=["samples"])
SampleId = Annotated[str, Path(min_length=1, max_length=64)]
Limit = Annotated[int, Query(ge=1, le=service.LIST_LIMIT)]


@router.post(
    "",
    response_model=SamplePublic,
    status_code=202,
    responses={
        404: {"description": "No such checkpoint (the message lists the steps the job has)"},
        409: {"description": "The job has no checkpoint yet"},
        429: {"description": "Too many samples waiting or running for this tenant"},
    },
)
def create_sample(job: OwnedJob, session: SessionDep, settings: SettingsDep, body: SampleCreate) -> Any:
    """Continue `prompt` from the checkpoint at `step` (the latest when null), in the background: 202
    with a pending sample; poll it until `ready` (its `text`) or `failed` (its `error`)."""
    return service.create_sample(session, settings, job, body)


@router.get("", response_model=list[SamplePublic])
def list_samples(job: OwnedJob, session: SessionDep, limit: Limit = service.LIST_LIMIT) -> list[Any]:
    """The job's last `limit` samples (at most 20), newest first."""
    return service.list_samples(session, job.id, limit)


@router.get("/{sample_id}", response_model=SamplePublic)
def get_sample(job: OwnedJob, session: SessionDep, sample_id: SampleId) -> Any:
    return service.get_sample(session, job.id, sample_id)
