"""Preemption on the runner's side: ask the engine's ranks to checkpoint at their next step boundary
and exit (SIGUSR2; the engine's answer is EXIT_PREEMPTED), and stop them after a bounded grace.

The scheduler marks the job (`job.preempt_for`); the runner's check() sees it and the supervise loop
calls `ask_to_stop` each tick until the engine has exited or the grace is over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.settings import Settings
from megatrain.worker.procs import descendants

if TYPE_CHECKING:
    from megatrain.worker.shard import Attempt, _Runner

log = logging.getLogger(__name__)


def ask_to_stop(
    settings: Settings, proc: subprocess.Popen, att: Attempt, runner: _Runner, now: float
) -> str | None:
    """Ask the engine to checkpoint at its next step boundary and exit (SIGUSR2 to its ranks, once);
    'preempt' (stop it) once it has had preempt_grace_s, else None (let it finish the save)."""
    if runner.preempt_asked is None:
        runner.preempt_asked = now
        log.info("job %s: preempted; asking the engine to checkpoint and stop", att.job_id)
        for pid in rank_pids(proc, att):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR2)
        return None
    return "preempt" if now - runner.preempt_asked > settings.preempt_grace_s else None


def rank_pids(proc: subprocess.Popen, att: Attempt) -> list[int]:
    """The engine's ranks: the process itself, or torchrun's children (torchrun itself would die of
    SIGUSR2, and the ranks' own helper processes have no handler for it)."""
    if att.num_procs == 1 and att.rendezvous is None:
        return [proc.pid]
    children = []
    for pid in descendants(proc.pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]) == proc.pid:
                children.append(pid)
    return children
