"""Where a run's figures go: DIR/metrics.jsonl and DIR/events.jsonl, one flushed JSON object per line,
written by global rank 0 (the worker tails both files; nothing else is needed to follow a run), and
the trackers a spec's `tracking:` names (megatrain.engine.tracking), which get every metrics row too."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatrain.engine.tracking.fanout import Trackers
    from megatrain.spec_tracking import TrackingSpec


class JsonlLog:
    """Append-only JSON lines, flushed per line; a no-op where `enabled` is False (ranks other than 0)."""

    def __init__(self, path: Path, enabled: bool):
        self._f = open(path, "a", buffering=1) if enabled else None  # noqa: SIM115
        self.also: Callable[[dict[str, Any]], None] | None = None
        """Called with every row written (the trackers' fan-out, on the metrics log)."""

    def write(self, row: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps({**row, "time": time.time()}) + "\n")
            self._f.flush()
            if self.also is not None:
                self.also(row)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class RunLog:
    """A run folder's metrics and events, and its console lines (printed by rank 0 only)."""

    def __init__(self, out_dir: Path, is_main: bool):
        self.is_main = is_main
        self.out_dir = out_dir
        self.metrics = JsonlLog(out_dir / "metrics.jsonl", is_main)
        self.events = JsonlLog(out_dir / "events.jsonl", is_main)
        self.trackers: Trackers | None = None

    def track(self, tracking: TrackingSpec | None, config: dict[str, Any], checkpoint_url: str) -> None:
        """Send every metrics row to the trackers `tracking` names too (rank 0 only), opened with
        `config` (the resolved spec and layout); TensorBoard's event files go next to `checkpoint_url`.
        A tracker that fails is a warning event, never the run's failure."""
        if not self.is_main or tracking is None or not tracking.enabled:
            return
        from megatrain.engine.tracking import configured, warning_event
        from megatrain.engine.tracking.fanout import Trackers  # the backends: in their own process

        try:
            self.trackers = Trackers(tracking, config, self.out_dir, checkpoint_url, self._warn)
        except Exception as exc:  # the trackers' process could not start: still never the run's failure
            for name in configured(tracking):
                self._warn(warning_event(name, exc, None))
            return
        self.metrics.also = self.trackers.log

    def _warn(self, event: dict[str, Any]) -> None:
        self.events.write(event)
        self.say(f"warning: {event['tracker']} tracking stopped: {event['reason']} (the run goes on)")

    def say(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def close(self) -> None:
        if self.trackers is not None:
            self.trackers.close(ok=True)  # before the events file closes: it may add warnings
        self.metrics.close()
        self.events.close()
