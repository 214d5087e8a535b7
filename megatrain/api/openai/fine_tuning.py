"""/openai/v1/fine_tuning/jobs: create, list (cursor pages), retrieve, cancel, pause, resume, and
a job's events and checkpoints (api/openai/jobs.py and events.py do the work)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from megatrain.api.deps import CurrentTenant, SessionDep, SettingsDep
from megatrain.api.openai import events, jobs
from megatrain.api.openai.models import fine_tuned_id
from megatrain.api.openai.schemas import CheckpointList, EventList, FineTuningJob, JobCreate, JobList
from megatrain.db.models import SUCCEEDED

router = APIRouter(prefix="/fine_tuning/jobs", tags=["openai: fine-tuning"])
After = Annotated[str | None, Query(max_length=128)]


@router.post("", response_model=FineTuningJob)
async def create_job(
    body: JobCreate, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> FineTuningJob:
    """A fine-tuning job on `training_file` from `model` (a registered model's name, or a
    fine-tuned model or checkpoint to continue from): method supervised or dpo, every "auto"
    resolved and reported back; `megatrain.training_method` lora or full (default: the operator's)."""
    return await run_in_threadpool(jobs.create_job, session, settings, tenant, body)


def _metadata_filter(request: Request) -> dict[str, str]:
    """metadata[KEY]=VALUE query parameters (the SDK's `metadata=` filter of list)."""
    out = {}
    for key, value in request.query_params.multi_items():
        if key.startswith("metadata[") and key.endswith("]"):
            out[key[len("metadata[") : -1]] = value
    return out


@router.get("", response_model=JobList)
def list_jobs(
    request: Request,
    session: SessionDep,
    tenant: CurrentTenant,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JobList:
    """The organization's fine-tuning jobs, newest first; `after` a job id for the next page."""
    data, more = jobs.list_jobs(session, tenant, after, limit, _metadata_filter(request))
    return JobList(data=data, has_more=more)


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJob)
def get_job(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant) -> FineTuningJob:
    ft, job = jobs.get_job(session, tenant, fine_tuning_job_id)
    return jobs.public_job(session, tenant, ft, job)


@router.post("/{fine_tuning_job_id}/cancel", response_model=FineTuningJob)
def cancel_job(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant) -> FineTuningJob:
    """Cancel a queued, running or paused job (409 once it has ended)."""
    return jobs.cancel_job(session, tenant, fine_tuning_job_id)


@router.post("/{fine_tuning_job_id}/pause", response_model=FineTuningJob)
def pause_job(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant) -> FineTuningJob:
    """Checkpoint and stop a running job (a queued one just waits), until it is resumed."""
    return jobs.pause_job(session, tenant, fine_tuning_job_id)


@router.post("/{fine_tuning_job_id}/resume", response_model=FineTuningJob)
def resume_job(fine_tuning_job_id: str, session: SessionDep, tenant: CurrentTenant) -> FineTuningJob:
    """Queue a paused job again; it continues from the checkpoint its pause saved."""
    return jobs.resume_job(session, tenant, fine_tuning_job_id)


@router.get("/{fine_tuning_job_id}/events", response_model=EventList)
def list_events(
    fine_tuning_job_id: str,
    session: SessionDep,
    tenant: CurrentTenant,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> EventList:
    """The job's events and metrics, newest first; `after` an event id for the next page."""
    ft, job = jobs.get_job(session, tenant, fine_tuning_job_id)
    model = (
        fine_tuned_id(ft, tenant.name) if job.status == SUCCEEDED and ft.model_deleted_at is None else None
    )
    data, more = events.list_events(session, ft, job, model, after, limit)
    return EventList(data=data, has_more=more)


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=CheckpointList)
def list_checkpoints(
    fine_tuning_job_id: str,
    session: SessionDep,
    tenant: CurrentTenant,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> Any:
    """The job's checkpoints, newest first, each usable as a model id with its step and metrics."""
    ft, job = jobs.get_job(session, tenant, fine_tuning_job_id)
    data, more = events.list_checkpoints(session, job, fine_tuned_id(ft, tenant.name), after, limit)
    first, last = (data[0].id, data[-1].id) if data else (None, None)
    return CheckpointList(data=data, has_more=more, first_id=first, last_id=last)
