"""Pool files: the generated reference (docs/pool-reference.md) is current and its rules refuse their
examples; every example under examples/pools/ validates and plans; messages about pools read right."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from megatrain import pool_reference as ref
from megatrain.cli import app as cli_app
from megatrain.plan.planner import plan
from megatrain.plan.pool import PoolSpec, load_pool
from megatrain.scheduler.pools import load_pools, parse_pools
from megatrain.spec import load_spec
from megatrain.spec_errors import SpecError
from megatrain.spec_reference import field_docstrings

ROOT = Path(__file__).resolve().parents[1]
POOLS = ROOT / "examples" / "pools"


def test_committed_pool_reference_is_current() -> None:
    committed = (ROOT / "docs" / "pool-reference.md").read_text()
    assert committed == ref.render_markdown(), (
        f"docs/pool-reference.md is out of date with megatrain/plan/pool.py; regenerate it: {ref.REGENERATE}"
    )


def test_every_pool_field_is_documented_in_the_reference() -> None:
    docs = field_docstrings(PoolSpec)
    text = ref.render_markdown()
    for name in PoolSpec.model_fields:
        assert docs.get(name), f"PoolSpec.{name} has no docstring"
        assert f"| `{name}` |" in text, name


def test_the_base_pool_is_valid_and_each_rule_refuses_its_example() -> None:
    parse_pools(ref.BASE_POOL)
    for rule in ref.RULES:
        with pytest.raises(SpecError) as caught:
            parse_pools(rule.breaks)
        assert rule.field in [e["field"] for e in caught.value.errors], (rule, caught.value.errors)


def test_every_example_pool_is_listed_and_validates() -> None:
    files = sorted(p.name for p in POOLS.glob("*.yaml"))
    assert files == sorted(ref.EXAMPLES)
    names = set()
    for name in files:
        [pool] = load_pools(POOLS / name)  # `megatrain pools apply`, MEGATRAIN_POOLS_FILE
        assert load_pool(POOLS / name) == pool  # `megatrain plan --pool`
        names.add(pool.name)
    h100, cpu = load_pool(POOLS / "h100.yaml"), load_pool(POOLS / "cpu.yaml")
    assert not h100.is_cpu and h100.total_devices == 32 and cpu.is_cpu
    # Each plans the walk-through's first example.
    spec = load_spec(ROOT / "examples" / "pretrain_jsonl.yaml")
    for pool in (h100, cpu):
        assert plan(spec, pool).as_dict()["predicted"]["step_time_s"] > 0


def test_offline_plan_on_an_example_pool(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli_app, ["plan", str(ROOT / "examples" / "auto.yaml"), "--pool", str(POOLS / "cpu.yaml")],
        env={"COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "of pool cpu" in result.output


def test_too_many_devices_names_the_pool_without_a_doubled_quote() -> None:
    spec = load_spec(ROOT / "examples" / "pretrain_jsonl.yaml")
    with pytest.raises(SpecError) as caught:
        plan(spec, load_pool(POOLS / "h100.yaml"), devices=64)
    [error] = caught.value.errors
    assert error["field"] == "resources.devices"
    assert error["message"] == "64 devices exceed the 4×8=32 of pool 'h100'", error
    assert "''" not in error["message"]


def test_examples_readme_lists_the_pools() -> None:
    readme = (ROOT / "examples" / "README.md").read_text()
    for name in ref.EXAMPLES:
        assert f"pools/{name}" in readme
    assert "docs/pool-reference.md" in readme
    assert yaml.safe_load((POOLS / "h100.yaml").read_text())["name"] == "h100"
