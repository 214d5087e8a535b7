"""Scheduler.schedule_once / reconcile_once / run on SQLite and PostgreSQL."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from scheduler_helpers import RecordingExecutor
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError

from megatrain.db.jobs import reserve_and_schedule, transition
from megatrain.db.models import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    Job,
    JobEvent,
    Node,
    utcnow,
)
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings


def _job(url: str, job_id: str) -> Job:
    with session_scope(url) as s:
        return s.get(Job, job_id)


def _slots_used(url: str, node_id: str) -> int:
    with session_scope(url) as s:
        return s.get(Node, node_id).slots_used


def test_priority_then_fifo_order(settings: Settings, add_node: Callable, add_job: Callable) -> None:
    add_node(16)
    low_old = add_job(priority=0)
    high = add_job(priority=5)
    low_new = add_job(priority=0)
    mid = add_job(priority=1)
    ex = RecordingExecutor()
    placed = Scheduler(settings, ex).schedule_once()
    assert placed == ex.submitted == [high, mid, low_old, low_new]
    assert {_job(settings.resolved_database_url, j).status for j in placed} == {SCHEDULED}


def test_jobs_that_do_not_fit_wait_without_event_spam(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    node = add_node(4)
    big = add_job(procs=3)
    waiting = add_job(procs=2)
    sched = Scheduler(settings, RecordingExecutor())
    for _ in range(3):
        sched.schedule_once()
    assert _job(url, big).status == SCHEDULED and _slots_used(url, node) == 3
    job = _job(url, waiting)
    assert job.status == QUEUED
    assert job.status_reason == "waiting: needs 2 free slots in pool 'default'; the freest node has 1"
    with session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == waiting)) == 0
    # once the big job ends its slots go to the waiting one
    with session_scope(url) as s:
        assert transition(s, big, RUNNING, from_statuses=(SCHEDULED,))
        assert transition(s, big, SUCCEEDED, from_statuses=(RUNNING,))
    assert sched.schedule_once() == [waiting]


def test_a_wait_behind_another_tenants_job_never_names_it(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    """The reason is rendered for the waiting job's tenant: another tenant's blocker is a queue
    position in the stored text, never an id to be redacted afterwards; the data keeps the id."""
    url = settings.resolved_database_url
    add_node(2)
    running = add_job(procs=2)
    sched = Scheduler(settings, RecordingExecutor())
    assert sched.schedule_once() == [running]
    theirs = add_job(procs=2, tenant="globex")
    mine = add_job(procs=1)
    assert sched.schedule_once() == []
    job = _job(url, mine)
    assert theirs not in job.status_reason and "another tenant's job" in job.status_reason
    assert job.wait_reason == {"code": "behind_job", "pool": "default", "job_id": theirs, "position": 2}


def test_blocked_high_priority_job_is_not_starved_by_small_ones(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(4)
    running = add_job(procs=2, priority=0)
    sched = Scheduler(settings, RecordingExecutor())
    assert sched.schedule_once() == [running]
    big = add_job(procs=4, priority=10)
    small = add_job(procs=1, priority=0)
    huge = add_job(procs=64, priority=20)  # can never fit: waits without blocking the pool
    other_pool = add_job(procs=1, priority=0, pool="other")
    assert sched.schedule_once() == []
    assert _job(url, small).status_reason.startswith(f"waiting: behind job {big}")
    assert "largest node in pool 'default' offers 4" in _job(url, huge).status_reason
    assert _job(url, other_pool).status_reason == "waiting: pool 'other' has no ready nodes"
    with session_scope(url) as s:
        assert transition(s, running, CANCELLED, from_statuses=(SCHEDULED,))
    assert sched.schedule_once() == [big]
    assert _job(url, small).status == QUEUED


def test_submit_failure_requeues_then_fails(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    node = add_node(4)
    job_id = add_job(procs=2, max_retries=1)
    ex = RecordingExecutor()
    ex.fail_with = RuntimeError("broker down")
    sched = Scheduler(settings, ex)
    assert sched.schedule_once() == []
    job = _job(url, job_id)
    assert job.status == QUEUED and job.attempt == 1 and "broker down" in job.status_reason
    assert _slots_used(url, node) == 0
    assert sched.schedule_once() == []
    job = _job(url, job_id)
    assert job.status == FAILED and job.attempt == 2


def _age(url: str, job_id: str, **fields: object) -> None:
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(**fields))


def test_reconcile_requeues_lost_runners_and_honours_limits(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    node = add_node(8)
    stale, exhausted, cancelling, fresh, never_picked = (add_job(procs=1, max_retries=1) for _ in range(5))
    queued_cancel = add_job(procs=1, cancel_requested=True)
    sched = Scheduler(settings, RecordingExecutor())
    assert len(sched.schedule_once()) == 5
    old = utcnow() - timedelta(seconds=60)
    for j in (stale, exhausted, cancelling, fresh):
        with session_scope(url) as s:
            transition(
                s,
                j,
                RUNNING,
                from_statuses=(SCHEDULED,),
                runner_host="elsewhere",
                runner_pid=1,
                heartbeat_at=utcnow(),
            )
    for j in (stale, exhausted, cancelling):
        _age(url, j, heartbeat_at=old)
    _age(url, exhausted, attempt=2)
    _age(url, cancelling, cancel_requested=True)
    _age(url, never_picked, scheduled_at=old)
    changed = sched.reconcile_once()
    assert set(changed) == {stale, exhausted, cancelling, never_picked, queued_cancel}
    job = _job(url, stale)
    assert job.status == QUEUED and job.runner_pid is None and job.attempt == 1
    assert job.status_reason.startswith("runner lost (no heartbeat from elsewhere")
    assert job.status_reason.endswith("retrying, will resume from checkpoint")
    assert _job(url, exhausted).status == FAILED
    assert _job(url, cancelling).status == CANCELLED
    assert _job(url, never_picked).status == QUEUED
    assert "no runner picked it up" in _job(url, never_picked).status_reason
    assert _job(url, queued_cancel).status == CANCELLED
    assert _job(url, fresh).status == RUNNING
    assert _slots_used(url, node) == 1  # only `fresh` still holds a slot
    assert sched.reconcile_once() == []


def test_reconcile_asks_the_executor_before_timeouts(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(4)
    dead, waiting, unknown = add_job(), add_job(), add_job()
    ex = RecordingExecutor()
    sched = Scheduler(settings, ex)
    assert sched.schedule_once() == [dead, waiting, unknown] and ex.refreshes == 1
    with session_scope(url) as s:
        transition(
            s,
            dead,
            RUNNING,
            from_statuses=(SCHEDULED,),
            runner_host="h",
            runner_pid=4242,
            heartbeat_at=utcnow(),
        )
    old = utcnow() - timedelta(seconds=60)
    _age(url, waiting, scheduled_at=old)  # e.g. still in its node's broker queue
    _age(url, unknown, scheduled_at=old)
    ex.verdicts = {dead: False, waiting: True}
    # the runner known gone is requeued at once (its heartbeat is fresh), the job known to wait is
    # left alone past the timeout, the one without evidence is judged by the timeout
    assert sorted(sched.reconcile_once()) == sorted([dead, unknown])
    assert "runner pid 4242 on h is gone" in _job(url, dead).status_reason
    assert _job(url, waiting).status == SCHEDULED
    assert "no runner picked it up" in _job(url, unknown).status_reason


def test_concurrent_schedulers_start_each_job_once(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    nodes = [add_node(4), add_node(3), add_node(2)]
    rng = random.Random(0)
    jobs = [add_job(procs=rng.choice([1, 1, 2, 3]), priority=rng.choice([0, 1])) for _ in range(30)]
    ex = RecordingExecutor()
    stop = threading.Event()
    errors: list[BaseException] = []
    oversubscribed: list[tuple[str, int, int]] = []

    def schedule_loop() -> None:
        sched = Scheduler(settings, ex)
        while not stop.is_set():
            try:
                sched.schedule_once()
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)
                return

    def finish_some() -> None:
        # Ends scheduled jobs at random so the schedulers keep competing for freed slots.
        r = random.Random(1)
        while not stop.is_set():
            with session_scope(url) as s:
                for n in s.execute(select(Node.id, Node.slots_used, Node.slots_total)).all():
                    if n.slots_used > n.slots_total or n.slots_used < 0:
                        oversubscribed.append(tuple(n))
                ids = s.scalars(select(Job.id).where(Job.status == SCHEDULED)).all()
                for j in r.sample(list(ids), k=min(len(ids), 2)):
                    transition(s, j, SUCCEEDED, from_statuses=(SCHEDULED,))
            time.sleep(0.02)

    threads = [threading.Thread(target=schedule_loop) for _ in range(4)] + [
        threading.Thread(target=finish_some)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        with session_scope(url) as s:
            if s.scalar(select(func.count()).select_from(Job).where(Job.status != SUCCEEDED)) == 0:
                break
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert not oversubscribed
    assert sorted(ex.submitted) == sorted(jobs)  # every job exactly once
    with session_scope(url) as s:
        assert all(a == 1 for a in s.scalars(select(Job.attempt)))
        assert [s.get(Node, n).slots_used for n in nodes] == [0, 0, 0]


def test_run_survives_database_errors(settings: Settings, add_node: Callable, add_job: Callable) -> None:
    add_node(2)
    job_id = add_job()
    ex = RecordingExecutor()
    sched = Scheduler(settings.model_copy(update={"scheduler_interval_s": 0.05}), ex)
    real = sched.schedule_once
    calls = {"n": 0}

    def flaky() -> list[str]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OperationalError("SELECT 1", {}, Exception("server closed the connection"))
        return real()

    sched.schedule_once = flaky  # type: ignore[method-assign]
    stop = threading.Event()
    t = threading.Thread(target=sched.run, args=(stop,))
    t.start()
    deadline = time.monotonic() + 10
    while not ex.submitted and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    t.join(5)
    assert ex.submitted == [job_id] and calls["n"] >= 2 and not t.is_alive()


def test_reserve_race_loser_does_not_submit(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    node = add_node(2)
    job_id = add_job(procs=2)
    with session_scope(url) as s:  # another scheduler got there first
        assert reserve_and_schedule(s, job_id, node)
    ex = RecordingExecutor()
    assert Scheduler(settings, ex).schedule_once() == [] and ex.submitted == []


def test_jobs_on_one_gpu_node_get_disjoint_devices(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(4, pool="gpu", accelerator="NVIDIA H100 80GB HBM3")
    first, second, third = (add_job(procs=2, pool="gpu") for _ in range(3))
    sched = Scheduler(settings, RecordingExecutor())
    assert sched.schedule_once() == [first, second]
    assert (_job(url, first).devices, _job(url, second).devices) == ([0, 1], [2, 3])
    with session_scope(url) as s:  # the first ends: its devices, and only those, go to the third
        assert transition(s, first, SUCCEEDED, from_statuses=(SCHEDULED,))
    assert _job(url, first).devices is None
    assert sched.schedule_once() == [third]
    assert _job(url, third).devices == [0, 1]


def test_reserve_refuses_devices_taken_by_a_racing_scheduler(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    node = add_node(4)
    a, b = add_job(procs=2), add_job(procs=2)
    with session_scope(url) as s:
        assert reserve_and_schedule(s, a, node, devices=[0, 1])
    with session_scope(url) as s:  # a stale snapshot chose the same devices: refused, slots untouched
        assert not reserve_and_schedule(s, b, node, devices=[1, 2])
        s.rollback()
    assert _slots_used(url, node) == 2 and _job(url, b).status == QUEUED
    assert Scheduler(settings, RecordingExecutor()).schedule_once() == [b]
    assert _job(url, b).devices == [2, 3]


def test_wait_reasons_are_data_and_never_name_another_tenants_job(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(2)
    add_job(procs=2)  # takes the node
    theirs = add_job(procs=2, tenant="globex")  # first in line
    mine_own_blocker = add_job(procs=2, tenant="globex")
    mine = add_job(procs=1)
    Scheduler(settings, RecordingExecutor()).schedule_once()
    job = _job(url, mine)
    assert job.wait_reason == {"code": "behind_job", "pool": "default", "job_id": theirs, "position": 3}
    assert job.status_reason == (
        "waiting: behind another tenant's job, first in line for pool 'default' (no backfill)"
    )
    assert theirs not in job.status_reason
    # the blocking job's own tenant reads its id
    assert _job(url, mine_own_blocker).status_reason.startswith(f"waiting: behind job {theirs}")
    assert _job(url, theirs).wait_reason == {
        "code": "no_free_slots",
        "pool": "default",
        "needs": 2,
        "freest": 0,
        "position": 1,
    }
