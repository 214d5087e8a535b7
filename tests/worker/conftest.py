"""Fixtures for runner/executor tests: the fake engine, a job factory, settings on the test database."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.cluster import seed_job, seed_node
from fixtures.slurm import slurm_cluster  # noqa: F401  (one test Slurm per worker process)
from fixtures.slurm_rest import slurm_rest  # noqa: F401
from slurm_jobs import slurm_api  # noqa: F401
from sqlalchemy import select
from worker_helpers import job_spec

from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import Node, NodePool
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings, reset_settings_cache
from megatrain.worker import oom

FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEGATRAIN_ENGINE_MODULE", str(FAKE_ENGINE))
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.01")
    return FAKE_ENGINE


@pytest.fixture
def oom_counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fabricated /proc and cgroup v2 tree for the runner's OOM kill counters (worker.oom), so
    no OOM kill elsewhere on this machine changes a verdict; returns the runner's cgroup's
    memory.events, whose oom_kill a test (or the fake engine, FAKE_ENGINE_OOM_COUNTER) bumps."""
    proc, cgroup = tmp_path / "oom-proc", tmp_path / "oom-cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/megatrain/runner\n")
    (proc / "vmstat").write_text("pgfault 100\noom_kill 7\n")
    events = cgroup / "megatrain" / "runner" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    monkeypatch.setattr(oom, "PROC", proc)
    monkeypatch.setattr(oom, "CGROUP_FS", cgroup)
    return events


@pytest.fixture
def settings(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("MEGATRAIN_HEARTBEAT_INTERVAL_S", "0.2")
    monkeypatch.setenv("MEGATRAIN_CPU_SLOTS", "4")
    # The seeded "testnode" never heartbeats: keep it ready through the longest runs here (node
    # liveness has its own tests in tests/scheduler/test_node_liveness.py).
    monkeypatch.setenv("MEGATRAIN_NODE_LOST_AFTER_S", "600")
    reset_settings_cache()
    return get_settings()


@pytest.fixture
def make_job(settings: Settings) -> Callable[..., str]:
    """Create a job (and its pool's node "testnode", 8 slots, on first use) and, unless
    schedule=False, reserve it: → scheduled."""
    url = settings.resolved_database_url

    def make(
        *, procs: int = 1, max_retries: int = 2, schedule: bool = True, pool: str = "default", **spec_kw: Any
    ) -> str:
        with session_scope(url) as s:
            node_id = s.scalar(select(Node.id).join(NodePool).where(NodePool.name == pool))
        if node_id is None:
            node_id = seed_node(url, 8, pool, "testnode")
        job_id = seed_job(
            url, procs, name="fake", spec=job_spec(**spec_kw), max_retries=max_retries, pool=pool
        )
        if schedule:
            with session_scope(url) as s:
                assert reserve_and_schedule(s, job_id, node_id, "test")
        return job_id

    return make
