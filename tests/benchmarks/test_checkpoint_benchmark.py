"""benchmarks/checkpoint.py on a tiny state, one and two ranks: every figure is there and sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint.py"


@pytest.mark.distributed
def test_checkpoint_benchmark_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, str(BENCH), "--params", "2e6", "--ranks", "1", "2", "--rounds", "1", "--json"]
    env = {**os.environ, "BENCH_DIR": str(tmp_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert [r["ranks"] for r in rows] == [1, 2]
    for r in rows:
        assert r["state_GB"] == pytest.approx(2e6 * 14 / 1e9, rel=0.05)  # bf16 + fp32 main + 2 moments
        assert all(r[k] > 0 for k in ("torch_save_GBps", "sync_save_GBps", "load_GBps", "async_stall_s"))
        assert r["async_peak_rss_x_state"] > r["sync_peak_rss_x_state"]  # the staging copy
    assert not list(tmp_path.iterdir())  # the benchmark cleans up after itself
