"""A BERT job's page charts its masked-token (MLM) and sentence-order (SOP) accuracy, train and
validation, in a real Chromium; a GPT-style job's page has neither chart."""

from __future__ import annotations

from pathlib import Path
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

WORDPIECE = Path(__file__).resolve().parents[2] / "examples" / "data" / "wordpiece.json"


def _submit(live: LiveApi, spec: dict[str, Any]) -> str:
    resp = httpx.post(f"{live.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {live.key}"})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def _metrics(db_url: str, job_id: str, bert: bool) -> None:
    """Rows as the engine writes them (megatrain.engine.loop): token_accuracy counts the masked
    positions of a BERT, sop_* its binary head."""
    with session_scope(db_url) as s:
        for step in (1, 2, 3):
            row: dict[str, Any] = {"step": step, "loss": 6.0 - step, "lr": 1e-3, "grad_norm": 1.0,
                                   "token_accuracy": 0.1 * step}  # fmt: skip
            if bert:
                row |= {"sop_loss": 0.7 - 0.1 * step, "sop_accuracy": 0.5 + 0.1 * step}
            s.add(JobMetric(job_id=job_id, kind="train", step=step, loss=row["loss"], data=row))
        val = {"step": 3, "val_loss": 2.5, "valid_loss": 2.5, "valid_mean_token_accuracy": 0.35}
        s.add(JobMetric(job_id=job_id, kind="val", step=3, loss=2.5, data=val))


def test_a_bert_job_charts_mlm_and_sop_accuracy(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    live = live_api
    spec = live.spec("bert-run")
    spec["model"] = {
        "arch": "bert",
        "num_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "seq_length": 32,
    }
    spec["data"]["tokenizer"] = {"type": "hf", "path": WORDPIECE.as_uri()}
    bert_job = _submit(live, spec)
    plain_job = _submit(live, live.spec("plain-run"))
    _metrics(db_url, bert_job, bert=True)
    _metrics(db_url, plain_job, bert=False)

    page = signed_in_page(browser_context, page_errors, live.url, live.key, "/jobs")
    page.wait_for_selector("#jobs-table")
    page.goto(f"{live.url}/#/jobs/{bert_job}")
    page.wait_for_function("Number(document.querySelector('#chart-mlm_accuracy')?.dataset.points) === 3")
    assert page.is_visible("#chart-mlm_accuracy") and page.is_visible("#chart-sop_accuracy")
    assert page.inner_text("#chart-mlm_accuracy-latest") == "latest 30.0%"
    assert page.inner_text("#chart-sop_accuracy-latest") == "latest 80.0%"
    legend = page.text_content("#chart-mlm_accuracy .u-legend") or ""
    assert "train" in legend and "validation" in legend

    page.goto(f"{live.url}/#/jobs/{plain_job}")
    page.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 3")
    assert page.query_selector("#chart-mlm_accuracy") is None
    assert page.query_selector("#chart-sop_accuracy") is None
