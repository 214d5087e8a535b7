"""A fine-tuning job's events and checkpoints in OpenAI's shape, paged newest first.

Events are our job's events (state changes, checkpoints, pauses) rendered as OpenAI's messages and
levels, and its metric rows as `metrics` events (`data`: step, train_loss or valid_loss,
total_steps), merged by time: each table read with its own keyset (created_at, table, id) past the
cursor, so a page costs two bounded queries however long the job ran.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from megatrain.api.openai import ids
from megatrain.api.openai.errors import openai_error
from megatrain.api.openai.schemas import CheckpointObject, JobEvent
from megatrain.db.fine_tuning import FineTuningJob
from megatrain.db.models import Checkpoint, Job, JobMetric
from megatrain.db.models import JobEvent as EventRow

_RANK = {"e": 1, "m": 0}
"""Order among rows of one instant: a job event after (newer than) a metric row."""
_TABLES = {"e": EventRow, "m": JobMetric}


def _level(row: EventRow) -> str:
    if row.kind == "failed":
        return "error"
    if (row.data or {}).get("level") == "warn" or (
        row.kind == "queued" and row.from_status in ("running", "scheduled")
    ):
        return "warn" if "paused" not in row.reason else "info"
    return "info"


def _message(row: EventRow, ft_id: str, model: str | None) -> str:
    step = (row.data or {}).get("step")
    match row.kind:
        case "queued" if row.reason == "submitted":
            return f"Created fine-tuning job: {ft_id}"
        case "running":
            attempt = (row.data or {}).get("attempt")
            return "Fine-tuning job started" + (f" (attempt {attempt})" if attempt and attempt > 1 else "")
        case "checkpoint_saved":
            return f"Checkpoint created at step {step}"
        case "succeeded":
            return "The job has successfully completed" + (
                f"; new fine-tuned model: {model}" if model else ""
            )
        case "failed":
            return f"The job failed: {row.reason}"
        case "cancelled":
            return "The job was cancelled" + (f": {row.reason}" if row.reason else "")
    return row.reason or row.kind.replace("_", " ")


VALID_FIGURES = (
    "valid_loss",
    "valid_mean_token_accuracy",
    "full_valid_loss",
    "full_valid_mean_token_accuracy",
)
"""OpenAI's names for validation figures, as the engine's validation rows carry them."""


def _metrics(row: JobMetric, total: int) -> tuple[str, dict[str, Any]]:
    values = row.data or {}
    if row.kind == "val":
        loss, key, what = values.get("val_loss", row.loss), "valid_loss", "validation"
    else:
        loss, key, what = row.loss if row.loss is not None else values.get("loss"), "train_loss", "training"
    data = {"step": row.step, key: loss, "total_steps": total}
    if isinstance(values.get("token_accuracy"), int | float):  # the engine's; DPO steps have none
        data["train_mean_token_accuracy"] = values["token_accuracy"]
    for name in VALID_FIGURES[1:]:  # a validation row's accuracy; at the end, the whole split's
        if row.kind == "val" and isinstance(values.get(name), int | float):
            data[name] = values[name]
    shown = f": {what} loss={loss:.4f}" if isinstance(loss, int | float) else ""
    return f"Step {row.step}/{total}{shown}", data


def _stamp(row: Any) -> int:
    return int(row.created_at.timestamp())


def _older(model: Any, table: str, cursor: tuple[Any, int, int]) -> Any:
    """Rows of `table` after the cursor (created_at, rank, id) in newest-first order."""
    created, rank, row_id = cursor
    mine = _RANK[table]
    same = model.created_at == created
    if mine < rank:
        later = same
    elif mine > rank:
        later = False
    else:
        later = and_(same, model.id < row_id)
    return or_(model.created_at < created, later)


def list_events(
    session: Session, ft: FineTuningJob, job: Job, model: str | None, after: str | None, limit: int
) -> tuple[list[JobEvent], bool]:
    """The job's events newest first, `limit` after the event `after` (404 for another job's)."""
    ft_id = ids.ft_job_id(job.id)
    cursor = None
    if after:
        parsed = ids.parse_event_id(after)
        table_row = None
        if parsed and parsed[0] == job.id:
            model_cls = _TABLES[parsed[1]]
            table_row = session.scalar(
                select(model_cls).where(model_cls.id == parsed[2], model_cls.job_id == job.id)
            )
        if table_row is None:
            raise openai_error(404, f"No such event of {ft_id}: {after[:80]}", param="after")
        cursor = (table_row.created_at, _RANK[parsed[1]], table_row.id)  # type: ignore[index]
    found: list[tuple[Any, str, Any]] = []
    for table, model_cls in _TABLES.items():
        q = select(model_cls).where(model_cls.job_id == job.id)
        if cursor is not None:
            q = q.where(_older(model_cls, table, cursor))
        rows = session.scalars(q.order_by(model_cls.created_at.desc(), model_cls.id.desc()).limit(limit + 1))
        found += [(r.created_at, table, r) for r in rows]
    found.sort(key=lambda f: (f[0], _RANK[f[1]], f[2].id), reverse=True)
    out = []
    for _, table, row in found[:limit]:
        if table == "m":
            message, data = _metrics(row, job.total_steps)
            kind, level = "metrics", "info"
        else:
            message, data, kind, level = _message(row, ft_id, model), row.data or {}, "message", _level(row)
        event_id = ids.event_id(job.id, table, row.id)
        out.append(
            JobEvent(id=event_id, created_at=_stamp(row), level=level, message=message, data=data, type=kind)
        )
    return out, len(found) > limit


def _checkpoint_metrics(session: Session, job_id: str, step: int) -> dict[str, float]:
    rows = session.execute(
        select(JobMetric.kind, JobMetric.loss, JobMetric.data).where(
            JobMetric.job_id == job_id, JobMetric.step == step
        )
    ).all()
    out: dict[str, float] = {"step": float(step)}
    for kind, loss, data in rows:
        if kind == "train" and loss is not None:
            out["train_loss"] = float(loss)
            if isinstance((data or {}).get("token_accuracy"), int | float):
                out["train_mean_token_accuracy"] = float(data["token_accuracy"])
        elif kind == "val" and (data or {}).get("val_loss") is not None:
            # An engine before full validation wrote val_loss alone: it stands for all of them.
            out["valid_loss"] = out["full_valid_loss"] = float(data["val_loss"])
            out |= {k: float(data[k]) for k in VALID_FIGURES[1:] if isinstance(data.get(k), int | float)}
    return out


def list_checkpoints(
    session: Session, job: Job, fine_tuned: str, after: str | None, limit: int
) -> tuple[list[CheckpointObject], bool]:
    """The job's checkpoints newest first, each a model id (ft:…:ckpt-step-N) with its metrics."""
    q = select(Checkpoint).where(Checkpoint.job_id == job.id)
    if after:
        parsed = ids.parse_checkpoint_id(after)
        if parsed is None or parsed[0] != job.id:
            raise openai_error(
                404, f"No such checkpoint of {ids.ft_job_id(job.id)}: {after[:80]}", param="after"
            )
        q = q.where(Checkpoint.step < parsed[1])
    rows = list(session.scalars(q.order_by(Checkpoint.step.desc()).limit(limit + 1)))
    data = [
        CheckpointObject(
            id=ids.checkpoint_id(job.id, c.step),
            created_at=_stamp(c),
            fine_tuned_model_checkpoint=ids.checkpoint_model(fine_tuned, c.step),
            fine_tuning_job_id=ids.ft_job_id(job.id),
            metrics=_checkpoint_metrics(session, job.id, c.step),
            step_number=c.step,
        )
        for c in rows[:limit]
    ]
    return data, len(rows) > limit
