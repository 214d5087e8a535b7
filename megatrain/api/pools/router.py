"""/v1/pools: each pool's hardware description (accelerator, memory and peak TFLOP/s per device,
devices per node, bandwidths and latencies) and its live nodes (ready or lost, devices, free).

Any tenant may read them: hardware facts, no tenant data. Operators describe pools with
`megatrain pools apply` (or MEGATRAIN_POOLS_FILE); a pool nobody described shows what its worker
measured (`described_by`: operator | measured | null).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from sqlalchemy import select

from megatrain.api.deps import CurrentTenant, SessionDep
from megatrain.db.models import Node, NodePool
from megatrain.scheduler.pools import pool_view, pools_view

router = APIRouter(prefix="/v1/pools", tags=["pools"])


@router.get("")
def list_pools(session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    """`{"items": [{name, accelerator, described_by, spec, nodes_ready, nodes_lost, devices_total,
    devices_free, nodes: [{hostname, status, devices, devices_free, memory_free_bytes, health,
    last_seen_at, lost_at, …}]}]}`, by name."""
    del tenant  # any tenant may read the hardware
    return {"items": pools_view(session)}


@router.get("/{name}", responses={404: {"description": "No such pool"}})
def get_pool(name: str, session: SessionDep, tenant: CurrentTenant) -> dict[str, Any]:
    """One pool as in the list; 404 when no pool has that name."""
    del tenant
    pool = session.scalar(select(NodePool).where(NodePool.name == name))
    if pool is None:
        raise HTTPException(404, f"pool {name!r} does not exist")
    return pool_view(pool, list(session.scalars(select(Node).where(Node.pool_id == pool.id))))
