"""The goodput ledger and node quarantine, on the attempt_ledger table.

Every ended attempt adds one row (the shard runner writes it): where it ran, how it ended, and its
seconds split into productive time and each loss. A job's goodput is the sum of its rows; a node's
the sum of the rows of attempts placed on it. A node whose attempts failed with infrastructure
errors (crashes, hangs) `node_quarantine_failures` times within `node_quarantine_window_s` is
quarantined: placement skips it until an operator releases it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from megatrain.db.models import QUARANTINED, AttemptLedger, Node, utcnow
from megatrain.settings import Settings

LOSSES = ("queued_s", "restart_s", "checkpoint_stall_s", "hang_s", "preempt_s", "eval_s")
"""Where time goes besides productive_s (training steps), in the API's `goodput` object; eval_s is
evaluation between steps, asked for but not training."""
FIELDS = ("productive_s", *LOSSES)
NODE_FAULTS = ("infrastructure", "hung", "runner_lost")
"""Ledger failures that count toward a node's quarantine. A lost node's attempts ("node_lost") do
not: the node is out of placement already, and one loss would count once per job it ran."""


def record_attempt(
    session: Session,
    job_id: str,
    node_id: str | None,
    attempt: int,
    outcome: str,
    failure: str | None,
    seconds: dict[str, float],
) -> None:
    """Add an ended attempt's row (seconds: productive_s and each of LOSSES)."""
    values = {k: round(max(float(seconds.get(k, 0.0)), 0.0), 3) for k in FIELDS}
    session.add(
        AttemptLedger(
            job_id=job_id, node_id=node_id, attempt=attempt, outcome=outcome, failure=failure, **values
        )
    )
    session.flush()


def _summary(row: Any) -> dict[str, Any]:
    seconds = {k: round(float(getattr(row, k) or 0.0), 3) for k in FIELDS}
    total = sum(seconds.values())
    return seconds | {
        "attempts": int(row.attempts or 0),
        "goodput": round(seconds["productive_s"] / total, 4) if total > 0 else None,
    }


def _sums() -> list[Any]:
    return [func.sum(getattr(AttemptLedger, k)).label(k) for k in FIELDS] + [
        func.count(AttemptLedger.id).label("attempts")
    ]


def job_goodput(session: Session, job_id: str) -> dict[str, Any]:
    """productive_s, each loss, attempts and goodput (productive share; None before any attempt ends)."""
    row = session.execute(select(*_sums()).where(AttemptLedger.job_id == job_id)).one()
    return _summary(row)


def node_goodput(session: Session) -> dict[str, dict[str, Any]]:
    """The same per node id, for every node with an ended attempt, plus its recent failures count."""
    rows = session.execute(
        select(AttemptLedger.node_id, *_sums())
        .where(AttemptLedger.node_id.is_not(None))
        .group_by(AttemptLedger.node_id)
    ).all()
    return {r.node_id: _summary(r) for r in rows}


def quarantine_if_failing(
    session: Session, node_id: str, settings: Settings, now: datetime | None = None
) -> str | None:
    """Quarantine the node if its infrastructure failures within the window reached the limit; the
    reason if this call quarantined it (None if it is fine or was quarantined already)."""
    now = now or utcnow()
    window = settings.node_quarantine_window_s
    count = session.scalar(
        select(func.count(AttemptLedger.id)).where(
            AttemptLedger.node_id == node_id,
            AttemptLedger.failure.in_(NODE_FAULTS),
            AttemptLedger.ended_at >= now - timedelta(seconds=window),
        )
    )
    if (count or 0) < settings.node_quarantine_failures:
        return None
    reason = f"{count} attempts failed with infrastructure errors within {window:g} s"
    changed = session.execute(
        update(Node)
        .where(Node.id == node_id, Node.status != QUARANTINED)
        .values(status=QUARANTINED, quarantine_reason=reason)
        .execution_options(synchronize_session=False)
    ).rowcount
    return reason if changed else None


def release_node(session: Session, node_id: str) -> bool:
    """Lift a node's quarantine (an operator's decision): ready again, its failure count restarts
    (the earlier failures no longer count toward the next quarantine). False if not quarantined."""
    changed = session.execute(
        update(Node)
        .where(Node.id == node_id, Node.status == QUARANTINED)
        .values(status="ready", quarantine_reason=None, last_seen_at=utcnow())
        .execution_options(synchronize_session=False)
    ).rowcount
    if changed:
        session.execute(
            update(AttemptLedger)
            .where(AttemptLedger.node_id == node_id, AttemptLedger.failure.in_(NODE_FAULTS))
            .values(failure=None)
            .execution_options(synchronize_session=False)
        )
    return bool(changed)


def record_lost_attempt(
    session: Session,
    settings: Settings,
    job: Any,
    outcome: str,
    failure: str,
    now: datetime | None = None,
) -> str | None:
    """The ledger row of a running attempt the scheduler ended because its runner or node went
    silent (the runner wrote none): productive until its last heartbeat, the silence after it lost
    to the restart. Counts toward its node's quarantine; returns the quarantine reason if it began."""
    if job.started_at is None:
        return None  # never started: nothing ran, nothing to count against the node
    now = now or utcnow()
    last = job.heartbeat_at or job.started_at
    seconds = {
        "productive_s": (last - job.started_at).total_seconds(),
        "restart_s": (now - last).total_seconds(),
    }
    record_attempt(session, job.id, job.node_id, job.attempt, outcome, failure, seconds)
    if job.node_id is None or failure not in NODE_FAULTS:
        return None
    return quarantine_if_failing(session, job.node_id, settings, now)
