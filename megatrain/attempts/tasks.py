"""Background work on a row (a dataset's preprocessing, a checkpoint's export, a sample), the control
plane's side: claim a pending row for one worker, keep its heartbeat and progress fresh, and write
its outcome only while the row is still that worker's attempt (scheduler.checkpoint_tasks and
scheduler.datasets may judge a silent worker lost and hand the row to another).

One piece of code whichever way a worker reaches it: on the database (worker.task_link.DbTasks) or
through the API's /v1/node/tasks routes with a node token (worker.task_link.HttpTasks). What a worker
may write is listed per kind: a node token can finish a task, not rewrite its row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from megatrain.db.models import (
    FAILED,
    PENDING,
    PROCESSING,
    READY,
    RUNNING_EXPORT,
    CheckpointExport,
    CheckpointSample,
    Dataset,
    utcnow,
)


@dataclass(frozen=True)
class TaskKind:
    model: Any
    status: str
    """The row's state column."""
    running: str
    """Its value while a worker has the row."""
    writable: frozenset[str]
    """The columns a worker sets (progress, outcome); besides them only the state and heartbeat."""


KINDS: dict[str, TaskKind] = {
    "dataset": TaskKind(
        Dataset, "state", PROCESSING,
        frozenset({"state_reason", "documents", "tokens", "vocab_size", "input_bytes", "output_bytes"}),
    ),
    "export": TaskKind(CheckpointExport, "status", RUNNING_EXPORT, frozenset({"uri", "size_bytes", "error"})),
    "sample": TaskKind(
        CheckpointSample, "status", RUNNING_EXPORT,
        frozenset({"text", "error", "prompt_tokens", "new_tokens", "elapsed_s"}),
    ),
}  # fmt: skip
OUTCOMES = (READY, FAILED)


class TaskValueError(ValueError):
    """A worker asked to write what it may not (a column not its kind's, an outcome not one of
    OUTCOMES)."""


def kind_of(name: str) -> TaskKind:
    if name not in KINDS:
        raise TaskValueError(f"unknown task kind {name!r} (one of {', '.join(KINDS)})")
    return KINDS[name]


def _check(kind: TaskKind, values: dict[str, Any]) -> None:
    extra = set(values) - kind.writable
    if extra:
        raise TaskValueError(f"a worker may not set {sorted(extra)} (only {sorted(kind.writable)})")


def _mine(kind: TaskKind, ident: str, attempt: int, host: str | None) -> list[Any]:
    m = kind.model
    where = [m.id == ident, getattr(m, kind.status) == kind.running, m.attempt == attempt]
    return where if host is None else [*where, m.runner_host == host]


def claim(
    session: Session, name: str, ident: str, host: str, pid: int, **values: Any
) -> tuple[int, dict[str, Any]] | None:
    """pending → running for the worker `host`/`pid`: (its attempt number, the row's columns), or
    None if the row was not pending (another delivery has it) or is gone."""
    kind = kind_of(name)
    _check(kind, values)
    m = kind.model
    state = getattr(m, kind.status)
    attempt = session.scalar(select(m.attempt).where(m.id == ident, state == PENDING))
    if attempt is None:
        return None
    now = utcnow()
    done = session.execute(
        update(m)
        .where(m.id == ident, state == PENDING, m.attempt == attempt)
        .values(
            {kind.status: kind.running, "attempt": attempt + 1, "runner_host": host, "runner_pid": pid,
             "heartbeat_at": now, "updated_at": now, **values}
        )
        .execution_options(synchronize_session=False)
    )  # fmt: skip
    if done.rowcount != 1:
        return None
    row = session.get(m, ident)
    if row is None:
        return None
    session.refresh(row)
    return attempt + 1, columns(row)


def columns(row: Any) -> dict[str, Any]:
    """The row's columns a worker reads (timestamps left out: the control plane keeps time)."""
    out = {}
    for col in row.__table__.columns:
        value = getattr(row, col.key)
        if not isinstance(value, datetime):
            out[col.key] = value
    return out


def beat(
    session: Session, name: str, ident: str, attempt: int, host: str | None = None, **values: Any
) -> bool:
    """Refresh the heartbeat (and write progress `values`) if the row is still this attempt's."""
    kind = kind_of(name)
    _check(kind, values)
    return _update(session, kind, ident, attempt, host, heartbeat_at=utcnow(), **values)


def finish(
    session: Session, name: str, ident: str, attempt: int, outcome: str, host: str | None = None,
    **values: Any,
) -> bool:  # fmt: skip
    """running → `outcome` (ready/failed) with `values`, if the row is still this attempt's; False
    if it is gone or was taken over."""
    kind = kind_of(name)
    _check(kind, values)
    if outcome not in OUTCOMES:
        raise TaskValueError(f"outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
    return _update(
        session, kind, ident, attempt, host, **{kind.status: outcome}, runner_pid=None,
        heartbeat_at=None, finished_at=utcnow(), **values,
    )  # fmt: skip


def exists(session: Session, name: str, ident: str) -> bool:
    m = kind_of(name).model
    return session.scalar(select(m.id).where(m.id == ident)) is not None


def _update(
    session: Session, kind: TaskKind, ident: str, attempt: int, host: str | None, **values: Any
) -> bool:
    done = session.execute(
        update(kind.model)
        .where(*_mine(kind, ident, attempt, host))
        .values(updated_at=utcnow(), **values)
        .execution_options(synchronize_session=False)
    )
    return bool(done.rowcount == 1)
