"""Production's path for background checkpoint work: the scheduler sends exports and samples to the
pool's shared queue, which the pool's Celery worker consumes beside its node's own; a repeated
delivery is a no-op."""

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
from worker_helpers import add_row, get_row, wait_for

from megatrain.db.models import FAILED, PENDING, READY, CheckpointExport, CheckpointSample
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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_celery_worker_runs_it_from_its_pools_queue(
    kind: str, settings: Settings, redis_url: str, make_job: Callable[..., str], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    import redis

    from megatrain.worker import celery_app
    from megatrain.worker.executors import CeleryExecutor, runner_env

    model, task_name, columns, step = KINDS[kind]
    pool = f"celery-{kind}-{uuid.uuid4().hex[:8]}"
    cfg = settings.model_copy(update={"executor": "celery", "redis_url": redis_url, "pool_name": pool})
    job_id = make_job(schedule=False)
    train_job_checkpoint(cfg, job_id, tmp_path / "train")
    ident = add_row(cfg, model, job_id=job_id, step=2, status=PENDING, **columns)
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [sys.executable, "-m", "megatrain.worker.celery_app"],
        env=runner_env(cfg), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
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
    finally:
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
