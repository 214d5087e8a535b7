"""Celery on Redis: a thin, idempotent `megatrain.run_shard(job_id)` task and the worker that runs it.

The task only takes an id and opens its own session; if the job is no longer `scheduled` (another
delivery of the same message already ran it, or the reconciler requeued it) it does nothing. Tasks
are acknowledged late, so a worker that dies mid-job leaves the message to be redelivered and the
reconciler requeues the job itself.

Each node has its own queue (`megatrain.{pool}.{hostname}`): the scheduler places a job on a node
and its devices, so only that node's worker may run it. A worker runs as many tasks at once as the
slots its node advertises (each job takes at least one slot), so a job placed beside others starts
at once instead of waiting in Redis behind them.

CLI: `python -m megatrain.worker.celery_app [--concurrency N] [--queue Q]`.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

from celery import Celery
from prometheus_client import start_http_server
from sqlalchemy import select

from megatrain.db.models import SCHEDULED, Job
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings
from megatrain.worker.metrics import worker_metrics
from megatrain.worker.nodes import cached_spec, device_memory, local_capacity, node_name, node_report
from megatrain.worker.pool_facts import heartbeat_values
from megatrain.worker.reporter import Reporter, ReportError, reporter_for

log = logging.getLogger(__name__)

TASK_NAME = "megatrain.run_shard"
PREPROCESS_TASK_NAME = "megatrain.preprocess_dataset"
EXPORT_TASK_NAME = "megatrain.export_checkpoint"
SAMPLE_TASK_NAME = "megatrain.sample_checkpoint"


def queue_name(pool: str, hostname: str) -> str:
    """The queue of one node of a pool."""
    return f"megatrain.{pool}.{hostname}"


def datasets_queue(pool: str) -> str:
    """The queue of dataset preprocessing in a pool: every worker of the pool consumes it beside
    its node's own, so whichever is free takes the next dataset."""
    return f"megatrain.{pool}.datasets"


def task_id(job_id: str, attempt: int, node_rank: int = 0) -> str:
    """One task id per attempt (and node of a gang), so the scheduler can find a job's message in
    its node's queue."""
    return f"{job_id}.{attempt}" + (f".n{node_rank}" if node_rank else "")


def create_celery_app(settings: Settings) -> Celery:
    """A Celery app on settings.redis_url (broker and result backend) with the run_shard task."""
    app = Celery("megatrain", broker=settings.redis_url, backend=settings.redis_url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=7 * 86400,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name=TASK_NAME, acks_late=True)
    def run_shard_task(job_id: str, share: dict[str, int] | None = None) -> int | None:
        # `share` (node_rank, nnodes, attempt) names one node's part of a multi-node attempt: node
        # rank 0's shard claims the job like a single-node one, the others join its attempt.
        if share is not None and share["node_rank"] > 0:
            from megatrain.worker.gang import Share, run_follower

            return run_follower(job_id, Share(**share), settings)
        if not settings.node_token:  # with one, the claim through the API says so
            with session_scope(settings.resolved_database_url) as s:
                status = s.scalar(select(Job.status).where(Job.id == job_id))
            if status != SCHEDULED:
                log.info("job %s is %s, not scheduled: skipping this delivery", job_id, status)
                return None
        from megatrain.worker.shard import run_shard

        return run_shard(job_id, settings, gang=share is not None)

    @app.task(name=PREPROCESS_TASK_NAME, acks_late=True)
    def preprocess_dataset_task(dataset_id: str) -> str | None:
        # Idempotent: a delivery that finds the dataset no longer pending does nothing.
        from megatrain.worker.datasets import preprocess_dataset

        return preprocess_dataset(dataset_id, settings)

    @app.task(name=EXPORT_TASK_NAME, acks_late=True)
    def export_checkpoint_task(export_id: str) -> str | None:
        # Idempotent: a delivery that finds the export no longer pending does nothing.
        from megatrain.worker.exports import export_checkpoint

        return export_checkpoint(export_id, settings)

    @app.task(name=SAMPLE_TASK_NAME, acks_late=True)
    def sample_checkpoint_task(sample_id: str) -> str | None:
        # The worker process's sampler keeps recently used checkpoints loaded between tasks.
        from megatrain.worker.samples import sample_checkpoint

        return sample_checkpoint(sample_id, settings)

    return app


def worker_slots(settings: Settings, concurrency: int | None = None) -> int:
    """What this node advertises and runs at once: its GPUs (or CPU slots), capped by `concurrency`.

    Each job takes at least one slot, so running as many tasks as slots never leaves a placed job
    waiting in the queue behind the others.
    """
    _, detected = local_capacity(settings)
    return detected if concurrency is None else max(1, min(detected, concurrency))


def node_heartbeat(
    settings: Settings, node_id: str, accelerator: str, slots: int, reporter: Reporter | None = None
) -> bool:
    """One heartbeat of this worker's node (db.node_registry.node_seen): devices free, free memory,
    health, and its pool's measured description until that is final; whether it is."""
    values = heartbeat_values(accelerator, slots, busy=None)
    spec, final = cached_spec(settings, accelerator, slots, device_memory(accelerator, slots))
    (reporter or reporter_for(settings)).node_seen(node_id, values, spec)
    worker_metrics().node_heartbeat(node_name(settings), values["memory_free_bytes"])
    return final


def _keep_node_seen(
    settings: Settings, node_id: str, accelerator: str, slots: int, reporter: Reporter
) -> None:
    """Heartbeat the node every heartbeat interval while the worker lives: a task waiting in this
    node's queue counts as waiting, not lost, only while its node is seen, and a node unseen for
    node_lost_after_s is marked lost by the scheduler (its jobs fail over)."""
    while True:
        time.sleep(settings.heartbeat_interval_s)
        try:
            node_heartbeat(settings, node_id, accelerator, slots, reporter)
        except ReportError as exc:
            log.warning("could not refresh node %s: %s", node_id, exc)


def run_worker(
    settings: Settings,
    concurrency: int | None = None,
    queues: list[str] | None = None,
    metrics_port: int | None = None,
) -> None:
    """Register this machine in its pool and consume its node's queue until stopped (blocks).

    The node advertises its slots (GPUs, or settings.resolved_cpu_slots), capped by `concurrency` when given,
    and the worker runs that many tasks at once: what the scheduler counts is what runs. With a node
    token (settings.node_token) it registers, heartbeats, runs its jobs and its pool's datasets,
    exports and samples through the API (worker.reporter, worker.task_link): it needs no database
    URL. With `metrics_port`, its attempts' and node's Prometheus series (worker.metrics) are served
    at http://0.0.0.0:PORT/metrics.
    """
    if metrics_port is not None:
        start_http_server(metrics_port, registry=worker_metrics().registry)
    slots = worker_slots(settings, concurrency)
    reporter = reporter_for(settings)
    # Measuring the device's peak takes seconds (once per host, then cached): it runs in the
    # background, and a heartbeat records the pool's description once it is done.
    try:
        node_id = reporter.register(node_report(settings, slots))
    except ReportError as exc:  # a revoked or mistyped token, an API out of reach: one line, no traceback
        raise SystemExit(f"megatrain worker: could not register node {node_name(settings)}: {exc}") from None
    hostname = node_name(settings)
    accelerator, _ = local_capacity(settings)
    beat = threading.Thread(
        target=_keep_node_seen,
        args=(settings, node_id, accelerator, slots, reporter),
        daemon=True,
        name="node-seen",
    )
    beat.start()
    app = create_celery_app(settings)
    shared = datasets_queue(settings.pool_name)
    queues = queues or [queue_name(settings.pool_name, hostname), shared]
    # One thread beyond the slots, for a dataset's preprocessing beside the node's jobs.
    threads = slots + (shared in queues)
    app.worker_main(
        [
            "worker",
            f"--queues={','.join(queues)}",
            f"--concurrency={threads}",
            # Threads, not prefork: each task only supervises a torchrun subprocess, and a thread
            # pool lives as long as the worker process, so the runner's children still die with it
            # (PDEATHSIG fires when the spawning thread ends; kill -9 of the worker ends them all).
            "--pool=threads",
            "--loglevel=INFO",
            f"--hostname=megatrain-{settings.pool_name}@{settings.node_name or '%h'}",
            "--without-gossip",
            "--without-mingle",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatrain.worker.celery_app", description=__doc__)
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="jobs at once (default: the node's slots; lower caps them)",
    )
    parser.add_argument("--queue", action="append", default=None, help="queue to consume (repeatable)")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on this port")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    run_worker(settings, concurrency=args.concurrency, queues=args.queue, metrics_port=args.metrics_port)


if __name__ == "__main__":
    main()
