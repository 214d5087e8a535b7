"""The Datasets view and the submit form's dataset picker in a real headless Chromium against a
live API: upload through the form (streamed file), a bad line shown by its field, the table's
statistics once a dataset is ready, picking it for a job, deleting, and tenant isolation.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from sqlalchemy import update
from web_helpers import ARTIFACTS, open_page

from megatrain.api.auth import create_api_key
from megatrain.db.models import Dataset
from megatrain.db.session import session_scope

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def test_datasets_view_upload_pick_delete(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str, tmp_path: Path
) -> None:
    live = live_api
    with session_scope(db_url) as s:
        other_key = create_api_key(s, "globex", "other tenant")
    corpus = tmp_path / "their.jsonl"
    corpus.write_text(json.dumps({"text": "secret"}) + "\n")
    resp = httpx.post(
        f"{live.url}/v1/datasets", params={"name": "their-secret-set"}, content=corpus.read_bytes(),
        headers={"Authorization": f"Bearer {other_key}", "Content-Type": "application/x-ndjson"},
    )  # fmt: skip
    assert resp.status_code == 201, resp.text

    page = open_page(browser_context, page_errors)
    page.goto(f"{live.url}/#/datasets")
    page.fill("#api-key", live.key)
    page.click("button[type=submit]")
    page.wait_for_selector("text=No datasets yet")  # the other tenant's is not listed

    # A bad line: the API's 422 appears under the file field, naming the line; nothing is listed.
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    page.set_input_files("#ds-file", str(bad))
    assert page.input_value("#ds-name") == "bad"  # proposed from the file's name
    page.click("#ds-upload")
    error = page.locator("#ds-file-error")
    error.wait_for()
    assert "line 2" in error.inner_text() and "'text'" in error.inner_text()
    assert page.get_attribute("#ds-file", "aria-invalid") == "true"

    good = tmp_path / "corpus.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(100)))
    page.set_input_files("#ds-file", str(good))
    page.fill("#ds-name", "web-corpus")
    page.click("#ds-upload")
    page.wait_for_selector("#datasets-table tr[data-dataset='web-corpus'][data-state='pending']")
    assert "their-secret-set" not in page.content()

    # The workers' progress, then their result (here written as a worker would), show without a reload.
    with session_scope(db_url) as s:
        busy = {"state": "processing", "state_reason": "preprocessing on node1: 50 documents"}
        s.execute(update(Dataset).where(Dataset.name == "web-corpus").values(**busy))
    page.wait_for_selector(
        "#datasets-table tr[data-dataset='web-corpus'][data-state='processing']", timeout=20_000
    )
    assert "50 documents" in page.inner_text("#datasets-table tr[data-dataset='web-corpus']")
    with session_scope(db_url) as s:
        s.execute(
            update(Dataset)
            .where(Dataset.name == "web-corpus")
            .values(state="ready", documents=100, tokens=1_234_567, output_bytes=5 << 20, state_reason="done")
        )
    page.wait_for_selector(
        "#datasets-table tr[data-dataset='web-corpus'][data-state='ready']", timeout=20_000
    )
    row = page.inner_text("#datasets-table tr[data-dataset='web-corpus']")
    assert "1,234,567" in row and "5.0 MiB" in row and "100" in row
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-datasets.png"), full_page=True)

    # The submit form picks it: the spec names the dataset, and the API fills its path.
    page.click("nav >> text=Submit")
    page.wait_for_selector("#f-data-train-0-dataset option[value='web-corpus']", state="attached")
    page.fill("#spec-editor", json.dumps(live.spec("from-dataset"), indent=2))
    page.select_option("#f-data-train-0-dataset", "web-corpus")
    spec = json.loads(page.input_value("#spec-editor"))
    assert spec["data"]["train"] == [{"dataset": "web-corpus"}]
    page.click("#validate")
    page.wait_for_selector("#submit-result:has-text('Valid')")
    page.click("#submit")
    page.wait_for_url("**/#/jobs/job-*")
    job_id = page.url.rsplit("/", 1)[-1]
    job = httpx.get(f"{live.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {live.key}"}).json()
    assert job["spec"]["data"]["train"][0]["path"].endswith("/data")
    httpx.post(f"{live.url}/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {live.key}"})

    # Delete from the table.
    page.click("nav >> text=Datasets")
    page.wait_for_selector("#datasets-table tr[data-dataset='web-corpus']")
    page.once("dialog", lambda d: d.accept())
    page.click("#datasets-table tr[data-dataset='web-corpus'] button")
    page.wait_for_selector("text=No datasets yet")
    assert page_errors == []
