"""benchmarks/attention.py runs (its --tiny settings), so it cannot rot between GPU loans: every
backend usable here was checked against SDPA and timed, plain and packed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "attention.py"


def test_attention_benchmark_times_every_usable_backend(tmp_path: Path) -> None:
    out = tmp_path / "attention.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    for name in ("sdpa", "flex", "reference"):
        for variant in (name, f"{name}+packed"):
            assert rows[variant]["median_s"] > 0 and rows[variant]["tflops"] > 0, variant
