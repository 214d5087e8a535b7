"""`megatrain up` stopped (even killed) and started again while a job runs: no job, no metric lost.

The local executor starts each job's shard runner detached from `megatrain up`, and the runner
copies the engine's metrics into the database itself, idempotently. So the job keeps training
while the API is down, and after the restart the API serves every step exactly once.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain.client import Client
from megatrain.client.client import read_credentials
from megatrain.settings import get_settings

FAKE_ENGINE = Path(__file__).resolve().parents[1] / "worker" / "fake_engine.py"
TRAIN_ITERS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_up(port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "megatrain.cli", "up", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=open(log, "ab"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
    )


def _wait(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = pred()
        except Exception:  # noqa: BLE001 - the API may be coming up or going down
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_restart_loses_no_job_and_no_metric(
    db_url: str, megatrain_home: Path, tmp_path: Path, stop_signal: signal.Signals
) -> None:
    port = _free_port()
    env = {
        **os.environ,
        "MEGATRAIN_API_URL": f"http://127.0.0.1:{port}",
        "MEGATRAIN_ENGINE_MODULE": str(FAKE_ENGINE),
        "FAKE_ENGINE_STEP_S": "0.1",
        "MEGATRAIN_SCHEDULER_INTERVAL_S": "0.2",
        "MEGATRAIN_HEARTBEAT_INTERVAL_S": "0.5",
        "MEGATRAIN_CPU_SLOTS": "2",
    }
    log = tmp_path / "up.log"
    corpus = tmp_path / "data" / "corpus.jsonl"  # submission checks that it exists
    corpus.parent.mkdir()
    corpus.write_text('{"text": "never read: the fake engine makes up its losses"}\n')
    spec = {
        "name": "survivor",
        "data": {"train": [{"path": corpus.as_uri()}]},
        "training": {"train_iters": TRAIN_ITERS, "log_interval": 1, "checkpoint_interval": 10,
                     "global_batch_size": 4, "micro_batch_size": 1, "warmup_iters": 0},
        "resources": {"devices": 1},
    }  # fmt: skip
    env["MEGATRAIN_ALLOWED_DATA_ROOTS"] = corpus.parent.as_uri()

    first = _start_up(port, env, log)
    second = None
    try:
        creds = get_settings().credentials_path
        key = _wait(lambda: read_credentials(creds), 60, "the key")
        client = Client(f"http://127.0.0.1:{port}", key)
        _wait(lambda: client.health(), 60, "the first API")
        job = client.submit(spec)
        _wait(lambda: len(client.metrics(job.id)) >= 5, 60, "the first metrics")

        first.send_signal(stop_signal)
        first.wait(30)
        time.sleep(1.5)  # the API is down; the detached runner goes on training and recording

        second = _start_up(port, env, log)
        done = _wait(lambda: (j := client.get_job(job.id)).done and j, 90, "the job to finish")
        assert done.status == "succeeded", (done, log.read_text()[-3000:])
        steps = [row["step"] for row in client.metrics(job.id) if "loss" in row]
        assert steps == list(range(1, TRAIN_ITERS + 1)), steps
        events = [e["kind"] for e in client.events(job.id)]
        # It ran once: no retry, no second start after the restart.
        assert events.count("running") == 1 and "retried" not in events, events
        assert [c.step for c in client.checkpoints(job.id)] == [10, 20, 30, 40]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
