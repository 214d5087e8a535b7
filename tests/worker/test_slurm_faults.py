"""Slurm's faults on a real Slurm (tests/fixtures/slurm.py, tests/worker/slurm_jobs.py): a job Slurm
kills at its time limit, one whose node goes down (NODE_FAIL) and one Slurm requeues are each retried
once by the product and resume from their checkpoint, nothing running twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.slurm import SlurmCluster
from slurm_jobs import SlurmApi, drive, events, spec
from sqlalchemy import select
from worker_helpers import wait_for

from megatrain.db.models import CANCELLED, FAILED, RUNNING, SUCCEEDED, JobEvent
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.worker.slurm.commands import SlurmCli
from megatrain.worker.slurm.executor import SUBMITTED_EVENT, SlurmExecutor

# PostgreSQL, as a Slurm deployment runs (the runner's SQL is the same on SQLite: tests/db).
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["postgres"], indirect=True)]


def test_a_job_slurm_kills_at_its_time_limit_resumes_from_its_checkpoint_on_retry(
    slurm_api: SlurmApi,
    fake_engine: Path,  # set up after slurm_api: the runners on Slurm run it
    slurm_cluster: SlurmCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An engine that does not stop when asked (the fake one, ignoring SIGUSR2) and a runner that
    # would wait longer than Slurm does: Slurm kills the job at its limit (TIMEOUT).
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    monkeypatch.setenv("FAKE_ENGINE_IGNORE_SIGUSR2", "1")
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    patient = scheduler.settings.model_copy(update={"slurm_time_limit_s": 60, "preempt_grace_s": 600.0})
    # sbatch passes its environment on: the fake engine's knobs reach the runners with it.
    scheduler = Scheduler(patient, executor=SlurmExecutor(patient, SlurmCli(env=slurm_cluster.env)))
    r = client.post("/v1/jobs", json=spec(corpus, 100_000, checkpoint_interval=5), headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    job = drive(scheduler, url, job_id, lambda j: j.attempt == 2 and j.status == RUNNING, 180)
    states = [e.data for e in events(url, job_id, "slurm_state") if e.data.get("attempt") == 1]
    assert states[-1]["state"] == "TIMEOUT" and states[-1]["cause"] == "slurm_timeout", states
    assert job.max_retries == 2  # a retry, counted
    wait_for(lambda: len(events(url, job_id, "started")) == 2, 60, 0.5)
    resumed = events(url, job_id, "started")[-1].data["resumed_from"]
    assert resumed is not None and resumed >= 5 and resumed % 5 == 0  # its last periodic checkpoint
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason


def test_a_slurm_node_failure_is_retried_and_resumes_from_the_checkpoint(
    slurm_api: SlurmApi,
    slurm_cluster: SlurmCluster,
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    r = client.post(
        "/v1/jobs", json=spec(corpus, 100_000, checkpoint_interval=10, log_interval=5), headers=headers
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = drive(scheduler, url, job_id, lambda j: j.status == RUNNING and (j.current_step or 0) >= 15, 120)
    (submitted,) = events(url, job_id, SUBMITTED_EVENT)
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    out = slurm_cluster.client("squeue", "-h", "-j", submitted.data["slurm_id"], "-o", "%N")
    node = out.stdout.strip()
    assert node in slurm_cluster.node_names, out
    try:
        # An operator (or Slurm's health check) takes the node down under the job: NODE_FAIL.
        down = slurm_cluster.client("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=test")
        assert down.returncode == 0, down.stderr
        job = drive(scheduler, url, job_id, lambda j: j.attempt == 2, 120)
        states = [e.data for e in events(url, job_id, "slurm_state") if e.data.get("attempt") == 1]
        assert states[-1]["state"] == "NODE_FAIL" and states[-1]["cause"] == "slurm_node_fail"
        assert job.max_retries == 2  # a retry: counted against the job's budget
        requeued = events(url, job_id, "queued")[-1]
        assert "retrying, will resume from checkpoint" in (requeued.reason or ""), requeued.reason
        wait_for(lambda: len(events(url, job_id, "started")) == 2, 90, 0.5)
        resumed = events(url, job_id, "started")[-1].data["resumed_from"]
        assert resumed is not None and resumed >= 10 and resumed % 10 == 0  # the periodic checkpoint
    finally:
        slurm_cluster.client("scontrol", "update", f"NodeName={node}", "State=RESUME")
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason
    first, second = (e.data["slurm_id"] for e in events(url, job_id, SUBMITTED_EVENT))
    wait_for(lambda: all(s.terminal for s in cli.status([first, second]).values()), 60, 0.5)


def test_a_requeue_by_slurm_is_one_retry_and_never_runs_the_attempt_twice(
    slurm_api: SlurmApi,
    slurm_cluster: SlurmCluster,
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    requeue = scheduler.settings.model_copy(update={"slurm_requeue": True})
    scheduler = Scheduler(requeue, executor=SlurmExecutor(requeue, scheduler.executor.commands))  # type: ignore[attr-defined]
    r = client.post(
        "/v1/jobs", json=spec(corpus, 100_000, checkpoint_interval=10, log_interval=5), headers=headers
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    drive(scheduler, url, job_id, lambda j: j.status == RUNNING and (j.current_step or 0) >= 5, 120)
    (submitted,) = events(url, job_id, SUBMITTED_EVENT)
    first = submitted.data["slurm_id"]
    assert "#SBATCH --requeue" in (scheduler.executor.log_dir(job_id, 1) / "job.sbatch").read_text()  # type: ignore[attr-defined]
    out = slurm_cluster.client("scontrol", "requeue", first)  # what Slurm does on a node failure
    assert out.returncode == 0, out.stderr

    job = drive(scheduler, url, job_id, lambda j: j.attempt == 2 and j.status == RUNNING, 120)
    assert job.max_retries == 2  # one retry of the job's budget: the requeue is not counted twice
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    assert wait_for(lambda: (s := cli.status([first])[first]).terminal and s, 60, 0.5).state == "CANCELLED"
    with session_scope(url) as s:
        claims = s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == RUNNING)
        ).all()
    assert [d["attempt"] for d in claims] == [1, 2]  # attempt 1 ran once, the requeued Slurm job never
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason
