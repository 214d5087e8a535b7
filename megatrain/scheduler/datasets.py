"""Dataset work for the scheduling loop: hand pending datasets to the executor, recover lost ones.

The API registers a dataset as `pending` (its enqueue is that row); each tick the scheduler marks
the ones not yet handed out as submitted (a guarded UPDATE, so of several schedulers exactly one
submits each) and asks the executor to preprocess them. A dataset whose worker stopped
heartbeating (or whose worker process the executor knows is gone) goes back to pending, or fails after
MAX_DATASET_ATTEMPTS, its objects removed.
"""

from __future__ import annotations

import logging

from sqlalchemy import select, update

from megatrain.db.models import FAILED, PENDING, PROCESSING, Dataset, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.checkpoint_tasks import worker_lost_why
from megatrain.scheduler.intake import Intake
from megatrain.settings import Settings
from megatrain.storage import StorageError, open_store, split_url
from megatrain.worker.executors import Executor

log = logging.getLogger(__name__)

MAX_DATASET_ATTEMPTS = 3
BATCH = 32
"""Datasets one tick hands out at most (the rest wait for the next tick)."""


def dispatch_datasets(settings: Settings, executor: Executor) -> list[str]:
    """Submit pending datasets nobody has submitted yet; returns their ids."""
    url = settings.resolved_database_url
    with session_scope(url) as s:
        ids = s.scalars(
            select(Dataset.id)
            .where(Dataset.state == PENDING, Dataset.submitted_at.is_(None))
            .order_by(Dataset.created_at)
            .limit(BATCH)
        ).all()
    submitted = []
    for dataset_id in ids:
        with session_scope(url) as s:
            won = s.execute(
                update(Dataset)
                .where(Dataset.id == dataset_id, Dataset.state == PENDING, Dataset.submitted_at.is_(None))
                .values(submitted_at=utcnow(), state_reason="waiting for a worker to preprocess it")
                .execution_options(synchronize_session=False)
            )
        if won.rowcount != 1:
            continue  # another scheduler took it
        try:
            executor.submit_dataset(dataset_id)
            submitted.append(dataset_id)
        except Exception as exc:
            log.exception("executor could not start preprocessing dataset %s", dataset_id)
            with session_scope(url) as s:
                s.execute(
                    update(Dataset)
                    .where(Dataset.id == dataset_id, Dataset.state == PENDING)
                    .values(submitted_at=None, state_reason=f"executor could not start it: {exc}"[:2000])
                    .execution_options(synchronize_session=False)
                )
    return submitted


def reconcile_datasets(settings: Settings, executor: Executor, intake: Intake | None = None) -> list[str]:
    """Requeue (or fail) datasets whose preprocessing worker is lost (`executor` judges whether its
    process is gone; heartbeats judge the rest); returns their ids."""
    url = settings.resolved_database_url
    changed = []
    with session_scope(url) as s:
        rows = s.scalars(select(Dataset).where(Dataset.state == PROCESSING)).all()
        lost = [
            (d.id, d.attempt, d.prefix_url, why)
            for d in rows
            if (why := worker_lost_why(d, settings, executor, intake))
        ]
    for dataset_id, attempt, prefix_url, why in lost:
        if attempt < MAX_DATASET_ATTEMPTS:
            values = {
                "state": PENDING,
                "state_reason": f"worker lost ({why}); retrying",
                "submitted_at": None,
            }
        else:
            values = {"state": FAILED, "state_reason": f"worker lost ({why}) on attempt {attempt}; giving up"}
        with session_scope(url) as s:
            done = s.execute(
                update(Dataset)
                .where(Dataset.id == dataset_id, Dataset.state == PROCESSING, Dataset.attempt == attempt)
                .values(runner_pid=None, heartbeat_at=None, updated_at=utcnow(), **values)
                .execution_options(synchronize_session=False)
            )
        if done.rowcount != 1:
            continue
        log.warning("dataset %s: %s", dataset_id, values["state_reason"])
        changed.append(dataset_id)
        if values["state"] == FAILED:
            parent, name = split_url(split_url(prefix_url)[0])
            try:
                open_store(parent, settings.s3_endpoint_url).delete_prefix(name)
            except StorageError as exc:
                log.warning("dataset %s: could not delete its objects: %s", dataset_id, exc)
    return changed
