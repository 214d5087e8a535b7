"""The job state machine: every state change is a guarded compare-and-set plus a job_event row.

API, scheduler and worker all change job state through these functions only. Each UPDATE names the
state it expects, so two schedulers (or an API cancel racing a runner) can never both win, on SQLite
or PostgreSQL, without holding locks across calls.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import ColumnElement, delete, select, update
from sqlalchemy.orm import Session

from megatrain.db.models import (
    ACTIVE_STATES,
    QUEUED,
    SCHEDULED,
    TERMINAL_STATES,
    Job,
    JobAllocation,
    JobEvent,
    Node,
    utcnow,
)
from megatrain.db.notify import notify_job


class _Attempts(Protocol):
    attempt: int
    max_retries: int
    preemptions: int
    continuations: int


NOT_PAUSED = Job.paused_at.is_(None)
"""Scheduling's guard: a job its user paused after the scheduler's snapshot stays queued (the
snapshot skips paused jobs; this closes the window between it and the UPDATE)."""


def failed_attempts(job: _Attempts) -> int:
    """The job's starts that did not end preempted or continued at a time limit (this one included,
    while it runs): what max_retries budgets."""
    # `or 0`: a row built in code and not flushed yet has no column defaults applied.
    return job.attempt - (job.preemptions or 0) - (job.continuations or 0)


def retry_allowed(job: _Attempts) -> bool:
    """Whether a failed attempt goes back to the queue (True) or ends the job (False).

    `attempt` counts starts, so a job with max_retries=2 and no preemptions runs at most three
    times; preempted and continued attempts are not failures and never spend max_retries.
    """
    return failed_attempts(job) <= job.max_retries


def record_event(
    session: Session,
    job_id: str,
    kind: str,
    reason: str = "",
    data: dict[str, Any] | None = None,
    from_status: str | None = None,
    to_status: str | None = None,
) -> None:
    session.add(
        JobEvent(
            job_id=job_id,
            kind=kind,
            reason=reason,
            data=data or {},
            from_status=from_status,
            to_status=to_status,
            created_at=utcnow(),
        )
    )


def _release_slots(session: Session, node_id: str | None, n: int) -> None:
    if node_id is not None:
        session.execute(update(Node).where(Node.id == node_id).values(slots_used=Node.slots_used - n))


def _release(session: Session, job_id: str, node_id: str | None, n: int) -> None:
    """Give a job's slots back: each node's share of a gang (and drop those rows), else the n slots
    on its one node."""
    shares = session.execute(
        select(JobAllocation.node_id, JobAllocation.slots).where(JobAllocation.job_id == job_id)
    ).all()
    if not shares:
        _release_slots(session, node_id, n)
        return
    for share in shares:
        _release_slots(session, share.node_id, share.slots)
    session.execute(delete(JobAllocation).where(JobAllocation.job_id == job_id))


def transition(
    session: Session,
    job_id: str,
    to_status: str,
    *,
    from_statuses: tuple[str, ...],
    reason: str = "",
    data: dict[str, Any] | None = None,
    only_if: ColumnElement[bool] | None = None,
    **fields: Any,
) -> bool:
    """Move a job to `to_status` if it is in one of `from_statuses` (and `only_if` holds, checked in
    the same UPDATE); False if someone else moved it, or changed it so that it no longer holds.

    Leaving an active state (scheduled/running) returns the job's slots and devices to its node in
    the same transaction. Every transition clears the queued job's wait reason. The caller commits.
    """
    row = session.execute(select(Job.status, Job.node_id, Job.num_procs).where(Job.id == job_id)).first()
    if row is None or row.status not in from_statuses:
        return False
    now = utcnow()
    values: dict[str, Any] = {
        "status": to_status,
        "status_reason": reason,
        "wait_reason": None,
        "updated_at": now,
        **fields,
    }
    if to_status in TERMINAL_STATES:
        values.setdefault("finished_at", now)
    leaving_active = row.status in ACTIVE_STATES and to_status not in ACTIVE_STATES
    if leaving_active:
        values["node_id"] = None
        values["devices"] = None
        values["preempt_for"] = None  # a preemption request ends with the attempt it was for
        values["serve_token"] = None  # and a model server's token with the server
    guarded = update(Job).where(Job.id == job_id, Job.status == row.status)
    if only_if is not None:
        guarded = guarded.where(only_if)
    result = session.execute(guarded.values(**values).execution_options(synchronize_session=False))
    if result.rowcount != 1:
        return False
    if leaving_active:
        _release(session, job_id, row.node_id, row.num_procs)
    record_event(session, job_id, to_status, reason, data, from_status=row.status, to_status=to_status)
    notify_job(session, job_id)  # a stream of a job that just ended ends at once
    return True


def devices_in_use(session: Session, node_id: str) -> set[int]:
    """Device indices held by the node's scheduled and running jobs (gangs' shares included)."""
    rows = session.scalars(
        select(Job.devices).where(Job.node_id == node_id, Job.status.in_(ACTIVE_STATES))
    ).all()
    shares = session.scalars(
        select(JobAllocation.devices)
        .join(Job, Job.id == JobAllocation.job_id)
        .where(JobAllocation.node_id == node_id, Job.status.in_(ACTIVE_STATES))
    ).all()
    return {int(d) for devices in [*rows, *shares] for d in devices or ()}


def reserve_and_schedule(
    session: Session, job_id: str, node_id: str, reason: str = "", devices: list[int] | None = None
) -> bool:
    """Take the job's slots (and `devices`) on a node and mark it scheduled, atomically; False if
    either fails.

    The slot UPDATE is guarded by capacity, the state UPDATE by the queued state. The devices are
    checked against the node's active jobs after the slot UPDATE: that UPDATE locks the node row
    (PostgreSQL) or the database (SQLite) until commit, so two schedulers that chose the same
    devices from stale snapshots cannot both pass. The caller commits on True and rolls back on False.
    """
    job = session.execute(select(Job.num_procs, Job.attempt).where(Job.id == job_id)).first()
    if job is None:
        return False
    got = session.execute(
        update(Node)
        .where(Node.id == node_id, Node.slots_used + job.num_procs <= Node.slots_total)
        .values(slots_used=Node.slots_used + job.num_procs)
        .execution_options(synchronize_session=False)
    )
    if got.rowcount != 1:
        return False
    if devices is not None and (
        len(devices) != job.num_procs or devices_in_use(session, node_id) & set(devices)
    ):
        return False
    return transition(
        session,
        job_id,
        SCHEDULED,
        from_statuses=(QUEUED,),
        reason=reason,
        data={"node_id": node_id, "devices": devices},
        node_id=node_id,
        devices=devices,
        scheduled_at=utcnow(),
        attempt=job.attempt + 1,
        cancel_requested=False,
        only_if=NOT_PAUSED,
    )


def reserve_gang(
    session: Session, job_id: str, shares: list[tuple[str, list[int]]], reason: str = ""
) -> bool:
    """Take a multi-node job's share of slots and devices on every node of `shares` ((node id,
    device indices), in node-rank order) and mark it scheduled, all in the caller's transaction;
    False if any node lacks the room or the devices, and the caller rolls back: a gang is never
    held in part. The job row names its first node and devices; job_allocation rows hold every
    node's share. Guards as in reserve_and_schedule, node by node."""
    job = session.execute(select(Job.num_procs, Job.attempt).where(Job.id == job_id)).first()
    if job is None or len(shares) < 2 or sum(len(d) for _, d in shares) != job.num_procs:
        return False
    # Nodes are locked in id order, so two schedulers reserving overlapping gangs cannot deadlock.
    for node_id, devices in sorted(shares):
        got = session.execute(
            update(Node)
            .where(Node.id == node_id, Node.slots_used + len(devices) <= Node.slots_total)
            .values(slots_used=Node.slots_used + len(devices))
            .execution_options(synchronize_session=False)
        )
        if got.rowcount != 1 or devices_in_use(session, node_id) & set(devices):
            return False
    first_node, first_devices = shares[0]
    if not transition(
        session,
        job_id,
        SCHEDULED,
        from_statuses=(QUEUED,),
        reason=reason,
        data={"nodes": [{"node_id": n, "devices": d} for n, d in shares]},
        node_id=first_node,
        devices=first_devices,
        scheduled_at=utcnow(),
        attempt=job.attempt + 1,
        cancel_requested=False,
        only_if=NOT_PAUSED,
    ):
        return False
    for rank, (node_id, devices) in enumerate(shares):
        session.add(
            JobAllocation(job_id=job_id, node_id=node_id, node_rank=rank, slots=len(devices), devices=devices)
        )
    session.flush()
    return True
