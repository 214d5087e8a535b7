"""A job's evaluation results on its page (in a real Chromium): the Evaluation card lists each task's
metrics (value ± stderr, items) from GET /v1/jobs/{id}/results, at the step they were scored, and
an eval row in the metrics never reaches the training charts; a job without results shows no card.
"Compare with…" opens several jobs' results side by side, the better value of each row in bold."""

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

OTHER = {
    "corpus_mc": {"acc": {"value": 0.5, "stderr": 0.035, "n": 200}},
    "corpus_cloze": {"perplexity": {"value": 2.5, "stderr": None, "n": 200}},
}  # fmt: skip
RESULTS = {
    "corpus_mc": {"acc": {"value": 0.75, "stderr": 0.03, "n": 200},
                  "acc_norm": {"value": 0.7, "stderr": 0.032, "n": 200}},
    "corpus_cloze": {"perplexity": {"value": 3.25, "stderr": None, "n": 200}},
}  # fmt: skip


def _job(live: LiveApi, name: str) -> str:
    resp = httpx.post(
        f"{live.url}/v1/jobs", json=live.spec(name), headers={"Authorization": f"Bearer {live.key}"}
    )
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def test_the_job_page_shows_its_evaluation_results(
    live_api: LiveApi, browser_context: Any, page_errors: list[str], db_url: str
) -> None:
    live = live_api
    scored, plain, other = _job(live, "scored"), _job(live, "plain"), _job(live, "other")
    with session_scope(db_url) as s:
        for step in (1, 2, 3):
            s.add(JobMetric(job_id=scored, kind="train", step=step, loss=2.0 - 0.1 * step,
                            data={"step": step, "loss": 2.0 - 0.1 * step}))  # fmt: skip
        # Scored during training at steps 1 and 2 (the same steps as train rows: their own kind).
        early = {"corpus_mc": {"acc": {"value": 0.5, "stderr": 0.03, "n": 200}}}
        s.add(JobMetric(job_id=scored, kind="eval", step=1, loss=None, data={"step": 1, "eval": early}))
        s.add(JobMetric(job_id=scored, kind="eval", step=2, loss=None, data={"step": 2, "eval": RESULTS}))
        s.add(JobMetric(job_id=other, kind="eval", step=0, loss=None, data={"step": 0, "eval": OTHER}))
    page = signed_in_page(browser_context, page_errors, live.url, live.key, "/jobs")
    page.wait_for_selector("#jobs-table")  # signed in: the sign-in's own route() has run
    page.goto(f"{live.url}/#/jobs/{scored}")
    page.wait_for_selector("#results-table")
    text = page.inner_text("#results-card")
    assert "at step 2" in text
    assert "corpus_mc\tacc\t0.7500 ± 0.0300\t200" in text, text
    assert "corpus_cloze\tperplexity\t3.2500\t200" in text, text
    page.wait_for_function("Number(document.querySelector('#chart-loss')?.dataset.points) === 3")
    # The scores over the eval steps: a line per task and metric (one of them scored at step 2 only).
    scores = page.locator("#chart-eval-scores")
    assert scores.is_visible()
    assert (scores.get_attribute("data-points"), scores.get_attribute("data-series")) == ("2", "3")
    legend = page.inner_text("#chart-eval-scores .u-legend").lower()  # (upper-cased by CSS)
    assert "corpus_mc / acc" in legend and "corpus_cloze / perplexity" in legend, legend

    page.fill("#compare-with", f" {other} , nope")
    page.click("#compare-form button")
    page.wait_for_selector("#compare-table")
    rows = page.locator("#compare-table tbody tr").all_inner_texts()
    assert (
        rows
        == [
            "corpus_cloze\tperplexity\t3.2500\t2.5000",
            "corpus_mc\tacc\t0.7500 ± 0.0300\t0.5000 ± 0.0350\t—",
            "corpus_mc\tacc_norm\t0.7000 ± 0.0320\t—\t—",
        ]
        or rows
    ), rows
    bold = page.locator("#compare-table td.best").all_inner_texts()
    assert bold == ["2.5000", "0.7500 ± 0.0300"], bold  # lower perplexity, higher accuracy
    head = page.inner_text("#compare-table thead").lower()  # (headers are upper-cased by CSS)
    assert "scored" in head and "other" in head and "nope (not found)" in head, head

    page.goto(f"{live.url}/#/jobs/{plain}")
    page.wait_for_selector("#job-tiles")
    page.wait_for_timeout(500)  # (the first poll's results answer has come back)
    assert page.locator("#results-card").is_hidden()
    assert not page_errors, page_errors
