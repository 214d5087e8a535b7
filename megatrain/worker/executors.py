"""Executors hand a scheduled job to something that runs `run_shard` for it.

`local` spawns a detached runner process on this machine; `celery` sends a task to the queue of
the node the job was placed on; `slurm` (worker.slurm) submits one sbatch job per attempt. The
scheduler knows only this interface: `submit` a placed job, `refresh_nodes` once per tick, and ask
`runner_alive` (a job's runner) or `worker_alive` (the worker of a dataset, export or sample) before
it declares one lost.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.models import Job, JobAllocation, Node, NodePool, utcnow
from megatrain.db.node_tokens import create_attempt_token
from megatrain.db.session import session_scope
from megatrain.settings import CONTROL_PLANE_SETTINGS, Settings
from megatrain.worker.metrics import MULTIPROC_ENV, RunnerFiles, runner_metrics_dir, sweep_runner_files
from megatrain.worker.nodes import ensure_local_pool
from megatrain.worker.procs import pid_alive
from megatrain.worker.storage_access import OTHER_IDENTITIES, scoped

if TYPE_CHECKING:
    from prometheus_client.registry import Collector
    from redis import Redis

LOCAL_NODE_REFRESH_S = 10.0
"""How often the local executor re-registers this machine (nvidia-smi is not free)."""


class Executor(Protocol):
    multi_node: bool
    """Whether it can run one job across several nodes (a gang); the scheduler places a job that
    needs more than one node only if so, else the job waits with that reason."""

    def submit(self, job_id: str) -> None:
        """Start (or enqueue) the runner of a job that is `scheduled`; raise if that is impossible."""
        ...

    def refresh_nodes(self) -> None:
        """Register or refresh the nodes this executor runs jobs on, where it is the one that knows
        them (called on every scheduler tick: cheap or throttled)."""
        ...

    def submit_dataset(self, dataset_id: str) -> None:
        """Start (or enqueue) the preprocessing of a `pending` dataset (worker.datasets)."""
        ...

    def submit_export(self, export_id: str) -> None:
        """Start (or enqueue) a `pending` checkpoint export (worker.exports)."""
        ...

    def submit_sample(self, sample_id: str) -> None:
        """Start (or enqueue) a `pending` sample of a checkpoint (worker.samples)."""
        ...

    def runner_alive(self, job: Job) -> bool | None:
        """For a scheduled or running job: False if its runner is known to be gone (requeue it now),
        True if the job is known to be fine without a heartbeat (e.g. waiting in its node's broker
        queue), None if there is no evidence here (heartbeat timeouts decide). Raises (e.g.
        StatusUnknown) when a query failed: the scheduler then leaves the job alone this tick."""
        ...

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        """For a job whose runner is gone without ending its attempt: why it ended, as a failure
        record (megatrain.failures), where the executor knows it (Slurm's OUT_OF_MEMORY); None
        where it does not (the attempt is then retried as a lost runner)."""
        ...

    def worker_alive(self, host: str | None, pid: int | None) -> bool | None:
        """For background work (a dataset's preprocessing, an export, a sample) whose worker claimed
        it as process `pid` on `host`: False if that process is known to be gone (requeue the work
        now), None if there is no evidence here (heartbeat timeouts decide)."""
        ...

    def runner_metrics(self) -> Collector | None:
        """The Prometheus series of this executor's runners that only the scheduler's process can
        serve (the local executor's runner processes on its machine), or None where the runners'
        own workers serve them (a Celery worker's --metrics-port)."""
        ...


class StatusUnknown(RuntimeError):
    """runner_alive could not find out (a failed broker or status query): neither alive nor dead."""


def runner_env(settings: Settings) -> dict[str, str]:
    """The caller's environment plus every setting as MEGATRAIN_*, so the runner sees the same world
    even when `settings` was built in code rather than read from the environment. With a node token
    the runner reaches the control plane through the API: it gets none of its credentials (nor its
    object-store key where attempts get scoped ones: worker.storage_access)."""
    env = dict(os.environ)
    env.pop(MULTIPROC_ENV, None)  # only a local shard runner writes metrics files, to its own folder
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"MEGATRAIN_{name.upper()}"] = str(value)
    env["MEGATRAIN_DATABASE_URL"] = settings.resolved_database_url
    env["MEGATRAIN_STORAGE_URL"] = settings.resolved_storage_url
    if settings.node_token:
        for name in CONTROL_PLANE_SETTINGS:
            env.pop(f"MEGATRAIN_{name.upper()}", None)
        if scoped(settings):  # it asks for its attempt's key: the control plane's own is not its
            for name in OTHER_IDENTITIES:
                env.pop(name, None)
    return env


def with_attempt_token(session: Session, settings: Settings, job: Job, ttl_s: float) -> Settings:
    """`settings` for the runners of the job's current attempt when they reach the control plane
    through the API (settings.runners_via_api): a token valid for this job only, for `ttl_s` or
    until the attempt ends (attempts.reports.finish revokes it). The caller commits."""
    pool_id = session.scalar(select(Node.pool_id).where(Node.id == job.node_id))
    if pool_id is None:
        raise LookupError(f"job {job.id} is placed on no node")
    token = create_attempt_token(session, job.id, pool_id, ttl_s=ttl_s)
    return settings.model_copy(update={"node_token": token})


LOCAL_TOKEN_TTL_S = 30 * 86400.0
"""How long a local runner's attempt token lives at most (a job without max_runtime_s); the
attempt's end revokes it sooner."""


def pid_verdict(host: str | None, pid: int | None) -> bool | None:
    """False when process `pid` was on this host and has exited; None otherwise (another host's
    process cannot be seen from here, and a live pid may still be hung: heartbeats judge that)."""
    if pid and host == socket.gethostname() and not pid_alive(pid):
        return False
    return None


class LocalExecutor:
    """One `python -m megatrain.worker.shard` process per job, in a session of its own so it outlives
    the API or scheduler that started it; output goes to {runs_dir}/{job_id}/runner.log."""

    multi_node = False

    def __init__(self, settings: Settings):
        self.settings = settings
        self._refreshed_at = float("-inf")

    def submit(self, job_id: str) -> None:
        settings = self.settings
        if settings.runners_via_api:
            with session_scope(settings.resolved_database_url) as s:
                job = s.get(Job, job_id)
                if job is None:
                    raise LookupError(f"job {job_id} does not exist")
                limit = float((job.spec.get("resources") or {}).get("max_runtime_s") or LOCAL_TOKEN_TTL_S)
                settings = with_attempt_token(s, settings, job, ttl_s=limit + 3600)
        # Its series go to files that the scheduler's (or the embedded API's) /metrics sums.
        metrics = runner_metrics_dir(self.settings)
        metrics.mkdir(parents=True, exist_ok=True)
        env = runner_env(settings) | {MULTIPROC_ENV: str(metrics)}
        self._spawn(settings.runs_dir / job_id, "megatrain.worker.shard", "--job-id", job_id, env=env)

    def submit_dataset(self, dataset_id: str) -> None:
        """One detached `python -m megatrain.worker.datasets` process per dataset; its output goes
        to {runs_dir}/datasets/{dataset_id}/runner.log."""
        run_dir = self.settings.runs_dir / "datasets" / dataset_id
        self._spawn(run_dir, "megatrain.worker.datasets", "--dataset-id", dataset_id)

    def submit_export(self, export_id: str) -> None:
        """One detached `python -m megatrain.worker.exports` process per export; its output goes
        to {runs_dir}/exports/{export_id}/runner.log."""
        run_dir = self.settings.runs_dir / "exports" / export_id
        self._spawn(run_dir, "megatrain.worker.exports", "--export-id", export_id)

    def submit_sample(self, sample_id: str) -> None:
        """One detached `python -m megatrain.worker.samples` process per sample (it loads the model
        each time; a Celery worker keeps it warm); output in {runs_dir}/samples/{sample_id}/runner.log."""
        run_dir = self.settings.runs_dir / "samples" / sample_id
        self._spawn(run_dir, "megatrain.worker.samples", "--sample-id", sample_id)

    def _spawn(
        self, run_dir: Path, module: str, flag: str, ident: str, env: dict[str, str] | None = None
    ) -> None:
        """`python -m module flag ident`, detached, its output in run_dir/runner.log; `env`: its
        environment (default: runner_env of this executor's settings)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "runner.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, flag, ident],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env if env is not None else runner_env(self.settings),
                cwd=run_dir,
                start_new_session=True,
                close_fds=True,
            )
        # Reap it when it ends: a zombie would look alive to the reconciler's pid check.
        threading.Thread(target=proc.wait, daemon=True, name=f"reap-{ident}").start()

    def refresh_nodes(self) -> None:
        """This machine is the one node: register it, at most every LOCAL_NODE_REFRESH_S."""
        if time.monotonic() - self._refreshed_at < LOCAL_NODE_REFRESH_S:
            return
        with session_scope(self.settings.resolved_database_url) as s:
            ensure_local_pool(s, self.settings)
        self._refreshed_at = time.monotonic()

    def runner_alive(self, job: Job) -> bool | None:
        return pid_verdict(job.runner_host, job.runner_pid)

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        return None  # a runner here writes its own attempt's end; a vanished one says nothing

    def worker_alive(self, host: str | None, pid: int | None) -> bool | None:
        return pid_verdict(host, pid)

    def runner_metrics(self) -> Collector | None:
        """What its runners wrote under runner_metrics_dir, summed (those gone since the last
        scheduler forgotten first)."""
        path = runner_metrics_dir(self.settings)
        sweep_runner_files(path)
        return RunnerFiles(path)


class CeleryExecutor:
    """Sends `megatrain.run_shard(job_id)` to the queue of the node the job was placed on, or for a
    multi-node job one shard task to each of its nodes' queues (worker.gang); the workers register
    their nodes themselves."""

    multi_node = True

    def __init__(self, settings: Settings):
        from megatrain.worker.celery_app import create_celery_app

        self.settings = settings
        self.app = create_celery_app(settings)
        self._redis: Redis | None = None

    def _target(self, job_id: str) -> tuple[str, str, datetime]:
        """(queue, task id, node last seen) of a scheduled job: its node's queue, one task id per
        attempt."""
        from megatrain.worker.celery_app import queue_name, task_id

        with session_scope(self.settings.resolved_database_url) as s:
            row = s.execute(
                select(Job.pool, Job.attempt, Node.hostname, Node.last_seen_at)
                .join(Node, Node.id == Job.node_id, isouter=True)
                .where(Job.id == job_id)
            ).first()
        if row is None:
            raise LookupError(f"job {job_id} does not exist")
        if row.hostname is None:
            raise LookupError(f"job {job_id} is not placed on a node")
        return queue_name(row.pool, row.hostname), task_id(job_id, row.attempt), row.last_seen_at

    def _gang(self, job_id: str) -> tuple[int, list[tuple[int, str]]]:
        """(attempt, [(node rank, node's queue)]) of a job reserved as a gang; no rows for others."""
        from megatrain.worker.celery_app import queue_name

        with session_scope(self.settings.resolved_database_url) as s:
            attempt = s.scalar(select(Job.attempt).where(Job.id == job_id)) or 0
            rows = s.execute(
                select(JobAllocation.node_rank, NodePool.name, Node.hostname)
                .join(Node, Node.id == JobAllocation.node_id)
                .join(NodePool, NodePool.id == Node.pool_id)
                .where(JobAllocation.job_id == job_id)
                .order_by(JobAllocation.node_rank)
            ).all()
        return attempt, [(r.node_rank, queue_name(r.name, r.hostname)) for r in rows]

    def submit(self, job_id: str) -> None:
        from megatrain.worker.celery_app import TASK_NAME, task_id

        attempt, shards = self._gang(job_id)
        if not shards:
            queue, tid, _ = self._target(job_id)
            self.app.send_task(TASK_NAME, args=[job_id], queue=queue, task_id=tid)
            return
        # Followers first: node rank 0 claims the job, and the others wait for it anyway.
        for rank, queue in reversed(shards):
            share = {"node_rank": rank, "nnodes": len(shards), "attempt": attempt}
            tid = task_id(job_id, attempt, rank)
            self.app.send_task(TASK_NAME, args=[job_id], kwargs={"share": share}, queue=queue, task_id=tid)

    def submit_dataset(self, dataset_id: str) -> None:
        """`megatrain.preprocess_dataset(dataset_id)` on the pool's dataset queue, which every worker
        of the pool consumes beside its node's own."""
        from megatrain.worker.celery_app import PREPROCESS_TASK_NAME, datasets_queue

        self.app.send_task(
            PREPROCESS_TASK_NAME, args=[dataset_id], queue=datasets_queue(self.settings.pool_name)
        )

    def submit_export(self, export_id: str) -> None:
        """`megatrain.export_checkpoint(export_id)` on the pool's shared queue (the datasets'),
        which every worker of the pool consumes beside its node's own."""
        from megatrain.worker.celery_app import EXPORT_TASK_NAME, datasets_queue

        self.app.send_task(EXPORT_TASK_NAME, args=[export_id], queue=datasets_queue(self.settings.pool_name))

    def submit_sample(self, sample_id: str) -> None:
        """`megatrain.sample_checkpoint(sample_id)` on the pool's shared queue, like exports."""
        from megatrain.worker.celery_app import SAMPLE_TASK_NAME, datasets_queue

        self.app.send_task(SAMPLE_TASK_NAME, args=[sample_id], queue=datasets_queue(self.settings.pool_name))

    def refresh_nodes(self) -> None:
        """Nothing to do: each Celery worker registers its own node when it starts."""

    def waiting_in_broker(self, job_id: str) -> bool:
        """Whether the job's task for its current attempt is still in its node's queue, not yet
        taken by a worker, while the node's worker is seen (it is busy: not lost). A node unseen for
        heartbeat_timeout_s has no worker to take it: then the timeouts judge the job."""
        import redis

        try:
            queue, tid, seen_at = self._target(job_id)
        except LookupError:
            return False
        if utcnow() - seen_at > timedelta(seconds=self.settings.heartbeat_timeout_s):
            return False
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5)
        try:
            # kombu's Redis transport keeps a queue's messages in a list named after it; each
            # message's headers carry the task id as plain JSON.
            return any(tid.encode() in raw for raw in self._redis.lrange(queue, 0, -1))
        except redis.RedisError as exc:
            # Unknown is not "gone": the scheduler must not relaunch a job it cannot see.
            raise StatusUnknown(f"broker query failed: {exc}") from exc

    def runner_alive(self, job: Job) -> bool | None:
        if job.runner_pid is None and self.waiting_in_broker(job.id):
            return True
        return pid_verdict(job.runner_host, job.runner_pid)

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        return None  # a worker's runner writes its own attempt's end

    def worker_alive(self, host: str | None, pid: int | None) -> bool | None:
        """A worker on this host is judged by its pid; one on another node by its heartbeats."""
        return pid_verdict(host, pid)

    def runner_metrics(self) -> Collector | None:
        return None  # each node's worker serves its own (`megatrain worker --metrics-port`)


def get_executor(settings: Settings) -> Executor:
    """The executor MEGATRAIN_EXECUTOR names."""
    if settings.executor == "celery":
        return CeleryExecutor(settings)
    if settings.executor == "slurm":
        from megatrain.worker.slurm.executor import SlurmExecutor

        return SlurmExecutor(settings)
    return LocalExecutor(settings)
