"""The scheduling side of work on one checkpoint that a worker runs in the background (exports,
samples): a table of rows pending → running → ready | failed, with the columns `status`,
`submitted_at`, `attempt`, `runner_host`, `runner_pid`, `heartbeat_at`, `error`, `created_at`,
`updated_at` and `finished_at`.

The API's `pending` row is the enqueue: each tick marks the rows nobody handed out yet as submitted
(a guarded UPDATE: of several schedulers exactly one submits each) and hands them to `submit`. A row
whose worker stopped heartbeating (or whose process the executor knows is gone) goes back to pending, or fails
after `max_attempts`; a row handed out but never claimed is handed out again after a while.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update

from megatrain.db.models import FAILED, PENDING, RUNNING_EXPORT, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.intake import Intake
from megatrain.settings import Settings
from megatrain.worker.executors import Executor

log = logging.getLogger(__name__)

RUNNING = RUNNING_EXPORT
UNCLAIMED_RESUBMIT_S = 600.0
"""A handed-out row no worker has claimed for this long (and at least the heartbeat timeout) is
handed out again: its process may have died before claiming it. Deliveries are idempotent, so a
slow queue only gets a second message that does nothing."""
BATCH = 32
"""Rows one tick hands out at most per table (the rest wait for the next tick)."""


def dispatch_pending(settings: Settings, row: Any, submit: Callable[[str], None], what: str) -> list[str]:
    """Submit the pending rows of table `row` nobody has submitted yet, oldest first; returns their
    ids. A row `submit` raises for fails with the reason (`what` names it in the log)."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        ids = s.scalars(
            select(row.id)
            .where(row.status == PENDING, row.submitted_at.is_(None))
            .order_by(row.created_at)
            .limit(BATCH)
        ).all()
    submitted = []
    for ident in ids:
        with session_scope(url) as s:
            won = s.execute(
                update(row)
                .where(row.id == ident, row.status == PENDING, row.submitted_at.is_(None))
                .values(submitted_at=utcnow())
                .execution_options(synchronize_session=False)
            )
        if won.rowcount != 1:
            continue  # another scheduler took it
        try:
            submit(ident)
            submitted.append(ident)
        except Exception as exc:
            log.exception("executor could not start %s %s", what, ident)
            with session_scope(url) as s:
                s.execute(
                    update(row)
                    .where(row.id == ident, row.status == PENDING)
                    .values(
                        status=FAILED,
                        error=f"executor could not start it: {exc}"[:2000],
                        finished_at=utcnow(),
                    )
                    .execution_options(synchronize_session=False)
                )
    return submitted


def worker_lost_why(task: Any, settings: Settings, executor: Executor, intake: Intake | None) -> str | None:
    """Why the worker of a running background row (a dataset, an export, a sample) is gone, or None:
    the executor's definite "its process is gone", else a heartbeat older than heartbeat_timeout_s,
    never judged while the control plane hears no node at all (scheduler.intake)."""
    if executor.worker_alive(task.runner_host, task.runner_pid) is False:
        return f"worker pid {task.runner_pid} on {task.runner_host} is gone"
    now = utcnow()
    if intake is not None and intake.deaf(now):
        return None
    last = task.heartbeat_at or task.updated_at
    if intake is not None:
        last = intake.heard_from(last)
    if last is not None and now - last > timedelta(seconds=settings.heartbeat_timeout_s):
        return f"no heartbeat from {task.runner_host} for {(now - last).total_seconds():.0f}s"
    return None


def reconcile_lost(
    settings: Settings,
    executor: Executor,
    row: Any,
    max_attempts: int,
    what: str,
    intake: Intake | None = None,
) -> list[str]:
    """Requeue (or fail, past `max_attempts`) the running rows of table `row` whose worker is lost
    (worker_lost_why), and hand out again the ones nobody claimed; returns their ids."""
    url = settings.resolved_database_url
    stale = utcnow() - timedelta(seconds=max(UNCLAIMED_RESUBMIT_S, settings.heartbeat_timeout_s))
    with session_scope(url) as s:
        unclaimed = s.scalars(
            update(row)
            .where(row.status == PENDING, row.submitted_at.is_not(None), row.submitted_at < stale)
            .values(submitted_at=None)
            .returning(row.id)
            .execution_options(synchronize_session=False)
        ).all()
    with session_scope(url) as s:
        running = s.scalars(select(row).where(row.status == RUNNING)).all()
        lost = [
            (t.id, t.attempt, why) for t in running if (why := worker_lost_why(t, settings, executor, intake))
        ]
    changed = list(unclaimed)
    for ident, attempt, why in lost:
        if attempt < max_attempts:
            values = {"status": PENDING, "submitted_at": None, "error": f"worker lost ({why}); retrying"}
        else:
            values = {"status": FAILED, "error": f"worker lost ({why}) on attempt {attempt}; giving up"}
            values["finished_at"] = utcnow()
        with session_scope(url) as s:
            done = s.execute(
                update(row)
                .where(row.id == ident, row.status == RUNNING, row.attempt == attempt)
                .values(runner_pid=None, heartbeat_at=None, updated_at=utcnow(), **values)
                .execution_options(synchronize_session=False)
            )
        if done.rowcount == 1:
            log.warning("%s %s: %s", what, ident, values["error"])
            changed.append(ident)
    return changed


@dataclass(frozen=True)
class CheckpointTaskKind:
    """One kind of background checkpoint work as the scheduling loop sees it."""

    row: Any
    """Its table (a CheckpointTaskColumns model)."""
    submit: str
    """The Executor method that starts one (by id)."""
    max_attempts: int
    what: str
    """Its name in the log."""

    def dispatch(self, settings: Settings, executor: Executor) -> list[str]:
        """Submit the pending rows nobody has submitted yet; returns their ids."""
        return dispatch_pending(settings, self.row, getattr(executor, self.submit), self.what)

    def reconcile(self, settings: Settings, executor: Executor, intake: Intake | None = None) -> list[str]:
        """Requeue (or fail) running rows whose worker is lost, and hand out again the ones nobody
        claimed; returns their ids."""
        return reconcile_lost(settings, executor, self.row, self.max_attempts, self.what, intake)
