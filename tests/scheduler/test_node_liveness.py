"""Node liveness in Scheduler.reconcile_once (SQLite and PostgreSQL): a node whose heartbeats stop
for node_lost_after_s is marked lost, its slots are no longer offered, its jobs fail over (requeued
with the node named and avoided next time, or failed without retries), and a heartbeat makes it
ready again. Two reconcilers at once mark and requeue once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
from scheduler_helpers import RecordingExecutor
from sqlalchemy import func, select, update

from megatrain.db.jobs import reserve_and_schedule, transition
from megatrain.db.models import FAILED, QUEUED, RUNNING, SCHEDULED, Job, JobEvent, Node, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.scheduler.placement import NodeRoom, QueuedJob, place
from megatrain.settings import Settings, get_settings, reset_settings_cache


@pytest.fixture
def live_settings(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("MEGATRAIN_NODE_LOST_AFTER_S", "3")
    reset_settings_cache()
    return get_settings()


def _seen(url: str, node_id: str, seconds_ago: float) -> None:
    with session_scope(url) as s:
        s.execute(
            update(Node)
            .where(Node.id == node_id)
            .values(last_seen_at=utcnow() - timedelta(seconds=seconds_ago))
        )


def _start(url: str, job_id: str, node_id: str) -> None:
    """Place the job on the node and mark it running, as a runner would."""
    with session_scope(url) as s:
        assert reserve_and_schedule(s, job_id, node_id, "test", devices=[0])
    with session_scope(url) as s:
        assert transition(s, job_id, RUNNING, from_statuses=(SCHEDULED,), runner_pid=1, runner_host="x")


def test_a_silent_node_is_lost_and_its_job_requeued_avoiding_it(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = live_settings.resolved_database_url
    a = add_node(2, hostname="node-a")
    b = add_node(2, hostname="node-b")
    job = add_job(procs=1)
    _start(url, job, a)
    sched = Scheduler(live_settings, RecordingExecutor())

    _seen(url, a, 2)  # within the bound: nothing happens
    assert sched.reconcile_once() == []
    _seen(url, a, 4)  # past node_lost_after_s=3
    assert sched.reconcile_once() == [job]
    with session_scope(url) as s:
        node = s.get(Node, a)
        assert (node.status, node.slots_used) == ("lost", 0)
        assert node.lost_at is not None
        j = s.get(Job, job)
        assert j.status == QUEUED and j.node_id is None
        assert "node node-a lost" in j.status_reason and "\n" not in j.status_reason
        assert j.avoid_nodes == [a]
        event = s.scalars(select(JobEvent).where(JobEvent.job_id == job, JobEvent.to_status == QUEUED)).one()
        assert event.data == {"cause": "node_lost", "node_id": a, "hostname": "node-a"}
        assert s.get(Node, b).status == "ready"

    # Placed again: on the other node, though node-a is back and the emptier-looking choice is equal.
    _seen(url, a, 0)
    with session_scope(url) as s:
        s.execute(update(Node).where(Node.id == a).values(status="ready"))
    ex = RecordingExecutor()
    assert Scheduler(live_settings, ex).schedule_once() == [job]
    with session_scope(url) as s:
        assert s.get(Job, job).node_id == b


def test_a_lost_node_offers_no_slots_until_it_heartbeats_again(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = live_settings.resolved_database_url
    a = add_node(2, hostname="node-a")
    _seen(url, a, 60)
    sched = Scheduler(live_settings, RecordingExecutor())
    assert sched.mark_lost_nodes() == [(a, "node-a")]
    assert sched.mark_lost_nodes() == []  # marked once
    job = add_job(procs=1)
    assert sched.schedule_once() == []
    with session_scope(url) as s:
        assert "no ready nodes" in s.get(Job, job).status_reason

    # The worker's heartbeat (worker.celery_app.node_heartbeat) makes it ready again.
    from megatrain.worker.celery_app import node_heartbeat

    node_heartbeat(live_settings, a, "cpu", 2)
    with session_scope(url) as s:
        node = s.get(Node, a)
        assert node.status == "ready"
        assert node.devices_free == 2 and node.memory_free_bytes and node.memory_free_bytes > 0
        assert node.health == {"ok": True, "devices": 2, "problems": []}
    assert sched.schedule_once() == [job]


def test_a_job_without_retries_left_fails_naming_the_node(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = live_settings.resolved_database_url
    a = add_node(2, hostname="node-a")
    job = add_job(procs=1, max_retries=0)
    _start(url, job, a)
    _seen(url, a, 10)
    assert Scheduler(live_settings, RecordingExecutor()).reconcile_once() == [job]
    with session_scope(url) as s:
        j = s.get(Job, job)
        assert j.status == FAILED
        assert j.status_reason.startswith("node node-a lost") and "no retries left" in j.status_reason


def test_placement_avoids_a_node_only_while_another_has_room() -> None:
    a = NodeRoom("id-a", "a", 2, 2)
    b = NodeRoom("id-b", "b", 2, 2)
    avoid = frozenset({"id-a"})
    [d] = place([QueuedJob("j", "p", 1, avoid=avoid)], {"p": [a, b]})
    assert d.placement is not None and d.placement.node_id == "id-b"
    full_b = NodeRoom("id-b", "b", 2, 0, frozenset({0, 1}))
    [d] = place([QueuedJob("j", "p", 1, avoid=avoid)], {"p": [a, full_b]})
    assert d.placement is not None and d.placement.node_id == "id-a"  # no other room: not stuck


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_two_reconcilers_mark_and_requeue_once(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = live_settings.resolved_database_url
    nodes = [add_node(4, hostname=f"node-{i}") for i in range(3)]
    jobs = [add_job(procs=1) for _ in range(6)]
    for i, job in enumerate(jobs):
        with session_scope(url) as s:
            assert reserve_and_schedule(s, job, nodes[i % 3], "test", devices=[i // 3])
    for n in nodes:
        _seen(url, n, 30)
    barrier = threading.Barrier(2)
    marked: list[list[tuple[str, str]]] = [[], []]
    moved: list[list[str]] = [[], []]

    def run(i: int) -> None:
        sched = Scheduler(live_settings, RecordingExecutor())
        barrier.wait()
        marked[i] = sched.mark_lost_nodes()
        moved[i] = sched.fail_over_lost_nodes()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(marked[0] + marked[1]) == sorted((n, f"node-{i}") for i, n in enumerate(nodes))
    assert sorted(moved[0] + moved[1]) == sorted(jobs)
    with session_scope(url) as s:
        requeues = s.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.to_status == QUEUED))
        assert requeues == len(jobs)
        assert {n.slots_used for n in s.scalars(select(Node))} == {0}


def test_when_every_node_falls_silent_at_once_none_is_lost_until_they_can_be_heard_again(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    """A cluster-wide silence is the control plane's outage (an API restart slower than the bound),
    not every node's death (scheduler.intake): no node is lost and no attempt ends for it, and once
    heartbeats arrive again each node has a whole bound from then to be heard."""
    url = live_settings.resolved_database_url
    a, b = add_node(2, hostname="node-a"), add_node(2, hostname="node-b")
    job = add_job(procs=1)
    _start(url, job, b)
    sched = Scheduler(live_settings, RecordingExecutor())
    _seen(url, a, 10)
    _seen(url, b, 10)  # nothing heard from anyone for over node_lost_after_s=3
    assert sched.reconcile_once() == []
    _seen(url, a, 0)  # heartbeats arrive again, node-a's first
    assert sched.reconcile_once() == []  # node-b, silent for 10 s, is judged from now
    with session_scope(url) as s:
        assert {n.status for n in s.scalars(select(Node))} == {"ready"}
        assert s.get(Job, job).status == RUNNING
    sched.intake.resumed_at -= timedelta(seconds=4)  # a bound later, node-b is still silent
    _seen(url, a, 0)
    assert sched.reconcile_once() == [job]
    with session_scope(url) as s:
        assert (s.get(Node, a).status, s.get(Node, b).status) == ("ready", "lost")
        assert "node node-b lost" in s.get(Job, job).status_reason


def test_a_cluster_falling_silent_one_heartbeat_apart_loses_no_node(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    """The soak's API restart in CI: both nodes' last heartbeats landed a second apart, so node-a
    crossed the bound while node-b's silence was still within it. Judged by node-b's freshness
    alone, node-a was lost, and then node-b, the one ready node left, a tick later."""
    url = live_settings.resolved_database_url
    a, b = add_node(2, hostname="node-a"), add_node(2, hostname="node-b")
    job = add_job(procs=1)
    _start(url, job, a)
    sched = Scheduler(live_settings, RecordingExecutor())
    _seen(url, a, 3.5)  # past node_lost_after_s=3
    _seen(url, b, 2.5)  # within it, but nothing heard from anyone for over half of it
    assert sched.reconcile_once() == []
    _seen(url, b, 3.5)
    assert sched.reconcile_once() == []
    with session_scope(url) as s:
        assert {n.status for n in s.scalars(select(Node))} == {"ready"}
        assert s.get(Job, job).status == RUNNING
    _seen(url, b, 0)  # node-b is heard again; node-a, still silent, has a bound from now
    assert sched.reconcile_once() == []
    sched.intake.resumed_at -= timedelta(seconds=4)
    _seen(url, b, 0)
    assert sched.reconcile_once() == [job]
    with session_scope(url) as s:
        assert (s.get(Node, a).status, s.get(Node, b).status) == ("lost", "ready")


def test_a_cluster_silent_for_ten_bounds_is_judged_node_by_node(
    live_settings: Settings, add_node: Callable, add_job: Callable
) -> None:
    url = live_settings.resolved_database_url
    a, b = add_node(2, hostname="node-a"), add_node(2, hostname="node-b")
    _seen(url, a, 40)
    _seen(url, b, 40)  # 10 x 3 s: gone dark for real
    sched = Scheduler(live_settings, RecordingExecutor())
    sched.reconcile_once()
    with session_scope(url) as s:
        assert {n.status for n in s.scalars(select(Node))} == {"lost"}
