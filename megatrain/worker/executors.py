"""Executors hand a scheduled job to something that runs `run_shard` for it.

`local` spawns a detached runner process on this machine; `celery` sends a task to the job's pool
queue on Redis. The scheduler only ever calls `get_executor(settings).submit(job_id)`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Protocol

from sqlalchemy import select

from megatrain.db.models import Job
from megatrain.db.session import session_scope
from megatrain.settings import Settings


class Executor(Protocol):
    def submit(self, job_id: str) -> None:
        """Start (or enqueue) the runner of a job that is `scheduled`; raise if that is impossible."""
        ...


def runner_env(settings: Settings) -> dict[str, str]:
    """The caller's environment plus every setting as MEGATRAIN_*, so the runner sees the same world
    even when `settings` was built in code rather than read from the environment."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"MEGATRAIN_{name.upper()}"] = str(value)
    env["MEGATRAIN_DATABASE_URL"] = settings.resolved_database_url
    env["MEGATRAIN_STORAGE_URL"] = settings.resolved_storage_url
    return env


class LocalExecutor:
    """One `python -m megatrain.worker.shard` process per job, in a session of its own so it outlives
    the API or scheduler that started it; output goes to {runs_dir}/{job_id}/runner.log."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def submit(self, job_id: str) -> None:
        run_dir = self.settings.runs_dir / job_id
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "runner.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "megatrain.worker.shard", "--job-id", job_id],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=runner_env(self.settings),
                cwd=run_dir,
                start_new_session=True,
                close_fds=True,
            )
        # Reap it when it ends: a zombie would look alive to the reconciler's pid check.
        threading.Thread(target=proc.wait, daemon=True, name=f"reap-{job_id}").start()


class CeleryExecutor:
    """Sends `megatrain.run_shard(job_id)` to the queue `megatrain.{pool}` of the job's pool."""

    def __init__(self, settings: Settings):
        from megatrain.worker.celery_app import create_celery_app

        self.settings = settings
        self.app = create_celery_app(settings)

    def submit(self, job_id: str) -> None:
        from megatrain.worker.celery_app import TASK_NAME, queue_name

        with session_scope(self.settings.resolved_database_url) as s:
            pool = s.scalar(select(Job.pool).where(Job.id == job_id))
        if pool is None:
            raise LookupError(f"job {job_id} does not exist")
        self.app.send_task(TASK_NAME, args=[job_id], queue=queue_name(pool))


def get_executor(settings: Settings) -> Executor:
    """The executor MEGATRAIN_EXECUTOR names."""
    if settings.executor == "celery":
        return CeleryExecutor(settings)
    return LocalExecutor(settings)
