"""The control plane's side of a node's reports: what a claim, a batch of reports, a heartbeat or the
end of an attempt does to the database.

Every function takes the caller's session (the caller commits) and only JSON-able inputs, so the
same code serves a runner that holds a database URL (worker.reporter.DbReporter, in its own process)
and one that holds only a node token (the API's /v1/node routes, api/node/router.py): whichever
transport carries them, a node's reports mean the same thing.

A batch (`report`) is applied once: it carries the next sequence number of its (job, attempt, node
rank), and one the cursor has passed is acknowledged without being applied again, so a runner that
resends a batch whose answer it never got (the API restarted) neither loses nor doubles a row.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from megatrain.attempts.ending import end_at_time_limit, end_failed_attempt, requeue_preempted
from megatrain.attempts.ingest import append_logs, ingest_events, ingest_metrics, next_log_seq
from megatrain.attempts.model import Attempt, Rendezvous
from megatrain.attempts.secrets import job_secrets
from megatrain.db.goodput import quarantine_if_failing, record_attempt
from megatrain.db.jobs import retry_allowed, transition
from megatrain.db.models import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SCHEDULED,
    SUCCEEDED,
    Job,
    JobEvent,
    Node,
    NodePool,
    utcnow,
)
from megatrain.db.node_tokens import ReportCursor, revoke_attempt_tokens
from megatrain.plan.attempt_times import predict_attempt_times
from megatrain.plan.layout import Layout
from megatrain.plan.pool import PoolSpec
from megatrain.secrets_box import SecretsUnavailable
from megatrain.settings import Settings
from megatrain.spec import parse_spec
from megatrain.spec_packages import package_problems

log = logging.getLogger(__name__)

CLEAR_RUNNER: dict[str, object] = {"runner_pid": None, "runner_host": None, "heartbeat_at": None}


def claim(
    s: Session,
    settings: Settings,
    job_id: str,
    *,
    node: str,
    host: str,
    pid: int,
    packages: dict[str, str],
    endpoint: str | None = None,
    attempt: int | None = None,
    node_id: str | None = None,
) -> dict[str, Any]:
    """scheduled → running, owned by runner `pid` on `host` of node `node`. {"attempt": the attempt
    as Attempt.to_wire, "spec", "layout"}, or {"skip": why} when there is nothing (more) to do.
    `endpoint` (HOST:PORT): the attempt spans several nodes and this is node rank 0, whose
    rendezvous the other shards meet (worker.gang). `packages`: what the node can import.
    `attempt`: the attempt the caller was started for (a Slurm job of an older attempt runs nothing).
    `node_id`: the calling node's, when the API knows it (it may report for the attempt later)."""
    job = s.get(Job, job_id)
    if job is not None and job.status == RUNNING and (job.runner_host, job.runner_pid) == (host, pid):
        # This runner's claim again: the answer to its first was lost (the API restarted).
        return _answer(s, settings, job, job.serve_token, endpoint, 0.0)
    if job is None or job.status != SCHEDULED:
        return {"skip": f"job {job_id} is {job.status if job else 'missing'}, not scheduled"}
    if attempt is not None and job.attempt != attempt:
        return {"skip": f"attempt {attempt} is not the scheduled one ({job.attempt})"}
    if job.cancel_requested:
        transition(s, job_id, CANCELLED, from_statuses=(SCHEDULED,), reason="cancelled before it started")
        return {"skip": "cancelled before it started"}
    problems = package_problems(parse_spec(job.spec), {node: packages}, f"node {node}")
    if problems:  # no retry installs a package: fail at once, in one line
        missing = "; ".join(p["message"] for p in problems)
        transition(s, job_id, FAILED, from_statuses=(SCHEDULED,), reason=missing)
        return {"skip": missing}
    try:
        job_secrets(s, settings, job)
    except SecretsUnavailable as exc:  # deleted since submission, or the key changed: no retry helps
        transition(s, job_id, FAILED, from_statuses=(SCHEDULED,), reason=str(exc))
        return {"skip": str(exc)}
    try:
        total_steps = int(job.spec["training"]["train_iters"])
    except (KeyError, TypeError, ValueError):
        total_steps = job.total_steps
    now = utcnow()
    queued_s = _queued_s(s, job, now)
    # A fresh token per attempt: a model server of an earlier attempt answers no one.
    serve_token = secrets.token_urlsafe(32) if job.kind == "serve" else None
    ok = transition(
        s,
        job_id,
        RUNNING,
        from_statuses=(SCHEDULED,),
        reason=f"attempt {job.attempt} running on {host}",
        data={"attempt": job.attempt, "host": host, "pid": pid},
        runner_host=host,
        runner_pid=pid,
        started_at=now,
        heartbeat_at=now,
        total_steps=total_steps,
        serve_token=serve_token,
    )
    if not ok:
        return {"skip": "another runner claimed it first"}
    cursor(s, job_id, job.attempt, 0, node_id)
    return _answer(s, settings, job, serve_token, endpoint, queued_s)


def cursor(s: Session, job_id: str, attempt: int, node_rank: int, node_id: str | None) -> ReportCursor:
    """The report cursor of an attempt's node rank, made when its runner claims or joins it."""
    row = s.get(ReportCursor, (job_id, attempt, node_rank), with_for_update=True)
    if row is None:
        row = ReportCursor(job_id=job_id, attempt=attempt, node_rank=node_rank, seq=0, node_id=node_id)
        s.add(row)
        s.flush()
    return row


def _answer(
    s: Session, settings: Settings, job: Job, serve_token: str | None, endpoint: str | None, queued_s: float
) -> dict[str, Any]:
    """A claim's answer: the attempt (with the secrets its engine gets), the job's spec and layout."""
    s.refresh(job)
    placed = s.execute(
        select(NodePool.accelerator, Node.slots_total, NodePool.spec)
        .join(Node, Node.pool_id == NodePool.id)
        .where(Node.id == job.node_id)
    ).first()
    accelerator, node_slots, pool_spec = placed if placed is not None else (None, None, None)
    att = Attempt(
        job.id,
        job.attempt,
        job.max_retries,
        job.num_procs,
        float((job.spec.get("resources") or {}).get("max_runtime_s") or 86400),
        out_dir=None,  # type: ignore[arg-type]  # the node's folder: the runner sets it
        devices=job.devices,
        accelerator=accelerator or "cpu",
        node_slots=node_slots,
        node_id=job.node_id,
        queued_s=queued_s,
        prev_step=job.current_step or 0,
        checkpoint_interval=int((job.spec.get("training") or {}).get("checkpoint_interval") or 0),
        train_iters=int((job.spec.get("training") or {}).get("train_iters") or 0),
        preemptions=job.preemptions,
        max_preemptions=job.max_preemptions,
        continuations=job.continuations,
        serve_token=serve_token,
        secret_env=job_secrets(s, settings, job),
        **pause_bounds(settings, job, pool_spec, node_slots),
    )
    if endpoint is not None:
        from megatrain.attempts.gang import lead

        lead(s, settings, att, endpoint)
    return {"attempt": att.to_wire(), "spec": job.spec, "layout": job.layout}


def pause_bounds(
    settings: Settings, job: Job, pool_spec: dict[str, Any] | None, node_slots: int | None
) -> dict[str, float]:
    """The attempt's allowances before its first step and for a save (plan.attempt_times), or none
    (the flat hang_grace_s) where its pool or its model's size is unknown."""
    if not pool_spec:
        return {}
    try:
        spec, layout = parse_spec(job.spec), Layout.from_dict(job.layout)
        pool = PoolSpec.model_validate(pool_spec)
        ranks = min(job.num_procs, node_slots or job.num_procs)
        times = predict_attempt_times(spec, layout, pool, ranks, resuming=bool(job.current_step))
    except Exception as exc:  # noqa: BLE001 - advisory: a prediction that fails must not fail the claim
        log.info("job %s: no predicted pauses (%s); the hang watch allows hang_grace_s", job.id, exc)
        return {}
    return times.bounds(settings.hang_min_s)


def _queued_s(s: Session, job: Job, now: datetime) -> float:
    """Seconds since the job last entered the queue (its creation, or its last requeue)."""
    since = s.scalar(
        select(func.max(JobEvent.created_at)).where(JobEvent.job_id == job.id, JobEvent.to_status == QUEUED)
    )
    since = since or job.created_at
    return max((now - since).total_seconds(), 0.0) if since else 0.0


def report(s: Session, job_id: str, batch: dict[str, Any], max_log_lines: int) -> dict[str, Any]:
    """Apply one batch of a runner's reports, once: {"verdict": None | "lost" | "cancel" |
    "preempt", "applied": whether this call applied it (False: the cursor had passed it)}.

    batch: attempt, node_rank, seq (> 0, one more than the last), lines (already redacted and, for a
    follower, prefixed with its node), metrics and events (rows of the engine's JSONL files),
    heartbeat (whether this tick beats), host and pid (the runner), follower (a non-zero node rank
    of a gang: it owns nothing and only learns whether the attempt still runs), progress (a follower's
    ranks, kept for node rank 0's hang report) and gang (node rank 0 of a gang: the answer carries
    the other shards' progress as "peers")."""
    attempt, node_rank, seq = int(batch["attempt"]), int(batch.get("node_rank") or 0), int(batch["seq"])
    row = cursor(s, job_id, attempt, node_rank, None)
    applied = seq > row.seq
    if batch.get("progress") is not None:
        row.progress = batch["progress"]
    if applied:
        row.seq = seq
        if follower_verdict(s, job_id, attempt) is None:
            if batch.get("lines"):
                append_logs(s, job_id, list(batch["lines"]), next_log_seq(s, job_id), max_log_lines)
            ingest_metrics(s, job_id, list(batch.get("metrics") or ()))
            ingest_events(s, job_id, list(batch.get("events") or ()), attempt)
        else:
            # An attempt the control plane has already ended (judged lost while cut off, say) whose
            # runner is heard again: its lines and figures would interleave with the attempt that
            # replaced it, and rewind the job's step. Only its saved checkpoints are kept on record.
            stale_checkpoints(s, job_id, attempt, list(batch.get("events") or ()))
    if batch.get("follower"):
        return {"verdict": follower_verdict(s, job_id, attempt), "applied": applied}
    host, pid = str(batch["host"]), int(batch["pid"])
    verdict = None
    if batch.get("heartbeat") and not heartbeat(s, job_id, host, pid):
        verdict = "lost"
    row = s.execute(
        select(Job.status, Job.cancel_requested, Job.runner_pid, Job.runner_host, Job.preempt_for).where(
            Job.id == job_id
        )
    ).first()
    if row is None or row.status != RUNNING or row.runner_pid != pid or row.runner_host != host:
        verdict = "lost"
    elif row.cancel_requested:
        verdict = verdict or "cancel"
    elif row.preempt_for is not None:
        verdict = verdict or "preempt"
    answer: dict[str, Any] = {"verdict": verdict, "applied": applied}
    if batch.get("gang"):
        answer["peers"] = peers_progress(s, job_id, attempt)
    return answer


def peers_progress(s: Session, job_id: str, attempt: int) -> list[dict[str, Any]]:
    """What the other shards of a gang attempt last said of their ranks (ReportCursor.progress)."""
    rows = s.scalars(
        select(ReportCursor.progress).where(
            ReportCursor.job_id == job_id, ReportCursor.attempt == attempt, ReportCursor.node_rank > 0
        )
    )
    return [p for p in rows if p]


def follower_verdict(s: Session, job_id: str, attempt: int) -> str | None:
    """'lost' once the attempt a follower shard runs is no longer running."""
    row = s.execute(select(Job.status, Job.attempt).where(Job.id == job_id)).first()
    if row is None or row.status != RUNNING or row.attempt != attempt:
        return "lost"
    return None


def heartbeat(s: Session, job_id: str, host: str, pid: int) -> bool:
    """Beat the running job if runner `pid` on `host` owns it; False when it does not."""
    owned = s.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == RUNNING, Job.runner_host == host, Job.runner_pid == pid)
        .values(heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    ).rowcount
    return bool(owned == 1)


CHECKPOINT_EVENTS = ("checkpoint_saved", "checkpoints_deleted", "checkpoint_corrupt", "checkpoints_set_aside")
"""What an ended attempt reports that still stands: the checkpoints it left in storage."""


def backfill(s: Session, job_id: str, attempt: int, metrics: list[dict], events: list[dict]) -> None:
    """What an earlier attempt wrote after its runner's last tick (idempotent inserts only)."""
    ingest_metrics(s, job_id, metrics)
    stale_checkpoints(s, job_id, attempt, events)


def stale_checkpoints(s: Session, job_id: str, attempt: int, events: list[dict]) -> None:
    """Record the checkpoint events among an ended attempt's (idempotent)."""
    ingest_events(s, job_id, [r for r in events if r.get("event") in CHECKPOINT_EVENTS], attempt)


def attempt_of(s: Session, job_id: str, attempt: int, rendezvous: dict[str, Any] | None) -> Attempt | None:
    """An attempt as the control plane knows it (from the job's row), for deciding how it ends: the
    node says only which attempt, and whether it is a gang's (its `rendezvous`). None when the job
    is gone or has moved on to another attempt."""
    job = s.get(Job, job_id)
    if job is None or job.attempt != attempt:
        return None
    return Attempt(
        job.id,
        job.attempt,
        job.max_retries,
        job.num_procs,
        float((job.spec.get("resources") or {}).get("max_runtime_s") or 86400),
        out_dir=None,  # type: ignore[arg-type]  # nothing here reads the node's files
        node_id=job.node_id,
        rendezvous=Rendezvous(**rendezvous) if rendezvous else None,
        preemptions=job.preemptions,
        max_preemptions=job.max_preemptions,
        continuations=job.continuations,
    )


def finish(s: Session, settings: Settings, att: Attempt, end: dict[str, Any]) -> str | None:
    """Move the job out of running as the attempt ended; the status it ended in (None when someone
    else moved it first). `end`: outcome (exited, cancel, preempt, time_limit, timeout, hung), rc,
    node (its name), records (its ranks' failure records), silent ([node id, hostname] of a gang's
    shards that never reported), preempted_step, hang ({reason, data} when it hung), time_limit_s
    (the allocation's, when it stopped at it), seconds (the attempt's goodput ledger row)."""
    job_id, outcome, rc = att.job_id, str(end["outcome"]), int(end["rc"])
    step = end.get("preempted_step")
    failure = None
    # Avoiding the node that failed is a preference: placement still uses it if nothing else has room.
    avoid_now = s.scalar(select(Job.avoid_nodes).where(Job.id == job_id)) or ()
    avoid = sorted({*avoid_now, att.node_id}) if att.node_id else None
    hang = end.get("hang")
    if outcome == "hung" and hang is not None:
        failure = "hung"
        retrying = retry_allowed(att)
        reason = str(hang["reason"]) + ("; retrying from the latest checkpoint" if retrying else "")
        data = dict(hang.get("data") or {}) | {"attempt": att.attempt}
        to, fields = (QUEUED, CLEAR_RUNNER | {"avoid_nodes": avoid}) if retrying else (FAILED, {})
        ok = transition(s, job_id, to, from_statuses=(RUNNING,), reason=reason, data=data, **fields)
    elif outcome == "cancel":
        ok = transition(s, job_id, CANCELLED, from_statuses=(RUNNING,), reason="cancelled by request")
    elif outcome == "preempt" and rc != 0:
        ok = requeue_preempted(s, att, step, CLEAR_RUNNER)
    elif outcome == "time_limit" and rc != 0 and end.get("time_limit_s") is not None:
        ok = end_at_time_limit(s, att, step, float(end["time_limit_s"]), CLEAR_RUNNER)
    elif outcome == "timeout":
        reason = f"exceeded max_runtime_s={att.max_runtime_s:g}"
        ok = transition(s, job_id, FAILED, from_statuses=(RUNNING,), reason=reason)
    elif rc == 0:
        ok = transition(s, job_id, SUCCEEDED, from_statuses=(RUNNING,), reason="engine exited 0")
    else:
        silent = [(str(a), str(b)) for a, b in end.get("silent") or ()]
        records = list(end.get("records") or ())
        ok, infra = end_failed_attempt(s, att, rc, silent, records=records)
        failure = "infrastructure" if infra else None
    if not ok:
        log.warning("job %s: someone else moved it out of running before this runner", job_id)
        return None
    revoke_attempt_tokens(s, job_id)
    status = s.scalar(select(Job.status).where(Job.id == job_id)) or outcome
    if outcome in ("preempt", "time_limit") and status == QUEUED:
        status = "preempted" if outcome == "preempt" else "continued"
    seconds = {k: float(v) for k, v in (end.get("seconds") or {}).items()}
    record_attempt(s, job_id, att.node_id, att.attempt, status, failure, seconds)
    if failure is not None and att.node_id is not None:
        why = quarantine_if_failing(s, att.node_id, settings)
        if why is not None:
            log.warning("node %s quarantined: %s", end.get("node"), why)
    return status
