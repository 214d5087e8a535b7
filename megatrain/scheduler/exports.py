"""Export work for the scheduling loop: hand pending exports to the executor (worker.exports),
recover lost ones; the mechanics are scheduler.checkpoint_tasks', shared with samples."""

from __future__ import annotations

from megatrain.db.models import CheckpointExport
from megatrain.scheduler.checkpoint_tasks import BATCH, UNCLAIMED_RESUBMIT_S, dispatch_pending, reconcile_lost
from megatrain.settings import Settings
from megatrain.worker.executors import Executor

__all__ = ["BATCH", "MAX_EXPORT_ATTEMPTS", "UNCLAIMED_RESUBMIT_S", "dispatch_exports", "reconcile_exports"]

MAX_EXPORT_ATTEMPTS = 3


def dispatch_exports(settings: Settings, executor: Executor) -> list[str]:
    """Submit pending exports nobody has submitted yet; returns their ids."""
    return dispatch_pending(settings, CheckpointExport, executor.submit_export, "export")


def reconcile_exports(settings: Settings) -> list[str]:
    """Requeue (or fail) running exports whose worker is lost, and hand out again the ones nobody
    claimed; returns their ids."""
    return reconcile_lost(settings, CheckpointExport, MAX_EXPORT_ATTEMPTS, "export")
