"""The shard runner's heartbeat thread: a slow stretch of the runner (here a backfill before its
first tick) never lets the heartbeat lapse, so a scheduler reconciling all along never relaunches
the attempt; a runner wedged past max_stall_s stops beating."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from megatrain.db.models import SUCCEEDED, Job, JobEvent
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings, get_settings, reset_settings_cache
from megatrain.worker import shard


class NoEvidence:
    """An executor that knows nothing about runners: the heartbeat timeout alone judges them."""

    def refresh_nodes(self) -> None: ...

    def runner_alive(self, job: Job) -> bool | None:
        return None

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        return None


def test_a_slow_runner_never_relaunches_a_healthy_attempt(
    settings: Settings,
    make_job: Callable[..., str],
    fake_engine: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MEGATRAIN_HEARTBEAT_TIMEOUT_S", "2")
    reset_settings_cache()
    settings = get_settings()
    real_backfill, stalled = shard._backfill_earlier_attempts, threading.Event()

    def slow_backfill(*args: Any) -> None:
        # Between the claim and the first tick, outside any transaction: e.g. a large backfill.
        stalled.set()
        time.sleep(3 * settings.heartbeat_timeout_s)
        real_backfill(*args)

    monkeypatch.setattr(shard, "_backfill_earlier_attempts", slow_backfill)
    job_id = make_job(train_iters=10, checkpoint_interval=0)
    sched = Scheduler(settings, NoEvidence())  # type: ignore[arg-type]
    stop, relaunched = threading.Event(), []

    def reconcile() -> None:
        while not stop.is_set():
            relaunched.extend(sched.reconcile_once())
            time.sleep(0.2)

    reconciler = threading.Thread(target=reconcile)
    reconciler.start()
    try:
        assert shard.run_shard(job_id, settings) == 0
    finally:
        stop.set()
        reconciler.join(10)
    assert stalled.is_set() and relaunched == []
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        assert job.status == SUCCEEDED and job.attempt == 1, job.status_reason
        reasons = s.scalars(select(JobEvent.reason).where(JobEvent.job_id == job_id)).all()
        assert not any("runner lost" in r for r in reasons)


def test_a_wedged_runner_stops_beating(settings: Settings, make_job: Callable[..., str]) -> None:
    from megatrain.db.jobs import transition
    from megatrain.db.models import RUNNING, SCHEDULED
    from megatrain.worker.heartbeat import Heartbeat
    from megatrain.worker.reporter import DbReporter

    url = settings.resolved_database_url
    job_id = make_job()
    with session_scope(url) as s:
        assert transition(s, job_id, RUNNING, from_statuses=(SCHEDULED,), runner_host="h", runner_pid=5)

    def last_beat() -> Any:
        with session_scope(url) as s:
            return s.scalar(select(Job.heartbeat_at).where(Job.id == job_id))

    reporter = DbReporter(settings)
    assert not Heartbeat(reporter, job_id, "h", 6, 1.0).beat()  # not its owner: no beat
    beats = Heartbeat(reporter, job_id, "h", 5, interval_s=0.1, max_stall_s=0.5).start()
    try:
        time.sleep(0.4)
        assert last_beat() is not None
        time.sleep(0.6)  # never touched: past max_stall_s the beats stop
        first = last_beat()
        time.sleep(0.4)
        assert last_beat() == first
        beats.touch()
        time.sleep(0.4)
        assert last_beat() > first
    finally:
        beats.stop()
