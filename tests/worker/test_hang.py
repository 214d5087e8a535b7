"""Hung attempts (worker.hang + the shard runner): an engine whose step counter stops is detected,
its stacks reach the job's log, the attempt is retried from its checkpoint and the retry finishes;
repeated infrastructure failures quarantine the node; every attempt adds a goodput ledger row."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select

from megatrain.db.goodput import job_goodput, node_goodput, release_node
from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import QUARANTINED, QUEUED, SUCCEEDED, AttemptLedger, Job, JobEvent, JobLog, Node
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings, reset_settings_cache
from megatrain.worker.hang import HangRule, HangWatch
from megatrain.worker.shard import run_shard

SQLITE = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
"""One database: the runner's SQL is the same on both (tests/db and tests/scheduler run both)."""


@pytest.fixture
def hang_settings(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("MEGATRAIN_HANG_MIN_S", "1.5")
    monkeypatch.setenv("MEGATRAIN_HANG_GRACE_S", "60")
    reset_settings_cache()
    return get_settings()


def _reschedule(url: str, job_id: str) -> None:
    with session_scope(url) as s:
        node_id = s.scalar(select(Node.id).where(Node.hostname == "testnode"))
        assert reserve_and_schedule(s, job_id, node_id, "test")


@SQLITE
def test_a_hung_rank_is_named_its_stacks_logged_and_the_retry_finishes(
    hang_settings: Settings,
    make_job: Callable[..., str],
    fake_engine: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    url = hang_settings.resolved_database_url
    monkeypatch.setenv("FAKE_ENGINE_HANG_AT", "8")
    monkeypatch.setenv("FAKE_ENGINE_FAIL_MARKER", str(tmp_path / "hung-once"))
    job_id = make_job(max_retries=1, train_iters=12, checkpoint_interval=5)
    run_shard(job_id, hang_settings)
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == QUEUED, job.status_reason
        assert job.status_reason.startswith("hung: rank 0 on ")
        assert " stopped at step 7 for " in job.status_reason
        assert job.status_reason.endswith(
            "(median step 0.01 s); stacks in the log; retrying from the latest checkpoint"
        )
        assert job.avoid_nodes == [s.scalar(select(Node.id).where(Node.hostname == "testnode"))]
        event = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc())
        ).first()
        assert event.data["cause"] == "hung" and event.data["ranks"] == [0] and event.data["step"] == 7
        log = "\n".join(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
    # faulthandler's dump of the stopped rank, naming the frame it is stuck in.
    assert "most recent call first" in log and "_hang_forever" in log, log[-2000:]
    _reschedule(url, job_id)
    assert run_shard(job_id, hang_settings) == 0
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        assert job.status == SUCCEEDED and job.attempt == 2
        rows = s.scalars(
            select(AttemptLedger).where(AttemptLedger.job_id == job_id).order_by(AttemptLedger.attempt)
        ).all()
        assert [(r.attempt, r.outcome, r.failure) for r in rows] == [
            (1, QUEUED, "hung"),
            (2, SUCCEEDED, None),
        ]
        assert rows[0].hang_s >= 1.5 and rows[1].hang_s == 0
        assert rows[1].restart_s > 0  # resumed from step 5 after reaching 7: overhead + 2 steps redone
        goodput = job_goodput(s, job_id)
        assert goodput["attempts"] == 2 and goodput["hang_s"] >= 1.5 and 0 < goodput["goodput"] < 1
        assert node_goodput(s)[rows[0].node_id]["hang_s"] == goodput["hang_s"]


@SQLITE
def test_repeated_infrastructure_failures_quarantine_the_node_until_released(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRAIN_NODE_QUARANTINE_FAILURES", "2")
    reset_settings_cache()
    settings = get_settings()
    url = settings.resolved_database_url
    monkeypatch.setenv("FAKE_ENGINE_FAIL_AT", "2")  # fails every time: an infrastructure error
    job_id = make_job(max_retries=3)
    run_shard(job_id, settings)
    with session_scope(url) as s:
        node = s.scalar(select(Node).where(Node.hostname == "testnode"))
        assert node.status == "ready"
    _reschedule(url, job_id)
    run_shard(job_id, settings)
    with session_scope(url) as s:
        node = s.scalar(select(Node).where(Node.hostname == "testnode"))
        assert node.status == QUARANTINED
        assert node.quarantine_reason == "2 attempts failed with infrastructure errors within 3600 s"
        assert release_node(s, node.id) and not release_node(s, node.id)
    with session_scope(url) as s:
        assert s.scalar(select(Node.status).where(Node.hostname == "testnode")) == "ready"


def test_the_allowance_is_the_factor_times_the_median_with_a_floor_and_a_grace() -> None:
    watch = HangWatch(HangRule(factor=10, min_s=2, grace_s=100), started=0.0, checkpoint_interval=5)
    assert watch.allowance_s() == 100  # before the first step
    watch.observe_metrics([{"step": s, "iter_time_s": 0.5} for s in (1, 2, 3)], now=3.0)
    assert watch.allowance_s() == 5  # 10 x median 0.5
    watch.observe_metrics([{"step": 4, "iter_time_s": 0.1}, {"step": 5, "iter_time_s": 0.1}], now=4.0)
    assert watch.allowance_s() == 100  # step 5 is due a checkpoint, not reported saved yet
    watch.observe_events([{"event": "checkpoint_saved", "step": 5}], now=9.0)
    assert watch.allowance_s() == 5 and watch.last_move == 9.0
    watch.observe_metrics([{"step": s, "iter_time_s": 0.01} for s in range(6, 20)], now=10.0)
    assert watch.allowance_s() == 100  # step 20, next, is a checkpoint's: its save may be running
    watch.observe_metrics([{"step": s, "iter_time_s": 0.01} for s in range(20, 22)], now=10.0)
    assert watch.allowance_s() == 2  # the floor: training went past step 20's save (async or done)
    assert watch.check(11.9, Path("/nonexistent"), "h") is None
    hang = watch.check(12.5, Path("/nonexistent"), "h")
    assert hang is not None and hang.step == 21 and hang.ranks == (0,)


def test_sparse_metrics_and_progress_files(tmp_path: Path) -> None:
    from megatrain.progress_files import write_progress

    # Logged every 10 steps: the allowance is 10 x the median step time x 10 steps between rows.
    watch = HangWatch(HangRule(factor=10, min_s=1, grace_s=100), started=0.0, checkpoint_interval=1000)
    watch.observe_events([{"event": "started", "resumed_from": 2000}], now=0.0)
    watch.observe_metrics([{"step": s, "iter_time_s": 0.5} for s in (2010, 2020, 2030)], now=1.0)
    assert watch.allowance_s() == 50
    # The ranks' files show movement between rows; a rank that stops holds the slowest step still.
    write_progress(tmp_path, 0, 2031)
    assert watch.check(40.0, tmp_path, "h") is None and watch.last_move == 40.0
    write_progress(tmp_path, 0, 2035)
    assert watch.check(80.0, tmp_path, "h") is None and watch.last_move == 80.0
    hang = watch.check(131.0, tmp_path, "h")
    assert hang is not None and hang.step == 2035 and hang.stalled_s == 51.0
    # A resumed attempt's start counts as saved: no grace at step 2000, but at 2999 (3000 is due).
    assert watch.known_step == 2035
    write_progress(tmp_path, 0, 2999)
    watch.check(140.0, tmp_path, "h")
    assert watch.allowance_s() == 100


def test_dump_stacks_asks_a_process_for_its_stacks(tmp_path: Path) -> None:
    import subprocess
    import sys

    from worker_helpers import wait_for

    from megatrain.worker.hang import dump_stacks

    err = tmp_path / "stderr"
    code = (
        "import faulthandler, signal, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        # 'ready' from inside the frame the dump must show: printed before it, the signal could land
        # while the module was still defining the function (it did, on a loaded host).
        "def stuck_here():\n    print('ready', flush=True)\n    time.sleep(30)\n"
        "stuck_here()\n"
    )
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=f, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        lines = dump_stacks((proc.pid,))
        assert not any("could not signal" in line for line in lines)
        wait_for(lambda: "stuck_here" in err.read_text(), timeout=10)
        assert "most recent call first" in err.read_text()
        assert proc.poll() is None  # asked, not killed
    finally:
        proc.kill()
        proc.wait()
    gone = dump_stacks((2**22 + 12345,))
    assert gone and "could not signal pid" in gone[0]


@SQLITE
def test_the_rank_that_stopped_first_is_named(
    hang_settings: Settings,
    make_job: Callable[..., str],
    fake_engine: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_HANG_AT", "6")
    monkeypatch.setenv("FAKE_ENGINE_HANG_RANK", "1")
    monkeypatch.setenv("FAKE_ENGINE_FAIL_MARKER", str(tmp_path / "hung-once"))
    job_id = make_job(procs=2, max_retries=0, train_iters=12, checkpoint_interval=0)
    run_shard(job_id, hang_settings)
    with session_scope(hang_settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        # rank 0 stood at step 6 waiting for rank 1, which never finished step 6
        assert job.status == "failed" and job.status_reason.startswith("hung: rank 1 on "), job.status_reason
        assert " stopped at step 5 for " in job.status_reason and job.status_reason.endswith(
            "stacks in the log"
        )


def test_the_grace_follows_the_phase_the_ranks_report(tmp_path: Path) -> None:
    from megatrain.progress_files import write_progress

    watch = HangWatch(HangRule(factor=10, min_s=1, grace_s=100), started=0.0, checkpoint_interval=5)
    watch.observe_metrics([{"step": s, "iter_time_s": 0.2} for s in (1, 2, 3, 4)], now=1.0)
    # Step 5 is a checkpoint's, but the ranks say they are training: a rank stuck in step 5's
    # compute is a hang after the usual allowance, not after the save's grace.
    write_progress(tmp_path, 0, 4, "training")
    write_progress(tmp_path, 1, 4, "training")
    assert watch.check(2.0, tmp_path, "h") is None and watch.allowance_s() == 2
    hang = watch.check(3.5, tmp_path, "h")
    assert hang is not None and hang.ranks == (0, 1) and hang.step == 4
    # One rank saving (or evaluating) pauses the counter legitimately: the grace applies.
    write_progress(tmp_path, 1, 5, "checkpoint")
    assert watch.check(4.0, tmp_path, "h") is None and watch.allowance_s() == 100
    write_progress(tmp_path, 1, 5, "evaluation")
    assert watch.check(50.0, tmp_path, "h") is None
    write_progress(tmp_path, 0, 5, "training")
    write_progress(tmp_path, 1, 5, "training")
    assert watch.check(51.0, tmp_path, "h") is None and watch.allowance_s() == 2


def test_predicted_pauses_replace_the_flat_grace(tmp_path: Path) -> None:
    """The control plane's predictions (plan.attempt_times) bound the start and a save; a save this
    attempt measured slower stretches the next one's; an evaluation keeps the flat grace."""
    from megatrain.progress_files import write_progress

    rule = HangRule(factor=10, min_s=1, grace_s=900, first_step_s=40, save_s=30)
    watch = HangWatch(rule, started=0.0, checkpoint_interval=5)
    assert watch.check(39.0, tmp_path, "h") is None
    hang = watch.check(41.0, tmp_path, "h")
    assert hang is not None and "before its first step" in hang.reason()
    watch.observe_metrics([{"step": s, "iter_time_s": 0.2} for s in (1, 2, 3, 4)], now=42.0)
    write_progress(tmp_path, 0, 5, "checkpoint")
    assert watch.check(42.0, tmp_path, "h") is None and watch.allowance_s() == 30
    assert watch.check(71.0, tmp_path, "h") is None and watch.check(72.5, tmp_path, "h") is not None
    watch.observe_events([{"event": "checkpoint_saved", "step": 5, "write_s": 4.0}], now=73.0)
    assert watch.allowance_s() == 40  # 10 x the 4 s this attempt's save took
    write_progress(tmp_path, 0, 6, "evaluation")
    assert watch.check(74.0, tmp_path, "h") is None and watch.allowance_s() == 900
    # Without predictions (a pool with no spec, a Hugging Face tokenizer): the flat grace.
    plain = HangWatch(HangRule(factor=10, min_s=1, grace_s=900), started=0.0, checkpoint_interval=5)
    assert plain.allowance_s() == 900


def test_past_the_last_step_the_engine_is_finishing_not_hung(tmp_path: Path) -> None:
    """After train_iters the ranks stand still by design (the final save's last writes, torchrun's
    exit barrier with the other nodes): a save's allowance, not a step's."""
    from megatrain.progress_files import write_progress

    rule = HangRule(factor=10, min_s=1, grace_s=900, save_s=30)
    rows = [{"step": s, "iter_time_s": 0.01} for s in range(1, 11)]
    for iters, allowed in ((10, 30.0), (0, 1.0), (20, 1.0)):  # (0: unknown; 20: mid-run)
        watch = HangWatch(rule, started=0.0, train_iters=iters)
        watch.observe_metrics(rows, now=1.0)
        write_progress(tmp_path, 0, 10, "training")
        assert watch.allowance_s() == allowed, iters
        assert (watch.check(3.0, tmp_path, "h") is None) == (allowed == 30.0), iters  # 2 s on
        assert watch.check(1.0 + allowed + 0.5, tmp_path, "h") is not None


def test_a_gangs_hang_names_the_node_whose_ranks_stopped_first(tmp_path: Path) -> None:
    """Node rank 0's runner sees its own ranks and what the other shards last said of theirs
    (attempts.reports.peers_progress): the ranks named are the gang's lowest, on their node."""
    from megatrain.progress_files import write_progress
    from megatrain.worker.hang import shard_progress

    for rank in (0, 1):
        write_progress(tmp_path, rank, 5, "training")
    watch = HangWatch(HangRule(factor=10, min_s=1, grace_s=100), started=0.0)
    watch.observe_metrics([{"step": s, "iter_time_s": 0.01} for s in (1, 2, 3, 4)], now=0.0)
    assert watch.check(0.5, tmp_path, "node-a") is None
    behind = [{"node": "node-b", "step": 4, "ranks": [3]}, {"node": "node-c", "step": 5, "ranks": [4, 5]}]
    hang = watch.check(2.0, tmp_path, "node-a", behind)
    assert hang is not None and (hang.ranks, hang.host, hang.step, hang.pids) == ((3,), "node-b", 4, ())
    assert hang.reason().startswith("hung: rank 3 on node-b stopped at step 4 for ")
    level = [{"node": "node-b", "step": 5, "ranks": [2, 3]}]
    hang = watch.check(2.0, tmp_path, "node-a", level)
    assert hang is not None and (hang.ranks, hang.host, hang.step) == ((0, 1, 2, 3), "node-a, node-b", 5)
    assert len(hang.pids) == 2  # this node's own stopped ranks' stacks are dumped here
    hang = watch.check(2.0, tmp_path, "node-a", [{"node": "node-b", "step": 9, "ranks": [2, 3]}])
    assert hang is not None and (hang.ranks, hang.host) == ((0, 1), "node-a")
    # What a follower reports of its own ranks.
    write_progress(tmp_path, 1, 4, "training")
    assert shard_progress(tmp_path, "node-a") == {"node": "node-a", "step": 4, "ranks": [1]}
    assert shard_progress(tmp_path / "nothing", "node-a") is None
