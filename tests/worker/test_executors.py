"""Executors end to end with the fake engine: local subprocesses (incl. kill -9 recovery) and Celery."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fixtures.celery import celery_worker
from sqlalchemy import select, update
from worker_helpers import alive, wait_for

from megatrain.db.models import (
    FAILED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    Checkpoint,
    Job,
    JobEvent,
    JobMetric,
    Node,
    NodePool,
    utcnow,
)
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.worker.celery_app import queue_name, worker_slots
from megatrain.worker.executors import CeleryExecutor, LocalExecutor, get_executor, runner_env
from megatrain.worker.nodes import ensure_local_pool


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


def test_local_executor_knows_a_dead_runner_on_this_host(settings: Settings) -> None:
    ex = LocalExecutor(settings)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    assert ex.runner_alive(Job(id="j", runner_host=here, runner_pid=dead.pid)) is False
    # a live pid may still hang (heartbeats judge it); another host's pid means nothing here
    assert ex.runner_alive(Job(id="j", runner_host=here, runner_pid=os.getpid())) is None
    assert ex.runner_alive(Job(id="j", runner_host="elsewhere", runner_pid=dead.pid)) is None
    assert ex.runner_alive(Job(id="j")) is None


def test_a_worker_runs_as_many_jobs_as_its_node_advertises(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("megatrain.worker.nodes.detect_gpus", lambda: ["NVIDIA H100"] * 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert worker_slots(settings) == 8
    assert worker_slots(settings, concurrency=2) == 2  # a cap lowers what the node advertises
    assert worker_slots(settings, concurrency=64) == 8
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the operator gave this worker two GPUs
    assert worker_slots(settings) == 2
    monkeypatch.setattr("megatrain.worker.nodes.detect_gpus", lambda: [])
    assert worker_slots(settings.model_copy(update={"cpu_slots": 3})) == 3


def test_a_node_registers_the_memory_of_one_device(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatrain.plan.memory import host_memory_bytes

    url = settings.resolved_database_url
    monkeypatch.setattr("megatrain.worker.nodes.detect_gpus", lambda: [])
    with session_scope(url) as s:
        node = ensure_local_pool(s, settings)
        assert node.device_memory_bytes == host_memory_bytes() // 4  # CPU ranks share the host
    gpus = ["NVIDIA H100 80GB HBM3"] * 4
    monkeypatch.setattr("megatrain.worker.nodes.detect_gpus", lambda: gpus)
    monkeypatch.setattr(
        "megatrain.worker.nodes.detect_gpu_memory",
        lambda: [81559 << 20, 40960 << 20, 81559 << 20, 81559 << 20],
    )
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with session_scope(url) as s:
        assert ensure_local_pool(s, settings).device_memory_bytes == 40960 << 20  # the smallest GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # this worker may use the first one only
    with session_scope(url) as s:
        assert ensure_local_pool(s, settings).device_memory_bytes == 81559 << 20


@pytest.fixture
def celery_settings(settings: Settings, redis_url: str) -> Iterator[Settings]:
    pool = f"celery-{uuid.uuid4().hex[:8]}"
    yield settings.model_copy(update={"executor": "celery", "redis_url": redis_url, "pool_name": pool})
    import redis

    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"megatrain.{pool}*"):
        client.delete(key)


@pytest.mark.redis
@pytest.mark.slow
def test_celery_worker_runs_a_scheduled_job(
    celery_settings: Settings, make_job: Callable[..., str], fake_engine: Path, tmp_path: Path
) -> None:
    settings = celery_settings
    url = settings.resolved_database_url
    with celery_worker(settings, tmp_path / "worker.log") as worker:
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
        queue = queue_name(settings.pool_name, socket.gethostname())
        result = sched.executor.app.send_task("megatrain.run_shard", args=[job_id], queue=queue)
        assert result.get(timeout=30) is None
        with session_scope(url) as s:
            assert len(s.scalars(select(JobEvent.id).where(JobEvent.job_id == job_id)).all()) == events
    assert _job(url, job_id).status not in (QUEUED, RUNNING)


@pytest.mark.redis
@pytest.mark.slow
def test_celery_node_runs_as_many_jobs_at_once_as_its_slots(
    celery_settings: Settings,
    make_job: Callable[..., str],
    fake_engine: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two 1-slot jobs placed together on a 2-slot node: both must start at once. A worker that ran
    # one task at a time left the second in Redis past the heartbeat timeout: requeued, retried.
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.1")
    settings = celery_settings.model_copy(update={"cpu_slots": 2, "heartbeat_timeout_s": 3.0})
    url = settings.resolved_database_url
    with celery_worker(settings, tmp_path / "worker.log"):
        with session_scope(url) as s:
            assert (
                s.scalar(select(Node.slots_total).join(NodePool).where(NodePool.name == settings.pool_name))
                == 2
            )
        jobs = [
            make_job(schedule=False, pool=settings.pool_name, train_iters=50, checkpoint_interval=0)
            for _ in range(2)
        ]
        sched = Scheduler(settings)
        assert sched.schedule_once() == jobs

        def done() -> bool:
            sched.reconcile_once()
            sched.schedule_once()
            return all(_job(url, j).status in (SUCCEEDED, FAILED) for j in jobs)

        wait_for(done, 90, interval=0.3)
    first, second = (_job(url, j) for j in jobs)
    assert (first.status, second.status) == (SUCCEEDED, SUCCEEDED)
    assert (first.attempt, second.attempt) == (1, 1)  # neither was mistaken for lost
    assert max(first.started_at, second.started_at) < min(first.finished_at, second.finished_at)


@pytest.mark.redis
def test_a_job_waiting_in_its_node_queue_is_not_lost(
    celery_settings: Settings, make_job: Callable[..., str]
) -> None:
    # No worker consumes the node's queue (busy or restarting): the task waits in Redis, and the
    # job stays scheduled past the heartbeat timeout instead of being requeued as lost.
    settings = celery_settings
    url = settings.resolved_database_url
    with session_scope(url) as s:
        ensure_local_pool(s, settings)
    job_id = make_job(schedule=False, pool=settings.pool_name)
    sched = Scheduler(settings)
    assert sched.schedule_once() == [job_id]
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(scheduled_at=utcnow() - timedelta(hours=1)))
    assert sched.reconcile_once() == []
    assert _job(url, job_id).status == SCHEDULED
    # a node whose worker is no longer seen has no one to take the task: the node is lost and
    # the job fails over
    with session_scope(url) as s:
        s.execute(update(Node).values(last_seen_at=utcnow() - timedelta(hours=1)))
    assert sched.reconcile_once() == [job_id]
    assert _job(url, job_id).status == QUEUED
    assert "lost" in _job(url, job_id).status_reason
    # and a task no longer in the queue (taken, or lost with Redis) is not waiting either
    with session_scope(url) as s:  # the worker heartbeats again: its node is ready
        s.execute(update(Node).values(last_seen_at=utcnow(), status="ready"))
    assert sched.schedule_once() == [job_id]
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(scheduled_at=utcnow() - timedelta(hours=1)))
    assert sched.reconcile_once() == []
    import redis

    redis.Redis.from_url(settings.redis_url).delete(queue_name(settings.pool_name, socket.gethostname()))
    assert sched.reconcile_once() == [job_id]
