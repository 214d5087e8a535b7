"""The scheduling loop: place queued jobs on nodes, hand them to the executor, recover lost runners.

Placement rule (strict priority, no backfill): queued jobs are taken by priority (highest first),
then FIFO by created_at. Within a pool, once a job that *could* fit a node (its size is at most the
largest node's total slots) finds no node with enough free slots, no later job of that pool is
placed in this tick: small low-priority jobs never keep a big high-priority one waiting forever.
A job too big for every node of its pool waits without blocking the others.

Several schedulers may run at once (API replicas, a separate scheduler process): a job is placed
only through `reserve_and_schedule`, whose guarded UPDATEs let exactly one of them win.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError

from megatrain.db.jobs import reserve_and_schedule, transition
from megatrain.db.models import (
    ACTIVE_STATES,
    CANCELLED,
    FAILED,
    QUEUED,
    SCHEDULED,
    Job,
    Node,
    NodePool,
    utcnow,
)
from megatrain.db.session import get_sessionmaker, session_scope
from megatrain.scheduler.pools import ensure_local_pool
from megatrain.settings import Settings, get_settings
from megatrain.worker.executors import Executor, get_executor
from megatrain.worker.procs import pid_alive

log = logging.getLogger(__name__)

LOCAL_NODE_REFRESH_S = 10.0
"""How often the local executor's scheduler re-registers this machine (nvidia-smi is not free)."""


@dataclass
class _NodeFree:
    id: str
    hostname: str
    total: int
    free: int


class Scheduler:
    """`schedule_once` places queued jobs; `reconcile_once` recovers jobs whose runner is gone."""

    def __init__(self, settings: Settings | None = None, executor: Executor | None = None):
        self.settings = settings or get_settings()
        self.url = self.settings.resolved_database_url
        self.hostname = socket.gethostname()
        self._executor = executor
        self._local_node_at = float("-inf")

    @property
    def executor(self) -> Executor:
        if self._executor is None:
            self._executor = get_executor(self.settings)
        return self._executor

    # -- placement -------------------------------------------------------------------------------

    def _refresh_local_node(self) -> None:
        if time.monotonic() - self._local_node_at < LOCAL_NODE_REFRESH_S:
            return
        with session_scope(self.url) as s:
            ensure_local_pool(s, self.settings)
        self._local_node_at = time.monotonic()

    def _free_slots(self) -> dict[str, list[_NodeFree]]:
        with session_scope(self.url) as s:
            rows = s.execute(
                select(Node.id, Node.hostname, Node.slots_total, Node.slots_used, NodePool.name)
                .join(NodePool, NodePool.id == Node.pool_id)
                .where(Node.status == "ready")
                .order_by(Node.hostname)
            ).all()
        pools: dict[str, list[_NodeFree]] = defaultdict(list)
        for r in rows:
            pools[r.name].append(_NodeFree(r.id, r.hostname, r.slots_total, r.slots_total - r.slots_used))
        return pools

    def _try_reserve(self, job_id: str, node: _NodeFree, num_procs: int) -> bool:
        session = get_sessionmaker(self.url)()
        try:
            reason = f"placed on {node.hostname} ({num_procs} slot{'s' * (num_procs != 1)})"
            if reserve_and_schedule(session, job_id, node.id, reason):
                session.commit()
                return True
            session.rollback()
        except SQLAlchemyError as exc:
            session.rollback()
            log.warning("reserving %s on %s failed: %s", job_id, node.hostname, exc)
        finally:
            session.close()
        return False

    def _refresh_after_miss(self, job_id: str, node: _NodeFree) -> bool:
        """After a lost race: update the node's free slots; True if the job is still queued."""
        with session_scope(self.url) as s:
            used = s.scalar(select(Node.slots_used).where(Node.id == node.id))
            status = s.scalar(select(Job.status).where(Job.id == job_id))
        if used is not None:
            node.free = node.total - used
        return status == QUEUED

    def _place(self, job_id: str, num_procs: int, nodes: list[_NodeFree]) -> bool | None:
        """True: scheduled here. False: no node has room. None: someone else took the job."""
        while True:
            # Best fit: the fullest node that still has room keeps big holes for big jobs.
            fits = sorted((n for n in nodes if n.free >= num_procs), key=lambda n: (n.free, n.hostname))
            if not fits:
                return False
            node = fits[0]
            if self._try_reserve(job_id, node, num_procs):
                node.free -= num_procs
                return True
            if not self._refresh_after_miss(job_id, node):
                return None
            if node.free >= num_procs:
                node.free = num_procs - 1  # still refused (e.g. a DB error): skip this node this tick

    def _submit(self, job_id: str) -> bool:
        try:
            self.executor.submit(job_id)
            return True
        except Exception as exc:
            log.exception("executor could not start job %s", job_id)
            with session_scope(self.url) as s:
                job = s.get(Job, job_id)
                if job is None:
                    return False
                retry = job.attempt <= job.max_retries
                transition(
                    s,
                    job_id,
                    QUEUED if retry else FAILED,
                    from_statuses=(SCHEDULED,),
                    reason=f"executor could not start the job: {exc}"[:2000],
                )
            return False

    def _note_waits(self, waits: dict[str, str]) -> None:
        """Say why each job waits, in status_reason only when it changed: no event per tick."""
        if not waits:
            return
        with session_scope(self.url) as s:
            for job_id, reason in waits.items():
                s.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.status == QUEUED, Job.status_reason != reason)
                    .values(status_reason=reason)
                    .execution_options(synchronize_session=False)
                )

    def schedule_once(self) -> list[str]:
        """Place what fits now and hand it to the executor; returns the ids submitted."""
        if self.settings.executor == "local":
            self._refresh_local_node()
        with session_scope(self.url) as s:
            queued = s.execute(
                select(Job.id, Job.pool, Job.num_procs, Job.priority)
                .where(Job.status == QUEUED, Job.cancel_requested.is_(False))
                .order_by(Job.priority.desc(), Job.created_at, Job.id)
            ).all()
        if not queued:
            return []
        pools = self._free_slots()
        blocked_by: dict[str, str] = {}
        waits: dict[str, str] = {}
        submitted: list[str] = []
        for job in queued:
            nodes = pools.get(job.pool, [])
            if not nodes:
                waits[job.id] = f"waiting: pool {job.pool!r} has no ready nodes"
                continue
            biggest = max(n.total for n in nodes)
            if job.num_procs > biggest:
                waits[job.id] = (
                    f"waiting: needs {job.num_procs} slots but the largest node in pool {job.pool!r} "
                    f"offers {biggest}"
                )
                continue
            if job.pool in blocked_by:
                waits[job.id] = (
                    f"waiting: behind job {blocked_by[job.pool]}, first in line for pool {job.pool!r}"
                )
                continue
            placed = self._place(job.id, job.num_procs, nodes)
            if placed is None:
                continue
            if not placed:
                blocked_by[job.pool] = job.id
                most = max(n.free for n in nodes)
                waits[job.id] = (
                    f"waiting: needs {job.num_procs} free slots in pool {job.pool!r}; "
                    f"the freest node has {most}"
                )
                continue
            if self._submit(job.id):
                submitted.append(job.id)
        self._note_waits(waits)
        return submitted

    # -- recovery --------------------------------------------------------------------------------

    def _lost_why(self, job: Job, now: datetime) -> str | None:
        timeout = timedelta(seconds=self.settings.heartbeat_timeout_s)
        if job.status == SCHEDULED:
            since = job.scheduled_at or job.updated_at
            if since is not None and now - since > timeout:
                return f"scheduled {(now - since).total_seconds():.0f}s ago but no runner picked it up"
            return None
        if job.runner_host == self.hostname and job.runner_pid and not pid_alive(job.runner_pid):
            return f"runner pid {job.runner_pid} on {job.runner_host} is gone"
        last = job.heartbeat_at or job.started_at or job.updated_at
        if last is not None and now - last > timeout:
            return f"no heartbeat from {job.runner_host} for {(now - last).total_seconds():.0f}s"
        return None

    def reconcile_once(self) -> list[str]:
        """Cancel queued jobs asked to stop; requeue (or fail) active jobs whose runner is gone.

        Returns the ids whose state changed.
        """
        changed: list[str] = []
        with session_scope(self.url) as s:
            ids = s.scalars(select(Job.id).where(Job.status == QUEUED, Job.cancel_requested.is_(True))).all()
            for job_id in ids:
                if transition(
                    s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="cancelled before it started"
                ):
                    changed.append(job_id)
        with session_scope(self.url) as s:
            active = s.scalars(select(Job.id).where(Job.status.in_(ACTIVE_STATES))).all()
        for job_id in active:
            with session_scope(self.url) as s:
                # FOR UPDATE (PostgreSQL) pins the row we judge, so a runner's own transition and
                # ours cannot interleave between the read and the guarded write.
                job = s.scalars(select(Job).where(Job.id == job_id).with_for_update()).first()
                if job is None or job.status not in ACTIVE_STATES:
                    continue
                why = self._lost_why(job, utcnow())
                if why is None:
                    continue
                clear = {"runner_pid": None, "runner_host": None, "heartbeat_at": None}
                if job.cancel_requested:
                    to, reason = CANCELLED, f"{why}; cancel was requested"
                elif job.attempt <= job.max_retries:
                    to, reason = QUEUED, f"runner lost ({why}); retrying, will resume from checkpoint"
                else:
                    to, reason = FAILED, f"runner lost ({why}) on attempt {job.attempt}; no retries left"
                log.warning("job %s: %s", job_id, reason)
                if transition(s, job_id, to, from_statuses=(job.status,), reason=reason, **clear):
                    changed.append(job_id)
        return changed

    # -- loop ------------------------------------------------------------------------------------

    def run(self, stop_event: threading.Event) -> None:
        """schedule_once + reconcile_once every scheduler_interval_s until stop_event is set."""
        log.info("scheduler started (executor=%s)", self.settings.executor)
        while not stop_event.is_set():
            for step in (self.reconcile_once, self.schedule_once):
                try:
                    step()
                except SQLAlchemyError:
                    log.exception("scheduler: database error in %s; continuing", step.__name__)
                except Exception:
                    log.exception("scheduler: unexpected error in %s; continuing", step.__name__)
            stop_event.wait(self.settings.scheduler_interval_s)
