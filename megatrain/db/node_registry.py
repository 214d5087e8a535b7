"""The nodes of the pools as their workers report them: a registration (`register_node`, what
worker.nodes.node_report measured), each heartbeat (`node_seen`), and a pool described by its
worker's measurement unless an operator described it. A worker holding the database URL calls these
itself; one holding a node token asks the API (api/node/router.py), which calls them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.db.models import QUARANTINED, Node, NodePool, utcnow


def apply_measured_spec(pool: NodePool, spec: dict[str, Any] | None) -> None:
    """Describe `pool` by a worker's measurement, unless an operator described it."""
    if pool.spec_source == "operator" or spec is None:
        return
    if pool.spec != spec or pool.spec_source != "measured":
        pool.spec, pool.spec_source = spec, "measured"


def register_node(session: Session, report: dict[str, Any]) -> Node:
    """Register (or refresh) the node a node_report describes; the caller commits. A lost node
    registering again is ready. Safe to call from several processes at once: a lost insert race is
    retried as a lookup."""
    pool_name, hostname = str(report["pool"]), str(report["node"])
    accelerator, slots = str(report["accelerator"]), int(report["slots"])
    for _ in range(3):
        pool = session.scalar(select(NodePool).where(NodePool.name == pool_name))
        if pool is None:
            try:
                with session.begin_nested():
                    pool = NodePool(name=pool_name, accelerator=accelerator)
                    session.add(pool)
            except IntegrityError:
                continue
        node = session.scalar(select(Node).where(Node.pool_id == pool.id, Node.hostname == hostname))
        if node is None:
            try:
                with session.begin_nested():
                    node = Node(pool_id=pool.id, hostname=hostname, slots_total=slots)
                    session.add(node)
            except IntegrityError:
                continue
        node.slots_total = slots
        node.device_memory_bytes = report.get("device_memory_bytes")
        node.packages = report.get("packages")
        node.last_seen_at = utcnow()
        if node.status != QUARANTINED:  # only an operator lifts a quarantine
            node.status = "ready"
        values = dict(report.get("heartbeat") or {})
        if values.get("devices_free") is None and accelerator == "cpu":
            values["devices_free"] = max(0, slots - (node.slots_used or 0))
        for column in ("devices_free", "memory_free_bytes", "health"):
            setattr(node, column, values.get(column))
        pool.accelerator = accelerator
        apply_measured_spec(pool, report.get("pool_spec"))
        session.flush()
        return node
    raise RuntimeError(f"could not register node {hostname} in pool {pool_name}")


def node_seen(
    session: Session, node_id: str, values: dict[str, Any], pool_spec: dict[str, Any] | None
) -> None:
    """One heartbeat of a worker's node: seen now, ready (a node marked lost comes back; a
    quarantined one stays so: only an operator lifts it), what it measured (`values`: devices free,
    free memory, health; a CPU node's free slots are the scheduler's count) and, once measured, its
    pool's description. The caller commits."""
    fields: dict[str, Any] = {k: values.get(k) for k in ("devices_free", "memory_free_bytes", "health")}
    if fields["devices_free"] is None:
        # A CPU node cannot see which slots are busy: the scheduler's count says.
        fields["devices_free"] = Node.slots_total - Node.slots_used
    session.execute(
        update(Node)
        .where(Node.id == node_id)
        .values(
            last_seen_at=utcnow(),
            status=case((Node.status == QUARANTINED, QUARANTINED), else_="ready"),
            **fields,
        )
        .execution_options(synchronize_session=False)
    )
    if pool_spec is not None:
        pool = session.scalar(
            select(NodePool).join(Node, Node.pool_id == NodePool.id).where(Node.id == node_id)
        )
        if pool is not None:
            apply_measured_spec(pool, pool_spec)
