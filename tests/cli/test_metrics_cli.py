"""`megatrain metrics` and `megatrain events` through CliRunner against a live API."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fixtures.live import LiveApi
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.client import Client
from megatrain.db.jobs import transition
from megatrain.db.models import CANCELLED, QUEUED, JobMetric
from megatrain.db.session import session_scope

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _add(api: LiveApi, job_id: str, step: int, val: bool = False) -> None:
    train = {"step": step, "loss": 10.0 / step, "lr": 3e-4, "grad_norm": 1.5, "tokens_per_s": 1234.5,
             "mfu": 0.05, "iter_time_s": 0.2}  # fmt: skip
    with session_scope(api.settings.resolved_database_url) as s:
        s.add(JobMetric(job_id=job_id, kind="train", step=step, loss=train["loss"], data=train))
        if val:
            row = {"step": step, "val_loss": 5.0 / step}
            s.add(JobMetric(job_id=job_id, kind="val", step=step, loss=row["val_loss"], data=row))


def _submit(api: LiveApi) -> str:
    with Client() as c:
        return c.submit(api.spec("metrics")).id


def test_metrics_table(live_api: LiveApi, tmp_path: Path) -> None:
    job_id = _submit(live_api)
    code, out = run("metrics", job_id)
    assert code == 0 and "no metrics yet" in out, out
    for step in (2, 4, 6):
        _add(live_api, job_id, step, val=step == 4)
    code, out = run("metrics", job_id)
    assert code == 0, out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), out
    assert "STEP" in lines[0] and "MFU" in lines[0] and "TOK/S" in lines[0], out
    assert [ln.split()[0] for ln in lines[1:]] == ["2", "4", "4", "6"], out
    assert "5.0000" in lines[1] and "1,234" in lines[1] and "5.00%" in lines[1], out
    assert "1.2500" in lines[3] and "val" in lines[3], out  # val_loss of step 4
    code, out = run("metrics", job_id, "--kind", "val")
    assert code == 0 and [ln.split()[0] for ln in out.splitlines()[1:]] == ["4"], out
    code, out = run("metrics", job_id, "--last", "2")
    assert code == 0 and [ln.split()[:2] for ln in out.splitlines()[1:]] == [["4", "val"], ["6", "train"]]


def test_metrics_follow_streams_until_the_job_ends(live_api: LiveApi) -> None:
    job_id = _submit(live_api)
    _add(live_api, job_id, 2)

    def later() -> None:
        time.sleep(1.0)
        _add(live_api, job_id, 4)
        time.sleep(0.5)
        with session_scope(live_api.settings.resolved_database_url) as s:
            transition(s, job_id, CANCELLED, from_statuses=(QUEUED,), reason="test over")

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    code, out = run("metrics", job_id, "--follow")
    thread.join()
    assert code == 0, out
    steps = [ln.split()[0] for ln in out.splitlines()[1:] if ln.split() and ln.split()[0].isdigit()]
    assert steps == ["2", "4"] and f"job {job_id} cancelled" in out, out


def test_events_timeline(live_api: LiveApi) -> None:
    job_id = _submit(live_api)
    with Client() as c:
        c.cancel(job_id)
    code, out = run("events", job_id)
    assert code == 0, out
    assert "TIME" in out and "queued" in out and "cancelled" in out, out
    code, out = run("events", "job-0000000000000000")
    assert code == 1 and "404" in out, out
    code, out = run("metrics", "job-0000000000000000")
    assert code == 1 and "404" in out, out
