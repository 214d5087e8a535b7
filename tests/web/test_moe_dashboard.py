"""An MoE job's page charts its router losses and expert load imbalance (in a real Chromium); a dense
job's page leaves those charts out."""

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


def _row(step: int, moe: bool) -> dict[str, Any]:
    row: dict[str, Any] = {
        "step": step,
        "loss": 5.0 - 0.1 * step,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_s": 500.0,
    }
    if moe:  # as megatrain.engine.moe_metrics writes them
        row.update(moe_aux_loss=0.0102 + 0.001 * step, moe_z_loss=0.002, moe_load_imbalance=1.5 - 0.1 * step,
                   moe_tokens_per_expert=[100, 140, 90, 182])  # fmt: skip
    return row


def _job(live: LiveApi, db_url: str, name: str, moe: bool) -> str:
    headers = {"Authorization": f"Bearer {live.key}"}
    job_id = str(httpx.post(f"{live.url}/v1/jobs", json=live.spec(name), headers=headers).json()["id"])
    with session_scope(db_url) as s:
        for step in (1, 2, 3):
            s.add(
                JobMetric(job_id=job_id, kind="train", step=step, loss=5.0 - 0.1 * step, data=_row(step, moe))
            )
    return job_id


def test_moe_charts(live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str) -> None:
    live = live_api
    moe_job, dense_job = _job(live, db_url, "moe-run", True), _job(live, db_url, "dense-run", False)
    page = signed_in_page(browser_context, page_errors, live.url, live.key, "/jobs")
    page.goto(f"{live.url}/#/jobs/{moe_job}")
    page.wait_for_function("Number(document.querySelector('#chart-moe_aux_loss')?.dataset.points) === 3")
    page.wait_for_function(
        "Number(document.querySelector('#chart-moe_load_imbalance')?.dataset.points) === 3"
    )
    assert page.is_visible("#chart-moe_aux_loss") and page.is_visible("#chart-moe_load_imbalance")
    assert page.inner_text("#chart-moe_load_imbalance-latest") == "latest 1.2"
    legend = page.text_content("#chart-moe_aux_loss .u-legend") or ""
    assert "aux (load balancing)" in legend and "z-loss" in legend

    page.goto(f"{live.url}/#/jobs/{dense_job}")
    page.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 3")
    assert page.is_hidden("#chart-moe_aux_loss") and page.is_hidden("#chart-moe_load_imbalance")
    assert page_errors == []
