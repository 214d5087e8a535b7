"""Preemption end to end with the fake engine: a low-priority job runs, a high-priority one arrives,
the low one is checkpointed, stopped and requeued (not a retry), the high one runs, the low one
resumes from the checkpoint and finishes with its steps continuous; the ledger keeps the time lost."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from fixtures.cluster import seed_job, seed_node
from sqlalchemy import select
from worker_helpers import job_spec, wait_for

from megatrain.db.goodput import job_goodput
from megatrain.db.jobs import retry_allowed
from megatrain.db.models import CANCELLED, QUEUED, RUNNING, SUCCEEDED, AttemptLedger, Job, JobEvent, JobMetric
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.worker.attempt import Attempt
from megatrain.worker.preempt import requeue_preempted
from megatrain.worker.shard import run_shard

# One database: the runner's SQL is the same on both (tests/db and tests/scheduler run both).
pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


class _PlaceOnly:
    """An executor that runs nothing: the test runs the shards itself."""

    def submit(self, job_id: str) -> None: ...

    def refresh_nodes(self) -> None: ...

    def runner_alive(self, job: Job) -> bool | None:
        return None

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        return None


def _job(url: str, job_id: str) -> Job:
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        s.expunge(job)
        return job


def test_a_higher_priority_job_preempts_checkpoints_and_the_victim_resumes(
    settings: Settings, fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    url = settings.resolved_database_url
    seed_node(url, 1, "solo", "solonode")
    sched = Scheduler(settings, _PlaceOnly())
    # No periodic checkpoint: the one it resumes from is the one saved on being preempted.
    low = seed_job(url, 1, pool="solo", priority=0, max_retries=0, spec=job_spec(40, checkpoint_interval=0))
    assert sched.schedule_once() == [low]
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(run_shard(low, settings)))
    runner.start()
    wait_for(lambda: _job(url, low).current_step >= 3)

    high = seed_job(url, 1, pool="solo", priority=5, name="urgent", spec=job_spec(3, checkpoint_interval=0))
    assert sched.schedule_once() == []  # no room yet: the low job is asked to make it
    assert _job(url, low).preempt_for == high
    assert sched.schedule_once() == []  # asked once, not again
    runner.join(timeout=30)
    assert codes == [75]

    after = _job(url, low)
    assert after.status == QUEUED
    assert after.preempt_for is None
    assert after.max_retries == 0 and after.preemptions == 1  # not a retry: counted apart
    step = int(after.status_reason.rsplit(" ", 1)[1])
    assert (
        after.status_reason
        == f"preempted by a higher-priority job (1 of at most 10); resumes from step {step}"
    )
    assert 3 <= step < 40
    with session_scope(url) as s:
        kinds = list(s.scalars(select(JobEvent.kind).where(JobEvent.job_id == low).order_by(JobEvent.id)))
        told = s.scalar(select(JobEvent.reason).where(JobEvent.job_id == low, JobEvent.kind == "preempting"))
        (row,) = s.scalars(select(AttemptLedger).where(AttemptLedger.job_id == low)).all()
        assert row.outcome == "preempted" and row.preempt_s > 0
        assert job_goodput(s, low)["preempt_s"] == row.preempt_s  # what the API's `goodput` serves
    assert "preempting" in kinds and kinds[-1] == QUEUED
    assert told == "preempting: checkpointing and stopping to make room for job urgent"  # same tenant

    assert sched.schedule_once() == [high]  # the higher-priority job gets the freed room first
    assert run_shard(high, settings) == 0
    assert sched.schedule_once() == [low]
    assert run_shard(low, settings) == 0
    assert _job(url, low).status == SUCCEEDED and _job(url, high).status == SUCCEEDED
    with session_scope(url) as s:
        steps = list(
            s.scalars(select(JobMetric.step).where(JobMetric.job_id == low, JobMetric.kind == "train"))
        )
        started = s.scalars(
            select(JobEvent.data)
            .where(JobEvent.job_id == low, JobEvent.kind == "started")
            .order_by(JobEvent.id)
        ).all()
    assert sorted(steps) == list(range(1, 41))  # continuous: nothing lost, nothing done twice
    assert started[-1]["resumed_from"] == step


def test_a_non_preemptible_job_is_left_alone(
    settings: Settings, fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    url = settings.resolved_database_url
    seed_node(url, 1, "solo", "solonode")
    sched = Scheduler(settings, _PlaceOnly())
    spec = job_spec(20, checkpoint_interval=0)
    spec["resources"]["preemptible"] = False
    low = seed_job(url, 1, pool="solo", priority=0, spec=spec)
    assert sched.schedule_once() == [low]
    with session_scope(url) as s:
        s.get(Job, low).status = RUNNING  # as its runner would: preemption looks at running jobs only
    seed_job(url, 1, pool="solo", priority=5, spec=job_spec(3))
    assert sched.schedule_once() == []
    assert _job(url, low).preempt_for is None


def test_another_tenants_job_is_not_named_to_the_victim(settings: Settings) -> None:
    url = settings.resolved_database_url
    seed_node(url, 1, "solo", "solonode")
    sched = Scheduler(settings, _PlaceOnly())
    low = seed_job(url, 1, pool="solo", priority=0, spec=job_spec(20))
    assert sched.schedule_once() == [low]
    with session_scope(url) as s:
        s.get(Job, low).status = RUNNING
    high = seed_job(url, 1, tenant="other", pool="solo", priority=5, name="secret", spec=job_spec(3))
    assert sched.schedule_once() == []
    assert _job(url, low).preempt_for == high
    with session_scope(url) as s:
        event = s.scalars(select(JobEvent).where(JobEvent.job_id == low, JobEvent.kind == "preempting")).one()
        assert event.reason == "preempting: checkpointing and stopping to make room for a higher-priority job"
        assert event.data == {}


def test_an_engine_that_does_not_stop_is_terminated_after_the_grace(
    settings: Settings, fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    monkeypatch.setenv("FAKE_ENGINE_IGNORE_SIGUSR2", "1")
    monkeypatch.setattr(settings, "preempt_grace_s", 0.5)
    url = settings.resolved_database_url
    seed_node(url, 1, "solo", "solonode")
    sched = Scheduler(settings, _PlaceOnly())
    low = seed_job(url, 1, pool="solo", priority=0, max_retries=0, spec=job_spec(400, checkpoint_interval=5))
    assert sched.schedule_once() == [low]
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(run_shard(low, settings)))
    runner.start()
    wait_for(lambda: _job(url, low).current_step >= 6)
    seed_job(url, 1, pool="solo", priority=5, spec=job_spec(3))
    assert sched.schedule_once() == []
    runner.join(timeout=30)
    assert codes and codes[0] != 0  # stopped with SIGTERM
    after = _job(url, low)
    assert after.status == QUEUED and (after.max_retries, after.preemptions) == (0, 1)
    assert after.status_reason == (
        "preempted by a higher-priority job (1 of at most 10); resumes from its latest checkpoint"
    )
    with session_scope(url) as s:
        (row,) = s.scalars(select(AttemptLedger).where(AttemptLedger.job_id == low)).all()
    assert row.outcome == "preempted" and row.preempt_s >= 0.5


def _preempt_once(url: str, sched: Scheduler, low: str, out: Path) -> None:
    """Run `low` (scheduled), let a new higher-priority job preempt it and its runner requeue it, as
    run_shard does once the engine checkpointed; then drop the higher-priority job again."""
    with session_scope(url) as s:
        s.get(Job, low).status = RUNNING  # as its runner would: preemption looks at running jobs only
    high = seed_job(url, 1, pool="solo", priority=5, spec=job_spec(3))
    assert sched.schedule_once() == []
    assert _job(url, low).preempt_for == high
    with session_scope(url) as s:
        job = s.get(Job, low)
        att = Attempt(low, job.attempt, job.max_retries, 1, 86400.0, out, preemptions=job.preemptions)
        att.max_preemptions = job.max_preemptions  # as _claim reads them off the job
        assert requeue_preempted(s, att, 7, {"runner_pid": None, "runner_host": None})
        s.get(Job, high).status = CANCELLED
    assert sched.schedule_once() == [low]


def test_preemptions_have_their_own_budget_and_never_touch_max_retries(
    settings: Settings, tmp_path: Path
) -> None:
    """Preempted N times, a job keeps the max_retries its user set, and every retry of it; once its
    preemptions reach resources.max_preemptions it is no longer a candidate and runs on."""
    url = settings.resolved_database_url
    seed_node(url, 1, "solo", "solonode")
    sched = Scheduler(settings, _PlaceOnly())
    spec = job_spec(20)
    spec["resources"]["max_preemptions"] = 2
    low = seed_job(url, 1, pool="solo", priority=0, max_retries=1, max_preemptions=2, spec=spec)
    assert sched.schedule_once() == [low]
    _preempt_once(url, sched, low, tmp_path)
    _preempt_once(url, sched, low, tmp_path)
    job = _job(url, low)
    assert (job.attempt, job.max_retries, job.preemptions, job.max_preemptions) == (3, 1, 2, 2)
    with session_scope(url) as s:
        requeued = s.scalars(
            select(JobEvent).where(JobEvent.job_id == low, JobEvent.to_status == QUEUED).order_by(JobEvent.id)
        ).all()
        assert [e.reason for e in requeued[-2:]] == [
            "preempted by a higher-priority job (1 of at most 2); resumes from step 7",
            "preempted by a higher-priority job (2 of at most 2); resumes from step 7; it will not be "
            "preempted again",
        ]
        assert [e.data["preemptions"] for e in requeued[-2:]] == [1, 2]
    assert retry_allowed(job)  # a failure of this third start is its first: one retry left
    # The budget is spent: a higher-priority job now waits instead.
    with session_scope(url) as s:
        s.get(Job, low).status = RUNNING
    seed_job(url, 1, pool="solo", priority=5, spec=job_spec(3))
    assert sched.schedule_once() == []
    assert _job(url, low).preempt_for is None
