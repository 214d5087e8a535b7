"""Fixtures for runner/executor tests: the fake engine, a job factory, settings on the test database."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from worker_helpers import job_spec

from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import Job, Node, NodePool, Tenant
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings, reset_settings_cache

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEGATRAIN_ENGINE_MODULE", str(FAKE_ENGINE))
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.01")
    return FAKE_ENGINE


@pytest.fixture
def settings(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("MEGATRAIN_HEARTBEAT_INTERVAL_S", "0.2")
    monkeypatch.setenv("MEGATRAIN_CPU_SLOTS", "4")
    reset_settings_cache()
    return get_settings()


@pytest.fixture
def make_job(settings: Settings) -> Callable[..., str]:
    """Create a job (and pool/node on first use) and, unless schedule=False, reserve it: → scheduled."""
    url = settings.resolved_database_url

    def make(
        *, procs: int = 1, max_retries: int = 2, schedule: bool = True, pool: str = "default", **spec_kw: Any
    ) -> str:
        with session_scope(url) as s:
            tenant = s.query(Tenant).filter_by(name="acme").one_or_none() or Tenant(name="acme")
            np = s.query(NodePool).filter_by(name=pool).one_or_none() or NodePool(name=pool)
            s.add_all([tenant, np])
            s.flush()
            node = s.query(Node).filter_by(pool_id=np.id).first()
            if node is None:
                node = Node(pool_id=np.id, hostname="testnode", slots_total=8)
                s.add(node)
            spec = job_spec(**spec_kw)
            job = Job(
                tenant_id=tenant.id,
                name="fake",
                kind="pretrain",
                spec=spec,
                spec_hash="x",
                layout={},
                num_procs=procs,
                max_retries=max_retries,
                pool=pool,
            )
            s.add(job)
            s.flush()
            job_id, node_id = job.id, node.id
        if schedule:
            with session_scope(url) as s:
                assert reserve_and_schedule(s, job_id, node_id, "test")
        return job_id

    return make
