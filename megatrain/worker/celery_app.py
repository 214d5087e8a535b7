"""Celery on Redis: a thin, idempotent `megatrain.run_shard(job_id)` task and the worker that runs it.

The task only takes an id and opens its own session; if the job is no longer `scheduled` (another
delivery of the same message already ran it, or the reconciler requeued it) it does nothing. Tasks
are acknowledged late, one at a time, so a worker that dies mid-job leaves the message to be
redelivered and the reconciler requeues the job itself.

CLI: `python -m megatrain.worker.celery_app [--concurrency N] [--queue Q]`.
"""

from __future__ import annotations

import argparse
import logging

from celery import Celery
from sqlalchemy import select

from megatrain.db.models import SCHEDULED, Job
from megatrain.db.session import session_scope
from megatrain.scheduler.pools import ensure_local_pool
from megatrain.settings import Settings, get_settings

log = logging.getLogger(__name__)

TASK_NAME = "megatrain.run_shard"


def queue_name(pool: str) -> str:
    return f"megatrain.{pool}"


def create_celery_app(settings: Settings) -> Celery:
    """A Celery app on settings.redis_url (broker and result backend) with the run_shard task."""
    app = Celery("megatrain", broker=settings.redis_url, backend=settings.redis_url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=queue_name(settings.pool_name),
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=7 * 86400,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name=TASK_NAME, acks_late=True)
    def run_shard_task(job_id: str) -> int | None:
        with session_scope(settings.resolved_database_url) as s:
            status = s.scalar(select(Job.status).where(Job.id == job_id))
        if status != SCHEDULED:
            log.info("job %s is %s, not scheduled: skipping this delivery", job_id, status)
            return None
        from megatrain.worker.shard import run_shard

        return run_shard(job_id, settings)

    return app


def run_worker(settings: Settings, concurrency: int = 1, queues: list[str] | None = None) -> None:
    """Register this machine in its pool and consume the pool's queue until stopped (blocks)."""
    with session_scope(settings.resolved_database_url) as s:
        ensure_local_pool(s, settings)
    app = create_celery_app(settings)
    queues = queues or [queue_name(settings.pool_name)]
    app.worker_main(
        [
            "worker",
            f"--queues={','.join(queues)}",
            f"--concurrency={concurrency}",
            # solo runs the task in the main thread: the runner's children die with it (PDEATHSIG).
            f"--pool={'solo' if concurrency == 1 else 'prefork'}",
            "--loglevel=INFO",
            f"--hostname=megatrain-{settings.pool_name}@%h",
            "--without-gossip",
            "--without-mingle",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatrain.worker.celery_app", description=__doc__)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--queue", action="append", default=None, help="queue to consume (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_worker(get_settings(), concurrency=args.concurrency, queues=args.queue)


if __name__ == "__main__":
    main()
