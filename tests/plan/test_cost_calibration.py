"""The planner's memory prediction against the engine on this CPU, through benchmarks/planner_engine.py:
on the three 4-rank layouts (tp, pp, dp each 2 in turn; gloo ranks under torchrun), rank 0's model
state (params + grads + optimizer, megatrain.engine.memory_stats) is what the planner predicts.

Step time is a measurement, judged by the benchmark (`python benchmarks/planner_engine.py`, with
BENCHMARKS.md "Layout planner" quoting its table), not by a timed test: on a shared 2-core VM the
same engine's steps moved by 2x between hosts of the same kind with the measured matmul peak equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_engine.py"


def test_model_state_matches_the_engine_in_every_sharded_layout() -> None:
    cmd = [sys.executable, str(BENCH), "--layouts", "2,2,1", "2,1,2", "1,2,2", "--steps", "2",
           "--warmup", "1", "--no-retry", "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert [(r["tp"], r["pp"], r["dp"]) for r in rows] == [(2, 2, 1), (2, 1, 2), (1, 2, 2)]
    for r in rows:
        assert r["predicted_model_state_bytes"] == pytest.approx(r["measured_model_state_bytes"], rel=0.01), r
        # The step-time columns are filled (the benchmark's table); their size is not judged here.
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 and r["peak_tflops"] > 0, r
    # tp and pp each split the layers' weights over two ranks; dp=2 without tp/pp keeps them whole.
    by = {(r["tp"], r["pp"], r["dp"]): r["measured_model_state_bytes"] for r in rows}
    assert by[(2, 2, 1)] < by[(2, 1, 2)] and by[(2, 2, 1)] < by[(1, 2, 2)]
