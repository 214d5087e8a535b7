"""`megatrain status` and `follow` on a failed job: the worker's one-line reason and where the
traceback is (`megatrain logs JOB`), never the traceback itself."""

from __future__ import annotations

import httpx
from fixtures.live import LiveApi
from test_cli import run

from megatrain.db.jobs import transition
from megatrain.db.models import FAILED, QUEUED
from megatrain.db.session import session_scope
from megatrain.failures import attempt_reason, event_data

RECORD = {"kind": "user", "rank": 1, "phase": "data", "step": None, "exception": "FileNotFoundError",
          "message": "/data/corpus.jsonl does not exist"}  # fmt: skip


def _failed_job(live: LiveApi, reason: str) -> str:
    """A submitted job ended as the shard runner ends one (its reason and the failure's data)."""
    resp = httpx.post(
        f"{live.url}/v1/jobs", json=live.spec("doomed"), headers={"Authorization": f"Bearer {live.key}"}
    )
    assert resp.status_code == 201, resp.text
    job_id = str(resp.json()["id"])
    with session_scope(live.settings.resolved_database_url) as s:
        data = event_data(RECORD, 2, 1)
        assert transition(s, job_id, FAILED, from_statuses=(QUEUED,), reason=reason, data=data)
    return job_id


def test_status_shows_the_one_line_reason_and_where_the_traceback_is(live_api: LiveApi) -> None:
    reason = attempt_reason(RECORD, 2, 1, retrying=False)
    job_id = _failed_job(live_api, reason)
    code, out = run("status", job_id)
    assert code == 0, out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("status")]
    assert line.split(None, 2)[1:] == ["failed", reason]
    assert "reading the data failed on rank 1 during setup: FileNotFoundError" in line
    assert f"megatrain logs {job_id}" in out
    code, out = run("follow", job_id)
    assert code == 1 and f"job {job_id} failed: {reason}" in out and f"megatrain logs {job_id}" in out


def test_a_reason_stored_with_a_traceback_shows_its_first_line(live_api: LiveApi) -> None:
    # Jobs failed before reasons were one line hold the engine's last output after the first line.
    job_id = _failed_job(live_api, "attempt 1 failed (exit code 1). Last output:\nTraceback (most recent")
    code, out = run("status", job_id)
    assert code == 0 and "attempt 1 failed (exit code 1). Last output:" in out, out
    assert "most recent" not in out
