"""Each engine rank's progress file, OUT/progress.rank{R}: its last finished step and its pid.

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


@dataclass(frozen=True)
class RankProgress:
    rank: int
    step: int
    pid: int | None


def read_progress(out_dir: Path) -> list[RankProgress]:
    """Every rank's last progress file; unreadable (half-written) ones are skipped."""
    found = []
    for path in sorted(out_dir.glob(PROGRESS_GLOB)):
        try:
            rank = int(path.name.removeprefix("progress.rank"))
            row = json.loads(path.read_text())
            found.append(RankProgress(rank, int(row.get("step") or 0), row.get("pid")))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return found


def write_progress(out_dir: Path, rank: int, step: int) -> None:
    """Atomically record this rank's last finished step (the engine calls this)."""
    path = out_dir / f"progress.rank{rank}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "pid": os.getpid()}))
    os.replace(tmp, path)
