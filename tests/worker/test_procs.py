"""worker.procs.terminate_tree: the whole tree ends, a stopped process included, by SIGTERM first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from worker_helpers import wait_for

from megatrain.worker.procs import pid_alive, terminate_tree

CHILD = """
import pathlib, signal, sys, time
def bye(*_):
    pathlib.Path(sys.argv[1]).write_text("terminated")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
pathlib.Path(sys.argv[1] + ".pid").write_text(str(__import__("os").getpid()))
while True:
    time.sleep(0.1)
"""

PARENT = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
while True:
    time.sleep(0.1)
"""


def test_a_stopped_rank_gets_its_sigterm(tmp_path: Path) -> None:
    """A rank frozen by SIGSTOP (as a hang fault leaves it) is continued after its SIGTERM, so its
    handler runs (its last words reach the log) instead of it dying of SIGKILL after the grace."""
    marker = tmp_path / "child"
    proc = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(marker)], start_new_session=True)
    pid_file = Path(f"{marker}.pid")
    child = int(wait_for(lambda: pid_file.is_file() and pid_file.read_text(), timeout=30))
    os.kill(child, signal.SIGSTOP)
    terminate_tree(proc, grace_s=30)
    assert marker.read_text() == "terminated"
    assert not pid_alive(child) and proc.poll() is not None
