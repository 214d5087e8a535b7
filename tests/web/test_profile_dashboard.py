"""The job page's Profile card in a real headless Chromium: hidden until the engine's `profiled`
event, then one download per rank's trace (the bytes the engine copied next to the checkpoints).

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api/test_profile.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from web_helpers import signed_in_page

from megatrain.attempts.ingest import ingest_events
from megatrain.db.session import session_scope
from megatrain.storage import open_store

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def test_profile_card_downloads_each_ranks_trace(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    live = live_api
    auth = {"Authorization": f"Bearer {live.key}"}
    resp = httpx.post(f"{live.url}/v1/jobs", json=live.spec("web-profile"), headers=auth)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    page = signed_in_page(browser_context, page_errors, live.url, live.key, f"/jobs/{job_id}")
    page.locator("#timeline").wait_for()
    assert page.locator("#profile-card").is_hidden()

    store = open_store(live.settings.resolved_storage_url)
    traces = {}
    for rank in range(2):
        trace = {"traceEvents": [{"name": f"ProfilerStep#{rank + 5}", "ph": "X", "ts": 0, "dur": 1}]}
        traces[rank] = gzip.compress(json.dumps(trace).encode())
        store.put_bytes(f"jobs/{job_id}/profile/trace.rank{rank}.json.gz", traces[rank])
    files = ["trace.rank0.json.gz", "trace.rank1.json.gz"]
    with session_scope(db_url) as s:
        ingest_events(s, job_id, [{"event": "profiled", "step": 6, "steps": [5, 6], "files": files}], 1)

    page.reload()
    page.locator("#profile-card").wait_for()
    assert "steps 5-6" in page.inner_text("#profile-card")
    assert "Profile written" in page.inner_text("#timeline")
    with page.expect_download() as info:
        page.get_by_role("button", name="Download trace.rank1.json.gz").click()
    download = info.value
    assert download.suggested_filename == f"{job_id}-trace.rank1.json.gz"
    assert Path(download.path()).read_bytes() == traces[1]
    assert page_errors == []
