"""What placement decides on, read from the database in one go: the queue in (priority, FIFO) order,
each pool's ready nodes with their free room and the expected ends of the jobs holding it, and each
tenant's use and quota. The scheduling loop and the cluster view read the same snapshot, so what
`GET /v1/cluster` says is what the scheduler does."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.models import ACTIVE_STATES, QUEUED, Job, JobAllocation, Node, NodePool, Tenant
from megatrain.scheduler.placement import NodeRoom, QueuedJob, TenantRoom


@dataclass
class Snapshot:
    rows: list[Any]
    """The queued jobs' rows (id, name, pool, num_procs, priority, created_at, tenant_id,
    cancel_requested, status_reason, wait_reason, layout, max_runtime_s), in (priority, FIFO) order."""
    queue: list[QueuedJob]
    pools: dict[str, list[NodeRoom]]
    tenants: dict[str, TenantRoom]


def _max_runtime() -> Any:
    # resources.max_runtime_s inside the stored spec (json_extract on SQLite, #>> on PostgreSQL)
    return Job.spec["resources"]["max_runtime_s"].as_float()


def _group(layout: Any) -> int:
    """tp×cp of a stored layout: the ranks that must share a node."""
    if not isinstance(layout, dict):
        return 1
    tp, cp = layout.get("tp", 1), layout.get("cp", 1)
    return tp * cp if isinstance(tp, int) and isinstance(cp, int) and tp * cp >= 1 else 1


def expected_end_s(
    start: datetime | None,
    max_runtime_s: float | None,
    now: datetime,
    current_step: int = 0,
    total_steps: int = 0,
) -> float | None:
    """Seconds from `now` until an active job is expected to end: at its pace so far (time since
    it started over the steps it has done, times the steps left) once it has done some, never
    past its max_runtime_s; None when neither is known."""
    if start is None:
        return None
    elapsed = max(0.0, (now - start).total_seconds())
    ends = None if max_runtime_s is None else max(0.0, max_runtime_s - elapsed)
    if 0 < current_step < total_steps and elapsed > 0:
        at_pace = elapsed / current_step * (total_steps - current_step)
        ends = at_pace if ends is None else min(ends, at_pace)
    return ends


def read_snapshot(session: Session, now: datetime) -> Snapshot:
    rows = session.execute(
        select(
            Job.id, Job.name, Job.pool, Job.num_procs, Job.priority, Job.created_at, Job.tenant_id,
            Job.cancel_requested, Job.status_reason, Job.wait_reason, Job.layout, Job.avoid_nodes,
            _max_runtime().label("max_runtime_s"),
        )
        .where(Job.status == QUEUED, Job.paused_at.is_(None))  # a paused job waits for its resume
        .order_by(Job.priority.desc(), Job.created_at, Job.id)
    ).all()  # fmt: skip
    if not rows:
        return Snapshot([], [], {}, {})
    queue = [
        QueuedJob(
            r.id, r.pool, r.num_procs, bool(r.cancel_requested), tenant=r.tenant_id, priority=r.priority,
            group=_group(r.layout), max_runtime_s=r.max_runtime_s, avoid=frozenset(r.avoid_nodes or ()),
        )
        for r in rows
    ]  # fmt: skip
    nodes = session.execute(
        select(Node.id, Node.hostname, Node.slots_total, Node.slots_used, NodePool.name)
        .join(NodePool, NodePool.id == Node.pool_id)
        .where(Node.status == "ready")
        .order_by(Node.hostname)
    ).all()
    busy: dict[str, set[int]] = defaultdict(set)
    releases: dict[str, list[tuple[float, int]]] = defaultdict(list)
    used: dict[str, int] = defaultdict(int)
    active = session.execute(
        select(
            Job.id, Job.tenant_id, Job.node_id, Job.devices, Job.num_procs, Job.started_at,
            Job.scheduled_at, Job.current_step, Job.total_steps, _max_runtime().label("max_runtime_s"),
        ).where(Job.status.in_(ACTIVE_STATES))
    )  # fmt: skip
    # A gang's share of each node (job_allocation); other jobs hold their one node's devices.
    gang_shares: dict[str, list[tuple[str, list[int]]]] = defaultdict(list)
    for job_id, node_id, devices in session.execute(
        select(JobAllocation.job_id, JobAllocation.node_id, JobAllocation.devices)
        .join(Job, Job.id == JobAllocation.job_id)
        .where(Job.status.in_(ACTIVE_STATES))
    ):
        gang_shares[job_id].append((node_id, devices))
    for a in active:
        used[a.tenant_id] += a.num_procs
        if a.node_id is None:
            continue
        shares = gang_shares.get(a.id) or [(a.node_id, a.devices)]
        if a.started_at is not None:
            ends = expected_end_s(a.started_at, a.max_runtime_s, now, a.current_step, a.total_steps)
        else:  # scheduled, not started yet: all of its runtime is ahead of it
            ends = expected_end_s(a.scheduled_at, a.max_runtime_s, now)
        for node_id, devices in shares:
            busy[node_id].update(int(d) for d in devices or ())
            if ends is not None:
                releases[node_id].append((ends, len(devices) if a.id in gang_shares else a.num_procs))
    quotas = dict(
        session.execute(select(Tenant.id, Tenant.max_devices).where(Tenant.max_devices.is_not(None))).all()
    )
    pools: dict[str, list[NodeRoom]] = defaultdict(list)
    for n in nodes:
        room = NodeRoom(
            n.id, n.hostname, n.slots_total, n.slots_total - n.slots_used, frozenset(busy[n.id]),
            tuple(releases[n.id]),
        )  # fmt: skip
        pools[n.name].append(room)
    tenants = {t: TenantRoom(used=used.get(t, 0), quota=quotas.get(t)) for t in {*used, *quotas}}
    return Snapshot(list(rows), queue, dict(pools), tenants)
