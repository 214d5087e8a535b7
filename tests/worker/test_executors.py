"""Executors end to end with the fake engine: local subprocesses (incl. kill -9 recovery) and Celery."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from worker_helpers import alive, wait_for

from megatrain.db.models import (
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Checkpoint,
    Job,
    JobEvent,
    JobMetric,
    Node,
    NodePool,
)
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.worker.executors import CeleryExecutor, LocalExecutor, get_executor, runner_env


def _job(url: str, job_id: str) -> Job:
    with session_scope(url) as s:
        return s.get(Job, job_id)


def test_runner_env_carries_the_settings(settings: Settings) -> None:
    env = runner_env(settings.model_copy(update={"cpu_slots": 3}))
    assert env["MEGATRAIN_CPU_SLOTS"] == "3"
    assert env["MEGATRAIN_DATABASE_URL"] == settings.resolved_database_url
    assert env["MEGATRAIN_HOME"] == str(settings.home)
    assert isinstance(get_executor(settings), LocalExecutor)


@pytest.mark.slow
def test_local_runner_killed_is_requeued_and_resumes(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    job_id = make_job(schedule=False, train_iters=80, checkpoint_interval=5)
    sched = Scheduler(settings)
    assert sched.schedule_once() == [job_id]

    def checkpointed() -> bool:
        with session_scope(url) as s:
            return s.scalar(select(Checkpoint.step).where(Checkpoint.job_id == job_id)) is not None

    wait_for(checkpointed, 30)
    runner = _job(url, job_id).runner_pid
    engine = int((settings.runs_dir / job_id / "attempt-1" / "pids" / "rank0.pid").read_text())
    os.kill(runner, signal.SIGKILL)
    wait_for(lambda: not alive(engine), 10)  # the engine dies with its runner: no orphan
    # same host: the dead pid is noticed at once, no heartbeat timeout needed
    wait_for(lambda: job_id in sched.reconcile_once(), 10)
    job = _job(url, job_id)
    assert job.status == QUEUED and "retrying, will resume from checkpoint" in job.status_reason

    def finished() -> bool:
        sched.reconcile_once()
        sched.schedule_once()
        return _job(url, job_id).status == SUCCEEDED

    wait_for(finished, 45, interval=0.2)
    job = _job(url, job_id)
    assert job.attempt == 2 and job.current_step == 80
    with session_scope(url) as s:
        resumed = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "resumed")
        ).all()
        steps = s.scalars(
            select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
        ).all()
    assert len(resumed) == 1 and resumed[0].data["resumed_from"] >= 5
    assert steps == list(range(1, 81))
    assert (settings.runs_dir / job_id / "runner.log").stat().st_size > 0


@pytest.fixture
def celery_settings(settings: Settings, redis_url: str) -> Iterator[Settings]:
    pool = f"celery-{uuid.uuid4().hex[:8]}"
    yield settings.model_copy(update={"executor": "celery", "redis_url": redis_url, "pool_name": pool})
    import redis

    redis.Redis.from_url(redis_url).delete(f"megatrain.{pool}")


@pytest.mark.redis
@pytest.mark.slow
def test_celery_worker_runs_a_scheduled_job(
    celery_settings: Settings, make_job: Callable[..., str], fake_engine: Path, tmp_path: Path
) -> None:
    settings = celery_settings
    url = settings.resolved_database_url
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    worker = subprocess.Popen(
        [sys.executable, "-m", "megatrain.worker.celery_app"],
        env=runner_env(settings),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def registered() -> bool:
            with session_scope(url) as s:
                return (
                    s.scalar(select(Node.id).join(NodePool).where(NodePool.name == settings.pool_name))
                    is not None
                )

        wait_for(registered, 30)
        job_id = make_job(schedule=False, pool=settings.pool_name, train_iters=12, checkpoint_interval=4)
        sched = Scheduler(settings)
        assert isinstance(sched.executor, CeleryExecutor)
        assert sched.schedule_once() == [job_id]
        wait_for(lambda: _job(url, job_id).status == SUCCEEDED, 60, interval=0.2)
        job = _job(url, job_id)
        assert job.current_step == 12 and job.runner_pid == worker.pid
        with session_scope(url) as s:
            steps = s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)).all()
            events = len(s.scalars(select(JobEvent.id).where(JobEvent.job_id == job_id)).all())
        assert sorted(steps) == list(range(1, 13))
        # a second delivery of the same task is a no-op
        result = sched.executor.app.send_task(
            "megatrain.run_shard", args=[job_id], queue=f"megatrain.{settings.pool_name}"
        )
        assert result.get(timeout=30) is None
        with session_scope(url) as s:
            assert len(s.scalars(select(JobEvent.id).where(JobEvent.job_id == job_id)).all()) == events
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
    assert _job(url, job_id).status not in (QUEUED, RUNNING)
