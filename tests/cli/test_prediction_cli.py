"""The planner's prediction in the CLI: `megatrain validate` prints it, `megatrain status` sets it
beside what the job measured (against the real API)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.cli.prediction import versus_line
from megatrain.client import Client
from megatrain.db.models import JobMetric
from megatrain.db.session import session_scope


def run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_validate_prints_the_plan_and_status_compares_it_with_the_metrics(
    live_api: LiveApi, tmp_path: Path
) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(live_api.spec("predicted")))
    out = run("validate", str(path))
    assert "planned: predicted step " in out and " tokens/s, MFU " in out and " per device" in out, out
    with Client() as c:
        job = c.submit(live_api.spec("predicted"))
        [predicted] = [e["data"]["plan"]["predicted"] for e in c.events(job.id) if e["reason"] == "submitted"]
    out = run("status", job.id)
    assert "predicted  step " in out and "(not measured yet)" in out, out
    rows = [0.3, 0.2, 0.25, 9.0, 0.2]  # a slow interval (a checkpoint) must not move the median
    with session_scope(live_api.settings.resolved_database_url) as s:
        for i, t in enumerate(rows, 1):
            data = {"step": i, "loss": 1.0, "iter_time_s": t, "tokens_per_s": 1000.0 / t, "mfu": 0.01}
            s.add(JobMetric(job_id=job.id, kind="train", step=i, loss=1.0, data=data))
    out = run("status", job.id)
    diff = 100 * (0.25 - predicted["step_time_s"]) / predicted["step_time_s"]
    assert f"(measured 0.25 s, {diff:+.0f}%)" in out, out
    assert "(measured 4,000, " in out and "(measured 1.0%, " in out, out


def test_versus_line_reports_the_signed_difference() -> None:
    predicted = {"step_time_s": 0.2, "tokens_per_s": 1000.0, "mfu": 0.1, "memory_per_gpu_bytes": 3 << 20}
    rows = [{"iter_time_s": 0.25, "tokens_per_s": 800.0, "mfu": 0.08}]
    line = versus_line(predicted, rows)
    assert "step 0.2 s (measured 0.25 s, +25%)" in line
    assert "1,000 tokens/s (measured 800, -20%)" in line
    assert "MFU 10.0% (measured 8.0%, -20%)" in line and "3.0 MiB per device" in line


def test_versus_line_says_when_it_was_taken_under_load() -> None:
    predicted = {"step_time_s": 0.2, "tokens_per_s": 1000.0, "mfu": 0.1, "memory_per_gpu_bytes": 3 << 20}
    row = {"iter_time_s": 4.0, "host_other_cores": 1.4, "host_cores": 2, "host_under_load": True}
    assert versus_line(predicted, [row, row]).endswith(
        "  (taken under load: other processes kept 1.4 of 2 cores busy)"
    )
    quiet = {**row, "host_other_cores": 0.05, "host_under_load": False}
    assert "under load" not in versus_line(predicted, [quiet, quiet, row])
