"""Sample work for the scheduling loop: hand pending samples to the executor (worker.samples),
recover lost ones; the mechanics are scheduler.checkpoint_tasks', shared with exports."""

from __future__ import annotations

from megatrain.db.models import CheckpointSample
from megatrain.scheduler.checkpoint_tasks import CheckpointTaskKind

MAX_SAMPLE_ATTEMPTS = 2
"""A sample is cheap to ask again: a worker lost twice fails it rather than holding the tenant's cap."""
SAMPLES = CheckpointTaskKind(CheckpointSample, "submit_sample", MAX_SAMPLE_ATTEMPTS, "sample")
dispatch_samples = SAMPLES.dispatch
reconcile_samples = SAMPLES.reconcile
