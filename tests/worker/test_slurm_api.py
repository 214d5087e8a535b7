"""Jobs through the API on a real Slurm (tests/fixtures/slurm.py), with the real engine: one runs to
success with its loss charted (its scheduler restarted meanwhile); one longer than Slurm's time limit
checkpoints before it, is queued again (not a retry) and resumes there in a second Slurm job, which
the product then cancels; one Slurm kills at its limit, one whose node goes down and one Slurm
requeues are retried once and resume from their checkpoint; a Slurm job that never started a runner
leaves its output in the job's log."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from fixtures.slurm import SlurmCluster, slurm_cluster  # noqa: F401  (the fixture)
from sqlalchemy import select
from worker_helpers import wait_for

from megatrain.api.app import create_app
from megatrain.api.auth import create_api_key
from megatrain.db.models import CANCELLED, FAILED, RUNNING, SUCCEEDED, Job, JobEvent
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import get_settings, reset_settings_cache
from megatrain.worker.slurm.commands import SlurmCli
from megatrain.worker.slurm.executor import SUBMITTED_EVENT, SlurmExecutor

pytestmark = pytest.mark.slow
POOL = "slurm"


@pytest.fixture
def slurm_api(
    db_url: str,
    slurm_cluster: SlurmCluster,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[TestClient, dict[str, str], Scheduler, Path]]:
    """The API and a scheduler with the slurm executor, on PostgreSQL (as in production; the runners
    reach it from the Slurm nodes); a corpus in an allowed data root."""
    pytest.importorskip("torch")
    if db_url.startswith("sqlite"):
        pytest.skip("one database is enough for these long runs: PostgreSQL, as in production")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)
    for name, value in {
        "ALLOWED_DATA_ROOTS": tmp_path.as_uri(),
        "EXECUTOR": "slurm",
        "POOL_NAME": POOL,
        "SLURM_PARTITION": slurm_cluster.partition,
        "HEARTBEAT_INTERVAL_S": "0.5",
    }.items():
        monkeypatch.setenv(f"MEGATRAIN_{name}", value)
    reset_settings_cache()
    settings = get_settings()
    corpus = tmp_path / "corpus.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 40
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(20)))
    with session_scope(db_url) as s:
        key = create_api_key(s, "acme", "test")
    scheduler = Scheduler(settings, executor=SlurmExecutor(settings, SlurmCli(env=slurm_cluster.env)))
    scheduler.reconcile_once()  # the pool's nodes, from sinfo
    with TestClient(create_app(settings)) as client:
        yield client, {"Authorization": f"Bearer {key}"}, scheduler, corpus


def _spec(corpus: Path, train_iters: int, **training: Any) -> dict[str, Any]:
    return {
        "name": "on-slurm",
        "model": {
            "arch": "llama",
            "num_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "seq_length": 32,
        },
        "data": {"tokenizer": {"type": "byte"}, "train": [{"path": corpus.as_uri()}], "split": "90,10,0"},
        "training": {
            "train_iters": train_iters,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "precision": "fp32",
            "log_interval": 1,
            "eval_interval": 0,
            "warmup_iters": 0,
            **training,
        },
        "resources": {"pool": POOL, "devices": 1, "max_runtime_s": 600},
    }


def _drive(scheduler: Scheduler, url: str, job_id: str, until: Callable[[Job], bool], timeout: float) -> Job:
    """Tick the scheduler (follow Slurm, place, submit) until the job satisfies `until`."""

    def check() -> Job | None:
        scheduler.reconcile_once()
        scheduler.schedule_once()
        with session_scope(url) as s:
            job = s.get(Job, job_id)
            assert job is not None
            s.expunge(job)
        return job if until(job) else None

    return wait_for(check, timeout, 1.0)


def _events(url: str, job_id: str, kind: str) -> list[JobEvent]:
    with session_scope(url) as s:
        rows = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == kind).order_by(JobEvent.id)
        )
        events = list(rows)
        s.expunge_all()
        return events


def test_a_job_submitted_through_the_api_runs_on_slurm_with_its_loss_charted(
    slurm_api: tuple[TestClient, dict[str, str], Scheduler, Path],
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    r = client.post("/v1/jobs", json=_spec(corpus, 6, checkpoint_interval=3), headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    _drive(scheduler, url, job_id, lambda j: j.status in (RUNNING, SUCCEEDED, FAILED, CANCELLED), 120)
    # The scheduler restarts while the job runs in Slurm: the new one follows it, submits nothing.
    scheduler = Scheduler(
        scheduler.settings, executor=SlurmExecutor(scheduler.settings, scheduler.executor.commands)
    )  # type: ignore[attr-defined]
    job = _drive(scheduler, url, job_id, lambda j: j.status in (SUCCEEDED, FAILED, CANCELLED), 180)
    logs = [line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs?tail=40", headers=headers).json()]
    assert job.status == SUCCEEDED, job.status_reason + "\n" + "\n".join(logs)
    assert job.attempt == 1

    # What the job page charts: a finite loss at every step.
    metrics = client.get(f"/v1/jobs/{job_id}/metrics?kind=train&max_points=100", headers=headers).json()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    events = client.get(f"/v1/jobs/{job_id}/events", headers=headers).json()
    kinds = [e["kind"] for e in events]
    assert SUBMITTED_EVENT in kinds and "started" in kinds
    (submitted,) = _events(url, job_id, SUBMITTED_EVENT)  # one Slurm job, restart or not
    assert (scheduler.executor.log_dir(job_id, 1) / "job.sbatch").exists()  # type: ignore[attr-defined]
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    sid = submitted.data["slurm_id"]
    # The runner ends the attempt, then exits: Slurm's job completes just after.
    assert wait_for(lambda: (s := cli.status([sid])[sid]).terminal and s, 30, 0.5).state == "COMPLETED"


def test_a_job_longer_than_slurms_time_limit_resumes_in_a_second_slurm_job_then_is_cancelled(
    slurm_api: tuple[TestClient, dict[str, str], Scheduler, Path],
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    limited = scheduler.settings.model_copy(update={"slurm_time_limit_s": 60})  # the shortest Slurm grants
    scheduler = Scheduler(limited, executor=SlurmExecutor(limited, scheduler.executor.commands))  # type: ignore[attr-defined]
    spec = _spec(corpus, 100_000, checkpoint_interval=0, log_interval=10)  # saves only when told to stop
    r = client.post("/v1/jobs", json=spec, headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    # Slurm warns (USR1) before its 60 s limit; the attempt checkpoints and the job is queued again.
    job = _drive(scheduler, url, job_id, lambda j: j.attempt == 2 and j.status == RUNNING, 150)
    assert job.max_retries == 2 + 1  # a link of a chain is not a retry
    requeued = [e for e in _events(url, job_id, "queued") if "time limit" in (e.reason or "")]
    assert len(requeued) == 1, [e.reason for e in _events(url, job_id, "queued")]
    step = int(requeued[0].reason.rsplit(" ", 1)[1])
    assert requeued[0].reason == f"reached the allocation's time limit (60s); resumes from step {step}"
    assert step >= 1
    wait_for(lambda: len(_events(url, job_id, "started")) == 2, 60, 0.5)
    assert _events(url, job_id, "started")[-1].data["resumed_from"] == step
    first, second = (e.data["slurm_id"] for e in _events(url, job_id, SUBMITTED_EVENT))
    assert first != second  # the next link is a new Slurm job

    # The product's cancel ends the second Slurm job.
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = _drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    wait_for(lambda: all(s.terminal for s in cli.status([first, second]).values()), 60, 0.5)
    assert cli.status([first])[first].state != "TIMEOUT"  # it stopped before Slurm's limit


def test_a_slurm_node_failure_is_retried_and_resumes_from_the_checkpoint(
    slurm_api: tuple[TestClient, dict[str, str], Scheduler, Path],
    slurm_cluster: SlurmCluster,  # noqa: F811
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    r = client.post(
        "/v1/jobs", json=_spec(corpus, 100_000, checkpoint_interval=10, log_interval=5), headers=headers
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = _drive(scheduler, url, job_id, lambda j: j.status == RUNNING and (j.current_step or 0) >= 15, 120)
    (submitted,) = _events(url, job_id, SUBMITTED_EVENT)
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    out = slurm_cluster.client("squeue", "-h", "-j", submitted.data["slurm_id"], "-o", "%N")
    node = out.stdout.strip()
    assert node in slurm_cluster.node_names, out
    try:
        # An operator (or Slurm's health check) takes the node down under the job: NODE_FAIL.
        down = slurm_cluster.client("scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=test")
        assert down.returncode == 0, down.stderr
        job = _drive(scheduler, url, job_id, lambda j: j.attempt == 2, 120)
        states = [e.data for e in _events(url, job_id, "slurm_state") if e.data.get("attempt") == 1]
        assert states[-1]["state"] == "NODE_FAIL" and states[-1]["cause"] == "slurm_node_fail"
        assert job.max_retries == 2  # a retry: counted against the job's budget
        requeued = _events(url, job_id, "queued")[-1]
        assert "retrying, will resume from checkpoint" in (requeued.reason or ""), requeued.reason
        wait_for(lambda: len(_events(url, job_id, "started")) == 2, 90, 0.5)
        resumed = _events(url, job_id, "started")[-1].data["resumed_from"]
        assert resumed is not None and resumed >= 10 and resumed % 10 == 0  # the periodic checkpoint
    finally:
        slurm_cluster.client("scontrol", "update", f"NodeName={node}", "State=RESUME")
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = _drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason
    first, second = (e.data["slurm_id"] for e in _events(url, job_id, SUBMITTED_EVENT))
    wait_for(lambda: all(s.terminal for s in cli.status([first, second]).values()), 60, 0.5)


def test_a_slurm_job_that_never_started_a_runner_shows_why_in_the_jobs_log(
    slurm_api: tuple[TestClient, dict[str, str], Scheduler, Path],
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    broken = scheduler.settings.model_copy(update={"slurm_python": "/nonexistent/bin/python3"})
    commands = scheduler.executor.commands  # type: ignore[attr-defined]
    scheduler = Scheduler(broken, executor=SlurmExecutor(broken, commands))
    spec = _spec(corpus, 2)
    spec["resources"]["max_retries"] = 0
    r = client.post("/v1/jobs", json=spec, headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    job = _drive(scheduler, url, job_id, lambda j: j.status in (SUCCEEDED, FAILED, CANCELLED), 90)
    assert job.status == FAILED
    logs = [line["line"] for line in client.get(f"/v1/jobs/{job_id}/logs", headers=headers).json()]
    slurm_lines = [line for line in logs if line.startswith("[slurm ")]
    assert any("/nonexistent/bin/python3" in line for line in slurm_lines), logs


def test_a_requeue_by_slurm_is_one_retry_and_never_runs_the_attempt_twice(
    slurm_api: tuple[TestClient, dict[str, str], Scheduler, Path],
    slurm_cluster: SlurmCluster,  # noqa: F811
) -> None:
    client, headers, scheduler, corpus = slurm_api
    url = scheduler.url
    requeue = scheduler.settings.model_copy(update={"slurm_requeue": True})
    scheduler = Scheduler(requeue, executor=SlurmExecutor(requeue, scheduler.executor.commands))  # type: ignore[attr-defined]
    r = client.post(
        "/v1/jobs", json=_spec(corpus, 100_000, checkpoint_interval=10, log_interval=5), headers=headers
    )
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    _drive(scheduler, url, job_id, lambda j: j.status == RUNNING and (j.current_step or 0) >= 5, 120)
    (submitted,) = _events(url, job_id, SUBMITTED_EVENT)
    first = submitted.data["slurm_id"]
    assert "#SBATCH --requeue" in (scheduler.executor.log_dir(job_id, 1) / "job.sbatch").read_text()  # type: ignore[attr-defined]
    out = slurm_cluster.client("scontrol", "requeue", first)  # what Slurm does on a node failure
    assert out.returncode == 0, out.stderr

    job = _drive(scheduler, url, job_id, lambda j: j.attempt == 2 and j.status == RUNNING, 120)
    assert job.max_retries == 2  # one retry of the job's budget: the requeue is not counted twice
    cli: SlurmCli = scheduler.executor.commands  # type: ignore[attr-defined]
    assert wait_for(lambda: (s := cli.status([first])[first]).terminal and s, 60, 0.5).state == "CANCELLED"
    with session_scope(url) as s:
        claims = s.scalars(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == RUNNING)
        ).all()
    assert [d["attempt"] for d in claims] == [1, 2]  # attempt 1 ran once, the requeued Slurm job never
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = _drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason


def test_a_job_slurm_kills_at_its_time_limit_resumes_from_its_checkpoint_on_retry(
    slurm_api: tuple[TestClient, dict[str, str], Scheduler, Path],
    fake_engine: Path,  # set up after slurm_api: the runners on Slurm run it
    slurm_cluster: SlurmCluster,  # noqa: F811
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
    r = client.post("/v1/jobs", json=_spec(corpus, 100_000, checkpoint_interval=5), headers=headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]

    job = _drive(scheduler, url, job_id, lambda j: j.attempt == 2 and j.status == RUNNING, 180)
    states = [e.data for e in _events(url, job_id, "slurm_state") if e.data.get("attempt") == 1]
    assert states[-1]["state"] == "TIMEOUT" and states[-1]["cause"] == "slurm_timeout", states
    assert job.max_retries == 2  # a retry, counted
    wait_for(lambda: len(_events(url, job_id, "started")) == 2, 60, 0.5)
    resumed = _events(url, job_id, "started")[-1].data["resumed_from"]
    assert resumed is not None and resumed >= 5 and resumed % 5 == 0  # its last periodic checkpoint
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=headers).status_code == 200
    job = _drive(scheduler, url, job_id, lambda j: j.status in (CANCELLED, FAILED, SUCCEEDED), 60)
    assert job.status == CANCELLED, job.status_reason
