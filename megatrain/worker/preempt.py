"""Stopping on request on the runner's side: ask the engine's ranks to checkpoint at their next step
boundary and exit (SIGUSR2; the engine's answer is EXIT_PREEMPTED), and stop them after a bounded grace.

Two things ask: the scheduler preempting the job for a higher-priority one (`job.preempt_for`, seen by
the runner's check()), and a cluster scheduler warning that the allocation's time limit is near
(`TimeLimit`: Slurm's --signal, turned into a flag file by the batch script). Either way the supervise
loop calls `ask_to_stop` each tick until the engine has exited or the grace is over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.attempts.ending import end_at_time_limit, requeue_preempted  # noqa: F401  (re-exported)
from megatrain.settings import Settings
from megatrain.worker.procs import descendants

if TYPE_CHECKING:
    from megatrain.worker.attempt import Attempt
    from megatrain.worker.shard import _Runner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimeLimit:
    """The allocation an attempt runs in ends at a time limit, and `flag` appears some time before
    it (Slurm's `--signal=B:USR1@lead`, the batch script's trap touching the file), or `stop_at`
    (Unix time) passes, whichever comes first: then the attempt checkpoints and stops. `limit_s`:
    the allocation's limit, shorter than the job's max_runtime_s when the job runs as a chain."""

    flag: Path
    limit_s: float
    stop_at: float | None = None

    def reached(self) -> bool:
        return self.flag.exists() or (self.stop_at is not None and time.time() >= self.stop_at)


def ask_to_stop(
    settings: Settings, proc: subprocess.Popen, att: Attempt, runner: _Runner, now: float, why: str
) -> bool:
    """Ask the engine to checkpoint at its next step boundary and exit (SIGUSR2 to its ranks, once,
    when they have started: before, the signal would kill a rank still importing, with nothing
    saved); True (stop it now) once it has had preempt_grace_s, else False (let it save)."""
    if runner.preempt_asked is None:
        runner.preempt_asked = now
        log.info("job %s: %s; asking the engine to checkpoint and stop", att.job_id, why)
    if not runner.stop_sent and (runner.engine_started or _ranks_reporting(att)):
        runner.stop_sent = True
        for pid in rank_pids(proc, att):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGUSR2)
    return now - runner.preempt_asked > settings.preempt_grace_s


def _ranks_reporting(att: Attempt) -> bool:
    """Whether every rank on this node writes its progress file (it starts after its handlers are in
    place). Node rank 0 of a gang may not see the 'started' event: global rank 0 writes it, and it
    can land on another node."""
    return len(list(att.out_dir.glob("progress.rank*[0-9]"))) >= att.num_procs


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
