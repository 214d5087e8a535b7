"""Pool descriptions in the database: what an operator applied, what a worker measured, and what
the planner and placement read (`pool_for`).

An operator describes pools with `megatrain pools apply POOL.yaml` or MEGATRAIN_POOLS_FILE (read
when the stack or the scheduler starts): one PoolSpec mapping, or a list of them. An applied
description is stored on the pool's row (NodePool.spec, spec_source='operator') and wins over the
one a worker measured on registering (spec_source='measured', worker.nodes). No torch here: the
API serves these.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.db.models import Node, NodePool, utcnow
from megatrain.db.session import session_scope
from megatrain.plan.pool import PoolSpec, parse_pool
from megatrain.settings import Settings
from megatrain.spec_errors import SpecError

OPERATOR, MEASURED = "operator", "measured"


_RULE_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z0-9_]+)*) (?:must|is)\b")


def _parse_one(data: Any) -> PoolSpec:
    """parse_pool, with a cross-field rule's error named by the field its message names (pydantic
    names the whole model: 'spec')."""
    try:
        return parse_pool(data)
    except SpecError as exc:
        errors = []
        for e in exc.errors:
            named = _RULE_FIELD.match(e["message"]) if e["field"] in ("spec", "") else None
            errors.append({**e, "field": named.group(1)} if named else e)
        raise SpecError(errors) from None


def parse_pools(data: Any) -> list[PoolSpec]:
    """Pools from one mapping or a list of mappings; SpecError naming each bad field (a list's
    entries as `pools[i].field`), every entry checked."""
    if isinstance(data, dict):
        return [_parse_one(data)]
    if not isinstance(data, list) or not data:
        raise SpecError(
            [{"field": "pool", "message": "expected a pool (a mapping) or a non-empty list of them"}]
        )
    pools, problems = [], []
    for i, entry in enumerate(data):
        try:
            pools.append(_parse_one(entry))
        except SpecError as exc:
            problems += [{"field": f"pools[{i}].{e['field']}", "message": e["message"]} for e in exc.errors]
    names = [p.name for p in pools]
    problems += [
        {"field": "pools", "message": f"pool {n!r} is described twice"}
        for n in sorted({n for n in names if names.count(n) > 1})
    ]
    if problems:
        raise SpecError(problems)
    return pools


def load_pools(path: str | Path) -> list[PoolSpec]:
    """Pools from a YAML (or JSON) file; SpecError when it is unreadable or breaks a rule."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise SpecError(
            [{"field": "pool", "message": f"cannot read {path}: {exc.strerror or exc}"}]
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError([{"field": "pool", "message": f"not valid YAML/JSON: {exc}"}]) from None
    return parse_pools(data)


def apply_pool(session: Session, spec: PoolSpec) -> tuple[NodePool, bool]:
    """Store an operator's description of a pool (created if new); (row, created). The caller commits."""
    created = False
    pool = session.scalar(select(NodePool).where(NodePool.name == spec.name))
    if pool is None:
        try:
            with session.begin_nested():
                pool = NodePool(name=spec.name, accelerator=spec.accelerator[:32])
                session.add(pool)
            created = True
        except IntegrityError:  # another process created it meanwhile
            pool = session.scalar(select(NodePool).where(NodePool.name == spec.name))
            assert pool is not None
    pool.spec, pool.spec_source = spec.model_dump(mode="json"), OPERATOR
    if not session.scalar(select(Node.id).where(Node.pool_id == pool.id).limit(1)):
        pool.accelerator = spec.accelerator[:32]  # no worker has said what it runs on yet
    session.flush()
    return pool, created


def apply_pools_file(session: Session, settings: Settings) -> list[str]:
    """Apply MEGATRAIN_POOLS_FILE, if set; the names applied. ValueError naming the file and each
    bad field when it is invalid (the stack then refuses to start)."""
    if settings.pools_file is None:
        return []
    try:
        pools = load_pools(settings.pools_file)
    except SpecError as exc:
        raise ValueError(f"MEGATRAIN_POOLS_FILE={settings.pools_file} is invalid: {exc}") from None
    for spec in pools:
        apply_pool(session, spec)
    return [p.name for p in pools]


def describe(pool: NodePool, nodes: list[Node]) -> tuple[PoolSpec | None, str | None]:
    """(description, its source) of a pool with its nodes. An operator's stands as written; a
    measured one (of the node that registered it) is scaled to the ready nodes: devices per node the
    most any ready node offers, nodes their count, memory the smallest device among them."""
    ready = [n for n in nodes if n.status == "ready"]
    if pool.spec is not None:
        try:
            spec = PoolSpec.model_validate(pool.spec)
        except ValueError:
            spec = None  # a description written by an older schema: derive instead
        if spec is not None and pool.spec_source == OPERATOR:
            return spec, OPERATOR
        if spec is not None:
            if ready:
                memory = [n.device_memory_bytes for n in ready if n.device_memory_bytes]
                spec = spec.model_copy(
                    update={
                        "devices_per_node": max(n.slots_total for n in ready),
                        "nodes": len(ready),
                        "device_memory_bytes": min(memory, default=spec.device_memory_bytes),
                    }
                )
            return spec, MEASURED
    # No peak can be guessed from nodes alone: until a worker measures one, there is none.
    return None, None


def apply_pools_at_start(settings: Settings) -> list[str]:
    """`apply_pools_file` in a session of its own (the stack's and the scheduler's start)."""
    with session_scope(settings.resolved_database_url) as session:
        return apply_pools_file(session, settings)


def pool_for(session: Session, name: str) -> PoolSpec | None:
    """The description of pool `name`: the operator's, else the measured one scaled to its ready
    nodes; None for an unknown pool or one nobody has described or measured yet."""
    pool = session.scalar(select(NodePool).where(NodePool.name == name))
    if pool is None:
        return None
    nodes = list(session.scalars(select(Node).where(Node.pool_id == pool.id)))
    return describe(pool, nodes)[0]


def node_view(node: Node, now: Any = None) -> dict[str, Any]:
    """A node as GET /v1/pools and the CLI show it (hardware and liveness; no tenant data)."""
    now = now or utcnow()
    return {
        "hostname": node.hostname,
        "status": node.status,
        "devices": node.slots_total,
        "devices_used": node.slots_used,
        "devices_free": max(node.slots_total - node.slots_used, 0) if node.status == "ready" else 0,
        "devices_idle": node.devices_free,
        "device_memory_bytes": node.device_memory_bytes,
        "memory_free_bytes": node.memory_free_bytes,
        "health": node.health,
        "last_seen_at": node.last_seen_at,
        "seen_s_ago": round((now - node.last_seen_at).total_seconds(), 1) if node.last_seen_at else None,
        "lost_at": node.lost_at,
    }


def pool_view(pool: NodePool, nodes: list[Node]) -> dict[str, Any]:
    """A pool's hardware description and its live nodes (GET /v1/pools/{name}, `megatrain pools show`)."""
    spec, source = describe(pool, nodes)
    rows = [node_view(n) for n in sorted(nodes, key=lambda n: n.hostname)]
    ready = [r for r in rows if r["status"] == "ready"]
    return {
        "name": pool.name,
        "accelerator": pool.accelerator,
        "described_by": source,
        "spec": spec.model_dump(mode="json") if spec is not None else None,
        "nodes_ready": len(ready),
        "nodes_lost": sum(r["status"] == "lost" for r in rows),
        "devices_total": sum(r["devices"] for r in ready),
        "devices_free": sum(r["devices_free"] for r in ready),
        "nodes": rows,
    }


def pools_view(session: Session) -> list[dict[str, Any]]:
    """Every pool, by name, as `pool_view` shows it."""
    pools = session.scalars(select(NodePool).order_by(NodePool.name)).all()
    nodes = session.scalars(select(Node)).all()
    return [pool_view(p, [n for n in nodes if n.pool_id == p.id]) for p in pools]
