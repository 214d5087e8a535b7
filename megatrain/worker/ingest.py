"""The engine's files as a runner reads them: the complete lines appended to a JSONL file since the
last batch (`JsonlTail`). What the control plane makes of them is megatrain.attempts.ingest."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatrain.attempts.ingest import (  # noqa: F401  (re-exported)
    append_logs,
    ingest_events,
    ingest_metrics,
    next_log_seq,
)

log = logging.getLogger(__name__)


@dataclass
class JsonlTail:
    """Reads the complete lines appended to a file since the last committed offset.

    `read()` does not move the offset; `commit()` does, once the rows are safely in the database,
    so a failed transaction re-reads the same lines next time.
    """

    path: Path
    offset: int = 0
    _pending: int = field(default=0, repr=False)

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []  # only a partial line so far; the engine flushes whole lines
        self._pending = self.offset + end + 1
        rows = []
        for raw in data[: end + 1].splitlines():
            try:
                row = json.loads(raw)
            except ValueError:
                log.warning("skipping malformed line in %s: %.200r", self.path, raw)
                continue
            if isinstance(row, dict):
                rows.append(row)
        return rows

    def commit(self) -> None:
        self.offset = max(self.offset, self._pending)
