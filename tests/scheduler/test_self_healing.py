"""Self-healing rules of the scheduler: an unanswered status query never relaunches a job, a healthy
job is never started twice by schedulers ticking together, a quarantined node is never offered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from scheduler_helpers import RecordingExecutor
from sqlalchemy import func, select, update

from megatrain.db.goodput import release_node
from megatrain.db.jobs import transition
from megatrain.db.models import (
    QUARANTINED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    AttemptLedger,
    Job,
    Node,
    utcnow,
)
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings, get_settings, reset_settings_cache
from megatrain.worker.executors import StatusUnknown


class FlakyExecutor(RecordingExecutor):
    """Its status queries fail (a broker outage) until told otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = True

    def runner_alive(self, job: Job) -> bool | None:
        if self.broken:
            raise StatusUnknown("broker query failed: connection refused")
        return super().runner_alive(job)


def _set(url: str, job_id: str, **values: object) -> None:
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))


def _status(url: str, job_id: str) -> str:
    with session_scope(url) as s:
        return s.scalar(select(Job.status).where(Job.id == job_id))


def test_a_failed_status_query_never_relaunches_and_the_timeout_still_bounds(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(4)
    waiting, slow, dead = add_job(), add_job(), add_job()
    ex = FlakyExecutor()
    sched = Scheduler(settings, ex)
    assert sorted(sched.schedule_once()) == sorted([waiting, slow, dead])
    old = utcnow() - timedelta(seconds=60)
    _set(url, waiting, scheduled_at=old)  # e.g. still in its node's broker queue
    for j, beat in ((slow, utcnow() - timedelta(seconds=settings.heartbeat_timeout_s * 0.4)), (dead, old)):
        with session_scope(url) as s:
            transition(
                s, j, RUNNING, from_statuses=(SCHEDULED,), runner_host="h", runner_pid=7, heartbeat_at=beat
            )
    # The broker cannot be asked: nothing is judged, however old.
    assert sched.reconcile_once() == []
    assert [_status(url, j) for j in (waiting, slow, dead)] == [SCHEDULED, RUNNING, RUNNING]
    # Once it answers "no evidence", the heartbeat timeout decides: the late beat (within the
    # timeout by 3 s; a loaded host spent over 1 s on the queries between) is healthy, the silent
    # ones are requeued.
    ex.broken = False
    assert sorted(sched.reconcile_once()) == sorted([waiting, dead])
    assert [_status(url, j) for j in (waiting, slow, dead)] == [QUEUED, RUNNING, QUEUED]


def test_two_schedulers_ticking_together_start_each_job_once_while_runners_heartbeat(
    settings: Settings, add_node: Callable, add_job: Callable, db_url: str
) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("concurrent schedulers are a PostgreSQL deployment")
    url = settings.resolved_database_url
    add_node(3)
    add_node(2)
    jobs = [add_job(procs=1 + i % 2) for i in range(16)]
    ex = RecordingExecutor()
    stop = threading.Event()
    errors: list[BaseException] = []

    def tick_loop() -> None:
        sched = Scheduler(settings, ex)
        while not stop.is_set():
            try:
                sched.reconcile_once()
                sched.schedule_once()
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)
                return

    def runners() -> None:
        # Claim what is scheduled (→ running, heartbeating), and finish what ran a little while.
        began: dict[str, float] = {}
        while not stop.is_set():
            with session_scope(url) as s:
                for j in s.scalars(select(Job.id).where(Job.status == SCHEDULED)).all():
                    if transition(s, j, RUNNING, from_statuses=(SCHEDULED,), runner_host="r", runner_pid=1,
                                  heartbeat_at=utcnow()):  # fmt: skip
                        began[j] = time.monotonic()
                for j in s.scalars(select(Job.id).where(Job.status == RUNNING)).all():
                    if time.monotonic() - began.get(j, 0) > 0.3:
                        transition(s, j, SUCCEEDED, from_statuses=(RUNNING,))
                    else:
                        s.execute(update(Job).where(Job.id == j).values(heartbeat_at=utcnow()))
            time.sleep(0.02)

    threads = [threading.Thread(target=tick_loop) for _ in range(2)] + [threading.Thread(target=runners)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        with session_scope(url) as s:
            if s.scalar(select(func.count()).select_from(Job).where(Job.status != SUCCEEDED)) == 0:
                break
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sorted(ex.submitted) == sorted(jobs)  # each exactly once
    with session_scope(url) as s:
        assert set(s.scalars(select(Job.attempt))) == {1}  # none relaunched
        assert set(s.scalars(select(Job.status))) == {SUCCEEDED}


def test_a_quarantined_node_is_not_offered_until_released(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    bad = add_node(2, hostname="bad")
    with session_scope(url) as s:
        s.execute(update(Node).where(Node.id == bad).values(status=QUARANTINED, quarantine_reason="test"))
    job = add_job()
    sched = Scheduler(settings, RecordingExecutor())
    assert sched.schedule_once() == []
    assert _status(url, job) == QUEUED
    with session_scope(url) as s:
        assert release_node(s, bad)
    assert sched.schedule_once() == [job]


def test_lost_runners_are_ledgered_and_quarantine_their_node(
    settings: Settings, add_node: Callable, add_job: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRAIN_NODE_QUARANTINE_FAILURES", "2")
    reset_settings_cache()
    settings = get_settings()
    url = settings.resolved_database_url
    node = add_node(2, hostname="flaky")
    jobs = [add_job(max_retries=3), add_job(max_retries=3)]
    ex = RecordingExecutor()
    sched = Scheduler(settings, ex)
    assert sorted(sched.schedule_once()) == sorted(jobs)
    now = utcnow()
    for j in jobs:
        with session_scope(url) as s:
            ago = {"started_at": now - timedelta(seconds=100), "heartbeat_at": now - timedelta(seconds=2)}
            transition(s, j, RUNNING, from_statuses=(SCHEDULED,), runner_host="flaky", runner_pid=9, **ago)
    ex.verdicts = {jobs[0]: False}  # its runner is known gone: ended at once
    assert sched.reconcile_once() == [jobs[0]]
    with session_scope(url) as s:
        assert s.get(Node, node).status == "ready"  # one failure: below the limit
        (row,) = s.scalars(select(AttemptLedger).where(AttemptLedger.job_id == jobs[0])).all()
        assert (row.node_id, row.attempt, row.outcome, row.failure) == (node, 1, QUEUED, "runner_lost")
        assert row.productive_s == pytest.approx(98, abs=1) and row.restart_s == pytest.approx(2, abs=2)
    _set(url, jobs[1], heartbeat_at=utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 5))
    assert sched.reconcile_once() == [jobs[1]]
    with session_scope(url) as s:
        flaky = s.get(Node, node)
        assert flaky.status == QUARANTINED and flaky.quarantine_reason.startswith("2 attempts failed")
    assert sched.schedule_once() == []  # both requeued, nowhere to go
