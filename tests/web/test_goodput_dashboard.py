"""The goodput panel of the job page and a quarantined node on the Cluster page, in a real headless
Chromium (the ledger rows are written as the runner writes them, db.goodput.record_attempt).

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi
from sqlalchemy import select, update
from web_helpers import signed_in_page

from megatrain.db.goodput import record_attempt
from megatrain.db.models import QUARANTINED, Job, Node
from megatrain.db.session import session_scope

pytestmark = [pytest.mark.browser, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]


def test_goodput_panel_and_quarantined_node(
    live_api: LiveApi, browser_context: Any, page_errors: list[str]
) -> None:
    headers = {"Authorization": f"Bearer {live_api.key}"}
    resp = httpx.post(f"{live_api.url}/v1/jobs", json=live_api.spec("ledger"), headers=headers)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    with session_scope(live_api.settings.resolved_database_url) as s:
        node_id, hostname = s.execute(select(Node.id, Node.hostname)).first()
        loss = {"queued_s": 60, "hang_s": 120, "productive_s": 600}
        record_attempt(s, job_id, node_id, 1, "queued", "hung", loss)
        record_attempt(s, job_id, node_id, 2, "succeeded", None, {"productive_s": 1200, "restart_s": 20})
        s.execute(update(Job).where(Job.id == job_id).values(attempt=2))  # as its runners claimed them
        s.execute(
            update(Node).where(Node.id == node_id).values(status=QUARANTINED, quarantine_reason="3 failures")
        )

    page = signed_in_page(browser_context, page_errors, live_api.url, live_api.key, f"/jobs/{job_id}")
    page.wait_for_selector("#goodput-share")
    assert page.inner_text("#goodput-share") == f"{100 * 1800 / 2000:.1f}% productive over 2 attempts"
    legend = page.inner_text("#goodput-legend")
    for part in ("productive 30m", "queued 1m", "restarts 20s", "hangs 2m"):
        assert part in legend, legend
    assert "checkpoint stalls" not in legend  # no loss of that kind: not shown

    page.goto(f"{live_api.url}/#/cluster")
    node = page.locator(f"[data-node='{hostname}']")
    node.wait_for()
    assert node.get_attribute("data-status") == QUARANTINED
    text = node.inner_text()
    assert "3 failures" in text and f"megatrain nodes release {hostname}" in text
    assert "goodput" not in text  # a quarantined node's line says why, not its share
    assert node.locator(".slots").count() == 0
    assert "1 node quarantined" in page.locator(".card", has=node).first.inner_text()
    assert page_errors == []
