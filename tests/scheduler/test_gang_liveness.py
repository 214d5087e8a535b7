"""A multi-node job (a gang) fails over when any of its nodes is lost, not only the node its job row
names (node rank 0): the attempt ends, every node's share is given back, the lost node is avoided."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
from scheduler_helpers import RecordingExecutor
from sqlalchemy import select, update

from megatrain.db.jobs import reserve_gang, transition
from megatrain.db.models import QUEUED, RUNNING, SCHEDULED, Job, JobAllocation, JobEvent, Node, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings, get_settings, reset_settings_cache


@pytest.fixture
def live_settings(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("MEGATRAIN_NODE_LOST_AFTER_S", "3")
    reset_settings_cache()
    return get_settings()


def test_losing_a_gangs_second_node_ends_its_attempt(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = live_settings.resolved_database_url
    a = add_node(2, hostname="node-a")
    b = add_node(2, hostname="node-b")
    job = add_job(procs=4)
    with session_scope(url) as s:
        assert reserve_gang(s, job, [(a, [0, 1]), (b, [0, 1])], "test")
    with session_scope(url) as s:
        assert transition(s, job, RUNNING, from_statuses=(SCHEDULED,), runner_pid=1, runner_host="x")
    sched = Scheduler(live_settings, RecordingExecutor())
    assert sched.reconcile_once() == []

    with session_scope(url) as s:  # node-b (node rank 1) stops heartbeating; node-a is fine
        s.execute(update(Node).values(last_seen_at=utcnow()))
        s.execute(update(Node).where(Node.id == b).values(last_seen_at=utcnow() - timedelta(seconds=4)))
    assert sched.reconcile_once() == [job]
    assert sched.reconcile_once() == []  # once
    with session_scope(url) as s:
        j = s.get(Job, job)
        assert j.status == QUEUED and j.node_id is None and j.avoid_nodes == [b]
        assert "node node-b lost" in j.status_reason
        assert s.scalars(select(JobAllocation).where(JobAllocation.job_id == job)).all() == []
        assert [s.get(Node, n).slots_used for n in (a, b)] == [0, 0]
        event = s.scalars(select(JobEvent).where(JobEvent.job_id == job, JobEvent.to_status == QUEUED)).one()
        assert event.data == {"cause": "node_lost", "node_id": b, "hostname": "node-b"}
