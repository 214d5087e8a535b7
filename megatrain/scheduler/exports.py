"""Export work for the scheduling loop: hand pending exports to the executor (worker.exports),
recover lost ones; the mechanics are scheduler.checkpoint_tasks', shared with samples."""

from __future__ import annotations

from megatrain.db.models import CheckpointExport
from megatrain.scheduler.checkpoint_tasks import BATCH, UNCLAIMED_RESUBMIT_S, CheckpointTaskKind

__all__ = [
    "BATCH",
    "EXPORTS",
    "MAX_EXPORT_ATTEMPTS",
    "UNCLAIMED_RESUBMIT_S",
    "dispatch_exports",
    "reconcile_exports",
]

MAX_EXPORT_ATTEMPTS = 3
EXPORTS = CheckpointTaskKind(CheckpointExport, "submit_export", MAX_EXPORT_ATTEMPTS, "export")
dispatch_exports = EXPORTS.dispatch
reconcile_exports = EXPORTS.reconcile
