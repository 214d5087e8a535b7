"""model.attention_backend at submission (megatrain/api/jobs/validation.py, megatrain/spec_attention.py):
a backend whose package the pool's nodes lack gets a 422 naming the package, the pool and how to
install it, from POST /v1/jobs and /v1/spec/validate alike, whatever the API host itself has; the
rules between it and precision, dropout and cp too."""

from __future__ import annotations

from typing import Any

import pytest
from api_handle import Api
from sqlalchemy import func, select, update

from megatrain.db.models import Job, Node
from megatrain.db.session import session_scope

ROUTES = ("/v1/jobs", "/v1/spec/validate")
GPU = {"torch": "2.13.0", "cuda": "12.8", "flash_attn": "2.8.3", "transformer_engine": "2.9.0"}
CPU = {"torch": "2.13.0+cpu", "triton": "3.9.0"}


def _gpu_packages(api: Api, installed: bool | None) -> None:
    """What the pool's node reports it can import (None: it never reported), whatever this host has."""
    with session_scope(api.db_url) as s:
        s.execute(update(Node).values(packages=None if installed is None else GPU if installed else CPU))


def _errors(api: Api, spec: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for route in ROUTES:
        resp = api.client.post(route, json=spec, headers=api.headers)
        assert resp.status_code == 422, (route, resp.text)
        out.append(resp.json()["detail"])
    assert out[0] == out[1]
    with session_scope(api.db_url) as s:
        assert s.scalar(select(func.count()).select_from(Job)) == 0
    return out[0]


def _bf16(api: Api, **model: Any) -> dict[str, Any]:
    spec = api.spec(model=model)
    spec["training"]["precision"] = "bf16"
    return spec


@pytest.mark.parametrize(("backend", "package"), [("flash", "flash-attn"), ("te", "transformer-engine")])
def test_a_backend_whose_package_is_missing_gets_a_422_naming_it(
    api: Api, backend: str, package: str
) -> None:
    _gpu_packages(api, installed=False)
    [error] = _errors(api, _bf16(api, attention_backend=backend))
    assert error["field"] == "model.attention_backend"
    assert f"needs the {package} package" in error["message"]
    assert "pip install megatrain[gpu]" in error["message"]
    assert "pool 'default' cannot import" in error["message"] and "torch 2.13.0+cpu" in error["message"]


def test_with_the_package_installed_the_same_spec_is_accepted(api: Api) -> None:
    _gpu_packages(api, installed=True)
    resp = api.client.post(
        "/v1/spec/validate", json=_bf16(api, attention_backend="flash"), headers=api.headers
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["spec"]["model"]["attention_backend"] == "flash"


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex"])
def test_backends_without_a_package_are_accepted(api: Api, backend: str) -> None:
    _gpu_packages(api, installed=False)
    job = api.submit(api.spec(model={"attention_backend": backend}))
    assert job["spec"]["model"]["attention_backend"] == backend


def test_the_rules_between_the_backend_and_other_fields(api: Api) -> None:
    _gpu_packages(api, installed=True)
    # flash and te run fp16/bf16 kernels only (the base spec trains fp32).
    [error] = _errors(api, api.spec(model={"attention_backend": "te"}))
    assert error["field"] == "model.attention_backend" and "training.precision is fp32" in error["message"]
    # flex_attention has no dropout.
    [error] = _errors(api, api.spec(model={"attention_backend": "flex", "attention_dropout": 0.1}))
    assert error["field"] == "model.attention_backend" and "runs no attention dropout" in error["message"]
    # Ring attention (cp > 1) runs its own blocks: a named backend would silently not run.
    spec = api.spec(model={"attention_backend": "flex"}, parallelism={"cp": 2})
    [error] = _errors(api, spec)
    assert error["field"] == "model.attention_backend" and "parallelism.cp=2" in error["message"]
    api.submit(api.spec(model={"attention_backend": "sdpa"}, parallelism={"cp": 2}))


def test_a_pool_is_judged_by_its_own_nodes(api: Api) -> None:
    """One node of two lacks flash-attn: the 422 names it; a pool that never reported its packages
    is accepted here and judged where the job is claimed (tests/worker/test_shard.py)."""
    with session_scope(api.db_url) as s:
        first = s.scalar(select(Node))
        assert first is not None
        s.add(Node(pool_id=first.pool_id, hostname="gpu-node-2", slots_total=1, packages=CPU))
        first.packages = GPU
    [error] = _errors(api, _bf16(api, attention_backend="flash"))
    assert "pool 'default''s node(s) gpu-node-2 cannot import" in error["message"], error
    _gpu_packages(api, installed=None)
    resp = api.client.post(
        "/v1/spec/validate", json=_bf16(api, attention_backend="flash"), headers=api.headers
    )
    assert resp.status_code == 200, resp.text
