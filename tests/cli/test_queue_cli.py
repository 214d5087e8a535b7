"""`megatrain status` and `list` show a queued job's place in the queue and a running job's ETA
(the API's queue_position / eta_s fields), through a stand-in client: rendering only."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.client import Job

BASE: dict[str, Any] = {
    "name": "j", "kind": "pretrain", "pool": "gpu", "total_steps": 1000, "attempt": 0,
    "created_at": "2026-11-25T16:00:00Z", "layout": {"tp": 1, "pp": 1, "dp": 8, "cp": 1}, "num_procs": 8,
}  # fmt: skip
QUEUED = BASE | {
    "id": "job-0000000000000001", "status": "queued", "queue_position": 3,
    "status_reason": "waiting: needs 8 free slots in pool 'gpu'; the freest node has 4",
}  # fmt: skip
RUNNING = BASE | {
    "id": "job-0000000000000002", "status": "running", "current_step": 400, "step_time_s": 1.5,
    "eta_s": 900.0, "eta_at": "2026-11-25T17:15:00Z", "status_reason": "",
}  # fmt: skip


class _Client:
    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get_job(self, job_id: str) -> Job:
        return Job.from_dict(QUEUED if job_id == QUEUED["id"] else RUNNING)

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return []

    def list_jobs(self, **_: Any) -> list[Job]:
        return [Job.from_dict(RUNNING), Job.from_dict(QUEUED)]


@pytest.fixture(autouse=True)
def _stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("megatrain.cli.jobs.Client", _Client)


def _run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


def test_status_shows_the_place_in_the_queue() -> None:
    out = _run("status", QUEUED["id"])
    assert "queue      3rd in pool 'gpu'" in out
    assert "needs 8 free slots in pool 'gpu'" in out and "eta" not in out


def test_status_shows_a_running_jobs_eta() -> None:
    out = _run("status", RUNNING["id"])
    assert "eta        15m (1.5 s/step measured; done about 17:15 UTC)" in out
    assert "queue " not in out


def test_list_marks_queued_jobs_with_their_place() -> None:
    lines = _run("list").splitlines()
    assert "queued #3" in lines[2] and "#" not in lines[1]
