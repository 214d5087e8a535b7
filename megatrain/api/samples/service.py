"""Samples from a job's checkpoints: created as `pending` rows (the scheduler hands them to a worker,
worker.samples, which loads the checkpoint and generates), and read back."""

from __future__ import annotations

from fastapi import HTTPException
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from megatrain.api.checkpoints import service as checkpoints
from megatrain.api.samples.schemas import SampleCreate
from megatrain.db.models import FAILED, READY, CheckpointSample, Job
from megatrain.settings import Settings

LIST_LIMIT = 20


def create_sample(session: Session, settings: Settings, job: Job, body: SampleCreate) -> CheckpointSample:
    """A new pending sample of the checkpoint at `body.step` (the latest for None). 409 when the job
    has no checkpoint yet, 404 naming the steps it has for a missing step, 429 when the tenant has
    `max_pending_samples_per_tenant` samples waiting or running."""
    if not checkpoints.list_checkpoints(session, job.id):
        raise HTTPException(
            409, f"{checkpoints.no_checkpoints(job.id, job.status)}: there is nothing to sample from"
        )
    step = checkpoints.resolve_step(session, settings, job.id, body.step)
    limit = settings.max_pending_samples_per_tenant
    waiting = session.scalar(
        select(func.count())
        .select_from(CheckpointSample)
        .join(Job, Job.id == CheckpointSample.job_id)
        .where(Job.tenant_id == job.tenant_id, CheckpointSample.status.not_in((READY, FAILED)))
    )
    if (waiting or 0) >= limit:
        raise HTTPException(
            429, f"{waiting} samples are already waiting or running (max_pending_samples_per_tenant={limit})"
        )
    sample = CheckpointSample(job_id=job.id, step=step, **body.model_dump(exclude={"step"}))
    session.add(sample)
    session.commit()
    return sample


def list_samples(session: Session, job_id: str, limit: int = LIST_LIMIT) -> list[CheckpointSample]:
    """The job's last `limit` samples, newest first."""
    q = select(CheckpointSample).where(CheckpointSample.job_id == job_id)
    q = q.order_by(CheckpointSample.created_at.desc(), CheckpointSample.id.desc()).limit(limit)
    return list(session.scalars(q).all())


def get_sample(session: Session, job_id: str, sample_id: str) -> CheckpointSample:
    return checkpoints.get_task(session, CheckpointSample, job_id, sample_id, "sample")
