"""The job page's checkpoints table in a real headless Chromium: "Export to Hugging Face" on an
engine-trained checkpoint, the export's state as the workers move it (pending/running → ready), its
download (a tar holding config.json and the safetensors), and a failed export's reason.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.checkpoints import exports_in_background, train_job_checkpoint
from fixtures.live import LiveApi
from sqlalchemy import update
from web_helpers import ARTIFACTS, signed_in_page

from megatrain.db.models import CheckpointExport
from megatrain.db.session import session_scope

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def test_export_from_the_checkpoints_table(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str, tmp_path: Path
) -> None:
    live = live_api
    auth = {"Authorization": f"Bearer {live.key}"}
    resp = httpx.post(f"{live.url}/v1/jobs", json=live.spec("web-export"), headers=auth)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    train_job_checkpoint(live.settings, job_id, tmp_path / "train")

    page = signed_in_page(browser_context, page_errors, live.url, live.key, f"/jobs/{job_id}")
    row = page.locator("#checkpoint-table tr[data-step='2']")
    row.wait_for()
    row.locator("select.export-dtype").select_option("fp32")
    with exports_in_background(live.settings):
        row.get_by_role("button", name="Export step 2 to Hugging Face").click()
        # The page shows the export at once (pending) and polls until the worker has made it ready.
        row.locator("li.export[data-dtype='fp32']").wait_for()
        row.locator("li.export[data-status='ready']").wait_for(timeout=60_000)
    assert "fp32" in row.inner_text() and "KiB" in row.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "job-exports.png"), full_page=True)

    with page.expect_download() as info:
        row.get_by_role("button", name="Download the fp32 Hugging Face export of step 2").click()
    download = info.value
    assert download.suggested_filename == f"{job_id}-iter_0000002-fp32.tar"
    with tarfile.open(fileobj=io.BytesIO(Path(download.path()).read_bytes())) as tar:
        names = {m.name for m in tar if m.isfile()}
    assert {"iter_0000002-fp32/config.json", "iter_0000002-fp32/model.safetensors"} <= names

    # A failed export shows its reason; the page picks it up on its next poll.
    resp = httpx.post(f"{live.url}/v1/jobs/{job_id}/exports", json={"step": 2}, headers=auth)
    assert resp.status_code == 202, resp.text
    with session_scope(db_url) as s:
        s.execute(
            update(CheckpointExport)
            .where(CheckpointExport.id == resp.json()["id"])
            .values(status="failed", error="RuntimeError: disk full")
        )
    page.reload()
    row.locator("li.export[data-status='failed']").wait_for()
    assert "disk full" in row.locator("li.export[data-status='failed']").inner_text()
    assert page_errors == []
