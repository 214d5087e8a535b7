"""The scheduling loop: place queued jobs on nodes, hand them to the executor, recover lost runners.

Which job goes where, and why each other one waits, is decided by `placement.place` on a snapshot
of the queue and the ready nodes. Several schedulers may run at once (API replicas, a separate
scheduler process): a job is placed only through `reserve_and_schedule`, whose guarded UPDATEs let
exactly one of them win; a loser takes a fresh snapshot and decides again.

The loop knows nothing of how jobs run: the executor submits them, registers its nodes and says
whether a runner is alive (`worker.executors.Executor`).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

from sqlalchemy import Select, func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from megatrain.db.goodput import record_lost_attempt
from megatrain.db.jobs import record_event, reserve_and_schedule, reserve_gang, retry_allowed, transition
from megatrain.db.models import (
    ACTIVE_STATES,
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    Job,
    JobAllocation,
    Node,
    utcnow,
)
from megatrain.db.session import get_sessionmaker, session_scope
from megatrain.failures import NOT_RETRIED, attempt_reason, failure_data
from megatrain.scheduler.datasets import dispatch_datasets, reconcile_datasets
from megatrain.scheduler.exports import dispatch_exports, reconcile_exports
from megatrain.scheduler.intake import Intake
from megatrain.scheduler.metrics import SchedulerMetrics
from megatrain.scheduler.placement import Decision, Placement, place
from megatrain.scheduler.preemption import RunningJob, victims_by_pool
from megatrain.scheduler.reasons import BEHIND_JOB, CANCEL_REQUESTED, NO_FREE_SLOTS, render_wait
from megatrain.scheduler.samples import dispatch_samples, reconcile_samples
from megatrain.scheduler.snapshot import Snapshot, read_snapshot
from megatrain.settings import Settings, get_settings
from megatrain.worker.executors import Executor, get_executor

log = logging.getLogger(__name__)

MAX_PASSES = 8
"""Fresh snapshots one tick may take after lost reservation races before it leaves the rest to the
next tick (several schedulers competing for the same slots)."""


def _gang_victims() -> Select[Any]:
    """(job id, node id, hostname) of every active multi-node job's share on a lost node."""
    return (
        select(Job.id, Node.id.label("node_id"), Node.hostname)
        .join(JobAllocation, JobAllocation.job_id == Job.id)
        .join(Node, Node.id == JobAllocation.node_id)
        .where(Job.status.in_(ACTIVE_STATES), Node.status == "lost")
    )


def _holds(s: Session, job: Job, node_id: str) -> bool:
    """Whether the job's current attempt still holds `node_id` (its node, or a gang's share)."""
    if job.node_id == node_id:
        return True
    share = select(JobAllocation.id).where(JobAllocation.job_id == job.id, JobAllocation.node_id == node_id)
    return s.scalar(share) is not None


def _attempt_facts(job: Job) -> SimpleNamespace:
    """What the ledger needs of an attempt, read before the transition changes the row."""
    names = ("id", "node_id", "attempt", "started_at", "heartbeat_at")
    return SimpleNamespace(**{n: getattr(job, n) for n in names})


class Scheduler:
    """`schedule_once` places queued jobs; `reconcile_once` recovers jobs whose runner is gone."""

    def __init__(
        self,
        settings: Settings | None = None,
        executor: Executor | None = None,
        metrics: SchedulerMetrics | None = None,
    ):
        self.settings = settings or get_settings()
        self.url = self.settings.resolved_database_url
        self._executor = executor
        self.intake = Intake(self.settings.node_lost_after_s)
        self.metrics = metrics or SchedulerMetrics()

    @property
    def executor(self) -> Executor:
        if self._executor is None:
            self._executor = get_executor(self.settings)
        return self._executor

    # -- placement -------------------------------------------------------------------------------

    def _snapshot(self) -> Snapshot:
        """The queue in (priority, FIFO) order, each pool's ready nodes, each tenant's use."""
        with session_scope(self.url) as s:
            return read_snapshot(s, utcnow())

    def _try_reserve(self, job_id: str, placements: tuple[Placement, ...]) -> bool:
        """Reserve a decision's nodes and devices (all of a gang's or none) in one transaction."""
        session = get_sessionmaker(self.url)()
        where = ", ".join(f"{p.hostname} ({len(p.devices)})" for p in placements)
        try:
            if len(placements) == 1:
                (p,) = placements
                n = len(p.devices)
                reason = f"placed on {p.hostname} ({n} slot{'s' * (n != 1)})"
                ok = reserve_and_schedule(session, job_id, p.node_id, reason, devices=list(p.devices))
            else:
                shares = [(p.node_id, list(p.devices)) for p in placements]
                ok = reserve_gang(session, job_id, shares, f"placed on {len(placements)} nodes: {where}")
            if ok:
                session.commit()
                return True
            session.rollback()
        except SQLAlchemyError as exc:
            session.rollback()
            log.warning("reserving %s on %s failed: %s", job_id, where, exc)
        finally:
            session.close()
        return False

    def _submit(self, job_id: str) -> bool:
        try:
            self.executor.submit(job_id)
            return True
        except Exception as exc:
            log.exception("executor could not start job %s", job_id)
            self.metrics.decided("submit_failed")
            with session_scope(self.url) as s:
                job = s.get(Job, job_id)
                if job is None:
                    return False
                transition(
                    s,
                    job_id,
                    QUEUED if retry_allowed(job) else FAILED,
                    from_statuses=(SCHEDULED,),
                    reason=f"executor could not start the job: {exc}"[:2000],
                )
            return False

    def _note_waits(self, queued: list[Any], decisions: list[Decision]) -> None:
        """Store why each job waits (data, with its place in its pool's queue) and its owner's text,
        only where it changed: no event per tick. The text names a blocking job only if the waiting
        job's tenant owns it."""
        tenant_of = {q.id: q.tenant_id for q in queued}
        row_of = {q.id: q for q in queued}
        changes = []
        for d in decisions:
            q, reason = row_of[d.job_id], d.wait
            if reason is None or reason.code == CANCEL_REQUESTED:
                continue
            owns = reason.code == BEHIND_JOB and tenant_of.get(reason.job_id or "") == q.tenant_id
            text = "waiting: " + render_wait(reason, owns_blocker=owns)
            data = reason.as_dict() | {"position": d.position}
            if q.status_reason != text or q.wait_reason != data:
                changes.append((q.id, text, data))
        if not changes:
            return
        with session_scope(self.url) as s:
            for job_id, text, data in changes:
                s.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.status == QUEUED)
                    .values(status_reason=text, wait_reason=data)
                    .execution_options(synchronize_session=False)
                )

    def schedule_once(self) -> list[str]:
        """Place what fits now and hand it to the executor; returns the ids submitted."""
        self.executor.refresh_nodes()
        submitted: list[str] = []
        multi_node = bool(getattr(self.executor, "multi_node", False))
        for _ in range(MAX_PASSES):
            snap = self._snapshot()
            if not snap.queue:
                self.metrics.waits(())
                return submitted
            decisions = place(snap.queue, snap.pools, snap.tenants, multi_node=multi_node)
            lost_race = False
            for d in decisions:
                if not d.placements:
                    continue
                if not self._try_reserve(d.job_id, d.placements):
                    # Another scheduler took the job or the room: the decisions after this one
                    # assumed it, so decide again on a fresh snapshot.
                    lost_race = True
                    self.metrics.decided("lost_race")
                    break
                if self._submit(d.job_id):
                    submitted.append(d.job_id)
                    self.metrics.decided("placed")
            if not lost_race:
                self._note_waits(snap.rows, decisions)
                self.metrics.waits(decisions)
                self.metrics.decided("preempted", len(self._preempt(snap, decisions, multi_node)))
                break
        return submitted

    def _running(self, s: Session) -> list[RunningJob]:
        """Running jobs as preemption sees them (scheduled ones are left alone: not started yet)."""
        rows = s.execute(
            select(
                Job.id, Job.pool, Job.priority, Job.started_at, Job.node_id, Job.devices, Job.preempt_for,
                Job.preemptions, Job.max_preemptions,
                Job.spec["resources"]["preemptible"].as_boolean().label("preemptible"),
            ).where(Job.status == RUNNING, Job.node_id.is_not(None))
        ).all()  # fmt: skip
        shares: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        for job_id, node_id, devices in s.execute(
            select(JobAllocation.job_id, JobAllocation.node_id, JobAllocation.devices).where(
                JobAllocation.job_id.in_([r.id for r in rows])
            )
        ):
            shares.setdefault(job_id, []).append((node_id, tuple(devices or ())))
        return [
            RunningJob(
                r.id, r.pool, r.priority, r.started_at.timestamp() if r.started_at else 0.0,
                tuple(shares.get(r.id) or [(r.node_id, tuple(r.devices or ()))]),
                preemptible=r.preemptible is not False, preempting=r.preempt_for is not None,
                preemptions_left=r.max_preemptions - r.preemptions,
            )
            for r in rows
        ]  # fmt: skip

    def _preempt(self, snap: Snapshot, decisions: list[Decision], multi_node: bool) -> list[str]:
        """Ask lower-priority running jobs to make room for a queued job that does not fit (their
        runners checkpoint, stop and requeue them; it is placed once the room is free). Returns the
        victims marked by this call."""
        waiting = {
            d.job_id for d in decisions if d.wait is not None and d.wait.code in (NO_FREE_SLOTS, BEHIND_JOB)
        }
        if not waiting:
            return []
        marked: list[str] = []
        with session_scope(self.url) as s:
            plan = victims_by_pool(snap.queue, waiting, snap.pools, self._running(s), multi_node=multi_node)
            rows = {r.id: r for r in snap.rows}
            for job_id, victims in plan.items():
                for victim in victims:
                    if self._mark_victim(s, victim, rows[job_id]):
                        marked.append(victim)
        return marked

    def _mark_victim(self, s: Session, victim_id: str, waiting: Any) -> bool:
        """Set the victim's preempt_for (once) and tell its owner; the waiting job is named only to
        its own tenant."""
        done = s.execute(
            update(Job)
            .where(Job.id == victim_id, Job.status == RUNNING, Job.preempt_for.is_(None))
            .values(preempt_for=waiting.id)
            .execution_options(synchronize_session=False)
        ).rowcount
        if done != 1:
            return False
        owner = s.scalar(select(Job.tenant_id).where(Job.id == victim_id))
        whom = f"job {waiting.name}" if owner == waiting.tenant_id else "a higher-priority job"
        data = {"for_job": waiting.id} if owner == waiting.tenant_id else {}
        record_event(
            s,
            victim_id,
            "preempting",
            f"preempting: checkpointing and stopping to make room for {whom}",
            data,
        )
        log.info("preempting %s for %s", victim_id, waiting.id)
        return True

    # -- recovery --------------------------------------------------------------------------------

    def _lost_why(self, job: Job, now: datetime) -> str | None:
        """Why the job's runner is gone, or None. Only a definite answer (the executor's False, or a
        heartbeat older than heartbeat_timeout_s) ends an attempt: a status query that fails says
        nothing, so the job is left alone this tick rather than relaunched while it may be healthy."""
        try:
            verdict = self.executor.runner_alive(job)
        except Exception as exc:
            log.warning(
                "job %s: could not ask whether its runner is alive (%s); judging it later", job.id, exc
            )
            return None
        if verdict is True:
            return None
        if verdict is False:
            where = f"pid {job.runner_pid} on {job.runner_host}" if job.runner_pid else "process"
            return f"runner {where} is gone"
        if self.intake.deaf(now):
            return None  # no runner can be heard now: silence says nothing of this one
        timeout = timedelta(seconds=self.settings.heartbeat_timeout_s)
        if job.status == SCHEDULED:
            since = self.intake.heard_from(job.scheduled_at or job.updated_at)
            if since is not None and now - since > timeout:
                return f"scheduled {(now - since).total_seconds():.0f}s ago but no runner picked it up"
            return None
        last = self.intake.heard_from(job.heartbeat_at or job.started_at or job.updated_at)
        if last is not None and now - last > timeout:
            return f"no heartbeat from {job.runner_host} for {(now - last).total_seconds():.0f}s"
        return None

    def _runner_failure(self, job: Job) -> dict[str, Any] | None:
        """Why the executor says the job's gone runner ended (a failure record), or None; a query
        that fails says nothing (the attempt is then judged as a lost runner)."""
        try:
            return self.executor.runner_failure(job)
        except Exception as exc:
            log.warning("job %s: could not ask why its runner ended (%s)", job.id, exc)
            return None

    def listen(self, now: datetime | None = None) -> None:
        """Whether any ready node was heard from lately (scheduler.intake)."""
        with session_scope(self.url) as s:
            newest, ready = s.execute(
                select(func.max(Node.last_seen_at), func.count()).where(Node.status == "ready")
            ).one()
        self.intake.observe(newest, ready, now or utcnow())

    def mark_lost_nodes(self, now: datetime | None = None) -> list[tuple[str, str]]:
        """Mark lost every ready node unseen for node_lost_after_s; (id, hostname) of those this
        scheduler marked. One guarded UPDATE: a second scheduler's finds them lost already."""
        now = now or utcnow()
        cutoff = now - timedelta(seconds=self.settings.node_lost_after_s)
        resumed = self.intake.resumed_at
        if self.intake.deaf(now) or (resumed is not None and resumed >= cutoff):
            return []  # the control plane cannot hear nodes, or has heard again too recently to judge
        with session_scope(self.url) as s:
            rows = s.execute(
                update(Node)
                .where(Node.status == "ready", Node.last_seen_at < cutoff)
                .values(status="lost", lost_at=now)
                .returning(Node.id, Node.hostname, Node.last_seen_at)
                .execution_options(synchronize_session=False)
            ).all()
        for r in rows:
            age = (now - r.last_seen_at).total_seconds()
            log.warning("node %s lost: no heartbeat for %.0fs", r.hostname, age)
        self.metrics.decided("node_lost", len(rows))
        return [(r.id, r.hostname) for r in rows]

    def fail_over_lost_nodes(self) -> list[str]:
        """End the attempts of the scheduled and running jobs of every lost node: requeued (while
        retries remain; they avoid that node next time) or failed, the node named in the reason
        and recorded in the event. A multi-node job's attempt ends when any of its nodes is lost
        (its shards on the others stop when they see it). Guarded per job, so two schedulers move
        each job once."""
        changed: list[str] = []
        with session_scope(self.url) as s:
            victims = s.execute(
                select(Job.id, Node.id.label("node_id"), Node.hostname)
                .join(Node, Node.id == Job.node_id)
                .where(Job.status.in_(ACTIVE_STATES), Node.status == "lost")
                .union(_gang_victims())
            ).all()
        for v in victims:
            with session_scope(self.url) as s:
                job = s.scalars(select(Job).where(Job.id == v.id).with_for_update()).first()
                if job is None or job.status not in ACTIVE_STATES or not _holds(s, job, v.node_id):
                    continue
                lost = f"node {v.hostname} lost (no heartbeat for over {self.settings.node_lost_after_s:g}s)"
                avoid = sorted({*(job.avoid_nodes or ()), v.node_id})
                if job.cancel_requested:
                    to, reason = CANCELLED, f"{lost}; cancel was requested"
                elif retry_allowed(job):
                    to, reason = QUEUED, f"{lost}; retrying on another node, will resume from checkpoint"
                else:
                    to, reason = FAILED, f"{lost} on attempt {job.attempt}; no retries left"
                data = {"cause": "node_lost", "node_id": v.node_id, "hostname": v.hostname}
                clear = {"runner_pid": None, "runner_host": None, "heartbeat_at": None}
                log.warning("job %s: %s", v.id, reason)
                ran = _attempt_facts(job) if job.status == RUNNING else None
                if transition(
                    s, v.id, to, from_statuses=(job.status,), reason=reason, data=data,
                    avoid_nodes=avoid, **clear,
                ):  # fmt: skip
                    changed.append(v.id)
                    self.metrics.decided("failed_over")
                    if ran is not None:
                        record_lost_attempt(s, self.settings, ran, to, "node_lost")
        return changed

    def reconcile_once(self) -> list[str]:
        """Cancel queued jobs asked to stop; mark silent nodes lost and fail their jobs over;
        requeue (or fail) active jobs whose runner is gone.

        Returns the ids whose state changed.
        """
        changed: list[str] = []
        # Nodes this executor registers itself (the local one: this very machine) are refreshed
        # before liveness is judged, so a slow tick never makes the scheduler's own host lost.
        self.executor.refresh_nodes()
        now = utcnow()  # one reading for both: what was heard and who is past the bound
        self.listen(now)
        self.mark_lost_nodes(now)
        changed += self.fail_over_lost_nodes()
        with session_scope(self.url) as s:
            ids = s.scalars(select(Job.id).where(Job.status == QUEUED, Job.cancel_requested.is_(True))).all()
            for job_id in ids:
                if transition(
                    s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="cancelled before it started"
                ):
                    changed.append(job_id)
                    self.metrics.decided("cancelled")
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
                failure, data = self._runner_failure(job), None
                if job.cancel_requested:
                    to, reason = CANCELLED, f"{why}; cancel was requested"
                elif failure is not None and failure.get("kind") in NOT_RETRIED:
                    # The executor knows why (Slurm's OUT_OF_MEMORY): every retry would end the same.
                    to, reason = FAILED, attempt_reason(failure, 0, job.attempt, retrying=False)
                    data = {"attempt": job.attempt, "failure": failure_data(failure)}
                elif retry_allowed(job):
                    to, reason = QUEUED, f"runner lost ({why}); retrying, will resume from checkpoint"
                else:
                    to, reason = FAILED, f"runner lost ({why}) on attempt {job.attempt}; no retries left"
                log.warning("job %s: %s", job_id, reason)
                ran = _attempt_facts(job) if job.status == RUNNING else None
                if transition(s, job_id, to, from_statuses=(job.status,), reason=reason, data=data, **clear):
                    changed.append(job_id)
                    self.metrics.decided("runner_lost")
                    # An out-of-memory end is the layout's, not the node's: no quarantine count.
                    lost_as = str(failure["kind"]) if data is not None and failure else "runner_lost"
                    if ran is not None and (why := record_lost_attempt(s, self.settings, ran, to, lost_as)):
                        log.warning("node of job %s quarantined: %s", job_id, why)
        return changed

    # -- datasets --------------------------------------------------------------------------------

    def datasets_once(self) -> list[str]:
        """Recover datasets whose worker is lost, then hand pending ones to the executor."""
        return reconcile_datasets(self.settings, self.executor, self.intake) + dispatch_datasets(
            self.settings, self.executor
        )

    def exports_once(self) -> list[str]:
        """Recover exports whose worker is lost, then hand pending ones to the executor."""
        return reconcile_exports(self.settings, self.executor, self.intake) + dispatch_exports(
            self.settings, self.executor
        )

    def samples_once(self) -> list[str]:
        """Recover samples whose worker is lost, then hand pending ones to the executor."""
        return reconcile_samples(self.settings, self.executor, self.intake) + dispatch_samples(
            self.settings, self.executor
        )

    # -- loop ------------------------------------------------------------------------------------

    def run(self, stop_event: threading.Event) -> None:
        """schedule_once + reconcile_once every scheduler_interval_s until stop_event is set; each
        tick and step timed, and a step's error counted, in self.metrics (with the executor's
        runners' series)."""
        log.info("scheduler started (executor=%s)", self.settings.executor)
        self.metrics.include(self.executor.runner_metrics())
        while not stop_event.is_set():
            background = (self.datasets_once, self.exports_once, self.samples_once)
            with self.metrics.tick():
                for step in (self.reconcile_once, self.schedule_once, *background):
                    try:
                        with self.metrics.step(step.__name__):
                            step()
                    except SQLAlchemyError:
                        log.exception("scheduler: database error in %s; continuing", step.__name__)
                    except Exception:
                        log.exception("scheduler: unexpected error in %s; continuing", step.__name__)
            stop_event.wait(self.settings.scheduler_interval_s)
