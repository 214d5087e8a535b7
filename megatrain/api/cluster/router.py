"""/v1/cluster: pools, nodes, slots busy and free, and the queue with why each job waits."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from megatrain.api.cluster.service import cluster_view
from megatrain.api.deps import CurrentTenant, SessionDep
from megatrain.scheduler.placement import rule_items, rule_summary

router = APIRouter(prefix="/v1/cluster", tags=["cluster"])


@router.get("")
def get_cluster(session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    """`{"pools": [{name, accelerator, slot_kind, slots_total/used/free (ready nodes), nodes_lost,
    nodes_quarantined, hardware (the pool's description, GET /v1/pools), described_by, nodes:
    [{hostname, status (ready | lost | quarantined), slots_*, last_seen_at, lost_at,
    memory_free_bytes, health, quarantine_reason, goodput (seconds over the attempts placed on it:
    productive_s, queued_s, restart_s, checkpoint_stall_s, hang_s, preempt_s, eval_s, attempts,
    goodput; null before any), jobs}]}],
    "queue": [{position, own, pool, slots, priority, queued_at, reason, id?, name?}],
    "scheduling": {summary, rules: [{title, text}]}}`, the queue in scheduling order, which
    `scheduling` states in the placement module's own words. Other tenants' jobs are counted but
    never named."""
    rules = [{"title": r.title, "text": r.text} for r in rule_items()]
    return {**cluster_view(session, tenant), "scheduling": {"summary": rule_summary(), "rules": rules}}
