"""benchmarks/kernels.py on CPU: every backend that runs here is timed and rated against the host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def test_kernels_benchmark_rates_each_cpu_backend(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    kernels = ["rms_norm", "apply_rope_qk", "attention"]
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--kernels", *kernels,
           "--repeat", "1", "--warmup", "0", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    got = {(r["kernel"], r["backend"]) for r in rows}
    # The CPU backends of each kernel, never a CUDA-only one (Triton, flash, te).
    assert {("rms_norm", "torch"), ("rms_norm", "reference"), ("apply_rope_qk", "torch")} <= got
    assert {("attention", "sdpa"), ("attention", "flex")} <= got
    assert not {b for _, b in got} & {"triton", "flash", "te", "liger"}
    for r in rows:
        assert r["ms"] > 0
        rate = r.get("GB/s", r.get("TFLOP/s"))
        assert rate is not None and rate > 0, r
        assert r["of_peak"] is not None and 0 < r["of_peak"] < 5, r  # against this host's measured figures
    assert "not a speed figure" in proc.stdout
