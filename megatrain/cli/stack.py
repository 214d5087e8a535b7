"""The pid file of the stack `megatrain up` runs (the demo starts one too), and `megatrain down`,
which stops it. The file lives in MEGATRAIN_HOME, so each home has at most one stack."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from megatrain.cli.common import _out, _server_errors, app
from megatrain.settings import Settings, get_settings

PID_FILE = "megatrain-up.pid"


def pid_path(settings: Settings) -> Path:
    return settings.home / PID_FILE


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, but not ours to judge
    cmdline = Path(f"/proc/{pid}/cmdline")
    if cmdline.exists():
        # A pid the OS gave to another program after ours died is no stack of ours.
        try:
            return b"megatrain" in cmdline.read_bytes()
        except OSError:
            return False
    return True


def running_stack(settings: Settings) -> dict[str, Any] | None:
    """{"pid", "url"} of the stack this home's pid file names, if that process still runs."""
    try:
        info = json.loads(pid_path(settings).read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if _alive(pid) else None


def write_pid_file(settings: Settings, url: str) -> Path:
    path = pid_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": os.getpid(), "url": url}) + "\n")
    return path


def remove_pid_file(settings: Settings) -> None:
    """Remove the pid file if it is this process's (a second `up` must not remove the first's)."""
    path = pid_path(settings)
    try:
        if int(json.loads(path.read_text())["pid"]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass


@app.command()
@_server_errors
def down() -> None:
    """Stop the stack that `megatrain up` (or `megatrain demo`) started from this MEGATRAIN_HOME.

    Running jobs' shard runners are detached from it and keep training; the next `up` serves them.
    """
    settings = get_settings()
    info = running_stack(settings)
    out = _out()
    if info is None:
        pid_path(settings).unlink(missing_ok=True)  # a stale file from a killed stack
        out.print(f"no megatrain stack runs from {settings.home}")
        return
    pid = int(info["pid"])
    # The demo starts `up` in its own session: stop its whole group. An `up` sharing a group with
    # its shell (or a test runner) gets the signal alone.
    own_group = os.getpgid(pid) == pid
    send = (lambda sig: os.killpg(pid, sig)) if own_group else (lambda sig: os.kill(pid, sig))
    # SIGINT, as Ctrl-C: uvicorn shuts down cleanly, then re-raises the signal, and only SIGINT's
    # re-raise (a KeyboardInterrupt) lets `up` remove its pid file and exit 0; SIGTERM's kills it.
    send(signal.SIGINT)
    deadline = time.monotonic() + 20.0
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    forced = _alive(pid)
    if forced:
        send(signal.SIGKILL)
    pid_path(settings).unlink(missing_ok=True)
    how = "killed (it did not stop within 20 s)" if forced else "stopped"
    out.print(f"{how} the megatrain stack at {info.get('url', '?')} (pid {pid})")
