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


def test_a_comparison_taken_under_load_is_greyed_with_the_hosts_other_load(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    live = live_api
    headers = {"Authorization": f"Bearer {live.key}"}
    job_id = str(httpx.post(f"{live.url}/v1/jobs", json=live.spec("busy"), headers=headers).json()["id"])
    # 20x the predicted step on a host where other processes kept 1.4 of 2 cores busy (the engine's
    # host_* fields, megatrain.hostinfo.HostLoad): the +1900% measures their work, not the layout.
    predicted = _predicted(live, job_id)
    with session_scope(db_url) as s:
        for i in range(1, 4):
            row = {"step": i, "loss": 5.0, "iter_time_s": 20 * predicted["step_time_s"], "host_cores": 2,
                   "host_other_cores": 1.4, "host_job_cores": 0.6, "host_under_load": True}  # fmt: skip
            s.add(JobMetric(job_id=job_id, kind="train", step=i, loss=5.0, data=row))
    page = signed_in_page(browser_context, page_errors, live.url, live.key, f"/jobs/{job_id}")
    page.wait_for_selector("#host-load")
    assert page.evaluate(CELLS, "step")[2] == "+1900%"
    greyed = "(key) => [...document.querySelectorAll(`#prediction-table tr[data-quantity='${key}'] td`)]" \
        ".map((td) => td.classList.contains('under-load'))"  # fmt: skip
    assert page.evaluate(greyed, "step") == [False, True, True]  # predicted, measured, difference
    note = page.inner_text("#host-load")
    assert "Taken under load" in note and "1.4 of 2 cores" in note, note

    # On a quiet host the load is still shown, and nothing is greyed.
    quiet_id = str(httpx.post(f"{live.url}/v1/jobs", json=live.spec("quiet"), headers=headers).json()["id"])
    with session_scope(db_url) as s:
        row = {"step": 1, "loss": 5.0, "iter_time_s": predicted["step_time_s"], "host_other_cores": 0.05,
               "host_job_cores": 1.9, "host_cores": 2, "host_under_load": False}  # fmt: skip
        s.add(JobMetric(job_id=quiet_id, kind="train", step=1, loss=5.0, data=row))
    page.goto(f"{live.url}/#/jobs/{quiet_id}")
    page.wait_for_function("document.querySelector('#host-load')?.textContent.includes('0.05 of 2')")
    assert page.evaluate(greyed, "step") == [False, False, False]
    assert page.inner_text("#host-load") == "Host's other load while measured: 0.05 of 2 cores."
    assert page_errors == []


def _predicted(live: LiveApi, job_id: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {live.key}"}
    events = httpx.get(f"{live.url}/v1/jobs/{job_id}/events", headers=headers).json()
    events = events["items"] if isinstance(events, dict) else events
    [predicted] = [e["data"]["plan"]["predicted"] for e in events if e["reason"] == "submitted"]
    return predicted
