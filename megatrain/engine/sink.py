"""Where a run's figures go: DIR/metrics.jsonl and DIR/events.jsonl, one flushed JSON object per line,
written by global rank 0 (the worker tails both files; nothing else is needed to follow a run)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class JsonlLog:
    """Append-only JSON lines, flushed per line; a no-op where `enabled` is False (ranks other than 0)."""

    def __init__(self, path: Path, enabled: bool):
        self._f = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115

    def write(self, row: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps({**row, "time": time.time()}) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class RunLog:
    """A run folder's metrics and events, and its console lines (printed by rank 0 only)."""

    def __init__(self, out_dir: Path, is_main: bool):
        self.is_main = is_main
        self.metrics = JsonlLog(out_dir / "metrics.jsonl", is_main)
        self.events = JsonlLog(out_dir / "events.jsonl", is_main)

    def say(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def close(self) -> None:
        self.metrics.close()
        self.events.close()
