"""The dashboard shows where each job stands: a queued job's place in its pool's queue and why it
waits ("2nd in queue: …"), a running job's ETA at its measured pace, in the jobs list and the job
page's header. The scheduler's decisions and the engine's metrics are seeded in the database.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from sqlalchemy import update
from web_helpers import signed_in_page

from megatrain.db.models import Job, JobMetric, utcnow
from megatrain.db.session import session_scope

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def test_queue_place_and_eta_are_shown(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    headers = {"Authorization": f"Bearer {live_api.key}"}
    ids = []
    for name in ("waits", "runs"):
        resp = httpx.post(f"{live_api.url}/v1/jobs", json=live_api.spec(name), headers=headers)
        assert resp.status_code == 201, resp.text
        ids.append(resp.json()["id"])
    waiting, running = ids
    with session_scope(db_url) as s:
        reason = "waiting: needs 8 free slots in pool 'default'; the freest node has 2"
        wait = {"code": "no_free_slots", "pool": "default", "needs": 8, "freest": 2, "position": 2}
        s.execute(update(Job).where(Job.id == waiting).values(status_reason=reason, wait_reason=wait))
        s.execute(
            update(Job)
            .where(Job.id == running)
            .values(status="running", status_reason="", current_step=4, total_steps=10, started_at=utcnow())
        )
        for step in (2, 4):  # 2 s a step, 6 steps left: 12 s
            data = {"step": step, "loss": 2.0, "iter_time_s": 2.0}
            at = utcnow() - timedelta(seconds=1)
            s.add(JobMetric(job_id=running, kind="train", step=step, loss=2.0, data=data, created_at=at))

    page = signed_in_page(browser_context, page_errors, live_api.url, live_api.key, "/jobs")
    page.wait_for_selector(f"tr[data-job-id='{waiting}']")
    assert "2nd in queue" in page.inner_text(f"tr[data-job-id='{waiting}'] td[data-label='State']")
    assert "ETA 12s" in page.inner_text(f"tr[data-job-id='{running}'] td[data-label='State']")

    page.goto(f"{live_api.url}/#/jobs/{waiting}")
    page.wait_for_selector("#job-reason:not(:empty)")
    assert page.inner_text("#job-reason") == (
        "2nd in queue: needs 8 free slots in pool 'default'; the freest node has 2"
    )
    page.goto(f"{live_api.url}/#/jobs/{running}")
    page.wait_for_function("document.querySelector('#job-reason')?.textContent.includes('ETA')")
    assert page.inner_text("#job-reason") == "ETA 12s (2.00 s/step)"
    assert not page_errors, page_errors
