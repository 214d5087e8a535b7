"""The spec's `tracking:` block (megatrain/spec_tracking.py): shorthands, every error naming its field,
no credential field anywhere, and the rule between tracking and a job's kind."""

from __future__ import annotations

import json
from typing import Any

import pytest

from megatrain.spec import SpecError, dump_spec, parse_spec

BASE: dict[str, Any] = {"name": "tiny", "data": {"train": [{"path": "file:///data/corpus.jsonl"}]}}


def _spec(tracking: Any, **top: Any) -> dict[str, Any]:
    return {**BASE, "tracking": tracking, **top}


def _errors(raw: dict[str, Any]) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    return info.value.errors


def test_shorthands_and_defaults() -> None:
    spec = parse_spec(_spec({"tensorboard": True, "wandb": True}))
    assert spec.tracking is not None and spec.tracking.enabled
    assert spec.tracking.tensorboard is not None and spec.tracking.tensorboard.flush_interval_s == 30.0
    assert spec.tracking.wandb is not None and spec.tracking.wandb.mode is None
    assert spec.tracking.wandb.project is None and spec.tracking.mlflow is None
    off = parse_spec(_spec({"tensorboard": False})).tracking
    assert off is not None and off.tensorboard is None and not off.enabled
    assert parse_spec(BASE).tracking is None
    # Round trip: what the API stores is what the engine reads.
    wandb = {"project": "p", "entity": "e", "name": "n", "tags": ["a", "b"], "mode": "offline"}
    full = _spec({"wandb": wandb, "mlflow": {"tracking_uri": "file:///srv/mlruns", "experiment": "x"}})
    spec = parse_spec(full)
    assert parse_spec(json.loads(dump_spec(spec))) == spec


@pytest.mark.parametrize(
    ("tracking", "field", "text"),
    [
        ({"wandb": {"api_key": "secret"}}, "tracking.wandb.api_key", "unknown field"),
        ({"mlflow": {"tracking_uri": "file:///m", "token": "x"}}, "tracking.mlflow.token", "unknown field"),
        ({"comet": {}}, "tracking.comet", "unknown field"),
        ({"wandb": {"mode": "disabled"}}, "tracking.wandb.mode", "online"),
        ({"wandb": {"tags": ["a", "a"]}}, "tracking.wandb.tags", "twice"),
        ({"wandb": {"tags": ["x" * 65]}}, "tracking.wandb.tags", "64 characters"),
        ({"mlflow": {}}, "tracking.mlflow.tracking_uri", "required"),
        ({"mlflow": {"tracking_uri": "mlruns"}}, "tracking.mlflow.tracking_uri", "needs a scheme"),
        ({"mlflow": {"tracking_uri": "file://host/m"}}, "tracking.mlflow.tracking_uri", "file:///abs/path"),
        ({"tensorboard": {"flush_interval_s": 0}}, "tracking.tensorboard.flush_interval_s", "greater"),
    ],
)
def test_each_error_names_its_field(tracking: dict[str, Any], field: str, text: str) -> None:
    errors = _errors(_spec(tracking))
    assert [e["field"] for e in errors] == [field], errors
    assert text in errors[0]["message"], errors


def test_tracking_is_for_training_jobs() -> None:
    base = {"kind": "serve", "model": {"init_from": "hf:file:///m"}, "data": {"train": []}}
    serve = _spec({"tensorboard": True}, **base)
    errors = _errors(serve)
    assert errors == [{"field": "tracking", "message": errors[0]["message"]}]
    assert "not kind serve" in errors[0]["message"]
    # An empty block asks for nothing: no rule broken.
    serve["tracking"] = {"tensorboard": False}
    assert parse_spec(serve).tracking is not None
