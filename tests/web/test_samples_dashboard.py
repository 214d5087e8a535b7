"""The job page's "Sample" panel in a real headless Chromium: a job without checkpoints cannot
sample; on an engine-trained checkpoint, Generate (keyboard: Ctrl+Enter) shows the pending sample at
once and polls until the worker's text appears, which is the engine CheckpointSampler's greedy
continuation; a bad field is named beside it; a failed sample shows its reason; the panel fits a
phone-width screen in the dark theme.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.checkpoints import samples_in_background, train_job_checkpoint
from fixtures.live import LiveApi
from web_helpers import ARTIFACTS, signed_in_page

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def test_sample_panel_generates_and_shows_failures(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from megatrain.engine.sampling import CheckpointSampler

    live = live_api
    auth = {"Authorization": f"Bearer {live.key}"}
    resp = httpx.post(f"{live.url}/v1/jobs", json=live.spec("web-sample"), headers=auth)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]

    page = signed_in_page(browser_context, page_errors, live.url, live.key, f"/jobs/{job_id}")
    panel = page.locator("#sample-panel")
    panel.wait_for()
    assert "has none yet" in page.inner_text("#sample-note")
    assert page.locator("#sample-generate").is_disabled()

    train_job_checkpoint(live.settings, job_id, tmp_path / "train")
    page.reload()
    page.wait_for_function("!document.querySelector('#sample-generate')?.disabled")
    assert "step 2" in page.inner_text("#sample-note")

    # A field the API refuses is named beside the form, and the input is marked.
    page.fill("#sample-prompt", "def add(a, b):")
    page.fill("#sample-max-tokens", "999")
    page.click("#sample-generate")
    page.wait_for_selector("#sample-max-tokens[aria-invalid='true']")
    assert "max new tokens" in page.inner_text("#sample-form-error")

    page.fill("#sample-max-tokens", "6")
    with samples_in_background(live.settings):
        page.focus("#sample-prompt")
        page.keyboard.press("Control+Enter")  # the keyboard path to Generate
        item = panel.locator("li.sample").first
        item.wait_for()
        item.locator("xpath=self::*[@data-status='ready']").wait_for(timeout=60_000)
    folder = f"{live.settings.resolved_storage_url}/jobs/{job_id}/checkpoints/iter_0000002"
    want = CheckpointSampler(keep=1).sample(folder, "def add(a, b):", 6)
    assert item.locator(".sample-output").inner_text() == want.text
    assert item.locator(".sample-prompt").inner_text() == "def add(a, b):"
    meta = item.locator(".sample-meta").inner_text()
    assert "step 2" in meta and f"{len(want.new_ids)} tokens" in meta and " s" in meta and "greedy" in meta

    # A prompt longer than the model reads: a failed sample with the reason.
    page.fill("#sample-prompt", "print(i) " * 40)
    page.fill("#sample-temperature", "0.8")
    with samples_in_background(live.settings):
        page.click("#sample-generate")
        failed = panel.locator("li.sample[data-status='failed']")
        failed.wait_for(timeout=60_000)
    assert "reads at most 15" in failed.locator(".sample-error").inner_text()
    assert "temperature 0.8" in failed.inner_text()
    assert panel.locator("li.sample").count() == 2

    # Phone width, dark theme: the panel fits without sideways scrolling.
    page.set_viewport_size({"width": 380, "height": 800})
    page.click("#theme-toggle")  # auto -> light
    page.click("#theme-toggle")  # light -> dark
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    overflow = page.evaluate("document.scrollingElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the job page scrolls sideways by {overflow}px at 380px"
    ARTIFACTS.mkdir(exist_ok=True)
    panel.screenshot(path=str(ARTIFACTS / "job-samples-narrow-dark.png"))
    page.set_viewport_size({"width": 1280, "height": 900})
    page.click("#theme-toggle")  # dark -> auto (light here)
    panel.screenshot(path=str(ARTIFACTS / "job-samples.png"))
    assert page_errors == []
