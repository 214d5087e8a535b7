"""benchmarks/moe.py runs (its --tiny settings) and prints every variant, so it cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_moe_benchmark_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "moe.py"), "--tiny"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("MoE layer,", "dense MLP"))]
    assert len(rows) == 4 and rows[-1].split()[-1] == "1.00"  # the dense MLP is the ratios' base


def test_expert_parallel_benchmark_runs_every_dispatch() -> None:
    """benchmarks/expert_parallel.py at a tiny size, recomputed: pairs, pipelined chunks, the two
    hops (on two nodes also pipelined) and two micro-batches in turn and in lanes at ep=2, each row
    with the bytes it sent (the two hops' across-node part 0 on one node of two, the same in chunks
    as whole)."""
    args = ["--ep", "1", "2", "--overlap", "2", "--nodes", "1", "2", "--lanes", "2", "--tokens", "64",
            "--steps", "1", "--hidden", "32", "--ffn", "32", "--recompute"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(BENCH / "expert_parallel.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {
        line.split("|")[3].strip(): line.split("|")
        for line in proc.stdout.splitlines()
        if line.startswith("| 2 |")
    }
    assert set(rows) >= {
        "pairs",
        "pairs, 2 chunks",
        "two hops, 1 ranks to a node",
        "two hops, 1 ranks to a node, 2 chunks",
        "two hops, 2 ranks to a node",
        "pairs, 2 micro-batches one after the other",
        "pairs, 2 micro-batches in lanes",
    }
    # Two micro-batches of half the tokens send what one whole one does, in turn or in lanes.
    for how in ("one after the other", "in lanes"):
        sent = float(rows[f"pairs, 2 micro-batches {how}"][5])
        assert sent == pytest.approx(float(rows["pairs"][5]), rel=0.3)
    assert "| 2 | 2 micro-batches in lanes |" in proc.stdout  # its row against compute and exchange
    assert float(rows["pairs"][5]) > 0 and rows["pairs"][6].strip() == "-"
    for key in (
        "pairs",
        "pairs, 2 chunks",
        "two hops, 2 ranks to a node",
        "two hops, 1 ranks to a node, 2 chunks",
    ):
        # Recomputed (--recompute), a layer's forward leaves its input and little else held (the
        # chunked one left its experts' activations, 0.11 MiB here, before it learnt not to).
        assert float(rows[key][9]) < 0.01, rows[key]
    assert (
        float(rows["two hops, 2 ranks to a node"][6]) == 0.0 < float(rows["two hops, 1 ranks to a node"][6])
    )
    assert rows["two hops, 1 ranks to a node, 2 chunks"][6] == rows["two hops, 1 ranks to a node"][6]
