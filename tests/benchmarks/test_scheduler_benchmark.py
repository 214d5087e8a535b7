"""benchmarks/scheduler.py: a small run prints its table with both executors, and bad sizes are
refused with the option named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_small_run_prints_the_table() -> None:
    result = _run("--jobs", "300", "--nodes", "20", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["executor", "jobs", "nodes", "decisions/s", "ms/tick", "placed", "gangs"]
    single, multi = (line.split() for line in lines[1:3])
    assert single[:3] == ["single-node", "300", "20"] and multi[:3] == ["multi-node", "300", "20"]
    assert float(single[3].replace(",", "")) > 0 and int(multi[5].replace(",", "")) > 0
    assert single[6] == "0"  # a single-node executor never gets a gang


def test_database_tick_is_timed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'bench.db'}"
    result = _run("--jobs", "200", "--nodes", "10", "--repeats", "1", "--db", url)
    assert result.returncode == 0, result.stderr
    line = result.stdout.splitlines()[-1]
    assert line.startswith("database tick (sqlite): snapshot ") and "for 200 queued jobs" in line


def test_bad_sizes_are_refused() -> None:
    result = _run("--jobs", "0")
    assert result.returncode == 2 and "--jobs must be >= 1" in result.stderr
