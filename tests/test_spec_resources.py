"""resources.devices: the device-neutral name of the processes a job asks for; gpus stays an alias."""

from __future__ import annotations

from typing import Any

import pytest

from megatrain.plan.layout import resolve_layout
from megatrain.spec import JobSpec, SpecError, dump_spec, parse_spec


def _spec(resources: dict[str, Any]) -> dict[str, Any]:
    return {"name": "r", "data": {"train": [{"path": "file:///data/c.jsonl"}]}, "resources": resources}


def test_devices_fills_data_parallel() -> None:
    spec = parse_spec(_spec({"devices": 4}))
    assert spec.resources.devices == 4
    assert resolve_layout(spec).dp == 4


def test_gpus_is_accepted_as_the_older_name() -> None:
    spec = parse_spec(_spec({"gpus": 2}))
    assert spec.resources.devices == 2 and resolve_layout(spec).world_size == 2
    # A stored spec says devices from now on, and an old stored one (gpus) still loads.
    assert '"devices": 2' in dump_spec(spec)
    assert JobSpec.model_validate(spec.model_dump(mode="json")).resources.devices == 2


def test_giving_both_names_is_an_error_naming_them() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_spec({"devices": 2, "gpus": 2}))
    [e] = err.value.errors
    assert e["field"] == "resources.devices"
    assert "resources.gpus" in e["message"] and "give one" in e["message"]


def test_devices_bounds_name_the_field_given() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_spec({"devices": 0}))
    assert [e["field"] for e in err.value.errors] == ["resources.devices"]
