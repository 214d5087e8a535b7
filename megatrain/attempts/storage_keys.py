"""An attempt's scoped object-store key (megatrain.storage_scope), as its runner asks for it: through
the API with a node token, or on its own database connection."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from megatrain.db.models import Job, Tenant
from megatrain.job_states import ACTIVE_STATES
from megatrain.settings import Settings
from megatrain.spec import JobSpec
from megatrain.storage_scope import assume, job_scope


class NoStorageKey(RuntimeError):
    """The attempt is over (or another one runs), or this control plane hands out no scoped keys."""


def attempt_storage_key(session: Session, settings: Settings, job_id: str, attempt: int) -> dict[str, Any]:
    """A fresh key for attempt `attempt` of `job_id` while it is scheduled or running; NoStorageKey
    otherwise. StorageScopeError when the scope does not fit a session policy; botocore's errors
    when STS refuses."""
    if settings.storage_role_arn is None:
        raise NoStorageKey("no scoped storage keys here (MEGATRAIN_STORAGE_ROLE_ARN is unset)")
    job = session.get(Job, job_id)
    if job is None or job.status not in ACTIVE_STATES or job.attempt != attempt:
        raise NoStorageKey(f"attempt {attempt} of job {job_id} is not the job's current attempt")
    tenant = session.get(Tenant, job.tenant_id)
    assert tenant is not None  # a job's tenant outlives it (ondelete cascade)
    scope = job_scope(settings, job.id, tenant.name, JobSpec.model_validate(job.spec))
    return assume(settings, job.id, attempt, scope)
