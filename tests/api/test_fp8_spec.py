"""POST /v1/jobs with training.precision fp8: accepted where the pool's nodes have torchao and the
widths suit float8 GEMMs, else a 422 naming the missing package or the width."""

from __future__ import annotations

import importlib.util

import pytest
from api_handle import Api
from sqlalchemy import update

from megatrain.db.models import Node
from megatrain.db.session import session_scope


def test_fp8_submissions(api: Api) -> None:
    pytest.importorskip("torchao")
    fp8 = {"precision": "fp8", "fp8_recipe": "rowwise"}
    job = api.submit(api.spec("fp8", training=fp8))
    assert job["spec"]["training"]["precision"] == "fp8"
    assert job["spec"]["training"]["fp8_recipe"] == "rowwise"

    # hidden 72: the linears' model-side width is no multiple of 16, on any layout.
    odd = api.spec("odd", training=fp8, model={"hidden_size": 72, "ffn_hidden_size": 192})
    resp = api.client.post("/v1/jobs", json=odd, headers=api.headers)
    assert resp.status_code == 422, resp.text
    (auto,) = resp.json()["detail"]  # parallelism auto: the planner found no layout, and says why
    assert auto["field"] == "resources.devices" and "model.hidden_size" in auto["message"], auto
    assert "it is 72 with tp=1" in auto["message"] and "it is 72 with tp=2" in auto["message"]
    odd["parallelism"] = {"tp": 1, "dp": 2}
    resp = api.client.post("/v1/jobs", json=odd, headers=api.headers)
    assert resp.status_code == 422, resp.text
    messages = [d["message"] for d in resp.json()["detail"] if d["field"] == "training.precision"]
    assert any("model.hidden_size" in m and "it is 72" in m for m in messages), resp.text

    with session_scope(api.db_url) as s:  # the pool's node reports no torchao (this host has it)
        s.execute(update(Node).values(packages={"torch": "2.13.0"}))
    resp = api.client.post("/v1/jobs", json=api.spec("no-torchao", training=fp8), headers=api.headers)
    assert resp.status_code == 422, resp.text
    assert [d["field"] for d in resp.json()["detail"]] == ["training.precision"]
    assert "'torchao' package" in resp.json()["detail"][0]["message"]


def test_an_fp8_backend_that_is_not_installed(api: Api) -> None:
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    fp8 = {"precision": "fp8", "fp8_backend": "te"}
    resp = api.client.post("/v1/jobs", json=api.spec("te", training=fp8), headers=api.headers)
    assert resp.status_code == 422, resp.text
    (problem,) = resp.json()["detail"]
    assert problem["field"] == "training.fp8_backend"
    assert "'transformer_engine' package" in problem["message"], problem
