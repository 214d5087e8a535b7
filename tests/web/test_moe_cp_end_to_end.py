"""A mixture-of-experts job (expert parallel over 2 ranks) and a context-parallel job, each submitted
to the embedded default and run for real: submit → train → the job page's charts (in a real
Chromium) → checkpoint → Hugging Face export that `transformers` loads.

SQLite only: the API's behaviour on PostgreSQL is covered by tests/api; this is about the whole path.
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fixtures.checkpoints import exports_in_background
from fixtures.live import LiveApi
from web_helpers import signed_in_page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]

STEPS, LOG_EVERY = 6, 2
MOE = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32, "aux_loss_coeff": 1e-2}


def _spec(live: LiveApi, kind: str) -> dict[str, Any]:
    spec = live.spec(kind, train_iters=STEPS, log_interval=LOG_EVERY, checkpoint_interval=STEPS)
    spec["training"].update(global_batch_size=4, micro_batch_size=2)
    spec["model"].update(num_layers=2, num_query_groups=2)
    spec["resources"]["devices"] = 2
    if kind == "moe":
        spec["model"]["moe"] = MOE
        spec["parallelism"] = {"ep": 2}  # dp 2, each rank holding 2 of the 4 experts
    else:
        spec["parallelism"] = {"cp": 2}  # each rank attends over half of every sequence
    return spec


def _wait_for(live: LiveApi, job_id: str, timeout_s: float = 240) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {live.key}"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{live.url}/v1/jobs/{job_id}", headers=auth).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"{job_id} still {job['status']} after {timeout_s} s")


@pytest.mark.parametrize("kind", ["moe", "cp"])
def test_a_parallel_job_runs_end_to_end(
    live_stack: LiveApi, browser_context: Any, page_errors: list[str], kind: str, tmp_path: Path
) -> None:
    live = live_stack
    auth = {"Authorization": f"Bearer {live.key}"}
    resp = httpx.post(f"{live.url}/v1/jobs", json=_spec(live, kind), headers=auth)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    job = _wait_for(live, job_id)
    assert job["status"] == "succeeded", job
    layout = job["layout"]
    assert (layout["ep"], layout["dp"]) == (2, 2) if kind == "moe" else (layout["cp"], layout["dp"]) == (2, 1)

    rows = httpx.get(f"{live.url}/v1/jobs/{job_id}/metrics", headers=auth).json()
    train = [r for r in rows if r.get("kind", "train") == "train"]
    assert [r["step"] for r in train] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    if kind == "moe":  # the routers' figures, measured across both expert-parallel ranks
        assert all(r["moe_aux_loss"] > 0 for r in train), train[0]
        assert all(len(r["moe_tokens_per_expert"]) == MOE["num_experts"] for r in train)

    page = signed_in_page(browser_context, page_errors, live.url, live.key, f"/jobs/{job_id}")
    points = STEPS // LOG_EVERY
    page.wait_for_function(f"Number(document.querySelector('#chart-loss')?.dataset.points) === {points}")
    moe_chart = "Number(document.querySelector('#chart-moe_aux_loss')?.dataset.points)"
    if kind == "moe":
        page.wait_for_function(f"{moe_chart} === {points}")
    else:
        assert page.is_hidden("#chart-moe_aux_loss")

    checkpoints = httpx.get(f"{live.url}/v1/jobs/{job_id}/checkpoints", headers=auth).json()
    assert [c["step"] for c in checkpoints] == [STEPS]
    with exports_in_background(live.settings):
        resp = httpx.post(f"{live.url}/v1/jobs/{job_id}/exports", json={"step": STEPS}, headers=auth)
        assert resp.status_code == 202, resp.text
        export_id = resp.json()["id"]
        deadline = time.monotonic() + 120
        while (export := httpx.get(f"{live.url}/v1/jobs/{job_id}/exports/{export_id}", headers=auth).json())[
            "status"
        ] not in ("ready", "failed") and time.monotonic() < deadline:
            time.sleep(0.3)
    assert export["status"] == "ready", export
    tar = httpx.get(f"{live.url}/v1/jobs/{job_id}/exports/{export_id}/download", headers=auth)
    assert tar.status_code == 200, tar.text
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as t:
        t.extractall(tmp_path, filter="data")
    folder = next(p.parent for p in tmp_path.rglob("config.json"))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == ("mixtral" if kind == "moe" else "llama")
    if kind == "moe":
        assert model.config.num_local_experts == MOE["num_experts"]
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()
    assert page_errors == []
