"""Jobs through the API on a real Slurm (tests/fixtures/slurm.py, tests/worker/slurm_jobs.py), with the
real engine: one runs to success with its loss charted (its scheduler restarted meanwhile); one longer
than Slurm's time limit checkpoints before it, is queued again (not a retry) and resumes there in a
second Slurm job, which the product then cancels; a Slurm job that never started a runner leaves its
output in the job's log. Slurm's faults: test_slurm_faults.py."""

from __future__ import annotations

import math

import pytest
from slurm_jobs import SlurmApi, drive, events, spec
from worker_helpers import wait_for

from megatrain.db.models import CANCELLED, FAILED, RUNNING, SUCCEEDED
from megatrain.scheduler.loop import Scheduler
from megatrain.worker.slurm.commands import SlurmCli
from megatrain.worker.slurm.executor import SUBMITTED_EVENT, SlurmExecutor

# PostgreSQL, as a Slurm deployment runs (the runner's SQL is the same on SQLite: tests/db).
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["postgres"], indirect=True)]


def test_a_job_submitted_through_the_api_runs_on_slurm_with_its_loss_charted(
    slurm_api: SlurmApi,
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    r = client.post("/v1/jobs", json=spec(corpus, 6, checkpoint_interval=3), headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    drive(scheduler, url, job_id, lambda j: j.status in (RUNNING, SUCCEEDED, FAILED, CANCELLED), 120)
    # The scheduler restarts while the job runs in Slurm: the new one follows it, submits nothing.
    scheduler = Scheduler(
        scheduler.settings, executor=SlurmExecutor(scheduler.settings, scheduler.executor.commands)
    )  # type: ignore[attr-defined]
    job = drive(scheduler, url, job_id, lambda j: j.status in (SUCCEEDED, FAILED, CANCELLED), 180)
    logs = [line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs?tail=40", headers=headers).json()]
    assert job.status == SUCCEEDED, job.status_reason + "\n" + "\n".join(logs)
    assert job.attempt == 1

    # What the job page charts: a finite loss at every step.
    metrics = client.get(f"/v1/jobs/{job_id}/metrics?kind=train&max_points=100", headers=headers).json()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    listed = client.get(f"/v1/jobs/{job_id}/events", headers=headers).json()
    kinds = [e["kind"] for e in listed]
    assert SUBMITTED_EVENT in kinds and "started" in kinds
    (submitted,) = events(url, job_id, SUBMITTED_EVENT)  # one Slurm job, restart or not
    assert (scheduler.executor.log_dir(job_id, 1) / "job.sbatch").exists()  # type: ignore[attr-defined]
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    sid = submitted.data["slurm_id"]
    # The runner ends the attempt, then exits: Slurm's job completes just after.
    assert wait_for(lambda: (s := cli.status([sid])[sid]).terminal and s, 30, 0.5).state == "COMPLETED"


def test_a_job_longer_than_slurms_time_limit_resumes_in_a_second_slurm_job_then_is_cancelled(
    slurm_api: SlurmApi,
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    limited = scheduler.settings.model_copy(update={"slurm_time_limit_s": 60})  # the shortest Slurm grants
    scheduler = Scheduler(limited, executor=SlurmExecutor(limited, scheduler.executor.commands))  # type: ignore[attr-defined]
    body = spec(corpus, 100_000, checkpoint_interval=0, log_interval=10)  # saves only when told to stop
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    # Slurm warns (USR1) before its 60 s limit; the attempt checkpoints and the job is queued again.
    job = drive(scheduler, url, job_id, lambda j: j.attempt == 2 and j.status == RUNNING, 150)
    assert (job.max_retries, job.continuations) == (2, 1)  # a link of a chain is not a retry
    requeued = [e for e in events(url, job_id, "queued") if "time limit" in (e.reason or "")]
    assert len(requeued) == 1, [e.reason for e in events(url, job_id, "queued")]
    step = int(requeued[0].reason.rsplit(" ", 1)[1])
    assert requeued[0].reason == f"reached the allocation's time limit (60s); resumes from step {step}"
    assert step >= 1
    wait_for(lambda: len(events(url, job_id, "started")) == 2, 60, 0.5)
    assert events(url, job_id, "started")[-1].data["resumed_from"] == step
    first, second = (e.data["slurm_id"] for e in events(url, job_id, SUBMITTED_EVENT))
    assert first != second  # the next link is a new Slurm job

    # The product's cancel ends the second Slurm job.
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    wait_for(lambda: all(s.terminal for s in cli.status([first, second]).values()), 60, 0.5)
    assert cli.status([first])[first].state != "TIMEOUT"  # it stopped before Slurm's limit


def test_a_slurm_job_that_never_started_a_runner_shows_why_in_the_jobs_log(
    slurm_api: SlurmApi,
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    broken = scheduler.settings.model_copy(update={"slurm_python": "/nonexistent/bin/python3"})
    commands = scheduler.executor.commands  # type: ignore[attr-defined]
    scheduler = Scheduler(broken, executor=SlurmExecutor(broken, commands))
    body = spec(corpus, 2)
    body["resources"]["max_retries"] = 0
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = drive(scheduler, url, job_id, lambda j: j.status in (SUCCEEDED, FAILED, CANCELLED), 90)
    assert job.status == FAILED
    logs = [line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs", headers=headers).json()]
    slurm_lines = [line for line in logs if line.startswith("[slurm ")]
    assert any("/nonexistent/bin/python3" in line for line in slurm_lines), logs
