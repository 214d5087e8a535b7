"""The dashboard on a CPU pool, in a real Chromium: CPU words (no "GPUs"), the measured memory
beside the planner's like for like (process RSS labelled as such), a one-point chart that draws
its point, the timeline's last event in view, and a Submit template on data that exists."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from web_helpers import ARTIFACTS, signed_in_page

from megatrain.api.spec.example import DEMO_CORPUS_KEY
from megatrain.db.jobs import record_event
from megatrain.db.models import JobMetric
from megatrain.db.session import session_scope
from megatrain.demo import build_stdlib_corpus
from megatrain.storage import open_store

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]

ESTIMATE = {"params_bytes": 86336, "grads_bytes": 172672, "optimizer_bytes": 518016,
            "activations_bytes": 351488, "total_bytes": 1128512}  # fmt: skip
# One CPU metrics row as the engine writes it (megatrain.engine.memory_stats, device_stats).
CPU_ROW = {"step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 500.0, "mfu": 0.01,
           "model_state_bytes": 777024, "measured_params_bytes": 86336, "measured_grads_bytes": 172672,
           "measured_optimizer_bytes": 518016, "process_rss_bytes": 531 << 20, "cpu_util": 95.0,
           "device_memory_used_bytes": 500 << 20, "device_memory_total_bytes": 16 << 30}  # fmt: skip

# Pixels of the first series' colour (--chart-1, #3f5bd8) on a chart's canvas: what uPlot drew.
SERIES_PIXELS = """(sel) => {
  const c = document.querySelector(sel + " canvas");
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    const near = Math.abs(d[i] - 63) + Math.abs(d[i + 1] - 91) + Math.abs(d[i + 2] - 216) < 90;
    if (near && d[i + 3] > 128) n++;
  }
  return n;
}"""
LAST_EVENT_IN_VIEW = """() => {
  const box = document.querySelector("#timeline").getBoundingClientRect();
  const last = document.querySelector("#timeline li:last-child").getBoundingClientRect();
  return last.top >= box.top - 1 && last.bottom <= box.bottom + 1;
}"""


def _queued_job_with_one_row(live: LiveApi, db_url: str) -> str:
    headers = {"Authorization": f"Bearer {live.key}"}
    job_id = str(httpx.post(f"{live.url}/v1/jobs", json=live.spec("cpu-run"), headers=headers).json()["id"])
    with session_scope(db_url) as s:
        s.add(JobMetric(job_id=job_id, kind="train", step=1, loss=5.5, data=CPU_ROW))
        # A validation row at a step without a train row: charts of train figures skip it.
        s.add(JobMetric(job_id=job_id, kind="val", step=2, loss=5.4, data={"step": 2, "val_loss": 5.4}))
        record_event(s, job_id, "started", "engine started on cpu",
                     {"device": "cpu", "precision": "fp32", "memory_estimate": ESTIMATE})  # fmt: skip
        for i in range(40):  # more than the timeline's box shows at once
            record_event(s, job_id, "info", f"note {i}", {})
        record_event(s, job_id, "info", "the newest event", {})
    return job_id


def test_cpu_job_page(live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str) -> None:
    live = live_api
    job_id = _queued_job_with_one_row(live, db_url)
    page = signed_in_page(browser_context, page_errors, live.url, live.key, "/jobs")
    page.wait_for_selector("#jobs-table")
    headers = page.locator("#jobs-table thead th").all_text_contents()
    assert "CPU slots" in headers and "GPUs" not in headers

    page.goto(f"{live.url}/#/jobs/{job_id}")
    page.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 1")
    page.wait_for_selector("#memory-model-state")
    # A pool without GPUs counts CPU slots.
    page.wait_for_function(
        "document.querySelector('#tile-devices').previousSibling.textContent === 'CPU slots'"
    )
    assert "GPU" not in page.inner_text("#job-tiles")

    # One metrics row: each chart draws its point (a line needs two).
    page.wait_for_function(f"({SERIES_PIXELS})('#chart-loss') > 0")
    assert page.evaluate(f"({SERIES_PIXELS})('#chart-lr')") > 0

    # The timeline shows its newest event without scrolling inside its box.
    assert page.locator("#timeline li").count() >= 42
    assert page.evaluate(LAST_EVENT_IN_VIEW)
    assert "the newest event" in page.locator("#timeline li:last-child").inner_text()

    # Memory, like for like: measured model state against the planner's static part; RSS apart.
    plan = page.inner_text("#memory-plan")
    assert "Planner's memory per device: 1.1 MiB" in plan and "per GPU" not in plan
    measured = page.inner_text("#memory-model-state")
    assert "758.8 KiB" in measured and "+0.0% of the plan" in measured
    assert "Process RSS: 531.0 MiB" in page.inner_text("#memory-rss")
    assert "not only tensors" in page.inner_text("#memory-rss")
    assert page.inner_text("#chart-memory-title") == "Memory per rank (CPU)"
    legend = page.text_content("#chart-memory .u-legend") or ""
    assert "process RSS" in legend and "model state (measured)" in legend and "GPU" not in legend
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#layout").screenshot(path=str(ARTIFACTS / "dashboard-cpu-memory.png"))
    assert page_errors == []


def test_submit_template_points_at_data_that_exists(
    live_api: LiveApi, browser_context: Any, page_errors: list[str]
) -> None:
    live = live_api
    page = signed_in_page(browser_context, page_errors, live.url, live.key, "/submit")
    page.wait_for_selector("#template-note:has-text('megatrain demo')")  # no data yet: says how
    spec = json.loads(page.input_value("#spec-editor"))
    assert "path/to" not in json.dumps(spec) and spec["training"]["precision"] == "auto"

    # Once the demo corpus is built, the template trains on it and validates as it stands.
    store = open_store(live.settings.resolved_storage_url)
    build_stdlib_corpus(store.local_path(DEMO_CORPUS_KEY), max_bytes=20_000)
    page.evaluate("sessionStorage.removeItem('megatrain.submit.draft')")  # the template, not a draft
    page.reload()
    page.wait_for_selector("#template-note:has-text('demo corpus')")
    spec = json.loads(page.input_value("#spec-editor"))
    path = spec["data"]["train"][0]["path"]
    assert path == f"{store.url}/{DEMO_CORPUS_KEY}" and store.exists(DEMO_CORPUS_KEY)
    assert page.input_value("#f-data-train-0-path") == path
    # A field the example leaves to its default shows that default, not an empty select.
    assert page.input_value("#f-training-precision") == "auto"
    page.click("#validate")
    page.wait_for_selector("#submit-result:has-text('Valid')")
    assert page_errors == []
