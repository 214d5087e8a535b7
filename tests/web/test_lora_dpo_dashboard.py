"""A LoRA job's page says what it trains beside the frozen model, and a preference (DPO) job's page
charts its rewards and accuracy (in a real Chromium); a plain job shows neither."""

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


def _row(step: int, dpo: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "loss": 0.69 - 0.05 * step, "lr": 1e-3, "grad_norm": 1.0}
    if dpo:  # as megatrain.engine's DPO metrics write them (TRL's names)
        row.update({"rewards/chosen": 0.01 * step, "rewards/rejected": -0.02 * step,
                    "rewards/margins": 0.03 * step, "rewards/accuracies": 0.25 * step})  # fmt: skip
    return row


def _job(live: LiveApi, db_url: str, name: str, training: dict[str, Any], dpo: bool) -> str:
    headers = {"Authorization": f"Bearer {live.key}"}
    spec = live.spec(name)
    spec["training"] = {**spec.get("training", {}), **training}
    resp = httpx.post(f"{live.url}/v1/jobs", json=spec, headers=headers)
    assert resp.status_code == 201, resp.text
    job_id = str(resp.json()["id"])
    with session_scope(db_url) as s:
        for step in (1, 2, 3):
            s.add(
                JobMetric(
                    job_id=job_id, kind="train", step=step, loss=0.69 - 0.05 * step, data=_row(step, dpo)
                )
            )
    return job_id


def test_lora_and_dpo_pages(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    live = live_api
    lora = {"method": "lora", "lora": {"rank": 8, "targets": ["qkv"]}}
    lora_job = _job(live, db_url, "lora-run", lora, dpo=True)
    plain_job = _job(live, db_url, "plain-run", {}, dpo=False)
    page = signed_in_page(browser_context, page_errors, live.url, live.key, "/jobs")
    page.goto(f"{live.url}/#/jobs/{lora_job}")
    page.wait_for_function("Number(document.querySelector('#chart-dpo_rewards')?.dataset.points) === 3")
    assert page.is_visible("#chart-dpo_rewards") and page.is_visible("#chart-dpo_accuracy")
    assert page.inner_text("#chart-dpo_accuracy-latest") == "latest 75.0%"
    legend = page.text_content("#chart-dpo_rewards .u-legend") or ""
    assert "margin" in legend and "chosen" in legend and "rejected" in legend
    assert "trainable" in page.inner_text("main")

    # The first metrics and logs loads fail (an API restarting): the page tries them again on its
    # next poll instead of keeping empty charts.
    failed: list[str] = []

    def fail_once(route: Any) -> None:
        if len(failed) < 2:
            failed.append(route.request.url)
            route.abort()
        else:
            route.continue_()

    page.route("**/v1/jobs/*/metrics?max_points=*", fail_once)
    page.route("**/v1/jobs/*/logs?tail=*", fail_once)
    page.goto(f"{live.url}/#/jobs/{plain_job}")
    page.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 3")
    assert len(failed) == 2 and any("/metrics" in u for u in failed), failed
    page.unroute_all()
    assert page.is_hidden("#chart-dpo_rewards") and page.is_hidden("#chart-dpo_accuracy")
    assert "trainable" not in page.inner_text("main")
    assert page.text_content("#banner") == ""
    assert page_errors == []
