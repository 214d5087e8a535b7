"""The job state machine on SQLite and PostgreSQL: guarded transitions, slot accounting."""

from fixtures.cluster import seed_job, seed_node
from sqlalchemy import select

from megatrain.db.jobs import reserve_and_schedule, retry_allowed, transition
from megatrain.db.models import (
    CANCELLED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    Job,
    JobEvent,
    Node,
)
from megatrain.db.session import session_scope


def _seed(url: str, slots: int = 4, procs: int = 2) -> tuple[str, str]:
    node_id = seed_node(url, slots, hostname="h1")
    return seed_job(url, procs), node_id


def test_schedule_reserves_and_terminal_releases_slots(db_url: str) -> None:
    job_id, node_id = _seed(db_url)
    with session_scope(db_url) as s:
        assert reserve_and_schedule(s, job_id, node_id, "placed")
    with session_scope(db_url) as s:
        assert s.get(Node, node_id).slots_used == 2
        assert s.get(Job, job_id).attempt == 1
        assert transition(s, job_id, RUNNING, from_statuses=(SCHEDULED,))
        # a second, stale writer expecting `scheduled` loses
        assert not transition(s, job_id, RUNNING, from_statuses=(SCHEDULED,))
        assert transition(s, job_id, SUCCEEDED, from_statuses=(RUNNING,), reason="done")
    with session_scope(db_url) as s:
        assert s.get(Node, node_id).slots_used == 0
        job = s.get(Job, job_id)
        assert job.status == SUCCEEDED and job.finished_at is not None and job.node_id is None
        kinds = s.scalars(select(JobEvent.kind).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
        assert kinds == [SCHEDULED, RUNNING, SUCCEEDED]


def test_reserve_refuses_when_node_is_full(db_url: str) -> None:
    job_id, node_id = _seed(db_url, slots=1, procs=2)
    with session_scope(db_url) as s:
        assert not reserve_and_schedule(s, job_id, node_id)
        s.rollback()
    with session_scope(db_url) as s:
        assert s.get(Job, job_id).status == QUEUED
        assert s.get(Node, node_id).slots_used == 0


def test_a_job_paused_after_the_schedulers_snapshot_is_not_scheduled(db_url: str) -> None:
    """The scheduler chose a queued job; its user paused it before the UPDATE: it stays queued (it
    would otherwise run with the pause unseen) and its slots are not taken."""
    from megatrain.db.models import utcnow

    job_id, node_id = _seed(db_url)
    with session_scope(db_url) as s:
        s.get(Job, job_id).paused_at = utcnow()
    with session_scope(db_url) as s:
        assert not reserve_and_schedule(s, job_id, node_id)
        s.rollback()
    with session_scope(db_url) as s:
        assert s.get(Job, job_id).status == QUEUED and s.get(Node, node_id).slots_used == 0
        s.get(Job, job_id).paused_at = None
    with session_scope(db_url) as s:
        assert reserve_and_schedule(s, job_id, node_id)  # resumed: it runs


def test_cancel_of_queued_job_needs_no_slots(db_url: str) -> None:
    job_id, node_id = _seed(db_url)
    with session_scope(db_url) as s:
        assert transition(s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="user")
    with session_scope(db_url) as s:
        assert s.get(Node, node_id).slots_used == 0
        assert not reserve_and_schedule(s, job_id, node_id)


def test_retry_allowed_counts_starts() -> None:
    # attempt counts starts: max_retries=2 allows a 2nd and a 3rd start, not a 4th
    assert [retry_allowed(Job(attempt=a, max_retries=2)) for a in (1, 2, 3)] == [True, True, False]
    assert not retry_allowed(Job(attempt=1, max_retries=0))
    # Preempted and continued starts are not failures: a 5th start after 3 preemptions and one
    # continuation that fails is the job's first failure, retried only if max_retries allows one.
    assert not retry_allowed(Job(attempt=5, max_retries=0, preemptions=3, continuations=1))
    assert retry_allowed(Job(attempt=5, max_retries=1, preemptions=3, continuations=1))


def test_leaving_active_frees_devices_and_any_transition_clears_the_wait_reason(db_url: str) -> None:
    job_id, node_id = _seed(db_url)
    with session_scope(db_url) as s:
        s.get(Job, job_id).wait_reason = {"code": "no_free_slots", "pool": "default", "needs": 2, "freest": 0}
    with session_scope(db_url) as s:
        assert reserve_and_schedule(s, job_id, node_id, "placed", devices=[2, 3])
    with session_scope(db_url) as s:
        job = s.get(Job, job_id)
        assert job.devices == [2, 3] and job.wait_reason is None
        assert transition(s, job_id, QUEUED, from_statuses=(SCHEDULED,), reason="retry")
    with session_scope(db_url) as s:
        assert s.get(Job, job_id).devices is None and s.get(Node, node_id).slots_used == 0
