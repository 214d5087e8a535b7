"""The job state machine on SQLite and PostgreSQL: guarded transitions, slot accounting."""

from sqlalchemy import select

from megatrain.db.jobs import reserve_and_schedule, transition
from megatrain.db.models import (
    CANCELLED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    Job,
    JobEvent,
    Node,
    NodePool,
    Tenant,
)
from megatrain.db.session import session_scope


def _seed(url: str, slots: int = 4, procs: int = 2) -> tuple[str, str]:
    with session_scope(url) as s:
        t = Tenant(name="acme")
        pool = NodePool(name="default")
        s.add_all([t, pool])
        s.flush()
        node = Node(pool_id=pool.id, hostname="h1", slots_total=slots)
        job = Job(
            tenant_id=t.id, name="j", kind="pretrain", spec={}, spec_hash="x", layout={}, num_procs=procs
        )
        s.add_all([node, job])
        s.flush()
        return job.id, node.id


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


def test_cancel_of_queued_job_needs_no_slots(db_url: str) -> None:
    job_id, node_id = _seed(db_url)
    with session_scope(db_url) as s:
        assert transition(s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="user")
    with session_scope(db_url) as s:
        assert s.get(Node, node_id).slots_used == 0
        assert not reserve_and_schedule(s, job_id, node_id)
