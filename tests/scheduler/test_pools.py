"""scheduler.pools: operator descriptions parsed, stored and read back (`pool_for`), the pools file
applied at start, a measured description scaled to the ready nodes and never replacing an
operator's (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import select, update

from megatrain.db.models import Node, NodePool
from megatrain.db.session import session_scope
from megatrain.plan.pool import PoolSpec
from megatrain.scheduler.pools import apply_pool, apply_pools_at_start, parse_pools, pool_for
from megatrain.settings import Settings, get_settings, reset_settings_cache
from megatrain.spec_errors import SpecError
from megatrain.worker.nodes import record_measured_spec

H100: dict[str, Any] = {
    "name": "h100",
    "accelerator": "NVIDIA H100 80GB HBM3",
    "device_memory_bytes": 80 << 30,
    "peak_tflops": {"bf16": 989.4, "fp8": 1979.0, "fp32": 66.9},
    "devices_per_node": 8,
    "nodes": 16,
    "intra_node_bandwidth_gbps": 450,
    "inter_node_bandwidth_gbps": 50,
}


def test_parse_pools_names_each_bad_field() -> None:
    assert [p.name for p in parse_pools(H100)] == ["h100"]
    no_memory = {k: v for k, v in H100.items() if k != "device_memory_bytes"} | {"name": "c"}
    bad = [H100, {**H100, "name": "b", "devices_per_node": 0}, no_memory, H100]
    with pytest.raises(SpecError) as err:
        parse_pools(bad)
    fields = [e["field"] for e in err.value.errors]
    assert fields == ["pools[1].devices_per_node", "pools[2].device_memory_bytes", "pools"]
    assert "'h100' is described twice" in err.value.errors[2]["message"]
    with pytest.raises(SpecError, match="peak_tflops.fp8"):
        parse_pools({**H100, "peak_tflops": {"fp8": -1}})
    with pytest.raises(SpecError, match="non-empty list"):
        parse_pools("h100")


def test_apply_and_read_back(db_url: str, add_node: Callable) -> None:
    with session_scope(db_url) as s:
        assert pool_for(s, "h100") is None
        _, created = apply_pool(s, PoolSpec.model_validate(H100))
        assert created
    with session_scope(db_url) as s:
        spec = pool_for(s, "h100")
        assert spec == PoolSpec.model_validate(H100)
        pool = s.scalar(select(NodePool).where(NodePool.name == "h100"))
        assert (pool.spec_source, pool.accelerator) == ("operator", H100["accelerator"])
        _, created = apply_pool(s, PoolSpec.model_validate({**H100, "nodes": 4}))
        assert not created
    with session_scope(db_url) as s:
        assert pool_for(s, "h100").nodes == 4


def test_measured_description_scales_to_ready_nodes_and_never_replaces_the_operators(
    db_url: str, add_node: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = add_node(2, hostname="a")
    add_node(4, hostname="b")
    facts = {
        "peak_tflops": {"fp32": 0.5},
        "intra_node_bandwidth_gbps": 2.0,
        "intra_node_latency_us": 50.0,
        "inter_node_bandwidth_gbps": 1.25,
        "inter_node_latency_us": 100.0,
    }
    monkeypatch.setattr("megatrain.worker.nodes.local_facts", lambda *a, **k: facts)
    settings = get_settings()
    with session_scope(db_url) as s:
        pool = s.scalar(select(NodePool).where(NodePool.name == "default"))
        s.execute(update(Node).values(device_memory_bytes=8 << 30))
        record_measured_spec(pool, settings, "cpu", 2, 8 << 30, wait=True)
        assert pool.spec_source == "measured"
    with session_scope(db_url) as s:
        spec = pool_for(s, "default")
        assert spec is not None
        assert (spec.nodes, spec.devices_per_node, spec.peak("bf16")) == (2, 4, 0.5)
        s.execute(update(Node).where(Node.id == a).values(status="lost"))
    with session_scope(db_url) as s:
        assert pool_for(s, "default").nodes == 1
        apply_pool(s, PoolSpec.model_validate({**H100, "name": "default"}))
    with session_scope(db_url) as s:
        pool = s.scalar(select(NodePool).where(NodePool.name == "default"))
        record_measured_spec(pool, settings, "cpu", 2, 8 << 30, wait=True)  # a worker re-registers
    with session_scope(db_url) as s:
        assert pool_for(s, "default") == PoolSpec.model_validate({**H100, "name": "default"})


def test_the_pools_file_is_applied_at_start(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump([H100, {**H100, "name": "a100", "accelerator": "NVIDIA A100"}]))
    monkeypatch.setenv("MEGATRAIN_POOLS_FILE", str(path))
    reset_settings_cache()
    settings: Settings = get_settings()
    assert apply_pools_at_start(settings) == ["h100", "a100"]
    with session_scope(db_url) as s:
        assert pool_for(s, "a100").accelerator == "NVIDIA A100"
    path.write_text(yaml.safe_dump({**H100, "device_memory_bytes": "lots"}))
    with pytest.raises(ValueError, match="pools.yaml is invalid: device_memory_bytes"):
        apply_pools_at_start(settings)
