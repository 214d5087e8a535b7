"""Production's path for background checkpoint work: the scheduler sends exports and samples to the
pool's shared queue, which the pool's Celery worker consumes beside its node's own; a repeated
delivery is a no-op. A worker that holds only a node token (no database URL) does the same through
the API (/v1/node/tasks)."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.checkpoints import train_job_checkpoint
from fixtures.node_api import Api
from worker_helpers import add_row, get_row, wait_for

from megatrain.db.models import FAILED, PENDING, READY, CheckpointExport, CheckpointSample
from megatrain.db.node_tokens import create_node_token
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings

pytestmark = [pytest.mark.redis, pytest.mark.slow]

# kind: (table, the task's name in celery_app, the row's own columns, the Scheduler step)
KINDS: dict[str, tuple[Any, str, dict[str, Any], str]] = {
    "export": (CheckpointExport, "EXPORT_TASK_NAME", {"format": "hf", "dtype": "fp32"}, "exports_once"),
    "sample": (
        CheckpointSample,
        "SAMPLE_TASK_NAME",
        {"prompt": "def add", "max_new_tokens": 4},
        "samples_once",
    ),
}


@pytest.mark.parametrize(
    ("kind", "via"), [("export", "database"), ("sample", "database"), ("export", "node token")]
)
def test_a_celery_worker_runs_it_from_its_pools_queue(
    kind: str, via: str, settings: Settings, redis_url: str, make_job: Callable[..., str], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    import redis

    from megatrain.worker import celery_app
    from megatrain.worker.executors import CeleryExecutor, runner_env

    if via == "node token" and settings.resolved_database_url.startswith("sqlite"):
        pytest.skip("token nodes are a cluster's: PostgreSQL only (the path is the same on SQLite)")
    model, task_name, columns, step = KINDS[kind]
    pool = f"celery-{kind}-{uuid.uuid4().hex[:8]}"
    cfg = settings.model_copy(update={"executor": "celery", "redis_url": redis_url, "pool_name": pool})
    job_id = make_job(schedule=False)
    train_job_checkpoint(cfg, job_id, tmp_path / "train")
    ident = add_row(cfg, model, job_id=job_id, step=2, status=PENDING, **columns)
    env, api = runner_env(cfg), None
    if via == "node token":
        (tmp_path / "control").mkdir()
        api = Api(cfg.resolved_database_url, tmp_path / "control")
        api.start()
        with session_scope(cfg.resolved_database_url) as s:
            token = create_node_token(s, pool, "tok-node")[1]
        node = cfg.model_copy(update={"api_url": api.url, "node_token": token, "node_name": "tok-node"})
        # The node's own: its home, and the broker (runner_env gives a token's runners none).
        env = runner_env(node) | {"MEGATRAIN_HOME": str(tmp_path / "node"), "MEGATRAIN_REDIS_URL": redis_url}
        assert "MEGATRAIN_DATABASE_URL" not in env
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [sys.executable, "-m", "megatrain.worker.celery_app"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        # A task sent before the worker binds its queues is dropped by Redis' transport; a token
        # worker registers through the API first.
        wait_for(lambda: b" ready." in (tmp_path / "worker.log").read_bytes(), 60.0, interval=0.2)
        sched = Scheduler(cfg)
        assert isinstance(sched.executor, CeleryExecutor)
        assert getattr(sched, step)() == [ident]
        wait_for(lambda: get_row(cfg, model, ident).status in (READY, FAILED), 120.0, interval=0.2)
        row = get_row(cfg, model, ident)
        assert row.status == READY, row.error
        name = getattr(celery_app, task_name)
        again = sched.executor.app.send_task(name, args=[ident], queue=celery_app.datasets_queue(pool))
        assert again.get(timeout=30) is None
        assert get_row(cfg, model, ident).attempt == 1
        if api is not None:
            assert get_row(cfg, model, ident).runner_host == "tok-node"
            assert not (tmp_path / "node" / "megatrain.db").exists()
    finally:
        if api is not None:
            api.kill()
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"megatrain.{pool}*"):
            client.delete(key)
