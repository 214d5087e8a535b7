"""model.attention_backend at submission (megatrain/api/jobs/validation.py, megatrain/spec_attention.py):
a backend whose package is missing gets a 422 naming the package and how to install it, from
POST /v1/jobs and /v1/spec/validate alike; the rules between it and precision, dropout and cp too."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from api_handle import Api
from sqlalchemy import func, select

from megatrain.db.models import Job
from megatrain.db.session import session_scope

ROUTES = ("/v1/jobs", "/v1/spec/validate")
GPU_MODULES = {"flash_attn", "flash_attn_interface", "transformer_engine"}


def _gpu_packages(monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    """Whether flash-attn and Transformer Engine look installed to the API process."""
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name in GPU_MODULES:
            return object() if installed else None
        return real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


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
    api: Api, monkeypatch: pytest.MonkeyPatch, backend: str, package: str
) -> None:
    _gpu_packages(monkeypatch, installed=False)
    [error] = _errors(api, _bf16(api, attention_backend=backend))
    assert error["field"] == "model.attention_backend"
    assert f"needs the {package} package" in error["message"]
    assert "pip install megatrain[gpu]" in error["message"]


def test_with_the_package_installed_the_same_spec_is_accepted(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpu_packages(monkeypatch, installed=True)
    resp = api.client.post(
        "/v1/spec/validate", json=_bf16(api, attention_backend="flash"), headers=api.headers
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["spec"]["model"]["attention_backend"] == "flash"


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex"])
def test_backends_without_a_package_are_accepted(
    api: Api, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    _gpu_packages(monkeypatch, installed=False)
    job = api.submit(api.spec(model={"attention_backend": backend}))
    assert job["spec"]["model"]["attention_backend"] == backend


def test_the_rules_between_the_backend_and_other_fields(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu_packages(monkeypatch, installed=True)
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
