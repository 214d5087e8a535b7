"""Export work for the scheduling loop: hand pending exports to the executor, recover lost ones.

As with datasets, the API's `pending` row is the enqueue: each tick marks the exports nobody handed
out yet as submitted (a guarded UPDATE: of several schedulers exactly one submits each) and asks
the executor to run them (worker.exports). An export whose worker stopped heartbeating (or whose
local process is gone) goes back to pending, or fails after MAX_EXPORT_ATTEMPTS.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

from sqlalchemy import select, update

from megatrain.db.models import FAILED, PENDING, RUNNING_EXPORT, CheckpointExport, utcnow
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.executors import Executor
from megatrain.worker.procs import pid_alive

log = logging.getLogger(__name__)

MAX_EXPORT_ATTEMPTS = 3
UNCLAIMED_RESUBMIT_S = 600.0
"""A handed-out export no worker has claimed for this long (and at least the heartbeat timeout) is
handed out again: its process may have died before claiming it. Deliveries are idempotent, so a
slow queue only gets a second message that does nothing."""
BATCH = 32
"""Exports one tick hands out at most (the rest wait for the next tick)."""


def dispatch_exports(settings: Settings, executor: Executor) -> list[str]:
    """Submit pending exports nobody has submitted yet; returns their ids."""
    url, row = settings.resolved_database_url, CheckpointExport
    with session_scope(url) as s:
        ids = s.scalars(
            select(row.id)
            .where(row.status == PENDING, row.submitted_at.is_(None))
            .order_by(row.created_at)
            .limit(BATCH)
        ).all()
    submitted = []
    for export_id in ids:
        with session_scope(url) as s:
            won = s.execute(
                update(row)
                .where(row.id == export_id, row.status == PENDING, row.submitted_at.is_(None))
                .values(submitted_at=utcnow())
                .execution_options(synchronize_session=False)
            )
        if won.rowcount != 1:
            continue  # another scheduler took it
        try:
            executor.submit_export(export_id)
            submitted.append(export_id)
        except Exception as exc:
            log.exception("executor could not start export %s", export_id)
            with session_scope(url) as s:
                s.execute(
                    update(row)
                    .where(row.id == export_id, row.status == PENDING)
                    .values(
                        status=FAILED,
                        error=f"executor could not start it: {exc}"[:2000],
                        finished_at=utcnow(),
                    )
                    .execution_options(synchronize_session=False)
                )
    return submitted


def _lost_why(exp: CheckpointExport, settings: Settings) -> str | None:
    if exp.runner_pid and exp.runner_host == socket.gethostname() and not pid_alive(exp.runner_pid):
        return f"worker pid {exp.runner_pid} on {exp.runner_host} is gone"
    last = exp.heartbeat_at or exp.updated_at
    if last is not None and utcnow() - last > timedelta(seconds=settings.heartbeat_timeout_s):
        return f"no heartbeat from {exp.runner_host} for {(utcnow() - last).total_seconds():.0f}s"
    return None


def reconcile_exports(settings: Settings) -> list[str]:
    """Requeue (or fail) running exports whose worker is lost, and hand out again the ones nobody
    claimed; returns their ids."""
    url, row = settings.resolved_database_url, CheckpointExport
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
        running = s.scalars(select(row).where(row.status == RUNNING_EXPORT)).all()
        lost = [(e.id, e.attempt, why) for e in running if (why := _lost_why(e, settings))]
    changed = list(unclaimed)
    for export_id, attempt, why in lost:
        if attempt < MAX_EXPORT_ATTEMPTS:
            values = {"status": PENDING, "submitted_at": None, "error": f"worker lost ({why}); retrying"}
        else:
            values = {"status": FAILED, "error": f"worker lost ({why}) on attempt {attempt}; giving up"}
            values["finished_at"] = utcnow()
        with session_scope(url) as s:
            done = s.execute(
                update(row)
                .where(row.id == export_id, row.status == RUNNING_EXPORT, row.attempt == attempt)
                .values(runner_pid=None, heartbeat_at=None, updated_at=utcnow(), **values)
                .execution_options(synchronize_session=False)
            )
        if done.rowcount == 1:
            log.warning("export %s: %s", export_id, values["error"])
            changed.append(export_id)
    return changed
