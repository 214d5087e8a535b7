"""Sample work for the scheduling loop: hand pending samples to the executor (worker.samples),
recover lost ones; the mechanics are scheduler.checkpoint_tasks', shared with exports."""

from __future__ import annotations

from megatrain.db.models import CheckpointSample
from megatrain.scheduler.checkpoint_tasks import dispatch_pending, reconcile_lost
from megatrain.settings import Settings
from megatrain.worker.executors import Executor

MAX_SAMPLE_ATTEMPTS = 2
"""A sample is cheap to ask again: a worker lost twice fails it rather than holding the tenant's cap."""


def dispatch_samples(settings: Settings, executor: Executor) -> list[str]:
    """Submit pending samples nobody has submitted yet; returns their ids."""
    return dispatch_pending(settings, CheckpointSample, executor.submit_sample, "sample")


def reconcile_samples(settings: Settings) -> list[str]:
    """Requeue (or fail) running samples whose worker is lost, and hand out again the ones nobody
    claimed; returns their ids."""
    return reconcile_lost(settings, CheckpointSample, MAX_SAMPLE_ATTEMPTS, "sample")
