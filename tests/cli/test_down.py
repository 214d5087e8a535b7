"""`megatrain down` stops the stack `megatrain up` started (found by its pid file in MEGATRAIN_HOME),
and `megatrain up` says so when this home's stack, or another megatrain, already runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from megatrain.cli import app
from megatrain.client import Client, MegatrainError
from megatrain.settings import reset_settings_cache


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_down_stops_what_up_started(
    megatrain_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = run("down")
    assert code == 0 and "no megatrain stack runs" in out, out
    # A pid file left by a killed stack names a dead process: nothing runs, and the file goes.
    megatrain_home.mkdir(parents=True, exist_ok=True)
    (megatrain_home / "megatrain-up.pid").write_text(json.dumps({"pid": 2**22 + 7, "url": "x"}))
    code, out = run("down")
    assert (
        code == 0 and "no megatrain stack runs" in out and not (megatrain_home / "megatrain-up.pid").exists()
    )

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatrain.cli", "up", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, "MEGATRAIN_API_URL": url},
        stdout=open(log, "ab"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
        start_new_session=True,  # as the demo starts it
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with Client(url, api_key="") as probe:
                    probe.health()
                break
            except MegatrainError:
                time.sleep(0.2)
        assert json.loads((megatrain_home / "megatrain-up.pid").read_text())["pid"] == proc.pid

        code, out = run("up", "--host", "127.0.0.1", "--port", str(port))
        assert code == 0 and "already runs" in out and str(proc.pid) in out and "megatrain down" in out, out
        # Another home on the same port: no pid file of its own, but a megatrain answers there.
        monkeypatch.setenv("MEGATRAIN_HOME", str(tmp_path / "other"))
        reset_settings_cache()
        code, out = run("up", "--host", "127.0.0.1", "--port", str(port))
        assert code == 1 and "already answers" in out and "Traceback" not in log.read_text(), out
        monkeypatch.setenv("MEGATRAIN_HOME", str(megatrain_home))
        reset_settings_cache()

        code, out = run("down")
        assert code == 0 and f"stopped the megatrain stack at {url} (pid {proc.pid})" in out, out
        assert proc.wait(10) == 0, log.read_text()[-3000:]  # a clean shutdown, not a kill
        assert not (megatrain_home / "megatrain-up.pid").exists()
        code, out = run("down")
        assert code == 0 and "no megatrain stack runs" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
