"""A rank starts holding its shard, not the model: each rank's peak resident memory (VmHWM of its
engine process, measured from outside by benchmarks/start_memory.py) above a one-layer-per-stage
run's, against the training state of the layers the full model adds (16 bytes per fp32 parameter;
4 + 4 + 8/dp with the distributed optimizer). Before sharded construction every rank built the whole
fp32 model first: the same measure was above 2 (BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "start_memory.py"
RATIO = 1.3


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("start_memory", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_360m_llama_at_tp4_pp2_starts_in_its_shard(tmp_path: Path) -> None:
    """8 gloo ranks, from random weights and from a Hugging Face folder, two steps each."""
    rows = _bench().measure("360m", {"tp": 4, "pp": 2, "dp": 1}, ["random", "hf"], tmp_path)
    runs = sorted((r["init"], r["rank"]) for r in rows)
    assert runs == [(init, rank) for init in ("hf", "random") for rank in range(8)]
    worst = max(rows, key=lambda r: r["ratio"])
    assert worst["ratio"] <= RATIO, worst
