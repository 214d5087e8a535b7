"""The slurm executor (worker.slurm.executor) against a real Slurm on this machine: a placed job
runs to success as a Slurm job, a second submit of its attempt submits nothing, and a job waiting in
Slurm's queue is followed (its reason recorded) and cancelled with scancel through the scheduler."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fixtures.slurm import SlurmCluster
from sqlalchemy import select, update
from worker_helpers import wait_for

from megatrain.db.models import CANCELLED, SUCCEEDED, Job, JobEvent, JobLog, JobMetric
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.worker.executors import get_executor
from megatrain.worker.slurm.commands import SlurmCli
from megatrain.worker.slurm.executor import STATE_EVENT, SUBMITTED_EVENT, SlurmExecutor

# PostgreSQL, as a Slurm deployment runs (the runner's SQL is the same on SQLite: tests/db).
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["postgres"], indirect=True)]


@pytest.fixture
def executor(settings: Settings, slurm_cluster: SlurmCluster, fake_engine: Path) -> SlurmExecutor:
    slurm = settings.model_copy(update={"executor": "slurm", "slurm_partition": slurm_cluster.partition})
    return SlurmExecutor(slurm, commands=SlurmCli(env=slurm_cluster.env))


def _events(url: str, job_id: str, kind: str) -> list[dict]:
    with session_scope(url) as s:
        return list(s.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == kind)))


def test_get_executor_names_slurm(settings: Settings) -> None:
    assert isinstance(get_executor(settings.model_copy(update={"executor": "slurm"})), SlurmExecutor)


def test_a_placed_job_runs_to_success_on_slurm(executor: SlurmExecutor, make_job: Callable[..., str]) -> None:
    url = executor.settings.resolved_database_url
    job_id = make_job(procs=1, train_iters=10)
    executor.submit(job_id)
    executor.submit(job_id)  # a restarted scheduler's second submit of the same attempt
    submitted = _events(url, job_id, SUBMITTED_EVENT)
    assert len(submitted) == 1 and submitted[0]["attempt"] == 1  # scheduling began attempt 1

    def ended() -> str | None:
        with session_scope(url) as s:
            status = s.scalar(select(Job.status).where(Job.id == job_id))
        return status if status not in ("scheduled", "running") else None

    assert wait_for(ended, 60, 0.5) == SUCCEEDED
    with session_scope(url) as s:
        steps = s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)).all()
        lines = s.scalars(select(JobLog.line).where(JobLog.job_id == job_id)).all()
    assert max(steps) == 10 and lines  # its loss was charted and its log collected
    log_dir = executor.log_dir(job_id, 1)
    assert "#SBATCH --nodes=1" in (log_dir / "job.sbatch").read_text()
    assert (log_dir / "node-0.log").exists()


def test_a_job_waiting_in_slurm_is_followed_and_scancelled(
    executor: SlurmExecutor,
    make_job: Callable[..., str],
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
) -> None:
    url = executor.settings.resolved_database_url
    # Another user's job holds every node, so ours waits in Slurm's queue.
    nodes = len(slurm_cluster.node_names)
    blocker = slurm_cluster.client(
        "sbatch", "--parsable", f"--nodes={nodes}", "--exclusive", f"--output={tmp_path / 'b.log'}",
        "--wrap", "sleep 120",
    )  # fmt: skip
    assert blocker.returncode == 0, blocker.stderr
    blocker_id = blocker.stdout.strip()
    try:
        job_id = make_job(procs=1)
        executor.submit(job_id)
        with session_scope(url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            s.expunge(job)

        def waiting_noted() -> bool:
            executor.follow()  # what the scheduler's tick does first
            return executor.runner_alive(job) is True and bool(_events(url, job_id, STATE_EVENT))

        assert wait_for(waiting_noted, 20, 0.5)
        waiting = _events(url, job_id, STATE_EVENT)[-1]
        assert waiting["state"] == "PENDING" and waiting["reason"] in ("Resources", "Priority")

        # The product's cancel: the scheduler's reconcile scancels it in Slurm, then ends the job.
        with session_scope(url) as s:
            s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
        scheduler = Scheduler(executor.settings, executor=executor)

        def cancelled() -> bool:
            scheduler.reconcile_once()
            with session_scope(url) as s:
                return s.scalar(select(Job.status).where(Job.id == job_id)) == CANCELLED

        assert wait_for(cancelled, 30, 0.5)
        assert _events(url, job_id, STATE_EVENT)[-1]["state"] == "CANCELLED"
    finally:
        slurm_cluster.client("scancel", blocker_id)
