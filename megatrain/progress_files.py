"""Each engine rank's progress file, OUT/progress.rank{R}: its last finished step, its pid and what
it is doing (megatrain.failures.PHASES: a checkpoint or an evaluation pauses the step counter
legitimately; the hang watch allows for them by name rather than guessing from the step).

The engine writes it (a daemon thread, megatrain.engine.train); the shard runner reads it to name
the rank(s) that stopped when an attempt hangs (megatrain.worker.hang). Shared by both sides, so it
depends on neither.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PROGRESS_GLOB = "progress.rank*"
LOOP_PHASES = ("training", "evaluation", "checkpoint")
"""The phases of the training loop, in which a rank's step counts."""
PAUSE_PHASES = frozenset({"evaluation", "checkpoint"})
"""Loop phases that hold the step counter still for longer than a step (the hang grace applies)."""


@dataclass(frozen=True)
class RankProgress:
    rank: int
    step: int
    pid: int | None
    phase: str | None = None
    """None from an engine that does not say (the watch then guesses when a save is due)."""


def read_progress(out_dir: Path) -> list[RankProgress]:
    """Every rank's last progress file; unreadable (half-written) ones are skipped."""
    found = []
    for path in sorted(out_dir.glob(PROGRESS_GLOB)):
        try:
            rank = int(path.name.removeprefix("progress.rank"))
            row = json.loads(path.read_text())
            phase = row.get("phase")
            phase = phase if isinstance(phase, str) else None
            found.append(RankProgress(rank, int(row.get("step") or 0), row.get("pid"), phase))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return found


def write_progress(out_dir: Path, rank: int, step: int, phase: str | None = None) -> None:
    """Atomically record this rank's last finished step and phase (the engine calls this)."""
    path = out_dir / f"progress.rank{rank}"
    tmp = path.with_name(path.name + ".tmp")
    row: dict[str, object] = {"step": step, "pid": os.getpid()}
    if phase is not None:
        row["phase"] = phase
    tmp.write_text(json.dumps(row))
    os.replace(tmp, path)
