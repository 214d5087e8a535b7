"""What srun starts on every node of an attempt's Slurm job: that node's share of the attempt.

`python -m megatrain.worker.slurm.node --job-id ID --attempt N`. The node's rank is Slurm's
SLURM_NODEID. Node rank 0 runs the shard runner that owns the attempt (claims it, publishes the
rendezvous at the first node's address, decides the outcome); the others run followers that meet
it there (worker.gang). When Slurm's warning before the time limit comes (the batch script's flag
file), every node asks its ranks to checkpoint at the next step boundary and stop; node rank 0 then
queues the job again to resume there (worker.preempt.end_at_time_limit). A Slurm job of an attempt
that is no longer the job's current one (a requeue of an old attempt) runs nothing, so an attempt is
never counted twice.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from megatrain.db.models import SCHEDULED, Job
from megatrain.db.session import session_scope
from megatrain.settings import Settings, get_settings
from megatrain.worker.preempt import TimeLimit
from megatrain.worker.slurm.script import (
    HEAD_ADDR_ENV,
    STOP_AT_ENV,
    TIME_LIMIT_ENV,
    TIME_LIMIT_FLAG_ENV,
)

log = logging.getLogger(__name__)


def _current(settings: Settings, job_id: str, attempt: int) -> bool:
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        return job is not None and job.attempt == attempt and job.status == SCHEDULED


def run_node(job_id: str, attempt: int, settings: Settings, environ: dict[str, str]) -> int:
    """Run this node's share; the engine's exit code (0 when there was nothing to run)."""
    from megatrain.worker.gang import Share, run_follower
    from megatrain.worker.shard import run_shard

    node_rank = int(environ.get("SLURM_NODEID", "0"))
    nnodes = int(environ.get("MEGATRAIN_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "1")
    # The node's Slurm name labels its log lines and events.
    settings = settings.model_copy(update={"node_name": environ.get("SLURMD_NODENAME") or settings.node_name})
    stop = time_limit(environ)
    if node_rank > 0:
        return run_follower(job_id, Share(node_rank, nnodes, attempt), settings, stop)
    if not settings.node_token and not _current(settings, job_id, attempt):
        log.info("job %s: attempt %d is not the scheduled one; nothing to run", job_id, attempt)
        return 0
    if nnodes > 1:
        # Publish the address the script found for the first node: its Slurm name need not resolve.
        host = environ.get(HEAD_ADDR_ENV)
        settings = settings.model_copy(update={"node_address": host or settings.node_address})
    # With a node token the claim itself refuses another attempt (the node has no database).
    return run_shard(job_id, settings, gang=nnodes > 1, stop=stop, attempt=attempt)


def time_limit(environ: dict[str, str]) -> TimeLimit | None:
    """The allocation's time limit as the batch script exported it (its flag file and seconds)."""
    flag, limit, stop_at = (environ.get(k) for k in (TIME_LIMIT_FLAG_ENV, TIME_LIMIT_ENV, STOP_AT_ENV))
    if not flag or not limit:
        return None
    return TimeLimit(Path(flag), float(limit), float(stop_at) if stop_at else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatrain.worker.slurm.node", description=__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--attempt", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rc = run_node(args.job_id, args.attempt, get_settings(), dict(os.environ))
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    main()
