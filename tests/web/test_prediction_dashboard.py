"""The job page's Layout panel, in a real Chromium: the planner's prediction (the submitted event's
plan) beside the medians the job measured, with the % difference; before any metrics, a hint."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from web_helpers import signed_in_page

from megatrain.db.models import JobMetric
from megatrain.db.session import session_scope

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]

CELLS = """(key) => [...document.querySelectorAll(`#prediction-table tr[data-quantity='${key}'] td`)]
  .map((td) => td.textContent)"""


def test_layout_panel_sets_the_prediction_beside_the_measured(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    live = live_api
    headers = {"Authorization": f"Bearer {live.key}"}
    job_id = str(httpx.post(f"{live.url}/v1/jobs", json=live.spec("predicted"), headers=headers).json()["id"])
    events = httpx.get(f"{live.url}/v1/jobs/{job_id}/events", headers=headers).json()
    events = events["items"] if isinstance(events, dict) else events
    [predicted] = [e["data"]["plan"]["predicted"] for e in events if e["reason"] == "submitted"]

    page = signed_in_page(browser_context, page_errors, live.url, live.key, f"/jobs/{job_id}")
    page.wait_for_selector("#prediction-table")
    assert "appear with the first metrics" in page.locator("#prediction").inner_text()
    assert page.evaluate(CELLS, "step")[1:] == ["—", "—"]

    # Twice the predicted step time, half its tokens/s: +100% and -50% (a slow outlier ignored).
    step, tokens = 2 * predicted["step_time_s"], predicted["tokens_per_s"] / 2
    with session_scope(db_url) as s:
        for i, t in enumerate([step, step, 50 * step], 1):
            row = {"step": i, "loss": 5.0, "iter_time_s": t, "tokens_per_s": tokens, "mfu": predicted["mfu"]}
            s.add(JobMetric(job_id=job_id, kind="train", step=i, loss=5.0, data=row))
    page.reload()
    page.wait_for_function(
        "document.querySelector('#prediction-table td:nth-child(4)')?.textContent === '+100%'"
    )
    assert page.evaluate(CELLS, "step")[2] == "+100%"
    assert page.evaluate(CELLS, "tokens")[2] == "-50%"
    assert page.evaluate(CELLS, "mfu")[2] == "+0%"
    assert page.evaluate(CELLS, "memory")[1:] == ["—", "—"]  # a CPU measures no allocator peak
    assert page_errors == []
