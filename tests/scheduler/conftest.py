"""Fixtures for the scheduling loop: a seeded cluster and a recording executor."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from megatrain.db.models import Job, Node, NodePool, Tenant, utcnow
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings, reset_settings_cache


@pytest.fixture
def settings(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    # celery: the scheduler does not register this machine; the tests seed their own nodes
    monkeypatch.setenv("MEGATRAIN_EXECUTOR", "celery")
    monkeypatch.setenv("MEGATRAIN_HEARTBEAT_TIMEOUT_S", "5")
    reset_settings_cache()
    return get_settings()


@pytest.fixture
def add_node(settings: Settings) -> Callable[..., str]:
    def add(slots: int, pool: str = "default", hostname: str | None = None) -> str:
        with session_scope(settings.resolved_database_url) as s:
            np = s.query(NodePool).filter_by(name=pool).one_or_none() or NodePool(name=pool)
            s.add(np)
            s.flush()
            node = Node(
                pool_id=np.id, hostname=hostname or f"host-{s.query(Node).count()}", slots_total=slots
            )
            s.add(node)
            s.flush()
            return node.id

    return add


@pytest.fixture
def add_job(settings: Settings) -> Callable[..., str]:
    """Queued jobs; created_at increases with each call so FIFO order is the creation order."""
    base = utcnow() - timedelta(hours=1)
    counter = iter(range(1_000_000))

    def add(procs: int = 1, priority: int = 0, pool: str = "default", **fields: Any) -> str:
        with session_scope(settings.resolved_database_url) as s:
            tenant = s.query(Tenant).filter_by(name="acme").one_or_none() or Tenant(name="acme")
            s.add(tenant)
            s.flush()
            created: datetime = base + timedelta(seconds=next(counter))
            job = Job(
                tenant_id=tenant.id,
                name="j",
                kind="pretrain",
                spec={},
                spec_hash="x",
                layout={},
                num_procs=procs,
                priority=priority,
                pool=pool,
                created_at=created,
                **fields,
            )
            s.add(job)
            s.flush()
            return job.id

    return add
