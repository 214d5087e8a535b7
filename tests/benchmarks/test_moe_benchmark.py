"""benchmarks/moe.py runs (its --tiny settings) and prints every variant, so it cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_moe_benchmark_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "moe.py"), "--tiny"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("MoE layer,", "dense MLP"))]
    assert len(rows) == 4 and rows[-1].split()[-1] == "1.00"  # the dense MLP is the ratios' base
