"""The dashboard in a real headless Chromium against a live API whose scheduler runs real (tiny)
training jobs: sign-in, live loss chart, cancel, checkpoint download, a field error from a bad
spec, tenant isolation, the cluster view, and a narrow screen. Saves a screenshot of the job page
to test-artifacts/.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api; this is about the page.
"""

from __future__ import annotations

import io
import json
import tarfile
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from web_helpers import ARTIFACTS, open_page

from megatrain.api.auth import create_api_key
from megatrain.db.session import session_scope

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]


def submit(live: LiveApi, spec: dict[str, Any], key: str | None = None) -> str:
    resp = httpx.post(
        f"{live.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {key or live.key}"}
    )
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def job_status(live: LiveApi, job_id: str) -> str:
    resp = httpx.get(f"{live.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {live.key}"})
    return str(resp.json()["status"])


def sign_in(page: Any, live: LiveApi, key: str) -> None:
    page.goto(f"{live.url}/#/jobs")
    page.fill("#api-key", key)
    page.click("button[type=submit]")


def test_dashboard_end_to_end(
    live_stack: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    live = live_stack
    with session_scope(db_url) as s:
        other_key = create_api_key(s, "globex", "other tenant")
    theirs = submit(live, live.spec("their-secret-job"), key=other_key)

    page = open_page(browser_context, page_errors)

    # A wrong key gets a clear message and no access.
    sign_in(page, live, "mt_" + "x" * 40)
    page.wait_for_selector("#key-error:has-text('not accepted')")
    assert "invalid or has been revoked" in page.inner_text("#key-error")
    assert page.locator("#jobs-table").count() == 0

    sign_in(page, live, live.key)
    page.wait_for_selector("text=No jobs yet")  # the other tenant's job is not listed

    # A bad spec: the API's 422 appears next to the field it names.
    page.click("nav >> text=Submit")
    page.wait_for_selector("#spec-editor")
    spec = live.spec(
        "dash-train",
        train_iters=300,
        log_interval=2,
        checkpoint_interval=100,
        eval_interval=100,
        eval_iters=2,
    )
    bad = json.loads(json.dumps(spec))
    bad["model"]["hidden_size"] = 30  # not divisible by 4 heads
    bad["model"]["num_attention_heads"] = 4
    page.fill("#spec-editor", json.dumps(bad, indent=2))
    page.click("#submit")
    error = page.locator("[data-error-for='model.hidden_size']")
    error.wait_for()
    assert "not divisible by" in error.inner_text()
    assert page.get_attribute("#f-model-hidden_size", "aria-invalid") == "true"
    assert page.evaluate("document.activeElement.id") == "f-model-hidden_size"  # focus moves to it
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-submit-error.png"))

    # The form edits the editor's spec; a good spec submits and opens the job page.
    page.fill("#spec-editor", json.dumps(spec, indent=2))
    page.fill("#f-name", "dash-train")
    page.click("#validate")
    page.wait_for_selector("#submit-result:has-text('Valid')")
    page.click("#submit")
    page.wait_for_url("**/#/jobs/job-*")
    job_id = page.url.rsplit("/", 1)[-1]

    # Live: the loss chart gains points while the job trains, without a reload.
    loss = page.locator("#chart-loss")
    page.wait_for_function(
        "Number(document.querySelector('#chart-loss')?.dataset.points) >= 1", timeout=90_000
    )
    first = int(loss.get_attribute("data-points"))
    page.wait_for_function(
        f"Number(document.querySelector('#chart-loss').dataset.points) >= {first + 5}", timeout=60_000
    )
    assert job_status(live, job_id) in ("running", "succeeded")
    # The log pane follows the job's lines (tail, then the stream).
    page.wait_for_function("document.querySelector('#logs').textContent.includes('step ')")
    page.wait_for_selector("#job-status .badge.succeeded", timeout=120_000)
    final_points = int(loss.get_attribute("data-points"))
    assert final_points == 150  # 300 steps logged every 2
    assert page.locator("#chart-lr").get_attribute("data-points") == "150"
    # A CPU run reports cpu_util (engine/device_stats.py): the utilization chart shows it, so titled.
    assert page.locator("#chart-utilization").is_visible()
    assert page.locator("#chart-utilization").get_attribute("data-points") == "150"
    assert page.inner_text("#chart-utilization-title") == "CPU utilization"
    assert page.inner_text("#chart-memory-title") == "Memory per rank (CPU)"
    for kind in ("Queued", "Scheduled", "Running", "Engine started", "Checkpoint saved", "Succeeded"):
        assert page.locator(f"#timeline .what:text-is('{kind}')").count() >= 1, kind
    assert "engine exited 0" in page.inner_text("#timeline")
    assert page.inner_text("#logs").strip()  # the log tail

    # Download a checkpoint: a tar whose folder holds the manifest.
    page.wait_for_selector("#checkpoint-table tr[data-step='300']")
    with page.expect_download() as info:
        page.click("#checkpoint-table tr[data-step='100'] button")
    download = info.value
    assert download.suggested_filename == f"{job_id}-iter_0000100.tar"
    with tarfile.open(fileobj=io.BytesIO(open(download.path(), "rb").read())) as tar:
        names = tar.getnames()
    assert "iter_0000100/manifest.json" in names

    shot = ARTIFACTS / "dashboard-job.png"
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(shot), full_page=True)
    print(f"\njob page screenshot: {shot}")

    # Cancel a running job from its page.
    long_id = submit(live, live.spec("dash-long", train_iters=100_000, log_interval=5, checkpoint_interval=0))
    page.goto(f"{live.url}/#/jobs/{long_id}")
    page.wait_for_selector("#job-status .badge.running", timeout=90_000)
    page.once("dialog", lambda d: d.accept())
    page.click("#cancel-job")
    page.wait_for_selector("#job-status .badge.cancelled", timeout=60_000)
    assert page.locator("#cancel-job").is_hidden()
    assert page.locator("#timeline .what:text-is('Cancel requested')").count() == 1

    # The list: both jobs, live state, filter by state; never the other tenant's.
    page.click("nav >> text=Jobs")
    page.wait_for_selector(f"#jobs-table tr[data-job-id='{job_id}']")
    rows = page.locator("#jobs-table tbody tr")
    assert rows.count() == 2
    page.click(".chip[data-state='succeeded']")
    page.wait_for_function("document.querySelectorAll('#jobs-table tbody tr').length === 1")
    assert page.locator(f"#jobs-table tr[data-job-id='{job_id}'] .badge.succeeded").count() == 1
    row_text = page.inner_text(f"#jobs-table tr[data-job-id='{job_id}']")
    assert "tp1 · pp1 · dp1" in row_text and "300 / 300" in row_text
    page.click(".chip[data-state='']")
    page.wait_for_function("document.querySelectorAll('#jobs-table tbody tr').length === 2")
    page.screenshot(path=str(ARTIFACTS / "dashboard-jobs.png"))
    assert "their-secret-job" not in page.content() and theirs not in page.content()

    # Another tenant's job id in the address bar is "not found", not their job.
    page.goto(f"{live.url}/#/jobs/{theirs}")
    page.wait_for_selector("#not-found")
    assert "their-secret-job" not in page.content()

    # Cluster: the pool's slots and the (other tenant's, queued or placed) work, unnamed.
    page.click("nav >> text=Cluster")
    page.wait_for_selector("#pools [data-pool='default']")
    assert "CPU slots" in page.inner_text("#pools")
    page.screenshot(path=str(ARTIFACTS / "dashboard-cluster.png"))
    assert theirs not in page.content() and "their-secret-job" not in page.content()

    # Keyboard: the nav links and filter chips are reachable with Tab and show a focus ring.
    page.click("nav >> text=Jobs")
    page.wait_for_selector("#jobs-table")
    page.focus("a.brand")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.textContent") == "Jobs"
    page.keyboard.press("Enter")

    # Narrow screen and dark theme: no sideways scrolling; rows become cards.
    page.set_viewport_size({"width": 380, "height": 800})
    page.goto(f"{live.url}/#/jobs/{job_id}")
    page.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) > 0")
    page.click("#theme-toggle")  # auto -> light
    page.click("#theme-toggle")  # light -> dark
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    overflow = page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the job page scrolls sideways by {overflow}px at 380px"
    page.screenshot(path=str(ARTIFACTS / "dashboard-job-narrow-dark.png"), full_page=True)
    page.goto(f"{live.url}/#/jobs")
    page.wait_for_selector("#jobs-table")
    assert page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth") <= 0
    assert page.evaluate("getComputedStyle(document.querySelector('#jobs-table thead')).display") == "none"

    assert page_errors == []
