"""The scheduler's Prometheus series (scheduler.metrics): each decision counted where the loop makes
it, the waiting jobs by pool and reason, tick and step times, errors; and `megatrain scheduler
--metrics-port` serving them, read back with prometheus_client's own parser."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scheduler_helpers import RecordingExecutor
from sqlalchemy import update

from megatrain.db.jobs import transition
from megatrain.db.models import RUNNING, SCHEDULED, Job, Node, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.scheduler.metrics import DECISIONS, SchedulerMetrics
from megatrain.settings import Settings, get_settings, reset_settings_cache

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by (name, sorted labels), through prometheus_client's parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def decisions(metrics: SchedulerMetrics) -> dict[str, float]:
    samples = parse(generate_latest(metrics.registry).decode())
    return {d: samples[("megatrain_scheduler_decisions_total", (("decision", d),))] for d in DECISIONS}


def _run(url: str, job_id: str) -> None:
    """A scheduled job's runner starts it."""
    with session_scope(url) as s:
        assert transition(s, job_id, RUNNING, from_statuses=(SCHEDULED,), runner_pid=1, runner_host="x")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_each_decision_is_counted_where_the_loop_makes_it(
    settings: Settings, add_node: Callable, add_job: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRAIN_NODE_LOST_AFTER_S", "30")
    reset_settings_cache()
    settings = get_settings()
    url = settings.resolved_database_url
    add_node(2, hostname="node-a")
    ex, metrics = RecordingExecutor(), SchedulerMetrics()
    sched = Scheduler(settings, ex, metrics=metrics)
    assert set(decisions(metrics).values()) == {0.0}  # every series exists before any decision

    low = add_job(procs=2, priority=0)
    too_big = add_job(procs=4, priority=0)
    assert sched.schedule_once() == [low]
    _run(url, low)
    add_job(procs=2, priority=5)
    assert sched.schedule_once() == []  # no room: the low-priority job is asked to make it
    counts = decisions(metrics)
    assert (counts["placed"], counts["preempted"]) == (1.0, 1.0)
    samples = parse(generate_latest(metrics.registry).decode())
    waiting = {k[1]: v for k, v in samples.items() if k[0] == "megatrain_scheduler_waiting_jobs"}
    assert waiting[(("pool", "default"), ("reason", "too_big_for_pool"))] == 1.0
    assert waiting[(("pool", "default"), ("reason", "no_free_slots"))] == 1.0

    # The node falls silent: lost, and its running job fails over; a cancelled queued job ends.
    with session_scope(url) as s:
        s.execute(update(Node).values(last_seen_at=utcnow() - timedelta(seconds=120)))
        s.execute(update(Job).where(Job.id == too_big).values(cancel_requested=True))
    sched.reconcile_once()
    counts = decisions(metrics)
    assert (counts["node_lost"], counts["failed_over"], counts["cancelled"]) == (1.0, 1.0, 1.0)
    # A new node fits both queued jobs (the preempting one, the requeued one), but the executor
    # refuses them; no job waits now, and the earlier reasons read 0 rather than stale counts.
    add_node(4, hostname="node-b")
    ex.fail_with = RuntimeError("executor down")
    assert sched.schedule_once() == []
    counts = decisions(metrics)
    assert (counts["submit_failed"], counts["placed"]) == (2.0, 1.0)
    samples = parse(generate_latest(metrics.registry).decode())
    for reason in ("too_big_for_pool", "no_free_slots"):
        assert samples[("megatrain_scheduler_waiting_jobs", (("pool", "default"), ("reason", reason)))] == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_loop_times_its_ticks_and_counts_a_failing_step(settings: Settings) -> None:
    class Broken(RecordingExecutor):
        def refresh_nodes(self) -> None:
            raise RuntimeError("cannot list nodes")

    metrics = SchedulerMetrics()
    sched = Scheduler(settings.model_copy(update={"scheduler_interval_s": 0.05}), Broken(), metrics=metrics)
    stop = threading.Event()
    thread = threading.Thread(target=sched.run, args=(stop,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while metrics.registry.get_sample_value("megatrain_scheduler_tick_seconds_count") in (None, 0.0):
        assert time.monotonic() < deadline, "no tick was timed"
        time.sleep(0.05)
    stop.set()
    thread.join(10)
    samples = parse(generate_latest(metrics.registry).decode())
    ticks = samples[("megatrain_scheduler_tick_seconds_count", ())]
    assert ticks >= 1
    # reconcile and schedule both refresh the nodes first: each tick counts both as unexpected errors.
    for step in ("reconcile", "schedule"):
        assert (
            samples[("megatrain_scheduler_errors_total", (("kind", "unexpected"), ("step", step)))] == ticks
        )
        assert samples[("megatrain_scheduler_step_seconds_count", (("step", step),))] == ticks
    assert ("megatrain_scheduler_errors_total", (("kind", "unexpected"), ("step", "datasets"))) not in samples
    assert samples[("megatrain_scheduler_last_tick_timestamp_seconds", ())] > time.time() - 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_megatrain_scheduler_serves_its_metrics(db_url: str, megatrain_home: Path) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")} | {
        "MEGATRAIN_HOME": str(megatrain_home),
        "MEGATRAIN_DATABASE_URL": db_url,
        "MEGATRAIN_SCHEDULER_INTERVAL_S": "0.2",
        "MEGATRAIN_CPU_SLOTS": "1",
    }
    cmd = [sys.executable, "-m", "megatrain.cli", "scheduler", "--metrics-port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, samples = time.monotonic() + 60, {}
        while samples.get(("megatrain_scheduler_tick_seconds_count", ()), 0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout and proc.stdout.read()
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                samples = parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text)
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert samples[("megatrain_scheduler_decisions_total", (("decision", "placed"),))] == 0.0
    assert samples[("megatrain_scheduler_step_seconds_count", (("step", "schedule"),))] >= 2
    # The local executor's runners write beside it, for its /metrics to sum (none ran here).
    assert (megatrain_home / "metrics" / "runners").is_dir()
