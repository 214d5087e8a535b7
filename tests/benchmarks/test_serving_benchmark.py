"""benchmarks/serving.py's engine section runs (its --tiny settings) and prints its table, so it
cannot rot; the stack section is what tests/api/test_openai_chat.py drives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_serving_benchmark_runs() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "serving.py"), "--tiny", "--sections", "engine"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "4"] and all(r[-1] in ("8/8", "32/32") for r in rows)
