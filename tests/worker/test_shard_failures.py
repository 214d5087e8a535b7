"""How the shard runner ends a failed attempt, against the fake engine: a user error fails the job
at once, an infrastructure error or a killed rank is retried; every reason is one line."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select

from megatrain.db.models import FAILED, QUEUED, Job, JobEvent, JobLog
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.nodes import node_name
from megatrain.worker.shard import run_shard

# One database: the runner's SQL is the same on both (tests/db and tests/scheduler run both).
pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _ended(url: str, job_id: str) -> tuple[Job, JobEvent, str]:
    """The job, its last event and its log."""
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        events = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc())
        event = s.scalars(events).first()
        lines = list(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
        s.expunge_all()
        return job, event, "\n".join(lines)


def test_a_user_error_fails_the_job_after_one_attempt_in_one_line(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_RAISE", "FileNotFoundError")
    monkeypatch.setenv("FAKE_ENGINE_PHASE", "data")
    monkeypatch.setenv("FAKE_ENGINE_MESSAGE", "/data/corpus.jsonl does not exist\nmore detail")
    job_id = make_job(max_retries=2)
    assert run_shard(job_id, settings) == 1
    job, event, log = _ended(settings.resolved_database_url, job_id)
    assert job.status == FAILED and job.attempt == 1  # two retries left, none spent
    assert job.status_reason == (
        "reading the data failed on rank 0 during setup: FileNotFoundError: /data/corpus.jsonl does not "
        "exist; not retried: every attempt would fail the same way"
    )
    assert event.kind == FAILED and event.data["attempt"] == 1 and event.data["exit_code"] == 1
    assert event.data["failure"] == {
        "kind": "user",
        "rank": 0,
        "phase": "data",
        "step": None,
        "exception": "FileNotFoundError",
        "message": "/data/corpus.jsonl does not exist",
        "node": node_name(settings),  # where it ran: the runner adds it to the rank's record
    }
    assert "Traceback (most recent call last):" in log and "more detail" in log


def test_an_infrastructure_error_is_retried_with_rank_and_step(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_RAISE", "ConnectionResetError")
    monkeypatch.setenv("FAKE_ENGINE_FAIL_AT", "4")
    monkeypatch.setenv("FAKE_ENGINE_MESSAGE", "Connection reset by peer")
    job_id = make_job(max_retries=1, procs=1)
    assert run_shard(job_id, settings) == 1
    job, event, _ = _ended(settings.resolved_database_url, job_id)
    assert job.status == QUEUED
    assert job.status_reason == (
        "attempt 1: training failed on rank 0 at step 4: ConnectionResetError: Connection reset by peer; "
        "retrying from the latest checkpoint"
    )
    assert event.kind == QUEUED and event.data["failure"]["kind"] == "infrastructure"
    assert event.data["failure"]["step"] == 4


def test_a_rank_killed_by_a_signal_is_retried(
    settings: Settings,
    make_job: Callable[..., str],
    fake_engine: Path,
    oom_counters: Path,  # no OOM kill counted: someone else's SIGKILL
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_SIGNAL", str(int(signal.SIGKILL)))
    monkeypatch.setenv("FAKE_ENGINE_FAIL_AT", "2")
    job_id = make_job(max_retries=1)
    assert run_shard(job_id, settings) == -signal.SIGKILL
    job, event, _ = _ended(settings.resolved_database_url, job_id)
    assert job.status == QUEUED and "\n" not in job.status_reason
    assert job.status_reason == (
        "attempt 1: a rank exited with code -9 (signal SIGKILL); retrying from the latest checkpoint"
    )
    assert event.data["failure"] == {"kind": "infrastructure", "exit": "exited with code -9 (signal SIGKILL)"}
