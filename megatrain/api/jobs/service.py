"""Jobs: validate and enqueue (by database state only; the scheduler picks queued jobs up), read,
cancel. Every state change goes through db.jobs.transition."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from datetime import datetime
from typing import Any

import yaml
from fastapi import HTTPException
from sqlalchemy import Row, and_, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.api.errors import FieldError
from megatrain.api.jobs.downsample import minmax_indices
from megatrain.api.jobs.progress import Pace
from megatrain.api.jobs.schemas import JobPublic, has_param_counts, param_counts
from megatrain.api.jobs.validation import JOB_ID_PATTERN, check_submission
from megatrain.db.jobs import record_event, transition
from megatrain.db.models import (
    ACTIVE_STATES,
    CANCELLED,
    JOB_STATES,
    QUEUED,
    TERMINAL_STATES,
    Job,
    JobEvent,
    JobLog,
    JobMetric,
    Tenant,
    new_id,
    utcnow,
)
from megatrain.settings import Settings
from megatrain.spec import JobSpec, dump_spec

YAML_TYPES = {"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"}
JSON_TYPES = {"", "application/json"}


# -- request bodies ---------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


MAX_BODY_DEPTH = 32
"""Nesting a job spec never needs (its deepest field is a few levels down)."""
MAX_BODY_NODES = 20_000
"""Values (scalars, lists, mappings) in one body: far above any real spec, far below a bomb."""


def _check_yaml_events(text: str) -> None:
    """Refuse aliases (a small document expanding into a huge one: "billion laughs"), nesting past
    MAX_BODY_DEPTH and more than MAX_BODY_NODES values from libyaml's event stream, stopping at the
    first broken bound: no Python object is built for a hostile body."""
    depth = count = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise FieldError("body", "YAML aliases (*name) are not accepted in a job spec")
        if isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            count += 1
            if count > MAX_BODY_NODES:
                raise FieldError("body", f"the body holds more than {MAX_BODY_NODES} values")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_BODY_DEPTH:
                raise FieldError("body", f"the body is nested deeper than {MAX_BODY_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _load_yaml(text: str) -> Any:
    """YAML through libyaml's C parser (PyYAML's pure-Python one takes seconds on hostile input),
    its events checked first, then built with the safe constructor."""
    _check_yaml_events(text)
    return yaml.load(text, Loader=yaml.CSafeLoader)


def _check_json_tree(data: Any) -> None:
    """The same depth and size bounds as YAML's, on parsed JSON (json's C parser is fast already)."""
    count = 0
    todo: list[tuple[Any, int]] = [(data, 1)]
    while todo:
        value, depth = todo.pop()
        count += 1
        if depth > MAX_BODY_DEPTH:
            raise FieldError("body", f"the body is nested deeper than {MAX_BODY_DEPTH} levels")
        if count > MAX_BODY_NODES:
            raise FieldError("body", f"the body holds more than {MAX_BODY_NODES} values")
        if isinstance(value, dict):
            todo += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            todo += [(v, depth + 1) for v in value]


def parse_body(raw: bytes, content_type: str) -> Any:
    """A request body as JSON (default) or YAML; unreadable bodies are 422s naming `body`.

    It takes milliseconds on any body the size limit lets through, but it is CPU work: the async
    handlers call it in a worker thread so the event loop keeps answering other requests."""
    ctype = content_type.split(";", 1)[0].strip().lower()
    if ctype not in JSON_TYPES and ctype not in YAML_TYPES and not ctype.endswith("+json"):
        raise HTTPException(
            415, f"unsupported Content-Type {ctype!r}: send application/json or application/yaml"
        )
    if not raw.strip():
        raise FieldError("body", "a job spec is required")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FieldError("body", "the body is not valid UTF-8") from None
    try:
        if ctype in YAML_TYPES:
            return _load_yaml(text)
        data = json.loads(text, parse_constant=_reject_constant)
        _check_json_tree(data)
        return data
    except RecursionError:
        raise FieldError("body", "the body is nested too deeply") from None
    except (ValueError, yaml.YAMLError) as exc:  # JSONDecodeError, over-long integers, NaN
        kind = "YAML" if ctype in YAML_TYPES else "JSON"
        raise FieldError("body", f"not valid {kind}: {str(exc)[:300]}") from None


# -- submission (its checks: validation.validate_submission) ----------------------------------


def spec_hash(spec: JobSpec) -> str:
    """Hash of the canonical spec (defaults filled, keys sorted): equal for equal requests."""
    return hashlib.sha256(dump_spec(spec).encode()).hexdigest()


def _replay(session: Session, tenant: Tenant, key: str, digest: str) -> Job | None:
    job = session.scalar(select(Job).where(Job.tenant_id == tenant.id, Job.idempotency_key == key))
    if job is not None and job.spec_hash != digest:
        raise HTTPException(
            409, f"Idempotency-Key {key!r} was already used for job {job.id} with a different spec"
        )
    return job


def submit_job(
    session: Session, settings: Settings, tenant: Tenant, data: Any, idempotency_key: str | None
) -> tuple[Job, bool]:
    """(job, created): a new queued job, or the earlier one for a repeated Idempotency-Key."""
    checked = check_submission(session, settings, tenant, data)
    spec, layout = checked.spec, checked.layout
    digest = spec_hash(spec)
    if idempotency_key is not None:
        existing = _replay(session, tenant, idempotency_key, digest)
        if existing is not None:
            return existing, False
    job = Job(
        id=new_id("job"),
        tenant_id=tenant.id,
        name=spec.name,
        kind=spec.kind,
        status=QUEUED,
        status_reason="waiting for the scheduler",
        spec=spec.model_dump(mode="json"),
        spec_hash=digest,
        idempotency_key=idempotency_key,
        priority=spec.resources.priority,
        pool=spec.resources.pool,
        layout=layout.as_dict(),
        num_procs=layout.world_size,
        max_retries=spec.resources.max_retries,
        max_preemptions=spec.resources.max_preemptions,
        total_steps=spec.training.train_iters,
    )
    session.add(job)
    try:
        session.flush()  # the job row exists before its event references it
        # The prediction rides in the submitted event (job.layout is the engine's, which reads no
        # more): the job page and `megatrain status` set it beside what the job measures.
        event = {"layout": layout.as_dict(), **({"plan": checked.plan} if checked.plan else {})}
        record_event(session, job.id, QUEUED, "submitted", event, to_status=QUEUED)
        session.commit()
    except IntegrityError:
        # A concurrent request with the same Idempotency-Key won the unique (tenant_id, key) race.
        session.rollback()
        if idempotency_key is None:
            raise
        existing = _replay(session, tenant, idempotency_key, digest)
        if existing is None:
            raise
        return existing, False
    return job, True


# -- reading ----------------------------------------------------------------------------------


def get_job(session: Session, tenant: Tenant, job_id: str) -> Job:
    """The tenant's job; any other id (malformed, missing, another tenant's) is the same 404."""
    job = None
    if JOB_ID_PATTERN.match(job_id):
        job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant.id))
    if job is None:
        raise HTTPException(404, f"job {job_id[:64]!r} not found")
    return job


def encode_cursor(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, job_id = json.loads(raw)
        return datetime.fromisoformat(created), str(job_id)
    except (binascii.Error, ValueError, TypeError):
        raise FieldError("cursor", "not a cursor this API returned") from None


def list_jobs(
    session: Session,
    tenant: Tenant,
    status: str | None,
    limit: int,
    cursor: str | None,
    with_spec: bool = True,
) -> tuple[list[Any], str | None]:
    """The tenant's jobs newest first, `limit` at a time, keyed on (created_at, id). Without
    `with_spec`, rows of the summary's columns (read as a Job's attributes are), the spec column left
    unread (decoding it was a list page's largest cost) but for the specs whose parameter estimates
    no answer has counted yet."""
    if status is not None and status not in JOB_STATES:
        raise FieldError("status", f"status={status!r} is not one of {', '.join(JOB_STATES)}")
    # A summary page reads its columns as plain rows: loading ORM objects was half its CPU.
    columns = [getattr(Job, name) for name in _SUMMARY_COLUMNS] if not with_spec else [Job]
    q = select(*columns).where(Job.tenant_id == tenant.id)
    if status is not None:
        q = q.where(Job.status == status)
    if cursor:
        created, job_id = decode_cursor(cursor)
        q = q.where(or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id)))
    q = q.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    rows = list(session.scalars(q).all() if with_spec else session.execute(q).all())
    page = rows[:limit]
    if not with_spec:
        _count_params(session, page)
    return page, encode_cursor(page[-1]) if len(rows) > limit else None


def _count_params(session: Session, jobs: list[Job]) -> None:
    """Count the parameters of the jobs' specs not counted before, reading those specs only."""
    missing = {j.id for j in jobs if not has_param_counts(j.spec_hash)}
    if missing:
        for digest, spec in session.execute(select(Job.spec_hash, Job.spec).where(Job.id.in_(missing))):
            param_counts(digest, spec)


# Past tense by state: "has already cancelled" would say the job cancelled something.
_ENDED = {
    "succeeded": "has already succeeded",
    "failed": "has already failed",
    "cancelled": "was already cancelled",
}


def cancel_job(session: Session, tenant: Tenant, job_id: str) -> Job:
    """Queued: cancelled now. Scheduled/running: `cancel_requested`, which the shard runner obeys.
    Terminal: 409. Retried when a concurrent change moved the job between our read and write."""
    job = get_job(session, tenant, job_id)
    for _ in range(5):
        status = session.scalar(select(Job.status).where(Job.id == job.id))
        if status == QUEUED:
            if transition(
                session, job.id, CANCELLED, from_statuses=(QUEUED,), reason="cancelled by the user"
            ):
                session.commit()
                break
        elif status in ACTIVE_STATES:
            asked = session.execute(
                update(Job)
                .where(Job.id == job.id, Job.status.in_(ACTIVE_STATES), Job.cancel_requested.is_(False))
                .values(cancel_requested=True, updated_at=utcnow())
                .execution_options(synchronize_session=False)
            )
            if asked.rowcount == 1:
                record_event(session, job.id, "cancel_requested", f"cancellation requested while {status}")
                session.commit()
                break
            if session.scalar(
                select(Job.cancel_requested).where(Job.id == job.id, Job.status.in_(ACTIVE_STATES))
            ):
                break  # asked before: cancelling twice is not an error
        elif status in TERMINAL_STATES:
            raise HTTPException(
                409,
                f"job {job.id} {_ENDED[status]}; only queued, scheduled or running jobs can be cancelled",
            )
        session.rollback()
    else:
        raise HTTPException(409, f"job {job.id} kept changing state; try cancelling again")
    session.refresh(job)
    return job


def list_events(session: Session, job_id: str) -> list[JobEvent]:
    q = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.created_at, JobEvent.id)
    return list(session.scalars(q).all())


def metric_row(row: JobMetric) -> dict[str, Any]:
    """The engine's row as it wrote it, plus the step and kind the database keys it by."""
    return {**(row.data or {}), "step": row.step, "kind": row.kind}


def list_metrics(
    session: Session, job_id: str, since_step: int | None, kind: str | None, limit: int
) -> list[dict[str, Any]]:
    q = select(JobMetric).where(JobMetric.job_id == job_id)
    if since_step is not None:
        q = q.where(JobMetric.step > since_step)
    if kind is not None:
        q = q.where(JobMetric.kind == kind)
    rows = session.scalars(q.order_by(JobMetric.step, JobMetric.kind).limit(limit)).all()
    return [metric_row(r) for r in rows]


def job_results(session: Session, job: Job) -> dict[str, Any]:
    """The job's lm-eval results: `tasks` {task: {metric: {value, stderr, n}}} at the latest step
    scored (an eval job's one, at step 0), and every scored step's in `history`."""
    rows = session.scalars(
        select(JobMetric).where(JobMetric.job_id == job.id, JobMetric.kind == "eval").order_by(JobMetric.step)
    ).all()
    history = [{"step": r.step, "tasks": (r.data or {}).get("eval", {})} for r in rows]
    latest = history[-1] if history else {"step": None, "tasks": {}}
    return {"job_id": job.id, "kind": job.kind, "status": job.status, **latest, "history": history}


ID_CHUNK = 1000


def list_metrics_downsampled(
    session: Session, job_id: str, since_step: int | None, kind: str | None, max_points: int
) -> tuple[list[dict[str, Any]], int]:
    """(rows, total): at most `max_points` rows per kind, chosen by min/max loss per step bucket
    (first and last always kept), in step order; `total` is how many rows matched.

    Only (id, kind, step, loss) of every row is read; the engine's JSON rows are loaded for the
    chosen ids alone, so 100,000 stored rows cost one narrow scan.
    """
    q = select(JobMetric.id, JobMetric.kind, JobMetric.step, JobMetric.loss).where(JobMetric.job_id == job_id)
    if since_step is not None:
        q = q.where(JobMetric.step > since_step)
    if kind is not None:
        q = q.where(JobMetric.kind == kind)
    narrow = session.execute(q.order_by(JobMetric.kind, JobMetric.step)).all()
    chosen: list[int] = []
    for k in ("train", "val"):
        series = [r for r in narrow if r.kind == k]
        chosen += [series[i].id for i in minmax_indices([r.loss for r in series], max_points)]
    rows: list[JobMetric] = []
    for start in range(0, len(chosen), ID_CHUNK):
        ids = chosen[start : start + ID_CHUNK]
        rows += session.scalars(select(JobMetric).where(JobMetric.id.in_(ids))).all()
    rows.sort(key=lambda r: (r.step, r.kind))
    return [metric_row(r) for r in rows], len(narrow)


def list_log_tail(session: Session, job_id: str, tail: int) -> list[JobLog]:
    """The job's last `tail` lines, oldest first."""
    q = select(JobLog).where(JobLog.job_id == job_id).order_by(JobLog.seq.desc()).limit(tail)
    return list(reversed(session.scalars(q).all()))


def public_job(job: Job | Row[Any], pace: Pace | None = None, with_spec: bool = True) -> JobPublic:
    """The job as the API answers it; `pace` (api.jobs.progress) adds a running job's ETA; without
    `with_spec`, a summary (a list page's: the spec is most of a job's bytes)."""
    # status_reason is written for the job's own tenant (the scheduler renders wait reasons from
    # data and names another tenant's job only by its place in the queue): nothing to redact.
    if with_spec:
        public = JobPublic.model_validate(job)
    else:  # the spec's column is not even read (list_jobs defers it): the estimates are cached
        summary = job._asdict() if isinstance(job, Row) else {k: getattr(job, k) for k in _SUMMARY_COLUMNS}
        public = JobPublic.model_validate(summary | {"spec": None})
    if pace is not None:
        update = {"step_time_s": pace.step_time_s, "eta_s": pace.eta_s, "eta_at": pace.eta_at}
        public = public.model_copy(update=update)
    return public


_SUMMARY_COLUMNS = [name for name in JobPublic.model_fields if name != "spec" and hasattr(Job, name)]


def list_logs(session: Session, job_id: str, after_seq: int, limit: int) -> list[JobLog]:
    q = (
        select(JobLog)
        .where(JobLog.job_id == job_id, JobLog.seq > after_seq)
        .order_by(JobLog.seq)
        .limit(limit)
    )
    return list(session.scalars(q).all())
