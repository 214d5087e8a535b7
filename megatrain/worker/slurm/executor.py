"""The slurm executor: one sbatch job per attempt of a placed job, followed with squeue/sacct (or
through slurmrestd, worker.slurm.rest).

`submit` renders the attempt's script (worker.slurm.script) from the job's placement and the Slurm
settings and submits it; the Slurm job id is recorded as a 'slurm_submitted' event naming the
attempt, so a second submit of the same attempt (a restarted scheduler) finds it and submits
nothing. `runner_alive` maps the Slurm job's state onto the scheduler's recovery: waiting in Slurm's
queue is alive, an ended Slurm job whose attempt is still active in the database is gone (the
scheduler retries it, resuming from the checkpoint). `refresh_nodes`, once per scheduler tick,
reads every active attempt's Slurm state (`follow`: state changes and Slurm's reasons become events,
a cancel asked of a job still in Slurm's queue becomes an scancel) and registers the partition's
nodes from sinfo as the pool's nodes; Slurm keeps the final say on which hosts run.
Datasets, exports and samples run on this host as with the local executor.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.jobs import record_event
from megatrain.db.models import (
    QUARANTINED,
    RUNNING,
    SCHEDULED,
    Job,
    JobAllocation,
    JobEvent,
    Node,
    NodePool,
    utcnow,
)
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.executors import LocalExecutor, StatusUnknown, runner_env, with_attempt_token
from megatrain.worker.ingest import append_logs, next_log_seq
from megatrain.worker.shard import KILL_GRACE_S
from megatrain.worker.slurm.commands import SlurmCommands, SlurmError, SlurmNode
from megatrain.worker.slurm.rest import slurm_commands
from megatrain.worker.slurm.script import SlurmRequest, render_sbatch

if TYPE_CHECKING:
    from prometheus_client.registry import Collector
from megatrain.worker.slurm.states import SlurmState, failure_record

log = logging.getLogger(__name__)

SUBMITTED_EVENT = "slurm_submitted"
STATE_EVENT = "slurm_state"
LOG_TAIL_LINES = 40
"""Lines of each Slurm output file (batch.log, node-N.log) put in the job's log when Slurm ends an
attempt its runners did not."""
ATTEMPT_TOKEN_SLACK_S = 3600
"""An attempt token outlives the attempt's time limit by this (a Slurm job may wait in the queue)."""
NODE_REFRESH_S = 30.0
"""How often sinfo is asked for the partition's nodes."""
ENV_PREFIXES = ("MEGATRAIN_",)
ENV_KEEP = (
    "PYTHONPATH",
    "PATH",
    "HOME",
    "HF_HOME",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
)
"""What of the scheduler's environment the runners get: its settings, and what finds Python and the
object store. Slurm propagates the submitter's environment by default too; naming it makes the
script self-contained (and readable in the run folder)."""


def runner_settings_env(settings: Settings, environ: dict[str, str]) -> dict[str, str]:
    """The variables the script exports: every MEGATRAIN_* setting and the kept few."""
    return {k: v for k, v in environ.items() if k.startswith(ENV_PREFIXES) or k in ENV_KEEP}


class SlurmExecutor:
    """Runs each attempt as one Slurm job over its gang's nodes (see the module's docstring)."""

    multi_node = True

    def __init__(self, settings: Settings, commands: SlurmCommands | None = None):
        self.settings = settings
        self.commands = commands or slurm_commands(settings)
        self._local = LocalExecutor(settings)
        self._refreshed_at = float("-inf")
        self._states: dict[str, SlurmState] = {}
        """Slurm id → state, as follow() read them this tick."""
        self.partitions = settings.slurm_pool_partitions
        """Pool → the partition it is filled from and its jobs are submitted to."""
        self._max_time_s: dict[str, int | None] = {}
        """Pool → its partition's MaxTime, as sinfo last said (the shortest where its nodes differ)."""
        self._cancel_seen: dict[str, float] = {}
        """Job id → when follow() first saw a cancel asked of it while it ran (time.monotonic())."""

    # -- jobs --------------------------------------------------------------------------------------

    def request(self, s: Session, job: Job) -> SlurmRequest:
        """The Slurm request of the job's current attempt, from its placement."""
        shares = s.scalars(
            select(JobAllocation.slots)
            .where(JobAllocation.job_id == job.id)
            .order_by(JobAllocation.node_rank)
        ).all()
        # A single-node job has no allocation rows: the job row holds its one share.
        nodes, per_node = (len(shares), shares[0]) if shares else (1, job.num_procs)
        pool = s.execute(
            select(NodePool.name, NodePool.accelerator)
            .join(Node, Node.pool_id == NodePool.id)
            .where(Node.id == job.node_id)
        ).first()
        pool_name, accelerator = (pool.name, pool.accelerator) if pool else (self.settings.pool_name, None)
        resources = job.spec.get("resources") or {}
        # Slurm would hold a job asking for more than its partition allows: such a job runs as a chain.
        caps = (self.settings.slurm_time_limit_s, self._max_time_s.get(pool_name))
        limit = min([int(resources.get("max_runtime_s") or 86400), *(c for c in caps if c is not None)])
        return SlurmRequest(
            job_id=job.id,
            attempt=job.attempt,
            nodes=nodes,
            procs_per_node=per_node,
            gpus=(accelerator or "cpu").lower() != "cpu",
            time_limit_s=limit,
            log_dir=self.log_dir(job.id, job.attempt),
            python=self.settings.slurm_python or sys.executable,
            partition=self.partitions.get(pool_name, self.settings.slurm_partition),
            account=self.settings.slurm_account,
            qos=self.settings.slurm_qos,
            env=self._env(s, job, limit),
            requeue=self.settings.slurm_requeue,
        )

    def _env(self, s: Session, job: Job, limit_s: int) -> dict[str, str]:
        """What the batch script exports: the settings; with runners_via_api, an attempt token in
        place of the control plane's credentials (valid a little past the attempt's limit)."""
        settings = self.settings
        if settings.runners_via_api:
            settings = with_attempt_token(s, settings, job, ttl_s=limit_s + ATTEMPT_TOKEN_SLACK_S)
        return runner_settings_env(settings, runner_env(settings))

    def log_dir(self, job_id: str, attempt: int) -> Any:
        return self.settings.runs_dir / job_id / f"attempt-{attempt}" / "slurm"

    def submit(self, job_id: str) -> None:
        with session_scope(self.settings.resolved_database_url) as s:
            job = s.get(Job, job_id)
            if job is None:
                raise LookupError(f"job {job_id} does not exist")
            if slurm_id_of(s, job_id, job.attempt) is not None:
                return  # this attempt is in Slurm already (a restarted scheduler submits again)
            req = self.request(s, job)
        req.log_dir.mkdir(parents=True, exist_ok=True)
        script = render_sbatch(req)
        token = req.env.get("MEGATRAIN_NODE_TOKEN")
        # The copy in the run folder is for reading: an attempt token is in Slurm's hands only.
        (req.log_dir / "job.sbatch").write_text(script.replace(token, "(attempt token)") if token else script)
        slurm_id = self.commands.submit(script)
        with session_scope(self.settings.resolved_database_url) as s:
            data = {"attempt": req.attempt, "slurm_id": slurm_id, "nodes": req.nodes}
            record_event(s, job_id, SUBMITTED_EVENT, f"attempt {req.attempt} is Slurm job {slurm_id}", data)

    def runner_alive(self, job: Job) -> bool | None:
        # Read-only: the scheduler holds the job's row locked while it asks (an event written
        # here would wait on that lock). follow() records what changed, once per tick.
        with session_scope(self.settings.resolved_database_url) as s:
            slurm_id = slurm_id_of(s, job.id, job.attempt)
        if slurm_id is None:
            return None  # not submitted (yet): the scheduled-too-long timeout judges it
        state = self._states.get(slurm_id)
        if state is None:
            try:
                state = self.commands.status([slurm_id]).get(slurm_id)
            except SlurmError as exc:
                raise StatusUnknown(str(exc)) from exc
        if state is None:
            return None  # Slurm forgot it and keeps no accounting: heartbeats decide
        self._states[slurm_id] = state  # runner_failure answers from it
        if state.terminal:
            # The runner did not end the attempt itself (else it would not be active): it was killed
            # (time limit, node failure, preemption, scancel) or never started.
            return False
        if state.phase == "pending" and job.status == RUNNING:
            # Slurm requeued the Slurm job (node failure or preemption, MEGATRAIN_SLURM_REQUEUE): the
            # runner is gone. The product's retry is the next attempt; follow() scancels the requeued
            # job, so one failure is counted once and nothing runs twice.
            return False
        if state.phase == "pending" or job.status == SCHEDULED:
            return True  # waiting in Slurm's queue, or started and about to claim the attempt
        return None  # running: its heartbeats say whether it is well

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        """The failure record of an attempt Slurm ended out of memory (states.failure_record), on
        the nodes it was placed on; None for any other end."""
        with session_scope(self.settings.resolved_database_url) as s:
            slurm_id = slurm_id_of(s, job.id, job.attempt)
            state = self._states.get(slurm_id) if slurm_id else None
            if state is None:
                return None
            shares = select(Node.hostname).join(JobAllocation, JobAllocation.node_id == Node.id)
            hosts = s.scalars(shares.where(JobAllocation.job_id == job.id).order_by(JobAllocation.node_rank))
            names = list(hosts) or list(s.scalars(select(Node.hostname).where(Node.id == job.node_id)))
        return failure_record(state, ",".join(names) or None)

    def follow(self) -> None:
        """Once per tick: read every active attempt's Slurm state in one query, record the changed
        ones (with Slurm's reason) as events, and scancel the attempts asked to cancel while still in
        Slurm's queue (no runner there to honour it). runner_alive answers from what it read."""
        self._states = {}
        with session_scope(self.settings.resolved_database_url) as s:
            active = s.execute(
                select(Job.id, Job.attempt, Job.status, Job.cancel_requested).where(
                    Job.status.in_((SCHEDULED, RUNNING))
                )
            ).all()
            ids = {r.id: (r, slurm_id_of(s, r.id, r.attempt)) for r in active}
        ids = {job_id: v for job_id, v in ids.items() if v[1] is not None}
        if not ids:
            return
        try:
            states = self.commands.status([sid for _, sid in ids.values() if sid])
        except SlurmError:
            return  # runner_alive asks again, and says it does not know
        self._states = states
        now = time.monotonic()
        self._cancel_seen = {k: v for k, v in self._cancel_seen.items() if k in ids}
        for job_id, (row, slurm_id) in ids.items():
            state = states.get(slurm_id or "")
            if state is None:
                continue
            self._note(job_id, row.attempt, state)
            if row.status == RUNNING and state.phase == "pending":
                self._cancel(job_id, state.slurm_id)  # requeued by Slurm: see runner_alive
            elif row.cancel_requested and not state.terminal and self._cancel_due(job_id, row.status, now):
                self._cancel(job_id, state.slurm_id)

    def _cancel(self, job_id: str, slurm_id: str) -> None:
        try:
            self.commands.cancel(slurm_id)
        except SlurmError as exc:
            log.warning("job %s: scancel %s failed (%s); asking again next tick", job_id, slurm_id, exc)

    def _cancel_due(self, job_id: str, status: str, now: float) -> bool:
        """Whether to scancel a job asked to cancel: at once while it waits in Slurm's queue (no
        runner there to honour it); while it runs, once its runner has had the time to stop the
        engine and end the attempt itself (a runner that hangs still frees the nodes)."""
        if status == SCHEDULED:
            return True
        seen = self._cancel_seen.setdefault(job_id, now)
        return now - seen > KILL_GRACE_S + self.settings.heartbeat_timeout_s

    def _note(self, job_id: str, attempt: int, state: SlurmState) -> None:
        """Record the Slurm state (and its reason) as an event when either changed."""
        with session_scope(self.settings.resolved_database_url) as s:
            last = last_state(s, job_id, attempt)
            if last is not None and (last.get("state"), last.get("reason")) == (state.state, state.reason):
                return
            data = {"attempt": attempt, **state.event_data()}
            text = f"Slurm job {state.slurm_id}: {state.state}" + (
                f" ({state.reason})" if state.reason else ""
            )
            record_event(s, job_id, STATE_EVENT, text, data)
            if state.terminal:
                self._collect_logs(s, job_id, attempt)

    def _collect_logs(self, s: Session, job_id: str, attempt: int) -> None:
        """Put the tails of the Slurm job's own output (the batch shell's, each node's runner's) in
        the job's log: a Slurm job that ended while its attempt was still active was killed, or
        never got a runner to the database (a wrong interpreter, a node that cannot import), and
        its output there is all anyone has to tell why."""
        lines: list[str] = []
        for path in sorted(self.log_dir(job_id, attempt).glob("*.log")):
            try:
                tail = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            except OSError as exc:
                tail = [f"(unreadable: {exc})"]
            lines += [f"[slurm {path.stem}] {line}" for line in tail]
        if lines:
            append_logs(s, job_id, lines, next_log_seq(s, job_id), self.settings.max_log_lines)

    # -- nodes -------------------------------------------------------------------------------------

    def refresh_nodes(self) -> None:
        """Follow the active attempts in Slurm (every tick), and register each partition's usable
        nodes (from sinfo) as its pool's ready nodes at most every NODE_REFRESH_S; a node sinfo no
        longer shows usable goes unseen and is marked lost."""
        self.follow()
        if time.monotonic() - self._refreshed_at < NODE_REFRESH_S:
            return
        for pool, partition in self.partitions.items():
            try:
                nodes = self.commands.capacity(partition)
            except SlurmError as exc:
                # Unseen nodes turn lost after node_lost_after_s: a long outage stops placement.
                log.warning("pool %s: sinfo of partition %s failed (%s)", pool, partition, exc)
                continue
            limits = [n.max_time_s for n in nodes if n.max_time_s is not None]
            self._max_time_s[pool] = min(limits) if limits else None
            with session_scope(self.settings.resolved_database_url) as s:
                register_nodes(s, pool, [n for n in nodes if n.usable])
        self._refreshed_at = time.monotonic()

    # -- the rest runs here ------------------------------------------------------------------------

    def submit_dataset(self, dataset_id: str) -> None:
        self._local.submit_dataset(dataset_id)

    def submit_export(self, export_id: str) -> None:
        self._local.submit_export(export_id)

    def submit_sample(self, sample_id: str) -> None:
        self._local.submit_sample(sample_id)

    def worker_alive(self, host: str | None, pid: int | None) -> bool | None:
        return self._local.worker_alive(host, pid)

    def runner_metrics(self) -> Collector | None:
        return None  # an sbatch runner lives one attempt on a Slurm node: nothing scrapes it there


def _attempt_events(s: Session, job_id: str, kind: str, attempt: int) -> list[dict[str, Any]]:
    rows = s.scalars(
        select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == kind).order_by(JobEvent.id)
    )
    return [d for d in rows if isinstance(d, dict) and d.get("attempt") == attempt]


def slurm_id_of(s: Session, job_id: str, attempt: int) -> str | None:
    """The Slurm job id of an attempt, once submitted."""
    events = _attempt_events(s, job_id, SUBMITTED_EVENT, attempt)
    return str(events[-1]["slurm_id"]) if events else None


def last_state(s: Session, job_id: str, attempt: int) -> dict[str, Any] | None:
    events = _attempt_events(s, job_id, STATE_EVENT, attempt)
    return events[-1] if events else None


def register_nodes(s: Session, pool_name: str, nodes: list[SlurmNode]) -> None:
    """Upsert `nodes` as ready nodes of `pool_name`: a GPU node's slots are its GPUs, a CPU node's
    its CPUs. The pool is created on first sight (accelerator 'cpu' unless the nodes have GPUs)."""
    pool = s.scalar(select(NodePool).where(NodePool.name == pool_name))
    if pool is None:
        pool = NodePool(name=pool_name, accelerator="gpu" if any(n.gpus for n in nodes) else "cpu")
        s.add(pool)
        s.flush()
    now = utcnow()
    for n in nodes:
        node = s.scalar(select(Node).where(Node.pool_id == pool.id, Node.hostname == n.name))
        if node is None:
            node = Node(pool_id=pool.id, hostname=n.name, slots_total=n.gpus or n.cpus)
            s.add(node)
        node.slots_total = n.gpus or n.cpus
        node.last_seen_at = now
        if node.status != QUARANTINED:  # only an operator lifts a quarantine
            node.status = "ready"
    s.flush()
