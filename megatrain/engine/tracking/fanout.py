"""The engine's side of the trackers: `Trackers.log(row)` from the training thread only queues the
row; a feeder thread flattens it and writes it as a JSON line to the trackers' process
(tracking.process), a reader thread collects that process's answers. Warnings reach events.jsonl
from the training thread only (RunLog's one writer), at the next row and at the end."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from megatrain.engine.tracking import configured, flatten, warning_event
from megatrain.engine.tracking.process import CLOSE_TIMEOUT_S
from megatrain.spec_tracking import TrackingSpec

COMMAND = [sys.executable, "-m", "megatrain.engine.tracking.process"]


class Trackers:
    """The fan-out: `log(row)` from the training thread, `close()` at the end (or at exit)."""

    def __init__(
        self,
        tracking: TrackingSpec,
        config: dict[str, Any],
        out_dir: Path,
        checkpoint_url: str,
        warn: Callable[[dict[str, Any]], None],
        command: list[str] | None = None,
    ) -> None:
        self.names = configured(tracking)
        self._warn = warn
        self._rows: queue.SimpleQueue[tuple[dict[str, Any], float] | bool] = queue.SimpleQueue()
        self._warnings: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        """Trackers closed or reported failed: no further warning names them."""
        self._last_step: int | None = None
        self._closed = False
        setup = {
            "tracking": tracking.model_dump(mode="json"),
            "job_name": str(config.get("spec", {}).get("name", "megatrain")),
            "job_id": os.environ.get("MEGATRAIN_JOB_ID") or None,
            "out_dir": str(out_dir),
            "checkpoint_url": checkpoint_url,
            "config": config,
        }
        # In the engine's process group, so a job killed as a group takes it along; it ignores the
        # SIGTERM of a cancel and ends when the engine does (its stdin closes).
        self._proc = subprocess.Popen(
            command or COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._feeder = threading.Thread(
            target=self._feed, args=(self._proc.stdin, setup), name="megatrain-trackers-feed", daemon=True
        )
        self._reader = threading.Thread(
            target=self._read, args=(self._proc.stdout,), name="megatrain-trackers-read", daemon=True
        )
        self._feeder.start()
        self._reader.start()
        # A run that fails never reaches RunLog.close(): still flush and end the tracker runs.
        atexit.register(self.close, ok=False)

    def log(self, row: dict[str, Any]) -> None:
        """Queue a metrics row (the feeder flattens it; a row without an integer step is skipped)."""
        self._report()
        if not self._closed:
            self._rows.put((row, time.time()))

    def close(self, ok: bool = True, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End every tracker's run (once); `ok`: the run ended normally, not in a failure."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._rows.put(ok)
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stuck = f"it did not finish within {timeout_s:.0f} s of the run's end"
            self._give_up(stuck)
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5.0)
        self._report()

    def _report(self) -> None:
        while True:
            try:
                event = self._warnings.get_nowait()
            except queue.Empty:
                return
            self._warn(event)

    def _give_up(self, reason: str) -> None:
        """A warning for each tracker neither closed nor already reported."""
        with self._lock:
            for name in self.names:
                if name not in self._done:
                    self._done.add(name)
                    self._warnings.put(warning_event(name, reason, self._last_step))

    def _feed(self, stdin: IO[str], setup: dict[str, Any]) -> None:
        try:
            stdin.write(json.dumps(setup) + "\n")
            while not isinstance(item := self._rows.get(), bool):
                row, at = item
                step, values = row.get("step"), flatten(row)
                if isinstance(step, int) and not isinstance(step, bool) and values:
                    self._last_step = step
                    stdin.write(json.dumps({"step": step, "values": values, "at": at}) + "\n")
            stdin.write(json.dumps({"close": item}) + "\n")
        except OSError:
            pass  # the process is gone: the reader says so
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def _read(self, stdout: IO[str]) -> None:
        for line in stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                if "closed" in message:
                    self._done.add(message["closed"])
                elif message.get("event") == "warning" and message.get("tracker") not in self._done:
                    self._done.add(message["tracker"])
                    self._warnings.put(message)
        code = self._proc.wait()
        if code:
            self._give_up(f"the trackers' process exited with code {code}")
