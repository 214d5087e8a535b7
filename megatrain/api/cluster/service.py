"""The cluster as a tenant may see it: pools, nodes and their slots, and the queue in order.

Slot counts are aggregate (no tenant data); running and queued jobs of other tenants appear only as
anonymous entries (slots, priority, place in the queue), never with an id, name or spec. Why each
queued job waits is the scheduler's own decision (`scheduler.placement.place` on this snapshot),
rendered for this viewer: a blocking job of another tenant is named by its place in the queue.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.goodput import node_goodput
from megatrain.db.models import ACTIVE_STATES, QUARANTINED, Job, Node, NodePool, Tenant, utcnow
from megatrain.scheduler.placement import Decision, place
from megatrain.scheduler.pools import describe
from megatrain.scheduler.reasons import FITS_NEXT_TICK, WaitReason, render_wait
from megatrain.scheduler.snapshot import read_snapshot


def _why(decision: Decision, pool: str, positions: dict[str, tuple[int | None, bool]]) -> dict[str, Any]:
    """{"reason": text, "wait": data} for one queued job, as this viewer may see it: the blocking
    job's id only if the viewer owns it, else its place in the queue."""
    if decision.placement is not None:
        reason = WaitReason(FITS_NEXT_TICK, pool, hostname=decision.placement.hostname)
    else:
        assert decision.wait is not None
        reason = decision.wait
    data = reason.as_dict()
    position, own = positions.get(reason.job_id or "", (None, False))
    if reason.job_id is not None and not own:
        del data["job_id"]
        data["blocker_position"] = position
    text = render_wait(reason, owns_blocker=own, blocker_position=position)
    return {"reason": text, "wait": data}


def cluster_view(session: Session, tenant: Tenant, multi_node: bool = False) -> dict[str, Any]:
    """Pools, nodes and the queue as `tenant` may see them; `multi_node`: whether the executor runs
    jobs across nodes (the scheduler's own flag), so that gangs get the scheduler's reason."""
    pools = session.scalars(select(NodePool).order_by(NodePool.name)).all()
    nodes = session.scalars(select(Node).order_by(Node.hostname)).all()
    active = session.execute(
        select(Job.id, Job.name, Job.status, Job.node_id, Job.num_procs, Job.tenant_id, Job.devices).where(
            Job.status.in_(ACTIVE_STATES)
        )
    ).all()
    # Seconds only, summed over every tenant's attempts: no tenant data.
    goodput = node_goodput(session)
    on_node: dict[str, list[dict[str, Any]]] = {}
    for j in active:
        own = j.tenant_id == tenant.id
        entry: dict[str, Any] = {"own": own, "status": j.status, "slots": j.num_procs}
        if own:
            entry |= {"id": j.id, "name": j.name}
        on_node.setdefault(j.node_id or "", []).append(entry)

    pool_rows: list[dict[str, Any]] = []
    for pool in pools:
        members = [n for n in nodes if n.pool_id == pool.id]
        node_rows = []
        for n in members:
            free = max(n.slots_total - n.slots_used, 0)
            node_rows.append(
                {
                    "hostname": n.hostname,
                    "status": n.status,
                    "slots_total": n.slots_total,
                    "slots_used": n.slots_used,
                    "slots_free": free,
                    "last_seen_at": n.last_seen_at,
                    "lost_at": n.lost_at,
                    "devices_idle": n.devices_free,
                    "memory_free_bytes": n.memory_free_bytes,
                    "health": n.health,
                    "quarantine_reason": n.quarantine_reason,
                    "goodput": goodput.get(n.id),
                    "jobs": on_node.get(n.id, []),
                }
            )
        # A lost or quarantined node's slots are not offered: the totals count ready nodes only.
        ready = [r for r in node_rows if r["status"] == "ready"]
        spec, source = describe(pool, list(members))
        pool_rows.append(
            {
                "name": pool.name,
                "accelerator": pool.accelerator,
                "slot_kind": "CPU slots" if pool.accelerator == "cpu" else "GPUs",
                "slots_total": sum(r["slots_total"] for r in ready),
                "slots_used": sum(r["slots_used"] for r in ready),
                "slots_free": sum(r["slots_free"] for r in ready),
                "nodes_lost": sum(r["status"] == "lost" for r in node_rows),
                "nodes_quarantined": sum(r["status"] == QUARANTINED for r in node_rows),
                "hardware": spec.model_dump(mode="json") if spec is not None else None,
                "described_by": source,
                "nodes": node_rows,
            }
        )

    snap = read_snapshot(session, utcnow())
    decisions = place(snap.queue, snap.pools, snap.tenants, multi_node=multi_node)
    row_of = {q.id: q for q in snap.rows}
    # Each job's place in its pool's queue, as the scheduler stores it; the listing is in
    # scheduling order (priority, fair share between tenants, FIFO).
    positions = {d.job_id: (d.position, row_of[d.job_id].tenant_id == tenant.id) for d in decisions}
    queue = []
    for decision in decisions:
        q = row_of[decision.job_id]
        entry = {
            "position": decision.position,
            "own": q.tenant_id == tenant.id,
            "pool": q.pool,
            "slots": q.num_procs,
            "priority": q.priority,
            "queued_at": q.created_at,
            **_why(decision, q.pool, positions),
        }
        if entry["own"]:
            entry |= {"id": q.id, "name": q.name}
        queue.append(entry)
    return {"pools": pool_rows, "queue": queue}
