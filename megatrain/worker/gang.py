"""Multi-node attempts: one job's shards on several nodes, meeting through torchrun's c10d rendezvous.

The scheduler reserves a gang (db.jobs.reserve_gang: one job_allocation row per node, in node-rank
order) and the Celery executor sends one shard task to each node's queue. Node rank 0's shard is the
attempt's owner: it claims the job (scheduled → running) like a single-node runner, publishes the
rendezvous endpoint (a 'rendezvous' event naming the attempt) and decides the attempt's outcome. The
other shards (`run_follower`) wait for that endpoint, run their node's share of the ranks, forward
their logs (prefixed with their node) and end their engine as soon as the attempt is no longer
running. A follower whose engine fails reports its ranks' failure records (a 'shard_failed' event)
and ends the attempt itself, so a broken gang never waits on a collective's timeout.
"""

from __future__ import annotations

import json
import logging
import time

from megatrain.attempts.gang import (  # noqa: F401  (re-exported)
    RENDEZVOUS_EVENT,
    SHARD_FAILED_EVENT,
    SHARD_JOINED_EVENT,
    Share,
    join,
    lead,
    run_id,
    shard_failed,
    shard_records,
    silent_now,
)
from megatrain.attempts.model import Attempt
from megatrain.failures import read_records
from megatrain.settings import Settings
from megatrain.worker.nodes import node_name
from megatrain.worker.preempt import TimeLimit
from megatrain.worker.reporter import Reporter, reporter_for
from megatrain.worker.shard import _Runner, supervise

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.5
SHARD_REPORT_WAIT_S = 10.0
"""How long node rank 0, its engine failed, waits for the other shards to report theirs: a shard
whose engine failed too reports within a second (the collectives break), one that stays silent
went with its worker."""


def silent_shares(
    settings: Settings, att: Attempt, wait_s: float = SHARD_REPORT_WAIT_S, reporter: Reporter | None = None
) -> list[tuple[str, str]]:
    """(node id, hostname) of the other shards of node rank 0's failed attempt that have not
    reported their end within wait_s; none once the attempt has ended otherwise (a shard ended it)."""
    reporter = reporter or reporter_for(settings)
    deadline = time.monotonic() + wait_s
    while True:
        silent = reporter.silent(att.job_id, att.attempt)
        if not silent or time.monotonic() >= deadline:
            return silent or []
        time.sleep(WAIT_POLL_S)


def _await_leader(
    settings: Settings, job_id: str, share: Share, reporter: Reporter | None = None
) -> Attempt | None:
    """This node's share of the attempt once node rank 0 runs it; None when the attempt is over
    (or never ran) before it did, or the wait outlasts rendezvous_timeout_s."""
    reporter = reporter or reporter_for(settings)
    node = node_name(settings)
    deadline = time.monotonic() + settings.rendezvous_timeout_s
    while time.monotonic() < deadline:
        answer = reporter.join(job_id, share, node)
        if answer["state"] == "gone":
            return None
        if answer["state"] == "go":
            out_dir = settings.runs_dir / job_id / f"attempt-{share.attempt}" / f"node-{share.node_rank}"
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "spec.json").write_text(json.dumps(answer["spec"], sort_keys=True))
            (out_dir / "layout.json").write_text(json.dumps(answer["layout"], sort_keys=True))
            return Attempt.from_wire(answer["attempt"], out_dir)
        time.sleep(WAIT_POLL_S)
    log.warning("job %s: node rank 0 never started attempt %d; giving up", job_id, share.attempt)
    return None


class _FollowerRunner(_Runner):
    """A non-zero node rank's reporting: its logs (prefixed with its node), the metrics and events
    of its ranks, and no ownership of the job: it stops when the attempt is no longer running."""

    follower = True

    def prefix(self, lines: list[str]) -> list[str]:
        return [f"[{self.node}] {line}" for line in lines]

    def finish(self, outcome: str, rc: int) -> None:
        """Node rank 0 owns the outcome; a failed engine here reports its records and ends the
        attempt (guarded: if node rank 0 already did, nothing changes)."""
        self.live.end(outcome, rc, None)  # the attempt's ledger is node rank 0's to count
        if outcome != "exited" or rc == 0:
            return
        if self.stop is not None and self.stop.reached():
            return  # its ranks stopped at the time limit with node rank 0's, which ends the attempt
        att = self.att
        records = att.redact.value(read_records(att.out_dir, self.node))
        rank = att.rendezvous.node_rank if att.rendezvous else 0
        self.reporter.shard_failed(att, rc, self.node, rank, records)


def run_follower(job_id: str, share: Share, settings: Settings, stop: TimeLimit | None = None) -> int:
    """Run node `share.node_rank`'s part of a multi-node attempt to its end; the engine's exit code
    (0 when there was nothing to run). `stop`: the allocation's time limit, as in run_shard."""
    reporter = reporter_for(settings)
    att = _await_leader(settings, job_id, share, reporter)
    if att is None:
        return 0
    return supervise(settings, att, _FollowerRunner(settings, att, stop, reporter))
