"""A failed job's page in a real headless Chromium: the header shows the worker's one-line reason
(what failed, on which rank, and why) with a button that brings the log's traceback into view, and
every timeline entry is one line. The job really fails: the real engine finds its data file gone
(deleted after submission), a user error, so it is not retried.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from web_helpers import ARTIFACTS, signed_in_page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]


def test_a_failed_job_shows_one_line_and_the_traceback_one_click_away(
    live_stack: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    pytest.importorskip("torch")
    live = live_stack
    doomed = live.data_path.with_name("doomed.jsonl")
    doomed.write_text("".join(json.dumps({"text": f"def f{i}(): pass\n"}) + "\n" for i in range(50)))
    spec = live.spec("doomed")
    spec["data"]["train"] = [{"path": doomed.as_uri()}]
    resp = httpx.post(f"{live.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {live.key}"})
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    doomed.unlink()  # before the engine reads it (it imports torch first)

    page = signed_in_page(browser_context, page_errors, live.url, live.key, f"/jobs/{job_id}")
    page.wait_for_selector("#job-status .badge.failed", timeout=120_000)
    reason = page.inner_text("#job-reason")
    assert reason.startswith("reading the data failed on rank 0 during setup: FileNotFoundError: "), reason
    assert str(doomed) in reason and "not retried" in reason and "\n" not in reason
    assert "Traceback" not in reason
    assert page.inner_text("#job-tiles").count("1 of 3")  # attempt 1 of 3: no retry spent

    # Every timeline entry is one line (the failed one's reason is the header's).
    failed = page.locator("#timeline li[data-kind='failed'] .why")
    assert failed.inner_text() == reason
    heights = page.eval_on_selector_all(
        "#timeline .why",
        "els => els.map(e => e.getBoundingClientRect().height / parseFloat(getComputedStyle(e).fontSize))",
    )
    assert heights and max(heights) < 2, heights

    # One click brings the log, scrolled to its end, where the traceback is.
    page.evaluate("window.scrollTo(0, 0)")
    page.wait_for_function("document.querySelector('#logs').textContent.includes('Traceback')")
    page.click("#show-log")
    page.wait_for_function("document.activeElement && document.activeElement.id === 'logs'")
    logs = page.locator("#logs")
    box = logs.bounding_box()
    viewport = page.viewport_size
    assert box is not None and viewport is not None
    assert box["y"] < viewport["height"] and box["y"] + box["height"] > 0  # on screen
    at_end = "e => e.scrollTop + e.clientHeight >= e.scrollHeight - 8"
    assert page.eval_on_selector("#logs", at_end)
    text = logs.inner_text()
    assert "Traceback (most recent call last):" in text and "FileNotFoundError" in text
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-failed-job.png"), full_page=True)
    assert not page_errors, page_errors
