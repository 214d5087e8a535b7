"""Ctrl-C while following a job (a real SIGINT to a `megatrain` process) stops the following, not
the job: the CLI says the job keeps running and how to follow or cancel it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures.live import LiveApi

from megatrain.client import Client

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _interrupt(args: list[str], wait_for: str, tmp_path: Path) -> tuple[int, str]:
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatrain.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
        )
        try:
            deadline = time.monotonic() + 30
            while wait_for not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            time.sleep(2.0)  # past its imports and first request: inside the follow loop
            proc.send_signal(signal.SIGINT)
            code = proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return code, log.read_text()


def test_ctrl_c_while_following_says_the_job_keeps_running(live_api: LiveApi, tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(live_api.spec("follow-me")))
    # No scheduler: the job stays queued, so following never ends by itself.
    code, out = _interrupt(["submit", str(spec), "--follow"], "submitted job", tmp_path)
    job_id = out.split("submitted job ", 1)[1].split()[0]
    assert code == 130 and f"job {job_id} keeps running" in out, out
    assert f"megatrain follow {job_id}" in out and f"megatrain cancel {job_id}" in out, out
    assert "Traceback" not in out, out
    with Client() as c:
        assert c.get_job(job_id).status == "queued"  # interrupting did not cancel it

    for args, ready in (
        (["follow", job_id], "queued"),
        (["logs", job_id, "--follow"], "following the log of job"),
        (["metrics", job_id, "--follow"], "STEP"),
    ):
        code, out = _interrupt(args, ready, tmp_path)
        assert code == 130 and f"job {job_id} keeps running" in out and "Traceback" not in out, (args, out)
