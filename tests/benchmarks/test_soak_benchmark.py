"""benchmarks/soak.py: its audit of what the engine printed against what the database holds, and the
CI version of the soak itself (a few minutes, every fault kind once) holding its targets on a real
PostgreSQL, Redis and S3 endpoint (moto's server): no row lost or doubled, every job succeeded, every
fault that ended an attempt followed by a resumed step within 60 s. Its goodput bar is a floor
against gross regressions (60% while a job holds its slot), not the hour's 90% target: its faults
come every 20 s, 9x as often as the hour's (3 minutes keep CI short), and CI runs it beside another
test worker on 2 cores, where every restart (torch's import) takes 2-3x longer (at 30 s apart it
measured 81.6-90.9% while held, and 69.6% once beside other heavy work; BENCHMARKS.md, "The
soak")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _soak_report import Fault, JobResult, audit_lines, expected_metric_steps, summarize  # noqa: E402

START = "model 0.16M params | layout tp=1 cp=1 dp=1 pp=1 | fp32 | device cpu"


def _step(step: int, total: int = 1000) -> str:
    return f"step {step}/{total} | loss 1.2345 | lr 3.0e-04 | grad_norm 1.0"


def test_a_resume_from_a_checkpoint_recomputes_the_steps_past_it() -> None:
    lines = [START, _step(100), _step(200), _step(300), "resumed from file:///c step 200", START]
    assert audit_lines([*lines, _step(300), _step(400)], 100) == (0, 0, 100)


def test_a_restart_without_a_checkpoint_recomputes_everything() -> None:
    assert audit_lines([START, _step(100), _step(200), START, _step(100), _step(200)], 100) == (0, 0, 200)


def test_a_missing_line_is_lost_and_a_repeated_one_doubled() -> None:
    assert audit_lines([START, _step(100), _step(400)], 100) == (2, 0, 0)
    assert audit_lines([START, _step(100), _step(200), _step(200), _step(300)], 100) == (0, 1, 0)
    # A batch applied twice repeats lines without the engine's start line before them: doubled.
    assert audit_lines([START, _step(100), _step(200), _step(100), _step(200)], 100)[1] == 2


def test_the_last_step_is_logged_off_the_interval() -> None:
    assert audit_lines([START, _step(100, 250), _step(200, 250), _step(250, 250)], 100) == (0, 0, 0)
    assert expected_metric_steps(250, 100) == {100, 200, 250}


def test_a_killed_nodes_other_job_is_the_faults_not_unexplained() -> None:
    """A Slurm node runs two jobs: killing it ends both attempts, the target's and a bystander's."""
    from datetime import UTC, datetime

    seconds = {"productive_s": 90.0, "queued_s": 0.0, "restart_s": 10.0}
    results = [JobResult(j, "acme", "succeeded", "", 2, 100, seconds) for j in ("a", "b")]
    fault = Fault("kill_node", datetime.now(UTC), "a", 1, "n1", ended_attempt=True, resume_s=10.0)
    assert summarize(results, [fault], 100.0)["unplanned_attempts"] == 1
    fault.bystanders = 1
    summary = summarize(results, [fault], 100.0)
    assert summary["unplanned_attempts"] == 0 and summary["attempts_ended_by_kind"] == {"kill_node": 2}


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.timeout(1020)  # 3 (up to 6) minutes of faults, up to 4 of draining, on a loaded host
def test_the_ci_soak_holds_its_targets(postgres_available: bool, redis_url: str, tmp_path: Path) -> None:
    if not postgres_available:
        pytest.skip("PostgreSQL unreachable")
    out = tmp_path / "soak.json"
    # Eight fault kinds land in 3 minutes (the first at 10 s, seven more at most 24 s apart), or a
    # little later on a slow host (--every-kind).
    # The partitions are short: a node cut from the API for 6 s (the node-lost bound is 20 s: cut for 10
    # s, a runner on a loaded CI host once took the other 10 to be heard again), from
    # S3 for 10 s (within the clients' retries), so neither may end an attempt.
    cmd = [
        sys.executable, str(BENCH / "soak.py"), "--minutes", "3", "--fault-every", "20",
        "--iters", "6000", "--checkpoint-interval", "1500", "--log-interval", "100",
        "--silence-s", "6", "--storage-outage-s", "10", "--every-kind",
        "--drain-minutes", "4", "--redis-db", "12", "--goodput-target", "0.6",
        "--home", str(tmp_path / "cluster"), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    report = proc.stdout[-6000:]
    assert summary["lost"] == 0 and summary["doubled"] == 0, report
    # How many jobs fit is the machine's: in 3 minutes of faults, 2 (both slots, each job hit by
    # 3-4 faults) on a loaded CI host, 3 on a quiet one.
    assert summary["jobs"] >= 2 and summary["succeeded"] == summary["jobs"], report
    assert set(summary["faults_by_kind"]) == {
        "kill_rank", "restart_api", "stop_rank", "drop_db", "corrupt_checkpoint", "kill_node",
        "silence", "storage_outage",
    }, report  # fmt: skip
    ended = summary["attempts_ended_by_kind"]
    assert "silence" not in ended and "storage_outage" not in ended, report
    assert summary["resumes_missing"] == 0 and summary["resume_s_max"] <= 60, report
    # An API restart or a dropped connection ends no attempt. A corrupted checkpoint that was the
    # job's only one costs one more: the attempt that finds it sets it aside, the next starts over.
    assert summary["unplanned_attempts"] <= summary["faults_by_kind"]["corrupt_checkpoint"], report
    assert not summary["targets_missed"] and proc.returncode == 0, report
