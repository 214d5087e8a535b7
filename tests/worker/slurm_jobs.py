"""Jobs through the API on a real Slurm (tests/fixtures/slurm.py): the `slurm_api` fixture (the API and
a scheduler with the slurm executor, on PostgreSQL) and what the tests of test_slurm_api.py and
test_slurm_faults.py drive it with. Imported by name (tests/worker/conftest.py provides the fixture)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fixtures.slurm import SlurmCluster
from sqlalchemy import select
from worker_helpers import wait_for

from megatrain.api.app import create_app
from megatrain.api.auth import create_api_key
from megatrain.db.models import Job, JobEvent
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import get_settings, reset_settings_cache
from megatrain.worker.slurm.commands import SlurmCli
from megatrain.worker.slurm.executor import SlurmExecutor

POOL = "slurm"
SlurmApi = tuple[TestClient, dict[str, str], Scheduler, Path]


@pytest.fixture
def slurm_api(
    db_url: str,
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[SlurmApi]:
    """The API and a scheduler with the slurm executor, on PostgreSQL (as in production; the runners
    reach it from the Slurm nodes); a corpus in an allowed data root."""
    pytest.importorskip("torch")
    if db_url.startswith("sqlite"):
        pytest.skip("one database is enough for these long runs: PostgreSQL, as in production")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    for name, value in {
        "ALLOWED_DATA_ROOTS": tmp_path.as_uri(),
        "EXECUTOR": "slurm",
        "POOL_NAME": POOL,
        "SLURM_PARTITION": slurm_cluster.partition,
        "HEARTBEAT_INTERVAL_S": "0.5",
    }.items():
        monkeypatch.setenv(f"MEGATRAIN_{name}", value)
    reset_settings_cache()
    settings = get_settings()
    corpus = tmp_path / "corpus.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 40
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))
    with session_scope(db_url) as s:
        key = create_api_key(s, "acme", "test")
    scheduler = Scheduler(settings, executor=SlurmExecutor(settings, SlurmCli(env=slurm_cluster.env)))
    scheduler.reconcile_once()  # the pool's nodes, from sinfo
    with TestClient(create_app(settings)) as client:
        yield client, {"Authorization": f"Bearer {key}"}, scheduler, corpus


def spec(corpus: Path, train_iters: int, **training: Any) -> dict[str, Any]:
    return {
        "name": "on-slurm",
        "model": {
            "arch": "llama",
            "num_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "seq_length": 32,
        },
        "data": {"tokenizer": {"type": "byte"}, "train": [{"path": corpus.as_uri()}], "split": "90,10,0"},
        "training": {
            "train_iters": train_iters,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "precision": "fp32",
            "log_interval": 1,
            "eval_interval": 0,
            "warmup_iters": 0,
            **training,
        },
        "resources": {"pool": POOL, "devices": 1, "max_runtime_s": 600},
    }


def drive(scheduler: Scheduler, url: str, job_id: str, until: Callable[[Job], bool], timeout: float) -> Job:
    """Tick the scheduler (follow Slurm, place, submit) until the job satisfies `until`."""

    def check() -> Job | None:
        scheduler.reconcile_once()
        scheduler.schedule_once()
        with session_scope(url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            s.expunge(job)
        return job if until(job) else None

    return wait_for(check, timeout, 1.0)


def events(url: str, job_id: str, kind: str) -> list[JobEvent]:
    with session_scope(url) as s:
        rows = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == kind).order_by(JobEvent.id)
        )
        events = list(rows)
        s.expunge_all()
        return events
