"""The queue's rules through Scheduler.schedule_once on SQLite and PostgreSQL: quotas read from the
tenant row, positions stored with the wait reason, backfill from the running jobs' expected ends,
fair share from the tenants' use, and the executor's multi_node gate."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from scheduler_helpers import RecordingExecutor
from sqlalchemy import select, update
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.db.jobs import reserve_and_schedule, reserve_gang, transition
from megatrain.db.models import QUEUED, RUNNING, SCHEDULED, Job, JobAllocation, Node, Tenant, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.scheduler.snapshot import expected_end_s
from megatrain.settings import Settings


def _job(url: str, job_id: str) -> Job:
    with session_scope(url) as s:
        return s.get(Job, job_id)


def _runtime(seconds: int) -> dict:
    return {"resources": {"max_runtime_s": seconds}}


def test_quota_set_by_the_cli_holds_jobs_back_with_a_reason(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(8)
    first, second, third = add_job(procs=2), add_job(procs=4), add_job(procs=1)
    result = CliRunner().invoke(app, ["tenants", "set-quota", "acme", "3"])
    assert result.exit_code == 0 and "a quota of 3 devices" in result.output, result.output
    sched = Scheduler(settings, RecordingExecutor())
    assert sched.schedule_once() == [first, third]  # 2 + 1 fit the quota; 4 more would not
    job = _job(url, second)
    assert job.status == QUEUED
    assert job.wait_reason == {
        "code": "over_quota", "pool": "default", "needs": 4, "quota": 3, "used": 2, "position": 1,
    }  # fmt: skip
    # the use as it stood when the job's turn came (the 1-device job behind it fitted afterwards)
    assert job.status_reason == "waiting: needs 4 devices but its tenant's quota is 3 and its jobs hold 2"
    # lifting the quota lets it start on the next tick
    result = CliRunner().invoke(app, ["tenants", "set-quota", "acme", "none"])
    assert result.exit_code == 0 and "no device quota" in result.output
    with session_scope(url) as s:
        assert s.scalar(select(Tenant.max_devices).where(Tenant.name == "acme")) is None
    assert sched.schedule_once() == [second]


def test_set_quota_rejects_a_bad_value(settings: Settings) -> None:
    for bad, words in (
        ("lots", "'lots' is not a whole number of devices or 'none'"),
        ("2000000", "outside 0..1000000"),
    ):
        result = CliRunner().invoke(app, ["tenants", "set-quota", "acme", bad], env={"COLUMNS": "200"})
        assert result.exit_code != 0 and words in result.output and "Traceback" not in result.output


def test_positions_are_stored_and_follow_the_scheduling_order(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(2)
    running = add_job(procs=2)
    sched = Scheduler(settings, RecordingExecutor())
    assert sched.schedule_once() == [running]
    low, high, other_pool = add_job(procs=1), add_job(procs=2, priority=3), add_job(procs=1, pool="gpu")
    sched.schedule_once()
    assert [_job(url, j).wait_reason["position"] for j in (high, low, other_pool)] == [1, 2, 1]
    # the running job ends: the first in line starts and the other moves up
    with session_scope(url) as s:
        assert transition(s, running, RUNNING, from_statuses=(SCHEDULED,))
        assert transition(s, running, "succeeded", from_statuses=(RUNNING,))
    assert sched.schedule_once() == [high]
    assert _job(url, low).wait_reason["position"] == 1


def test_backfill_uses_the_running_jobs_expected_end(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(4)
    running = add_job(procs=3, spec=_runtime(3600))
    sched = Scheduler(settings, RecordingExecutor())
    assert sched.schedule_once() == [running]
    with session_scope(url) as s:  # started 10 minutes ago, may run an hour: ends in ~50 minutes
        transition(
            s, running, RUNNING, from_statuses=(SCHEDULED,), started_at=utcnow() - timedelta(minutes=10)
        )
    head = add_job(procs=4, priority=1, spec=_runtime(600))
    long_small = add_job(procs=1, spec=_runtime(7200))
    short_small = add_job(procs=1, spec=_runtime(600))
    assert sched.schedule_once() == [short_small]  # ends well before the head's estimated start
    wait = _job(url, head).wait_reason
    assert wait["code"] == "no_free_slots" and 2900 < wait["starts_in_s"] <= 3000
    job = _job(url, long_small)
    assert job.wait_reason["code"] == "behind_job" and job.wait_reason["runtime_s"] == 7200
    assert "this job's 2h 00m would delay it" in job.status_reason


def test_fair_share_between_tenants_in_the_loop(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    add_node(8)
    ex = RecordingExecutor()
    sched = Scheduler(settings, ex)
    held = add_job(procs=4)  # acme already holds 4 devices
    assert sched.schedule_once() == [held]
    acme = [add_job(procs=1) for _ in range(3)]
    globex = [add_job(procs=1, tenant="globex") for _ in range(3)]
    placed = sched.schedule_once()
    # globex (0 held) goes first though acme's jobs are older, until acme's 4 devices are matched
    assert placed == [*globex, acme[0]]


def test_a_gang_waits_under_a_single_node_executor(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    add_node(2)
    add_node(2)
    gang = add_job(procs=4)
    small = add_job(procs=2)
    ex = RecordingExecutor()
    assert Scheduler(settings, ex).schedule_once() == [small]  # the gang blocks nobody
    job = _job(url, gang)
    assert job.wait_reason == {
        "code": "single_node_executor",
        "pool": "default",
        "needs": 4,
        "nodes": 2,
        "position": 1,
    }
    assert job.status_reason == (
        "waiting: needs 4 devices across 2 nodes of pool 'default'; this executor runs a job on one node"
    )
    with session_scope(url) as s:  # nothing is held for it anywhere
        assert s.scalar(select(Job.node_id).where(Job.id == gang)) is None


def test_layout_groups_reach_placement(settings: Settings, add_node: Callable, add_job: Callable) -> None:
    # a tp=2 job of 2 ranks can use a node with 2 free, not one split 1+1 (single node anyway); and
    # the stored layout's tp×cp is read: a tp=4 job of 4 on two 2-slot nodes is too big in whole groups
    url = settings.resolved_database_url
    add_node(2)
    add_node(2)
    job = add_job(procs=4, layout={"tp": 4, "pp": 1, "dp": 1, "cp": 1})
    Scheduler(settings, RecordingExecutor()).schedule_once()
    assert _job(url, job).wait_reason["code"] == "too_big_for_pool"
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job).values(layout={"tp": 2, "pp": 1, "dp": 2, "cp": 1}))
    Scheduler(settings, RecordingExecutor()).schedule_once()
    assert _job(url, job).wait_reason["code"] == "single_node_executor"


class _GangExecutor(RecordingExecutor):
    multi_node = True


def _allocations(url: str, job_id: str) -> list[tuple[str, int, int, list[int]]]:
    with session_scope(url) as s:
        rows = s.execute(
            select(JobAllocation.node_id, JobAllocation.node_rank, JobAllocation.slots, JobAllocation.devices)
            .where(JobAllocation.job_id == job_id)
            .order_by(JobAllocation.node_rank)
        ).all()
        return [tuple(r) for r in rows]  # type: ignore[misc]


def _used(url: str, *nodes: str) -> list[int]:
    with session_scope(url) as s:
        return [s.get(Node, n).slots_used for n in nodes]


def test_a_gang_is_reserved_on_two_nodes_whole_and_released_whole(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    a, b = add_node(2, hostname="a"), add_node(2, hostname="b")
    gang = add_job(procs=4, layout={"tp": 2, "pp": 1, "dp": 2, "cp": 1})
    waiting = add_job(procs=4)  # the second big job holds nothing while it waits: no deadlock
    ex = _GangExecutor()
    sched = Scheduler(settings, ex)
    assert sched.schedule_once() == [gang]
    job = _job(url, gang)
    assert job.status == SCHEDULED and job.node_id == a and job.devices == [0, 1]
    assert job.status_reason == "placed on 2 nodes: a (2), b (2)"
    assert _allocations(url, gang) == [(a, 0, 2, [0, 1]), (b, 1, 2, [0, 1])]
    assert _used(url, a, b) == [2, 2]
    assert _allocations(url, waiting) == [] and _job(url, waiting).wait_reason["code"] == "no_free_slots"
    with session_scope(url) as s:  # the gang ends: both nodes' slots come back, its rows go
        assert transition(s, gang, RUNNING, from_statuses=(SCHEDULED,))
        assert transition(s, gang, "succeeded", from_statuses=(RUNNING,))
    assert _used(url, a, b) == [0, 0] and _allocations(url, gang) == []
    assert sched.schedule_once() == [waiting]
    assert [r[0] for r in _allocations(url, waiting)] == [a, b]


def test_a_gang_reservation_is_all_or_nothing(
    settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = settings.resolved_database_url
    a, b = add_node(2, hostname="a"), add_node(2, hostname="b")
    other = add_job(procs=1)
    gang = add_job(procs=4)
    with session_scope(url) as s:  # another scheduler took a slot on b after our snapshot
        assert reserve_and_schedule(s, other, b, devices=[0])
    with session_scope(url) as s:
        assert not reserve_gang(s, gang, [(a, [0, 1]), (b, [0, 1])])
        s.rollback()
    assert _used(url, a, b) == [0, 1] and _allocations(url, gang) == []
    assert _job(url, gang).status == QUEUED and _job(url, gang).node_id is None
    with session_scope(url) as s:  # devices held by a racing reservation are refused too
        assert not reserve_gang(s, gang, [(a, [0, 1]), (b, [0, 1])])
        s.rollback()
    assert _used(url, a, b) == [0, 1]


def test_expected_end_follows_the_pace_so_far_within_max_runtime() -> None:
    now = utcnow()
    started = now - timedelta(seconds=100)
    # 100 s for 25 of 100 steps: 300 s to go, well inside the hour left of max_runtime_s
    assert expected_end_s(started, 3700.0, now, 25, 100) == pytest.approx(300.0)
    # never past max_runtime_s (it is stopped there)
    assert expected_end_s(started, 200.0, now, 25, 100) == pytest.approx(100.0)
    # no step done yet, or no step count: max_runtime_s alone; neither known: no estimate
    assert expected_end_s(started, 3700.0, now, 0, 100) == pytest.approx(3600.0)
    assert expected_end_s(started, None, now, 25, 100) == pytest.approx(300.0)
    assert expected_end_s(started, None, now) is None and expected_end_s(None, 60.0, now) is None
