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
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.jobs import record_event
from megatrain.db.models import RUNNING, SCHEDULED, Job, JobAllocation, JobEvent, Node, NodePool
from megatrain.failures import read_records
from megatrain.secrets_box import SecretsUnavailable
from megatrain.settings import Settings
from megatrain.worker.attempt import Attempt, end_failed_attempt
from megatrain.worker.launch import Rendezvous
from megatrain.worker.nodes import node_name
from megatrain.worker.preempt import TimeLimit
from megatrain.worker.reporter import Reporter, reporter_for
from megatrain.worker.secrets import job_secrets
from megatrain.worker.shard import _Runner, supervise

log = logging.getLogger(__name__)

RENDEZVOUS_EVENT = "rendezvous"
SHARD_FAILED_EVENT = "shard_failed"
SHARD_JOINED_EVENT = "shard_joined"
WAIT_POLL_S = 0.5
SHARD_REPORT_WAIT_S = 10.0
"""How long node rank 0, its engine failed, waits for the other shards to report theirs: a shard
whose engine failed too reports within a second (the collectives break), one that stays silent
went with its worker."""


@dataclass(frozen=True)
class Share:
    """One node's part of a multi-node attempt, as the executor's task names it."""

    node_rank: int
    nnodes: int
    attempt: int


def run_id(job_id: str, attempt: int) -> str:
    """torchrun's --rdzv-id of an attempt."""
    return f"{job_id}.{attempt}"


def _share_row(s: Session, job_id: str, node_rank: int) -> Any:
    """(slots, devices, accelerator) of the job's share on its node_rank'th node; None if gone."""
    return s.execute(
        select(JobAllocation.slots, JobAllocation.devices, NodePool.accelerator)
        .join(Node, Node.id == JobAllocation.node_id)
        .join(NodePool, NodePool.id == Node.pool_id)
        .where(JobAllocation.job_id == job_id, JobAllocation.node_rank == node_rank)
    ).first()


def lead(s: Session, settings: Settings, att: Attempt, endpoint: str) -> None:
    """Make `att` (just claimed by node rank 0's shard, in session `s`) this node's share of the
    gang and publish `endpoint` (HOST:PORT), where the other shards meet it. A repeated claim (its
    first answer was lost) keeps the endpoint published first."""
    count = len(s.scalars(select(JobAllocation.id).where(JobAllocation.job_id == att.job_id)).all())
    share = _share_row(s, att.job_id, 0)
    if count < 2 or share is None:
        raise RuntimeError(f"job {att.job_id} has no gang allocation to run")
    published = _events(s, att.job_id, RENDEZVOUS_EVENT, att.attempt)
    if published:
        endpoint = published[-1]["endpoint"]
    rdzv = Rendezvous(0, count, endpoint, run_id(att.job_id, att.attempt), settings.rendezvous_timeout_s)
    att.num_procs, att.devices, att.rendezvous = share.slots, share.devices, rdzv
    if not published:
        data = {"attempt": att.attempt, "endpoint": endpoint, "run_id": rdzv.run_id, "nnodes": count}
        text = f"attempt {att.attempt}: shards meet at {endpoint}"
        record_event(s, att.job_id, RENDEZVOUS_EVENT, text, data)


def _events(s: Session, job_id: str, kind: str, attempt: int) -> list[dict[str, Any]]:
    rows = s.scalars(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == kind))
    return [d for d in rows if isinstance(d, dict) and d.get("attempt") == attempt]


def shard_records(s: Session, job_id: str, attempt: int) -> list[dict[str, Any]]:
    """The failure records every shard of the attempt reported (their ranks' failure.rank{R}.json)."""
    return [r for d in _events(s, job_id, SHARD_FAILED_EVENT, attempt) for r in d.get("records") or ()]


def silent_now(s: Session, job_id: str, attempt: int) -> list[tuple[str, str]] | None:
    """(node id, hostname) of the attempt's other shards that have not reported their end; None
    once the attempt has ended (a shard ended it)."""
    job = s.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).first()
    if job is None or job.status != RUNNING or job.attempt != attempt:
        return None
    reported = {d.get("node_rank") for d in _events(s, job_id, SHARD_FAILED_EVENT, attempt)}
    rows = s.execute(
        select(JobAllocation.node_rank, Node.id, Node.hostname)
        .join(Node, Node.id == JobAllocation.node_id)
        .where(JobAllocation.job_id == job_id, JobAllocation.node_rank > 0)
    ).all()
    return [(r.id, r.hostname) for r in rows if r.node_rank not in reported]


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


def join(
    s: Session, settings: Settings, job_id: str, share: Share, node: str, node_id: str | None = None
) -> dict[str, Any]:
    """A follower shard's turn: {"state": "wait"} until node rank 0 runs the attempt, {"state":
    "gone"} when the attempt is over (or never ran), or this share was joined already (a
    redelivery), else {"state": "go", "attempt": its Attempt.to_wire, "spec", "layout"}."""
    job = s.get(Job, job_id)
    if job is None or job.attempt != share.attempt or job.status not in (SCHEDULED, RUNNING):
        return {"state": "gone"}
    published = _events(s, job_id, RENDEZVOUS_EVENT, share.attempt)
    row = _share_row(s, job_id, share.node_rank)
    joined = _events(s, job_id, SHARD_JOINED_EVENT, share.attempt)
    if row is None or any(d.get("node_rank") == share.node_rank for d in joined):
        # A redelivery (its worker died mid-attempt): joining a rendezvous that is complete would
        # restart the others' ranks; the attempt ends without it.
        return {"state": "gone"}
    if job.status != RUNNING or not published:
        return {"state": "wait"}
    try:
        secret_env = job_secrets(s, settings, job)
    except SecretsUnavailable:
        return {"state": "gone"}  # node rank 0 fails the job, naming why
    data = {"attempt": share.attempt, "node_rank": share.node_rank, "node": node}
    text = f"node {node} joins attempt {share.attempt} as node rank {share.node_rank}"
    record_event(s, job_id, SHARD_JOINED_EVENT, text, data)
    from megatrain.worker.control import cursor

    cursor(s, job_id, share.attempt, share.node_rank, node_id)
    spec_runtime = (job.spec.get("resources") or {}).get("max_runtime_s") or 86400
    rdzv = Rendezvous(
        share.node_rank,
        share.nnodes,
        published[-1]["endpoint"],
        run_id(job_id, share.attempt),
        settings.rendezvous_timeout_s,
    )
    att = Attempt(
        job_id,
        share.attempt,
        job.max_retries,
        row.slots,
        float(spec_runtime),
        out_dir=None,  # type: ignore[arg-type]  # the node's folder: the shard sets it
        devices=row.devices,
        accelerator=row.accelerator or "cpu",
        rendezvous=rdzv,
        preemptions=job.preemptions,
        continuations=job.continuations,
        secret_env=secret_env,
    )
    return {"state": "go", "attempt": att.to_wire(), "spec": job.spec, "layout": job.layout}


def shard_failed(
    s: Session, att: Attempt, rc: int, node: str, node_rank: int, records: list[dict[str, Any]]
) -> None:
    """A follower's engine failed: record its ranks' failure records (a 'shard_failed' event) and end
    the attempt (guarded: if node rank 0 already did, nothing changes)."""
    job = s.scalars(select(Job).where(Job.id == att.job_id).with_for_update()).first()
    if job is None or job.status != RUNNING or job.attempt != att.attempt:
        return
    if job.preempt_for is not None:
        return  # preempted: its ranks stopped with node rank 0's, which requeues the job
    data = {"attempt": att.attempt, "node": node, "node_rank": node_rank, "rc": rc, "records": records}
    record_event(s, att.job_id, SHARD_FAILED_EVENT, f"shard on {node} exited {rc}", data)
    s.flush()
    # It reads every shard's reported records, this one's included.
    end_failed_attempt(s, att, rc, node=node, records=[])


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
