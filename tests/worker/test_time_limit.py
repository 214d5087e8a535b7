"""An allocation's time limit (Slurm's warning before it, worker.preempt.TimeLimit) with the fake
engine: the attempt checkpoints and stops; a limit shorter than the job's max_runtime_s chains the job
(queued again, not a retry, resuming with its steps continuous), the job's own max_runtime_s fails it
with its progress saved."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures.cluster import seed_job, seed_node
from sqlalchemy import select
from test_preempt import _job, _PlaceOnly
from worker_helpers import job_spec, wait_for

from megatrain.db.models import FAILED, QUEUED, SUCCEEDED, AttemptLedger, JobEvent, JobMetric
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.worker.attempt import Attempt
from megatrain.worker.preempt import TimeLimit, ask_to_stop
from megatrain.worker.shard import run_shard

# The runner's decisions; the databases' own differences are tested elsewhere (one is enough here).
pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _placed(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, steps: int, max_runtime_s: int, **kw: int
) -> str:
    """A scheduled job of `steps` fake-engine steps (0.05 s each) on a one-slot pool; no periodic
    checkpoint, so the one it resumes from is the one saved on stopping."""
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    url = settings.resolved_database_url
    seed_node(url, 1, "solo", "solonode")
    spec = job_spec(steps, checkpoint_interval=0, max_runtime_s=max_runtime_s)
    job = seed_job(url, 1, pool="solo", spec=spec, **kw)
    assert Scheduler(settings, _PlaceOnly()).schedule_once() == [job]
    return job


def _run_until_warned(settings: Settings, job_id: str, stop: TimeLimit) -> list[int]:
    """Run the attempt; once it has made progress, the warning comes (the flag appears)."""
    url = settings.resolved_database_url
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(run_shard(job_id, settings, stop=stop)))
    runner.start()
    wait_for(lambda: _job(url, job_id).current_step >= 3)
    stop.flag.write_text("")
    runner.join(timeout=30)
    return codes


def test_a_job_longer_than_the_allocation_runs_as_a_chain(
    settings: Settings, fake_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url
    job = _placed(settings, monkeypatch, 40, 600, max_retries=0)
    assert _run_until_warned(settings, job, TimeLimit(tmp_path / "time-limit", 120.0)) == [75]

    after = _job(url, job)
    assert after.status == QUEUED
    assert (after.max_retries, after.continuations) == (0, 1)  # not a retry: counted apart
    step = int(after.status_reason.rsplit(" ", 1)[1])
    assert after.status_reason == f"reached the allocation's time limit (120s); resumes from step {step}"
    assert 3 <= step < 40
    with session_scope(url) as s:
        (row,) = s.scalars(select(AttemptLedger).where(AttemptLedger.job_id == job)).all()
        assert row.outcome == "continued" and row.preempt_s > 0  # checkpoint-and-stop time is lost time

    assert Scheduler(settings, _PlaceOnly()).schedule_once() == [job]
    assert run_shard(job, settings, stop=TimeLimit(tmp_path / "next-flag", 120.0)) == 0
    assert _job(url, job).status == SUCCEEDED
    with session_scope(url) as s:
        steps = s.scalars(select(JobMetric.step).where(JobMetric.job_id == job, JobMetric.kind == "train"))
        started = s.scalars(
            select(JobEvent.data)
            .where(JobEvent.job_id == job, JobEvent.kind == "started")
            .order_by(JobEvent.id)
        ).all()
        assert sorted(steps) == list(range(1, 41))  # continuous: nothing lost, nothing done twice
    assert started[-1]["resumed_from"] == step


def test_a_limit_that_is_the_jobs_own_max_runtime_fails_it_with_progress_saved(
    settings: Settings, fake_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url
    job = _placed(settings, monkeypatch, 40, 120, max_retries=2)
    assert _run_until_warned(settings, job, TimeLimit(tmp_path / "time-limit", 120.0)) == [75]
    after = _job(url, job)
    assert after.status == FAILED
    step = int(after.status_reason.rsplit(" ", 1)[1])
    assert after.status_reason == f"exceeded max_runtime_s=120; checkpointed at step {step}"
    assert 3 <= step < 40


def test_a_warning_before_the_engine_started_waits_for_it(
    settings: Settings, fake_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slurm may warn up to a minute early: with a short limit, before the ranks have their handlers.
    url = settings.resolved_database_url
    job = _placed(settings, monkeypatch, 40, 600)
    flag = tmp_path / "time-limit"
    flag.write_text("")
    assert run_shard(job, settings, stop=TimeLimit(flag, 60.0)) == 75  # checkpointed, not killed
    after = _job(url, job)
    assert after.status == QUEUED
    step = int(after.status_reason.rsplit(" ", 1)[1])
    assert 1 <= step < 40


def test_the_deadline_stops_the_attempt_where_no_warning_comes(
    settings: Settings, fake_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through slurmrestd Slurm's warning cannot reach the batch shell: the exported deadline stands in.
    url = settings.resolved_database_url
    job = _placed(settings, monkeypatch, 400, 600)
    stop = TimeLimit(tmp_path / "never-touched", 120.0, stop_at=time.time() + 2.0)
    assert run_shard(job, settings, stop=stop) == 75
    after = _job(url, job)
    assert after.status == QUEUED and "reached the allocation's time limit (120s)" in after.status_reason
    assert 1 <= after.current_step < 400


def test_the_stop_is_signalled_once_this_nodes_ranks_report_progress(
    settings: Settings, tmp_path: Path
) -> None:
    # Node rank 0 of a gang may never see 'started' (global rank 0 can run on another node): its own
    # ranks' progress files say their handlers are in place. Two `sleep`s stand for its two ranks
    # under torchrun (the shell): they die of the SIGUSR2 they get, and the shell ends.
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        att = Attempt("job", 1, 0, 2, 600.0, tmp_path)
        runner = SimpleNamespace(preempt_asked=None, engine_started=False, stop_sent=False)
        assert not ask_to_stop(settings, proc, att, runner, 0.0, "test")  # type: ignore[arg-type]
        (tmp_path / "progress.rank4").write_text("{}")
        assert not ask_to_stop(settings, proc, att, runner, 1.0, "test")  # type: ignore[arg-type]
        time.sleep(0.2)
        assert proc.poll() is None and not runner.stop_sent  # one of its two ranks only
        (tmp_path / "progress.rank5").write_text("{}")
        (tmp_path / "progress.rank6.tmp").write_text("{}")
        ask_to_stop(settings, proc, att, runner, 2.0, "test")  # type: ignore[arg-type]
        assert proc.wait(timeout=5) == 0 and runner.stop_sent
        assert ask_to_stop(settings, proc, att, runner, settings.preempt_grace_s + 1, "test")  # type: ignore[arg-type]
    finally:
        proc.kill()
        proc.wait()
