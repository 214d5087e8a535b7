"""A worker's Prometheus series (worker.metrics), fed from the engine's metrics rows its runner reads:
the arithmetic on its own, then a job run end to end under the embedded stack (its runner a process
of its own, summed into the API's /metrics) and under a Celery worker (`--metrics-port`), each
scrape read back with prometheus_client's own parser."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.live import LiveApi, start_live_api
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from megatrain.db.models import Node, NodePool
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.executors import runner_env
from megatrain.worker.metrics import WorkerMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
FAKE_ENGINE = Path(__file__).with_name("fake_engine.py")


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def one(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _row(step: int, **extra: Any) -> dict[str, Any]:
    return {"step": step, "iter_time_s": 0.5, "tokens_per_s": 400.0, "mfu": 0.25, **extra}


def test_steps_and_tokens_count_from_where_the_attempt_resumed() -> None:
    m = WorkerMetrics()
    live = m.attempt("j1")
    live.observe([_row(12, device_memory_used_bytes=7, peak_memory_bytes=9)], resumed_from=10)
    live.observe([{"step": 12, "val_loss": 1.0}, _row(14)], resumed_from=10)  # an eval row adds nothing
    s = parse(generate_latest(m.registry).decode())
    assert one(s, "megatrain_worker_steps_total") == 4  # 10 -> 14
    assert one(s, "megatrain_worker_tokens_total") == 4 * 400.0 * 0.5  # steps x tokens per step
    assert one(s, "megatrain_worker_running_attempts") == 1
    assert one(s, "megatrain_worker_mfu_ratio", job_id="j1") == 0.25
    assert one(s, "megatrain_worker_device_memory_bytes", job_id="j1", kind="used") == 7
    assert one(s, "megatrain_worker_device_memory_bytes", job_id="j1", kind="peak") == 9


def test_an_attempts_end_counts_once_and_takes_its_series_away() -> None:
    m = WorkerMetrics()
    live = m.attempt("j1")
    live.observe([_row(2)], resumed_from=None)
    m.heartbeat("j1")
    assert one(
        parse(generate_latest(m.registry).decode()),
        "megatrain_worker_heartbeat_timestamp_seconds",
        job_id="j1",
    )
    live.end("exited", 0, {"productive_s": 5.0, "queued_s": 2.0, "restart_s": 0.0})
    live.end("exited", 0, {"productive_s": 5.0, "queued_s": 2.0})  # finish() retried: nothing more
    m.heartbeat("j1")  # its heartbeat thread's last beat, after the end
    s = parse(generate_latest(m.registry).decode())
    assert one(s, "megatrain_worker_running_attempts") == 0
    assert one(s, "megatrain_worker_attempts_ended_total", outcome="completed") == 1
    assert one(s, "megatrain_worker_goodput_seconds_total", kind="productive") == 5.0
    assert one(s, "megatrain_worker_goodput_seconds_total", kind="queued") == 2.0
    assert not [k for k in s if dict(k[1]).get("job_id") == "j1"]  # no series of an ended attempt
    m.attempt("j2").end("exited", 3, None)
    s = parse(generate_latest(m.registry).decode())
    assert one(s, "megatrain_worker_attempts_ended_total", outcome="failed") == 1


ITERS, STEP_S, LOG_EVERY = 30, 0.1, 2
TOKENS = sum((1000.0 + step) * STEP_S * LOG_EVERY for step in range(LOG_EVERY, ITERS + 1, LOG_EVERY))
"""What the fake engine's rows add up to: each says 1000+step tokens/s over STEP_S a step."""


def _fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake engine at STEP_S a step, set once the database fixture has cleared MEGATRAIN_*
    (the runner takes this environment when it is spawned)."""
    monkeypatch.setenv("MEGATRAIN_ENGINE_MODULE", str(FAKE_ENGINE))
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", str(STEP_S))


def _submit(live: LiveApi, name: str) -> str:
    headers = {"Authorization": f"Bearer {live.key}"}
    spec = live.spec(name, train_iters=ITERS, log_interval=LOG_EVERY, checkpoint_interval=0)
    spec["resources"]["pool"] = live.settings.pool_name
    resp = httpx.post(f"{live.url}/v1/jobs", json=spec, headers=headers, timeout=30)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"])


def _watch(scrape: Callable[[], Samples], until: Callable[[Samples], bool], what: str) -> Samples:
    deadline = time.monotonic() + 90
    while True:
        samples = scrape()
        if until(samples):
            return samples
        worker = {k: v for k, v in samples.items() if k[0].startswith("megatrain_worker_")}
        assert time.monotonic() < deadline, f"never saw {what}: {worker}"
        time.sleep(0.1)


def _job_metrics_move(scrape: Callable[[], Samples], live: LiveApi) -> tuple[str, Samples, Samples]:
    """Submit a job and scrape while it runs and after it ends; (job id, during, after)."""
    job_id = _submit(live, "metered")
    during = _watch(
        scrape,
        lambda s: (
            (one(s, "megatrain_worker_heartbeat_timestamp_seconds", job_id=job_id) or 0) > 0
            and 0 < (one(s, "megatrain_worker_steps_total") or 0) < ITERS
        ),
        "a heartbeat and some steps of the running attempt",
    )
    after = _watch(
        scrape,
        lambda s: (
            one(s, "megatrain_worker_attempts_ended_total", outcome="completed") == 1
            and one(s, "megatrain_worker_step_seconds", job_id=job_id) is None
        ),
        "the attempt's end",
    )
    status = httpx.get(f"{live.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {live.key}"}).json()
    assert status["status"] == "succeeded", status
    return job_id, during, after


def _check_run(job_id: str, during: Samples, after: Samples) -> None:
    assert one(during, "megatrain_worker_running_attempts") == 1
    assert one(during, "megatrain_worker_step_seconds", job_id=job_id) == STEP_S
    assert (one(during, "megatrain_worker_tokens_per_second", job_id=job_id) or 0) > 1000
    assert one(during, "megatrain_worker_mfu_ratio", job_id=job_id) == 0.1
    assert one(during, "megatrain_worker_device_memory_bytes", job_id=job_id, kind="peak") == 0
    assert time.time() - one(during, "megatrain_worker_heartbeat_timestamp_seconds", job_id=job_id) < 60
    assert one(after, "megatrain_worker_running_attempts") == 0
    assert one(after, "megatrain_worker_steps_total") == ITERS
    assert one(after, "megatrain_worker_tokens_total") == pytest.approx(TOKENS)
    assert (one(after, "megatrain_worker_goodput_seconds_total", kind="productive") or 0) > ITERS * STEP_S
    assert not [k for k in after if dict(k[1]).get("job_id") == job_id]  # its series left with it


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_embedded_stacks_metrics_move_as_a_job_runs(
    live_stack: LiveApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_engine(monkeypatch)

    def scrape() -> Samples:
        return parse(httpx.get(f"{live_stack.url}/metrics", timeout=10).text)

    before = scrape()
    assert one(before, "megatrain_worker_steps_total") is None  # no runner has written yet
    assert (one(before, "megatrain_scheduler_tick_seconds_count") or 0) >= 1  # the scheduler's, here too
    job_id, during, after = _job_metrics_move(scrape, live_stack)
    _check_run(job_id, during, after)
    assert one(after, "megatrain_scheduler_decisions_total", decision="placed") == 1
    assert one(after, "megatrain_jobs", status="succeeded") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _registered(settings: Settings) -> bool:
    with session_scope(settings.resolved_database_url) as s:
        return s.scalar(select(Node.id).join(NodePool).where(NodePool.name == settings.pool_name)) is not None


@contextlib.contextmanager
def _celery_worker(settings: Settings, log_path: Path, port: int) -> Iterator[None]:
    """`python -m megatrain.worker.celery_app --metrics-port PORT`, once its node is registered
    (tests/fixtures/celery.py's worker, with the port)."""
    with open(log_path, "wb") as log:
        cmd = [sys.executable, "-m", "megatrain.worker.celery_app", "--metrics-port", str(port)]
        worker = subprocess.Popen(
            cmd, env=runner_env(settings), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 60
            while not _registered(settings):
                assert worker.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
            yield
        finally:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_celery_workers_metrics_port_moves_as_a_job_runs(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, db_url: str
) -> None:
    pool = f"metrics-{uuid.uuid4().hex[:8]}"
    for name, value in {"EXECUTOR": "celery", "REDIS_URL": redis_url, "POOL_NAME": pool}.items():
        monkeypatch.setenv(f"MEGATRAIN_{name}", value)
    _fake_engine(monkeypatch)
    port = _free_port()
    stack = contextlib.contextmanager(start_live_api)(tmp_path, monkeypatch, with_scheduler=True)
    try:
        with stack as live, _celery_worker(live.settings, tmp_path / "worker.log", port):

            def scrape() -> Samples:
                return parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)

            node = _watch(
                scrape,
                lambda s: any(k[0] == "megatrain_worker_node_heartbeat_timestamp_seconds" for k in s),
                "the node's heartbeat",
            )
            assert one(node, "megatrain_worker_steps_total") == 0
            job_id, during, after = _job_metrics_move(scrape, live)
    finally:
        import redis

        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"megatrain.{pool}*"):
            client.delete(key)
    _check_run(job_id, during, after)
    free = [v for k, v in after.items() if k[0] == "megatrain_worker_node_memory_free_bytes"]
    assert free and free[0] > 0
