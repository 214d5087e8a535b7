"""Trackers: the metrics rows of global rank 0, also sent to TensorBoard, W&B and MLflow (a spec's
`tracking:`, megatrain.spec_tracking), each a module here behind the `Tracker` interface.

The training thread only flattens a row and queues it: one background thread opens the trackers
(their imports and W&B's start-up take seconds), writes to them and closes them, so tracking costs
a step next to nothing. A tracker that fails (a missing package, an unreachable server, a full
disk) is dropped and reported as one warning event; the run goes on without it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatrain.spec_tracking import TrackingSpec

CLOSE_TIMEOUT_S = 120.0
"""How long the end of a run waits for the trackers to finish (W&B's upload, the last copy of
the event files); past it the run ends anyway, with a warning."""
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_./\- :]")
"""Outside what MLflow accepts in a metric's name; the same names go to every tracker."""


class Tracker(Protocol):
    name: str

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        """One row's numbers at `step`, written at wall-clock time `at` (seconds)."""

    def close(self, ok: bool) -> None:
        """Flush and end the run (`ok`: the run ended normally)."""


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is opened with."""

    job_name: str
    job_id: str | None
    """The control plane's job id (MEGATRAIN_JOB_ID), None for the engine on its own: a resumed
    attempt continues the same W&B and MLflow run."""
    out_dir: Path
    checkpoint_url: str
    config: dict[str, Any]
    """{"spec": the resolved spec, "layout": the layout it runs with}."""


def flatten(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's numbers by name, as every tracker logs them: nested objects joined with "/"
    (an eval row's {"eval": {task: {metric: {value, stderr, n}}}} as eval/<task>/<metric> and
    eval/<task>/<metric>_stderr); step, time, flags and empty (None) figures left out."""
    out: dict[str, float] = {}
    _flatten(row, "", out)
    return out


def _flatten(node: dict[str, Any], prefix: str, out: dict[str, float]) -> None:
    for key, value in node.items():
        if not prefix and key in ("step", "time"):
            continue
        name = prefix + _NOT_A_NAME.sub("_", str(key))
        if isinstance(value, dict):
            if "value" in value:  # a scored metric: its value, and its standard error beside it
                _number(value["value"], name, out)
                _number(value.get("stderr"), f"{name}_stderr", out)
            else:
                _flatten(value, f"{name}/", out)
        else:
            _number(value, name, out)


def _number(value: Any, name: str, out: dict[str, float]) -> None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        out[name] = float(value)


def sibling_url(checkpoint_url: str, name: str) -> str:
    """The folder next to the checkpoints' (`{storage}/jobs/{id}/tensorboard` beside
    `{storage}/jobs/{id}/checkpoints`): the job's own prefix, which its storage key may write."""
    return f"{checkpoint_url.rstrip('/').rsplit('/', 1)[0]}/{name}"


def warning_event(tracker: str, exc: BaseException, step: int | None) -> dict[str, Any]:
    """The event a failed tracker leaves (the worker records it on the job as a warning)."""
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, ImportError):
        reason = f"{exc.name or 'its package'} is not installed here (pip install 'megatrain[tracking]')"
    return {"event": "warning", "tracker": tracker, "step": step, "reason": reason[:1000]}


def _open(name: str, tracking: TrackingSpec, run: RunInfo) -> Tracker:
    # Each backend's module imports its library itself, so a missing one is that tracker's warning.
    if name == "tensorboard":
        from megatrain.engine.tracking.tensorboard_writer import TensorBoardTracker

        assert tracking.tensorboard is not None
        return TensorBoardTracker(tracking.tensorboard, run)
    if name == "wandb":
        from megatrain.engine.tracking.wandb_run import WandbTracker

        assert tracking.wandb is not None
        return WandbTracker(tracking.wandb, run)
    from megatrain.engine.tracking.mlflow_run import MLflowTracker

    assert tracking.mlflow is not None
    return MLflowTracker(tracking.mlflow, run)


class Trackers:
    """The fan-out: `log(row)` from the training thread, `close()` at the end (or at exit)."""

    def __init__(
        self,
        tracking: TrackingSpec,
        config: dict[str, Any],
        out_dir: Path,
        checkpoint_url: str,
        warn: Callable[[dict[str, Any]], None],
    ) -> None:
        spec = config.get("spec", {})
        self.run = RunInfo(
            job_name=str(spec.get("name", "megatrain")),
            job_id=os.environ.get("MEGATRAIN_JOB_ID") or None,
            out_dir=out_dir,
            checkpoint_url=checkpoint_url,
            config=config,
        )
        self.names = [n for n in ("tensorboard", "wandb", "mlflow") if getattr(tracking, n) is not None]
        self._tracking = tracking
        self._warn = warn
        self._queue: queue.SimpleQueue[tuple[int, dict[str, float], float] | None] = queue.SimpleQueue()
        self._warnings: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        """Filled by the tracker thread, written to events.jsonl by the training thread (one writer)."""
        self._last_step: int | None = None
        self._ok = True
        self._open: list[str] = []
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="megatrain-trackers", daemon=True)
        self._thread.start()
        # A run that fails never reaches RunLog.close(): still flush and end the tracker runs.
        atexit.register(self.close, ok=False)

    def log(self, row: dict[str, Any]) -> None:
        """Queue a metrics row's numbers (a row without an integer step is no point on any chart)."""
        self._report()
        step = row.get("step")
        values = flatten(row)
        if self._closed or not values or not isinstance(step, int) or isinstance(step, bool):
            return
        self._last_step = step
        self._queue.put((step, values, time.time()))

    def close(self, ok: bool = True, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End every tracker's run (once); `ok`: the run ended normally, not in a failure."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._ok = ok
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            for name in self._open:
                stuck = TimeoutError(f"it did not finish within {timeout_s:.0f} s of the run's end")
                self._warnings.put(warning_event(name, stuck, self._last_step))
        self._report()

    def _report(self) -> None:
        while True:
            try:
                event = self._warnings.get_nowait()
            except queue.Empty:
                return
            self._warn(event)

    def _work(self) -> None:
        trackers: list[Tracker] = []
        for name in self.names:
            try:
                trackers.append(_open(name, self._tracking, self.run))
                self._open.append(name)
            except Exception as exc:
                self._warnings.put(warning_event(name, exc, None))
        while (item := self._queue.get()) is not None:
            for tracker in list(trackers):
                try:
                    tracker.log(*item)
                except Exception as exc:
                    trackers.remove(tracker)
                    self._fail(tracker, exc, item[0])
        for tracker in trackers:
            try:
                tracker.close(self._ok)
            except Exception as exc:
                self._warnings.put(warning_event(tracker.name, exc, self._last_step))
            self._open.remove(tracker.name)

    def _fail(self, tracker: Tracker, exc: BaseException, step: int) -> None:
        """Drop a tracker that raised: one warning, and its run ended as well as it still can."""
        self._warnings.put(warning_event(tracker.name, exc, step))
        self._open.remove(tracker.name)
        with contextlib.suppress(Exception):  # already reported: the first error says why
            tracker.close(False)
