"""Fine-tuning jobs: an OpenAI request becomes one of our jobs, submitted through the very service
/v1/jobs uses (api/jobs/service: every check, the planner, the scheduler, the dashboard), with a
fine_tuning_job row keeping what was asked; read back, listed, cancelled, paused and resumed.

Statuses: queued → queued (a paused job too: it waits in the queue, held), scheduled and running →
running, then succeeded, failed or cancelled. A pause asks a running job to checkpoint and stop
(the preemption path, worker/preempt) and holds it queued (Job.paused_at) until its resume, which
continues from that checkpoint.
"""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from megatrain.api.jobs import service as jobs
from megatrain.api.jobs.progress import job_pace
from megatrain.api.openai import ids, job_spec
from megatrain.api.openai.errors import openai_error
from megatrain.api.openai.files import find_file
from megatrain.api.openai.models import ModelRef, fine_tuned_id, resolve_model
from megatrain.api.openai.schemas import FineTuningJob as FineTuningJobOut
from megatrain.api.openai.schemas import JobCreate, JobError
from megatrain.db.fine_tuning import FineTuningJob
from megatrain.db.jobs import record_event
from megatrain.db.models import (
    ACTIVE_STATES,
    FAILED,
    QUEUED,
    SUCCEEDED,
    TERMINAL_STATES,
    Dataset,
    Job,
    JobMetric,
    Tenant,
    utcnow,
)
from megatrain.job_states import PAUSE_REQUEST
from megatrain.settings import Settings

STATUSES = {"queued": "queued", "scheduled": "running", "running": "running"}
"""Our job states as OpenAI's (the terminal ones are the same words)."""
FORMATS = {"supervised": ("chat", "prompt_completion"), "dpo": ("preference",)}


def _file(session: Session, tenant: Tenant, file_id: str, param: str, kind: str) -> Dataset:
    ds = find_file(session, tenant, file_id, param)
    if ds.record_format not in FORMATS[kind]:
        wanted = " or ".join(FORMATS[kind])
        raise openai_error(
            400, f"{param} {file_id} holds {ds.record_format} records; {kind} trains on {wanted}", param
        )
    return ds


def _base(
    ref: ModelRef, settings: Settings, req: JobCreate
) -> tuple[dict[str, Any], dict[str, Any], str, str, dict[str, Any]]:
    """(spec model section, data tokenizer and template, base model name, training method, the
    training section's adapter settings when it continues a LoRA fine-tune)."""
    ext = req.megatrain
    method = (ext.training_method if ext else None) or settings.openai_training_method
    if ref.registered is not None:
        m = ref.registered
        own = int(m.fields.get("seq_length") or job_spec.DEFAULT_MAX_SEQ_LENGTH)
        seq = (ext.seq_length if ext else None) or min(own, job_spec.DEFAULT_MAX_SEQ_LENGTH)
        model = {"init_from": f"hf:{m.name}", "seq_length": seq}
        return model, job_spec.tokenizer_and_template(m, settings), m.name, method, {}
    # Continuing from a fine-tuned model (or a checkpoint of one): its job's model, from that step.
    assert ref.ft is not None and ref.job is not None
    if ref.step is None:
        raise openai_error(400, f"{ref.id} has no checkpoint to continue from", param="model")
    prior = ref.job.spec
    data = {k: prior["data"].get(k) for k in ("tokenizer", "chat_template")}
    checkpoint = f"checkpoint:{ref.job.id}@{ref.step}"
    prior_method = prior["training"].get("method") or "full"
    if prior_method != "full":
        # Its checkpoint holds adapters: they train on, over the same base, shaped as they were.
        if ext is not None and ext.training_method not in (None, "lora"):
            raise openai_error(
                400,
                f"{ref.id} is a LoRA fine-tune: continuing it trains its adapters (training_method lora)",
                param="megatrain.training_method",
            )
        model = {**prior["model"], "adapter_from": checkpoint}
        adapters = {"method": prior_method, "lora": prior["training"].get("lora") or {}}
        return model, data, ref.ft.base_model, prior_method, adapters
    # A full checkpoint is a whole model: trained on in full (unless the request asks for LoRA
    # adapters over it), whatever the operator's default for a base.
    method = (ext.training_method if ext else None) or "full"
    model = {**prior["model"], "init_from": checkpoint}
    return model, data, ref.ft.base_model, method, {}


def _check_cap(session: Session, settings: Settings, tenant: Tenant) -> None:
    limit = settings.max_active_fine_tuning_jobs_per_tenant
    active = session.scalar(
        select(func.count())
        .select_from(FineTuningJob)
        .join(Job, Job.id == FineTuningJob.job_id)
        .where(FineTuningJob.tenant_id == tenant.id, Job.status.not_in(TERMINAL_STATES))
    )
    if (active or 0) >= limit:
        raise openai_error(
            429,
            f"{active} fine-tuning jobs are already queued or running for this organization (the "
            f"maximum is {limit}); retry once one has finished",
            retry_after="30",
        )


def create_job(session: Session, settings: Settings, tenant: Tenant, req: JobCreate) -> FineTuningJobOut:
    """Check the request, submit its job (SpecError: a 400 naming the spec field), record it."""
    kind = job_spec.method_type(req)
    _check_cap(session, settings, tenant)
    training = _file(session, tenant, req.training_file, "training_file", kind)
    validation = None
    if req.validation_file is not None:
        validation = _file(session, tenant, req.validation_file, "validation_file", kind)
    ref = resolve_model(session, tenant, req.model)
    model, data, base, method, adapters = _base(ref, settings, req)
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    name = f"ft-{req.suffix or base}"[:100]
    plan = job_spec.plan(req, settings, training, model, data, method, seed, name, validation, adapters)
    job, _ = jobs.submit_job(session, settings, tenant, plan.spec, None)
    ft = FineTuningJob(
        job_id=job.id,
        tenant_id=tenant.id,
        model=req.model,
        base_model=base,
        training_file=training.id,
        validation_file=req.validation_file,
        suffix=req.suffix,
        seed=seed,
        method=plan.method,
        training_method=method,
        integrations=[i.model_dump(exclude_none=True) for i in req.integrations or []],
        user_metadata=req.metadata,
        created_at=job.created_at,
    )
    session.add(ft)
    session.commit()
    return public_job(session, tenant, ft, job)


def get_job(session: Session, tenant: Tenant, ft_id: str) -> tuple[FineTuningJob, Job]:
    """The tenant's fine-tuning job; any other id is the same 404."""
    job_id = ids.job_id_of(ft_id)
    row = None
    if job_id is not None:
        row = session.execute(
            select(FineTuningJob, Job)
            .join(Job, Job.id == FineTuningJob.job_id)
            .where(FineTuningJob.job_id == job_id, FineTuningJob.tenant_id == tenant.id)
        ).first()
    if row is None:
        raise openai_error(404, f"No such fine-tuning job: {ft_id[:64]}", param="fine_tuning_job_id")
    return row[0], row[1]


def _trained_tokens(session: Session, job: Job) -> int | None:
    """Tokens the job trained on once it has finished: the records' tokens of every sample it
    consumed, epochs counted again, padding not (the engine's `trained_tokens` metric; a run logged
    before that metric existed counts whole rows)."""
    if job.status != SUCCEEDED:
        return None
    data = session.scalar(
        select(JobMetric.data)
        .where(JobMetric.job_id == job.id, JobMetric.kind == "train")
        .order_by(JobMetric.step.desc())
        .limit(1)
    )
    data = data or {}
    if isinstance(data.get("trained_tokens"), int):
        return int(data["trained_tokens"])
    rows = data.get("consumed_samples")
    return int(rows) * int(job.spec["model"]["seq_length"]) if isinstance(rows, int) else 0


def public_job(session: Session, tenant: Tenant, ft: FineTuningJob, job: Job) -> FineTuningJobOut:
    status = STATUSES.get(job.status, job.status)
    pace = job_pace(session, job)
    hp = dict(next(iter(v for k, v in ft.method.items() if k != "type"))["hyperparameters"])
    hp.pop("beta", None)  # (a dpo setting: in method.dpo alone)
    done = job.status in TERMINAL_STATES
    return FineTuningJobOut(
        id=ids.ft_job_id(job.id),
        created_at=int(ft.created_at.timestamp()),
        error=JobError(code="training_failed", message=job.status_reason or "the job failed")
        if job.status == FAILED
        else None,
        fine_tuned_model=fine_tuned_id(ft, tenant.name)
        if job.status == SUCCEEDED and ft.model_deleted_at is None
        else None,
        finished_at=int(job.finished_at.timestamp()) if done and job.finished_at else None,
        hyperparameters=hp,
        model=ft.model,
        organization_id=tenant.name,
        result_files=[],
        seed=ft.seed,
        status=status,  # type: ignore[arg-type]
        trained_tokens=_trained_tokens(session, job),
        training_file=ft.training_file,
        validation_file=ft.validation_file,
        estimated_finish=int(pace.eta_at.timestamp()) if pace and pace.eta_at else None,
        integrations=ft.integrations or None,
        metadata=ft.user_metadata,
        method=ft.method,
        megatrain={
            "job_id": job.id,
            "status": job.status,
            "status_reason": job.status_reason,
            "paused": job.paused_at is not None and not done,
            "training_method": ft.training_method,
        },
    )


def list_jobs(
    session: Session, tenant: Tenant, after: str | None, limit: int, metadata: dict[str, str]
) -> tuple[list[FineTuningJobOut], bool]:
    """The tenant's fine-tuning jobs, newest first, `limit` after the job `after`."""
    q = (
        select(FineTuningJob, Job)
        .join(Job, Job.id == FineTuningJob.job_id)
        .where(FineTuningJob.tenant_id == tenant.id)
    )
    if after:
        cursor, _ = get_job(session, tenant, after)
        older = FineTuningJob.created_at < cursor.created_at
        q = q.where(
            or_(
                older,
                and_(FineTuningJob.created_at == cursor.created_at, FineTuningJob.job_id < cursor.job_id),
            )
        )
    q = q.order_by(FineTuningJob.created_at.desc(), FineTuningJob.job_id.desc())
    if not metadata:
        rows = session.execute(q.limit(limit + 1)).all()
    else:  # (metadata is JSON: filtered here, over the tenant's jobs)
        rows = [r for r in session.execute(q).all() if metadata.items() <= (r[0].user_metadata or {}).items()]
        rows = rows[: limit + 1]
    return [public_job(session, tenant, ft, job) for ft, job in rows[:limit]], len(rows) > limit


def cancel_job(session: Session, tenant: Tenant, ft_id: str) -> FineTuningJobOut:
    ft, job = get_job(session, tenant, ft_id)
    job = jobs.cancel_job(session, tenant, job.id)  # 409 once it has ended
    return public_job(session, tenant, ft, job)


def pause_job(session: Session, tenant: Tenant, ft_id: str) -> FineTuningJobOut:
    """Hold the job: a queued one stays queued; a running one checkpoints, stops and is requeued
    held (its runner obeys preempt_for as it obeys a preemption). Pausing twice is no error."""
    ft, job = get_job(session, tenant, ft_id)
    if job.status in TERMINAL_STATES:
        raise openai_error(409, f"{ft_id} has already {job.status}; only a queued or running job pauses")
    if job.paused_at is None:
        now = utcnow()
        values: dict[str, Any] = {"paused_at": now, "updated_at": now}
        if job.status == QUEUED:
            values["status_reason"] = "paused by its user; resume it to run"
        done = session.execute(
            update(Job)
            .where(Job.id == job.id, Job.status.not_in(TERMINAL_STATES), Job.paused_at.is_(None))
            .values(**values)
            .execution_options(synchronize_session=False)
        )
        # Also asked to checkpoint and stop, should it be (or get) scheduled meanwhile: unless the
        # scheduler's own preemption already asked, which requeues it just the same.
        session.execute(
            update(Job)
            .where(Job.id == job.id, Job.preempt_for.is_(None))
            .values(preempt_for=PAUSE_REQUEST)
            .execution_options(synchronize_session=False)
        )
        if done.rowcount == 1:
            running = job.status in ACTIVE_STATES
            why = "pause requested: checkpointing and stopping" if running else "paused while queued"
            record_event(session, job.id, "pause_requested" if running else "paused", why)
        session.commit()
        session.refresh(job)
    return public_job(session, tenant, ft, job)


def resume_job(session: Session, tenant: Tenant, ft_id: str) -> FineTuningJobOut:
    """Let a paused job run again, from the checkpoint its pause saved (409 if it is not paused)."""
    ft, job = get_job(session, tenant, ft_id)
    if job.paused_at is None or job.status in TERMINAL_STATES:
        raise openai_error(409, f"{ft_id} is not paused")
    values: dict[str, Any] = {"paused_at": None, "updated_at": utcnow()}
    if job.status == QUEUED:
        values["status_reason"] = "waiting for the scheduler"
    session.execute(
        update(Job).where(Job.id == job.id).values(**values).execution_options(synchronize_session=False)
    )
    session.execute(
        update(Job)
        .where(Job.id == job.id, Job.preempt_for == PAUSE_REQUEST)
        .values(preempt_for=None)
        .execution_options(synchronize_session=False)
    )
    record_event(session, job.id, "resumed_by_user", "resumed by its user")
    session.commit()
    session.refresh(job)
    return public_job(session, tenant, ft, job)
