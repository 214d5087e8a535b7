"""Hung-attempt detection for the shard runner.

The rule: an attempt is hung when its step counter has not moved for `hang_factor` x the median
step time the attempt measured (never less than `hang_min_s`). Before the attempt's first step
(setup, resume) and while any rank says it is saving a checkpoint or evaluating (its progress
file's phase), the allowance is longer: those pauses are legitimately long. Before the first step
and for a save it is what the control plane predicted for this job on its pool
(plan.attempt_times: the state a node reads and writes over the pool's storage bandwidth), a save's
never less than `hang_factor` x the longest save this attempt measured; otherwise, and for an
evaluation, `hang_grace_s`. A rank that hangs in the step before a checkpoint is not one of them.
(Progress files without a phase, from an older engine, fall back to a guess: the step after the
newest known one is due a checkpoint that is not yet reported saved.)

Each engine rank writes OUT/progress.rank{R} (JSON: its last finished step and its pid) so a hang
names the rank(s) that stopped first; the runner asks those processes for their stacks (SIGUSR1,
which the engine routes to `faulthandler`; `py-spy dump` too when it is installed) before it ends
the attempt.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatrain.progress_files import PAUSE_PHASES, RankProgress, read_progress

if TYPE_CHECKING:
    from megatrain.attempts.model import Attempt
    from megatrain.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HangRule:
    factor: float = 10.0
    min_s: float = 120.0
    grace_s: float = 900.0
    first_step_s: float | None = None
    """The allowance before the first step, predicted for the attempt (None: grace_s)."""
    save_s: float | None = None
    """The allowance for a checkpoint's save, predicted for the attempt (None: grace_s)."""


@dataclass(frozen=True)
class Hang:
    """What the runner reports: who stopped, where, for how long."""

    ranks: tuple[int, ...]
    host: str
    step: int
    stalled_s: float
    median_s: float | None
    pids: tuple[int, ...]

    def reason(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else "ranks " + ",".join(map(str, self.ranks))
        median = f"median step {self.median_s:.3g} s" if self.median_s else "before its first step"
        return (
            f"hung: {who} on {self.host} stopped at step {self.step} for {self.stalled_s:.0f} s "
            f"({median}); stacks in the log"
        )

    def data(self) -> dict[str, Any]:
        return {
            "cause": "hung",
            "ranks": list(self.ranks),
            "host": self.host,
            "step": self.step,
            "stalled_s": round(self.stalled_s, 3),
            "median_step_s": self.median_s,
        }


class HangWatch:
    """Fed every metrics row and event the runner ingests, and the ranks' progress files at each
    check; `check(now, …)` says whether the attempt is hung.

    Metrics rows come every log_interval steps, so the allowance scales with the usual gap between
    logged steps; the progress files (each rank's step, about once a second) see movement between
    them. A checkpoint is due when the next step, or one since the last logged, is a multiple of
    checkpoint_interval not reported saved (a resumed attempt's start counts as saved). Past the
    last step (train_iters) the engine is finishing: its final save and exit (the last async writes,
    torchrun's exit barrier with the other nodes) get a save's allowance."""

    def __init__(self, rule: HangRule, started: float, checkpoint_interval: int = 0, train_iters: int = 0):
        self.rule = rule
        self.checkpoint_interval = checkpoint_interval
        self.train_iters = train_iters
        self.last_step: int | None = None
        self.progress_low: int | None = None
        self.last_move = started
        self.step_times: list[float] = []
        self.gaps: list[int] = []
        self.saved_step = 0
        self.phases_known = False
        """Whether the ranks' progress files say what they are doing."""
        self.pausing = False
        """A rank is saving a checkpoint or evaluating."""
        self.evaluating = False
        self.longest_save_s = 0.0
        """The longest write of a checkpoint this attempt reported."""

    def observe_metrics(self, rows: list[dict[str, Any]], now: float) -> None:
        for row in rows:
            step = row.get("step")
            if not isinstance(step, int) or (self.last_step is not None and step <= self.last_step):
                continue
            if self.last_step is not None:
                self.gaps.append(step - self.last_step)
            self.last_step, self.last_move = step, now
            t = row.get("iter_time_s")
            if isinstance(t, (int, float)) and t > 0:
                self.step_times.append(float(t))

    def observe_events(self, rows: list[dict[str, Any]], now: float) -> None:
        for row in rows:
            event, step = row.get("event"), row.get("step")
            if event == "started" and isinstance(row.get("resumed_from"), int):
                self.saved_step = max(self.saved_step, row["resumed_from"])
            elif event == "checkpoint_saved" and isinstance(step, int):
                self.saved_step = max(self.saved_step, step)
                if isinstance(row.get("write_s"), (int, float)):
                    self.longest_save_s = max(self.longest_save_s, float(row["write_s"]))
                self.last_move = max(self.last_move, now)  # a save's end restarts the clock

    def observe_progress(self, progress: list[RankProgress], now: float) -> None:
        """The slowest rank's step moving is movement (a hung rank holds it still)."""
        if not progress:
            return
        self.phases_known = all(p.phase is not None for p in progress)
        self.pausing = any(p.phase in PAUSE_PHASES for p in progress)
        self.evaluating = any(p.phase == "evaluation" for p in progress)
        low = min(p.step for p in progress)
        if low > self.known_step:
            self.last_move = now
        self.progress_low = max(low, self.progress_low or 0)

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def known_step(self) -> int:
        return max(self.last_step or 0, self.progress_low or 0)

    def allowance_s(self) -> float:
        """How long the step counter may stand still now."""
        median = self.median_s
        if self.last_step is None:
            return self.rule.first_step_s or self.rule.grace_s
        if median is None or self.evaluating:
            return self.rule.grace_s
        if self.pausing or (self.train_iters and self.known_step >= self.train_iters):
            return self.save_allowance_s()
        gap = statistics.median_low(self.gaps) if self.gaps else 1
        every, known = self.checkpoint_interval, self.known_step
        if every and not self.phases_known:
            # The step after the newest known one may be a checkpoint's: its compute and its save
            # look alike from here (a rank's file holds still through both).
            boundary = (known + 1) // every * every
            if boundary > max(self.saved_step, known - gap):
                return self.save_allowance_s()  # a save is due about now and not reported done
        return max(self.rule.min_s, self.rule.factor * median * gap)

    def save_allowance_s(self) -> float:
        """A checkpoint's save: the predicted allowance, or longer where this attempt's saves were."""
        if self.rule.save_s is None:
            return self.rule.grace_s
        return max(self.rule.save_s, self.rule.min_s, self.rule.factor * self.longest_save_s)

    def check(
        self, now: float, out_dir: Path, host: str, peers: Sequence[dict[str, Any]] = ()
    ) -> Hang | None:
        """The hang, if the attempt is hung now. `peers`: the other shards of a gang (node rank 0's
        runner; attempts.reports.peers_progress), so the ranks named are the gang's lowest, on
        whichever node they run."""
        progress = read_progress(out_dir)
        self.observe_progress(progress, now)
        stalled = now - self.last_move
        if stalled <= self.allowance_s():
            return None
        if progress:
            low = min(p.step for p in progress)
            stopped = [p for p in progress if p.step == low]
            if len(stopped) == len(progress):
                # All stand at the same step: the metrics may know it finished one more (a rank's
                # file counts only the steps before the one it started last).
                low = max(low, self.last_step or 0)
        else:
            low, stopped = self.last_step or 0, [RankProgress(0, self.last_step or 0, None)]
        pids = tuple(p.pid for p in stopped if isinstance(p.pid, int))
        hang = Hang(tuple(p.rank for p in stopped), host, low, stalled, self.median_s, pids)
        return _lowest_of_gang(hang, peers)


def watch_attempt(settings: Settings, att: Attempt, started: float) -> HangWatch:
    """The attempt's watch: the settings' rule, with the pauses the control plane predicted for it."""
    s = settings
    rule = HangRule(s.hang_factor, s.hang_min_s, s.hang_grace_s, att.first_step_bound_s, att.save_bound_s)
    return HangWatch(rule, started, att.checkpoint_interval, att.train_iters)


def _lowest_of_gang(own: Hang, peers: Sequence[dict[str, Any]]) -> Hang:
    """The gang's ranks that stopped first: another node's where they stand at a lower step than this
    node's (their stacks are in that node's log lines), both where they stand at the same one."""
    steps = [p["step"] for p in peers if isinstance(p.get("step"), int)]
    if not steps or min(steps) > own.step:
        return own
    low = min(steps)
    named = [p for p in peers if p.get("step") == low]
    ranks = tuple(r for p in named for r in p.get("ranks") or ())
    hosts = [str(p.get("node") or "?") for p in named]
    if low == own.step:
        ranks, hosts = own.ranks + ranks, [own.host, *hosts]
    return replace(
        own, ranks=ranks, host=", ".join(hosts), step=low, pids=own.pids if low == own.step else ()
    )


def shard_progress(out_dir: Path, node: str) -> dict[str, Any] | None:
    """What a gang shard tells the control plane of its ranks: its node, their lowest step and the
    ranks standing at it (None before any rank wrote its progress file)."""
    progress = read_progress(out_dir)
    if not progress:
        return None
    low = min(p.step for p in progress)
    return {"node": node, "step": low, "ranks": sorted(p.rank for p in progress if p.step == low)}


def dump_stacks(pids: tuple[int, ...], timeout_s: float = 10.0) -> list[str]:
    """Ask each process for its Python stacks: SIGUSR1 (the engine's faulthandler writes them to its
    stderr, i.e. the job's log) and, if installed, `py-spy dump`, whose output is returned. The
    py-spy dumps run at once and are bounded together, so the runner's heartbeat never lapses."""
    lines: list[str] = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError as exc:
            lines.append(f"could not signal pid {pid} for its stacks: {exc}")
    spy = shutil.which("py-spy")
    if spy is None or not pids:
        return lines
    procs = {}
    for pid in pids:
        try:
            procs[pid] = subprocess.Popen(
                [spy, "dump", "--pid", str(pid)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        except OSError as exc:
            lines.append(f"py-spy dump of pid {pid} failed: {exc}")
    deadline = time.monotonic() + timeout_s
    for pid, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            lines += [f"py-spy dump of pid {pid}:", *out.splitlines()]
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            lines.append(f"py-spy dump of pid {pid} took over {timeout_s:g} s; skipped")
    return lines
