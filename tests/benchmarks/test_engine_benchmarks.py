"""The engine benchmarks run (their --tiny settings), so they cannot rot between GPU loans.

The figures themselves live in BENCHMARKS.md; here only what must hold at any size: our model and
Hugging Face's compute the same function from the same weights, every variant was timed, and the
memory estimate matches our model's measured step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the benchmarks compare with Hugging Face transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{script}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--tiny", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vs hf" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def test_engine_cpu_benchmark(tmp_path: Path) -> None:
    results = _run("engine_cpu.py", tmp_path)["results"]
    assert [r["flavour"] for r in results] == ["gpt2", "llama"]
    for r in results:
        first = r["first_loss"]
        assert first["ours"] == pytest.approx(first["hf"], rel=1e-4)
        assert set(r["variants"]) == {"ours", "hf"}
        assert all(v["tokens_per_s"] > 0 for v in r["variants"].values())
        est, measured = r["memory"]["estimate"], r["memory"]["measured"]
        for part in ("params", "grads", "optimizer"):
            assert est[part] == measured[part], part
        assert est["activations"] == pytest.approx(measured["activations"], rel=0.15)


def test_engine_gpu_benchmark_smoke_on_cpu(tmp_path: Path) -> None:
    data = _run("engine_gpu.py", tmp_path)
    assert data["precision"] == "bf16" and data["flops_per_iteration"] > 0
    assert data["first_loss"]["ours"] == pytest.approx(data["first_loss"]["hf"], rel=2e-2)  # bf16
    assert set(data["variants"]) == {"ours", "hf"}
    assert data["estimate"]["total_bytes"] > 0


def test_grad_fusion_benchmark_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "grad_fusion.py"), "--tiny"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "paired" in proc.stdout and "no fusion" in proc.stdout
