"""From a runner's reports to the database: idempotent metric/checkpoint inserts, events, logs.

Every write here is safe to repeat: metrics are unique on (job_id, kind, step) and checkpoints on
(job_id, step), so a restarted runner or a resumed attempt that re-reads or re-writes a step never
counts it twice.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.db.jobs import record_event
from megatrain.db.models import Checkpoint, Job, JobEvent, JobLog, JobMetric, utcnow
from megatrain.db.notify import notify_job

log = logging.getLogger(__name__)

MAX_LINE_CHARS = 8192


def _insert_ignoring_duplicates(
    session: Session, model: type, rows: list[dict[str, Any]], keys: list[str]
) -> int:
    """INSERT … ON CONFLICT DO NOTHING on PostgreSQL and SQLite; a savepoint per row elsewhere."""
    if not rows:
        return 0
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        stmt = insert(model).values(rows).on_conflict_do_nothing(index_elements=keys).returning(model.id)
        # RETURNING counts the rows really inserted (rowcount is -1 for multi-row inserts on psycopg).
        return len(session.execute(stmt).all())
    inserted = 0
    for row in rows:
        try:
            with session.begin_nested():
                session.add(model(**row))
            inserted += 1
        except IntegrityError:
            pass
    return inserted


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def ingest_metrics(session: Session, job_id: str, rows: list[dict[str, Any]]) -> int:
    """Store train/val/eval rows (first write of a step wins) and the job's latest figures; returns
    inserts. An eval row carries {"eval": {task: {metric: {value, stderr, n}}}}: an eval job's results
    (step 0), or scores during training at that step."""
    now = utcnow()
    records: dict[tuple[str, int], dict[str, Any]] = {}
    latest_train: dict[str, Any] | None = None
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int):
            continue
        kind = "eval" if isinstance(row.get("eval"), dict) else "val" if "val_loss" in row else "train"
        loss = _num(row.get("val_loss" if kind == "val" else "loss")) if kind != "eval" else None
        records.setdefault(
            (kind, step),
            {"job_id": job_id, "kind": kind, "step": step, "created_at": now, "loss": loss, "data": row},
        )
        if kind == "train":
            latest_train = row
    inserted = _insert_ignoring_duplicates(
        session, JobMetric, list(records.values()), ["job_id", "kind", "step"]
    )
    if inserted:
        notify_job(session, job_id)
    if latest_train is not None:
        # The newest line is the truth even after a resume rewound the step counter.
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                current_step=latest_train["step"],
                latest_loss=_num(latest_train.get("loss")),
                latest_tokens_per_s=_num(latest_train.get("tokens_per_s")),
                latest_mfu=_num(latest_train.get("mfu")),
            )
            .execution_options(synchronize_session=False)
        )
    return inserted


EVENT_DATA_KEYS = (
    "step",
    "num_params",
    "world_size",
    "layout",
    "device",
    "precision",
    "distributed_optimizer",
    "recompute",
    "compile",
    "memory_estimate",
    "resumed_from",
    "uri",
    "size_bytes",
    "steps",
    "reason",
    "url",
    "startup_s",
    "rank",
    "host",
    "ratio",
    "median_s",
    "tracker",
    "files",
)


def ingest_events(session: Session, job_id: str, rows: list[dict[str, Any]], attempt: int) -> None:
    """started → job_event (+ resumed, num_params); serving (a serve job listens) → job_event with
    its url; checkpoint_saved → checkpoint row + job_event;
    checkpoints_deleted (retention), checkpoint_corrupt, checkpoints_set_aside → those rows removed
    + job_event; straggler → job_event; warning (a tracker that stopped: the run went on without
    it) → job_event; profiled (training.profile_steps: traces written) → job_event.

    Rows are applied in file order, so a re-read that saves and then deletes a step ends deleted."""
    for row in rows:
        kind = row.get("event")
        data = {k: row[k] for k in EVENT_DATA_KEYS if k in row} | {"attempt": attempt}
        if kind == "started":
            if isinstance(row.get("num_params"), int):
                session.execute(update(Job).where(Job.id == job_id).values(num_params=row["num_params"]))
            record_event(session, job_id, "started", f"engine started on {row.get('device', '?')}", data)
            if row.get("resumed_from") is not None:
                record_event(session, job_id, "resumed", f"resumed from step {row['resumed_from']}", data)
        elif kind == "checkpoint_saved" and isinstance(row.get("step"), int):
            if _deleted_since(session, job_id, row["step"], attempt):
                continue  # a re-read of a save whose checkpoint retention has deleted since
            new = _insert_ignoring_duplicates(
                session,
                Checkpoint,
                [
                    {
                        "job_id": job_id,
                        "step": row["step"],
                        "uri": str(row.get("uri", "")),
                        "size_bytes": int(row.get("size_bytes") or 0),
                        "created_at": utcnow(),
                    }
                ],
                ["job_id", "step"],
            )
            if new:
                record_event(session, job_id, "checkpoint_saved", f"checkpoint at step {row['step']}", data)
        elif kind == "checkpoints_deleted" and isinstance(row.get("steps"), list):
            _delete_checkpoints(session, job_id, row["steps"], data)
        elif kind == "checkpoint_corrupt":
            step, why = row.get("step"), str(row.get("reason") or "unknown reason")
            if isinstance(step, int):
                _unlist(session, job_id, [step])  # never offered for download or init_from again
            record_event(
                session, job_id, "checkpoint_corrupt", f"checkpoint at step {step} skipped: {why}", data
            )
        elif kind == "checkpoints_set_aside" and isinstance(row.get("steps"), list):
            _unlist(session, job_id, row["steps"])
            steps = ", ".join(str(s) for s in row["steps"])
            reason = f"every checkpoint was corrupt (steps {steps}): set aside, the next attempt starts over"
            record_event(session, job_id, "checkpoints_set_aside", reason, data)
        elif kind == "serving" and isinstance(row.get("url"), str):
            # A serve job's model server listens: the API proxies its model's requests there.
            record_event(session, job_id, "serving", f"serving at {row['url']}", data)
        elif kind == "straggler" and isinstance(row.get("rank"), int):
            # A rank persistently slower than its peers (engine.stragglers): named on the job.
            record_event(session, job_id, "straggler", str(row.get("reason") or "")[:1000], data)
        elif kind == "warning" and isinstance(row.get("tracker"), str):
            why = str(row.get("reason") or "unknown reason")
            record_event(session, job_id, "warning", f"{row['tracker']} tracking stopped: {why}"[:1000], data)
        elif kind == "profiled" and isinstance(row.get("files"), list) and isinstance(row.get("steps"), list):
            # training.profile_steps: the traces lie next to the checkpoints (GET .../profile).
            first, last = (row["steps"] + [None, None])[:2]
            record_event(session, job_id, "profiled", f"profile of steps {first}-{last} written", data)
        elif kind == "finished":
            record_event(session, job_id, "info", f"engine finished at step {row.get('step')}", data)


_UNLISTING = ("checkpoints_deleted", "checkpoint_corrupt", "checkpoints_set_aside")


def _deleted_since(session: Session, job_id: str, step: int, attempt: int) -> bool:
    """Whether retention deleted `step` in this attempt or a later one, or a later attempt found it
    corrupt (so a save read again, e.g. by a backfill of an earlier attempt's files, must not bring
    the row back). A step saved anew after that (a resume below it) is a new checkpoint; a corrupt
    one is found as its attempt starts, before any save of that attempt."""
    rows = session.execute(
        select(JobEvent.kind, JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind.in_(_UNLISTING))
    )
    for kind, data in rows:
        steps = data.get("steps") or ([data["step"]] if "step" in data else [])
        when = int(data.get("attempt") or 0)
        if step in steps and (when >= attempt if kind == "checkpoints_deleted" else when > attempt):
            return True
    return False


def _unlist(session: Session, job_id: str, steps: list[Any]) -> list[int]:
    """Remove the rows of `steps` (integers only); the steps that were listed."""
    wanted = sorted({s for s in steps if isinstance(s, int) and not isinstance(s, bool)})
    if not wanted:
        return []
    return sorted(
        session.scalars(
            delete(Checkpoint)
            .where(Checkpoint.job_id == job_id, Checkpoint.step.in_(wanted))
            .returning(Checkpoint.step)
            .execution_options(synchronize_session=False)
        ).all()
    )


def _delete_checkpoints(session: Session, job_id: str, steps: list[Any], data: dict[str, Any]) -> None:
    """Drop the rows of checkpoints the engine's retention deleted from storage; one event naming
    the steps that were still listed (none on a re-read: nothing is recorded twice)."""
    gone = _unlist(session, job_id, steps)
    if gone:
        listed = ", ".join(str(s) for s in sorted(gone))
        record_event(
            session, job_id, "checkpoints_deleted", f"retention deleted checkpoints at steps {listed}",
            data | {"steps": sorted(gone)},
        )  # fmt: skip


def next_log_seq(session: Session, job_id: str) -> int:
    """The seq after the job's last stored line, so numbering carries on across attempts."""
    return (session.scalar(select(func.max(JobLog.seq)).where(JobLog.job_id == job_id)) or 0) + 1


def append_logs(session: Session, job_id: str, lines: list[str], first_seq: int, max_lines: int) -> int:
    """Insert lines numbered from first_seq, drop the job's lines older than the last max_lines;
    returns the next seq."""
    if not lines:
        return first_seq
    now = utcnow()
    session.execute(
        JobLog.__table__.insert(),
        [
            {"job_id": job_id, "seq": first_seq + i, "created_at": now, "line": line[:MAX_LINE_CHARS]}
            for i, line in enumerate(lines)
        ],
    )
    next_seq = first_seq + len(lines)
    notify_job(session, job_id)
    session.execute(delete(JobLog).where(JobLog.job_id == job_id, JobLog.seq < next_seq - max_lines))
    return next_seq
