"""Trackers: the metrics rows of global rank 0, also sent to TensorBoard, W&B and MLflow (a spec's
`tracking:`, megatrain.spec_tracking), each a module here behind the `Tracker` interface.

The trackers live in a process of their own (tracking.process), fed one JSON line per row through
a pipe by the engine's side (tracking.fanout): their libraries' Python work (MLflow's file store
takes milliseconds a row) then never holds the training process's GIL, and nothing they do (a
crash, a hang, a signal handler, an exit hook) can touch the run. A tracker that fails (a missing
package, an unreachable server, a full disk) is dropped and reported as one warning event; the run
goes on without it. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from megatrain.spec_tracking import TrackingSpec

NAMES = ("tensorboard", "wandb", "mlflow")
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


def configured(tracking: TrackingSpec) -> list[str]:
    """The trackers a spec's block names, in a fixed order."""
    return [name for name in NAMES if getattr(tracking, name) is not None]


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


def warning_event(tracker: str, exc: BaseException | str, step: int | None) -> dict[str, Any]:
    """The event a failed tracker leaves (the worker records it on the job as a warning)."""
    if isinstance(exc, ImportError):
        reason = f"{exc.name or 'its package'} is not installed here (pip install 'megatrain[tracking]')"
    elif isinstance(exc, BaseException):
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    else:
        reason = exc
    return {"event": "warning", "tracker": tracker, "step": step, "reason": reason[:1000]}


def open_tracker(name: str, tracking: TrackingSpec, run: RunInfo) -> Tracker:
    """One backend, opened; each module imports its library itself, so a missing one is that
    tracker's ImportError."""
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
