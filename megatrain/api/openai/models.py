"""/openai/v1/models: a tenant's base models (our registered models, own and shared) and its
fine-tuned ones (succeeded fine-tuning jobs), in OpenAI's shape; `resolve_model` turns any model id
a request names (a base, a fine-tuned model, one of its checkpoints) into the rows behind it, for
fine-tuning (continuing from a model) and for serving it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from fastapi import APIRouter
from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.api.deps import CurrentTenant, SessionDep
from megatrain.api.models import service as registry
from megatrain.api.openai import ids
from megatrain.api.openai.errors import openai_error
from megatrain.api.openai.schemas import ModelDeleted, ModelList, ModelObject
from megatrain.api.registry import find_named
from megatrain.db.fine_tuning import FineTuningJob
from megatrain.db.models import SUCCEEDED, Checkpoint, Job, RegisteredModel, Tenant, utcnow

router = APIRouter(prefix="/models", tags=["openai: models"])
SHARED_OWNER = "system"
"""owned_by of a model the operator shared with every tenant."""


@dataclass
class ModelRef:
    """What a model id names: a registered model (`registered`), or a fine-tuning job's model
    (`ft`, `job`) at `step` (its latest checkpoint, or the checkpoint the id names)."""

    id: str
    registered: RegisteredModel | None = None
    ft: FineTuningJob | None = None
    job: Job | None = None
    step: int | None = None
    checkpoint: bool = False
    """The id names one checkpoint (ft:…:ckpt-step-N), not the fine-tuned model."""


def not_found(model: str, param: str | None = "model") -> Exception:
    return openai_error(
        404,
        f"The model {model[:200]!r} does not exist or you do not have access to it.",
        param=param,
        code="model_not_found",
    )


def fine_tuned_id(ft: FineTuningJob, tenant_name: str) -> str:
    return ids.fine_tuned_model(ft.base_model, tenant_name, ft.suffix, ft.job_id)


def latest_step(session: Session, job_id: str) -> int | None:
    return session.scalar(
        select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step.desc())
    )


def resolve_model(session: Session, tenant: Tenant, model: str, param: str | None = "model") -> ModelRef:
    """The model `model` names for the tenant; 404 (model_not_found) for any other id: unknown,
    another tenant's, deleted, a fine-tuning job that has not succeeded, a step without a checkpoint."""
    parsed = ids.parse_model(model)
    if parsed is None:
        found = find_named(session, RegisteredModel, tenant, model) if ":" not in model else None
        if found is None:
            raise not_found(model, param)
        return ModelRef(model, registered=found)
    row = session.execute(
        select(FineTuningJob, Job)
        .join(Job, Job.id == FineTuningJob.job_id)
        .where(FineTuningJob.job_id == parsed.job_id, FineTuningJob.tenant_id == tenant.id)
    ).first()
    if row is None or ids.parse_model(fine_tuned_id(row[0], tenant.name)) != ids.ModelId(
        parsed.base, parsed.tenant, parsed.suffix, parsed.job_id, None
    ):
        raise not_found(model, param)
    ft, job = row
    if parsed.step is None:
        if job.status != SUCCEEDED or ft.model_deleted_at is not None:
            raise not_found(model, param)
        return ModelRef(model, ft=ft, job=job, step=latest_step(session, job.id))
    has = session.scalar(
        select(Checkpoint.id).where(Checkpoint.job_id == job.id, Checkpoint.step == parsed.step)
    )
    if has is None or ft.model_deleted_at is not None:
        raise not_found(model, param)
    return ModelRef(model, ft=ft, job=job, step=parsed.step, checkpoint=True)


def _stamp(at: datetime | None) -> int:
    return int(at.timestamp()) if at is not None else 0


def public_model(ref: ModelRef, tenant: Tenant) -> ModelObject:
    if ref.registered is not None:
        m = ref.registered
        owner = tenant.name if m.tenant_id is not None else SHARED_OWNER
        return ModelObject(id=ref.id, created=_stamp(m.created_at), owned_by=owner)
    assert ref.job is not None
    return ModelObject(
        id=ref.id, created=_stamp(ref.job.finished_at or ref.job.created_at), owned_by=tenant.name
    )


@router.get("", response_model=ModelList)
def list_models(session: SessionDep, tenant: CurrentTenant) -> ModelList:
    """The base models (registered, own then shared, by name) and the fine-tuned ones (newest first)."""
    data = [
        public_model(ModelRef(m.name, registered=m), tenant) for m in registry.list_models(session, tenant)
    ]
    rows = session.execute(
        select(FineTuningJob, Job)
        .join(Job, Job.id == FineTuningJob.job_id)
        .where(
            FineTuningJob.tenant_id == tenant.id,
            FineTuningJob.model_deleted_at.is_(None),
            Job.status == SUCCEEDED,
        )
        .order_by(Job.finished_at.desc(), Job.id.desc())
    ).all()
    data += [
        public_model(ModelRef(fine_tuned_id(ft, tenant.name), ft=ft, job=job), tenant) for ft, job in rows
    ]
    return ModelList(data=data)


@router.get("/{model:path}", response_model=ModelObject)
def get_model(model: str, session: SessionDep, tenant: CurrentTenant) -> ModelObject:
    """A base model, a fine-tuned model or one of its checkpoints (ft:…:ckpt-step-N)."""
    return public_model(resolve_model(session, tenant, model, param=None), tenant)


@router.delete("/{model:path}", response_model=ModelDeleted)
def delete_model(model: str, session: SessionDep, tenant: CurrentTenant) -> ModelDeleted:
    """Delete a fine-tuned model (its job and checkpoints stay, on /v1), or forget one of the
    tenant's registered base models (a shared one: 403)."""
    ref = resolve_model(session, tenant, model, param=None)
    if ref.registered is not None:
        if ref.registered.tenant_id is None:
            raise openai_error(403, f"model {model!r} is shared by the operator; it cannot be deleted here")
        registry.delete_model(session, tenant, ref.registered.name)
    elif ref.checkpoint:
        raise openai_error(
            400, "a checkpoint goes with its fine-tuned model: delete that instead", param="model"
        )
    else:
        assert ref.ft is not None
        ref.ft.model_deleted_at = utcnow()
        session.commit()
    return ModelDeleted(id=model, deleted=True)
