"""The shard runner: runs one attempt of a job under torchrun and reports it to the database.

`run_shard(job_id, settings)` claims a `scheduled` job (→ running), launches the engine, then loops:
forward its output to job_log, tail metrics.jsonl/events.jsonl into the job's tables, heartbeat,
honour cancel requests and max_runtime_s. On exit the job succeeds, is queued again (the engine
resumes from the latest checkpoint) or fails. Every state change goes through db.jobs.transition.

CLI: `python -m megatrain.worker.shard --job-id ID` (what the local executor spawns).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import IO

from sqlalchemy import func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

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
from megatrain.db.session import get_sessionmaker, session_scope
from megatrain.secrets_box import SecretsUnavailable
from megatrain.settings import Settings, get_settings
from megatrain.worker.attempt import Attempt, end_failed_attempt
from megatrain.worker.hang import Hang, HangRule, HangWatch, dump_stacks
from megatrain.worker.heartbeat import Heartbeat
from megatrain.worker.ingest import JsonlTail, append_logs, ingest_events, ingest_metrics, next_log_seq
from megatrain.worker.launch import (  # noqa: F401  (re-exported)
    DEFAULT_ENGINE_MODULE,
    ENGINE_MODULE_ENV,
    Rendezvous,
    engine_command,
    free_port,
)
from megatrain.worker.ledger import AttemptClock
from megatrain.worker.nodes import node_name, package_problem
from megatrain.worker.oom import OomWatch
from megatrain.worker.preempt import TimeLimit, ask_to_stop, end_at_time_limit, requeue_preempted
from megatrain.worker.procs import die_with_parent, terminate_tree
from megatrain.worker.secrets import job_secrets

log = logging.getLogger(__name__)

KILL_GRACE_S = float(os.environ.get("MEGATRAIN_KILL_GRACE_S", "10"))
"""Seconds between SIGTERM and SIGKILL when a job is cancelled or runs out of time."""
POLL_S = 0.25
STACK_DUMP_WAIT_S = 2.0


def hang_rule(settings: Settings) -> HangRule:
    return HangRule(settings.hang_factor, settings.hang_min_s, settings.hang_grace_s)


def _claim(settings: Settings, job_id: str, gang: bool = False) -> Attempt | None:
    """scheduled → running, owned by this process; None when there is nothing (more) to do.

    For a multi-node job (`gang`) this process is node rank 0's shard: it owns the attempt, runs its
    node's share and publishes the rendezvous endpoint the other shards join (worker.gang)."""
    rendezvous_port = free_port() if gang else 0
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        if job is None or job.status != SCHEDULED:
            log.info("job %s is %s, not scheduled: nothing to do", job_id, job.status if job else "missing")
            return None
        if job.cancel_requested:
            transition(s, job_id, CANCELLED, from_statuses=(SCHEDULED,), reason="cancelled before it started")
            return None
        missing = package_problem(job.spec, node_name(settings))
        if missing:  # no retry installs a package: fail at once, in one line
            transition(s, job_id, FAILED, from_statuses=(SCHEDULED,), reason=missing)
            return None
        try:
            secret_env = job_secrets(s, settings, job)
        except SecretsUnavailable as exc:  # deleted since submission, or the key changed: no retry helps
            transition(s, job_id, FAILED, from_statuses=(SCHEDULED,), reason=str(exc))
            return None
        out_dir = settings.runs_dir / job_id / f"attempt-{job.attempt}"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "spec.json").write_text(json.dumps(job.spec, indent=2, sort_keys=True))
        (out_dir / "layout.json").write_text(json.dumps(job.layout, indent=2, sort_keys=True))
        max_runtime_s = float((job.spec.get("resources") or {}).get("max_runtime_s") or 86400)
        try:
            total_steps = int(job.spec["training"]["train_iters"])
        except (KeyError, TypeError, ValueError):
            total_steps = job.total_steps
        now = utcnow()
        queued_s, prev_step = _queued_s(s, job, now), job.current_step or 0
        # A fresh token per attempt: a model server of an earlier attempt answers no one.
        serve_token = secrets.token_urlsafe(32) if job.kind == "serve" else None
        ok = transition(
            s,
            job_id,
            RUNNING,
            from_statuses=(SCHEDULED,),
            reason=f"attempt {job.attempt} running on {socket.gethostname()}",
            data={"attempt": job.attempt, "host": socket.gethostname(), "pid": os.getpid()},
            runner_host=socket.gethostname(),
            runner_pid=os.getpid(),
            started_at=now,
            heartbeat_at=now,
            total_steps=total_steps,
            serve_token=serve_token,
        )
        if not ok:
            return None
        accelerator = s.scalar(
            select(NodePool.accelerator).join(Node, Node.pool_id == NodePool.id).where(Node.id == job.node_id)
        )
        att = Attempt(
            job_id,
            job.attempt,
            job.max_retries,
            job.num_procs,
            max_runtime_s,
            out_dir,
            devices=job.devices,
            accelerator=accelerator or "cpu",
            node_id=job.node_id,
            queued_s=queued_s,
            prev_step=prev_step,
            checkpoint_interval=int((job.spec.get("training") or {}).get("checkpoint_interval") or 0),
            preemptions=job.preemptions,
            max_preemptions=job.max_preemptions,
            continuations=job.continuations,
            serve_token=serve_token,
            secret_env=secret_env,
        )
        if gang:
            from megatrain.worker.gang import lead

            lead(s, settings, att, rendezvous_port)
        return att


def _queued_s(s: Session, job: Job, now: datetime) -> float:
    """Seconds since the job last entered the queue (its creation, or its last requeue)."""
    since = s.scalar(
        select(func.max(JobEvent.created_at)).where(JobEvent.job_id == job.id, JobEvent.to_status == QUEUED)
    )
    since = since or job.created_at
    return max((now - since).total_seconds(), 0.0) if since else 0.0


def _backfill_earlier_attempts(settings: Settings, att: Attempt) -> None:
    """Ingest what earlier attempts on this host wrote after their runner's last tick (a runner
    killed with -9 leaves such lines behind); the inserts are idempotent, so re-reading is safe."""
    for n in range(1, att.attempt):
        out = settings.runs_dir / att.job_id / f"attempt-{n}"
        if not out.is_dir():
            continue
        metrics = JsonlTail(out / "metrics.jsonl").read()
        # Checkpoint bookkeeping only (saves, retention's deletions, corrupt ones skipped): the
        # attempt's lifecycle events were reported by its own runner.
        kinds = ("checkpoint_saved", "checkpoints_deleted", "checkpoint_corrupt")
        checkpoints = [r for r in JsonlTail(out / "events.jsonl").read() if r.get("event") in kinds]
        try:
            with session_scope(settings.resolved_database_url) as s:
                ingest_metrics(s, att.job_id, metrics)
                ingest_events(s, att.job_id, checkpoints, n)
        except SQLAlchemyError as exc:
            log.warning("job %s: could not backfill attempt %d: %s", att.job_id, n, exc)


def _pump(stream: IO[bytes], lines: queue.Queue[str | None]) -> None:
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
    lines.put(None)


class _Runner:
    """One attempt's reporting loop; all database work happens in short transactions per tick."""

    def __init__(self, settings: Settings, att: Attempt, stop: TimeLimit | None = None):
        self.settings = settings
        self.att = att
        self.stop = stop
        """Where the allocation's time limit comes from, on a cluster that has one (Slurm)."""
        self.url = settings.resolved_database_url
        self.host = socket.gethostname()
        self.node = node_name(settings)
        self.oom = OomWatch(launcher=att.num_procs > 1 or att.rendezvous is not None)
        """The OOM kill counters from before the engine starts, and torchrun's report of its ranks."""
        self.pid = os.getpid()
        self.metrics = JsonlTail(att.out_dir / "metrics.jsonl")
        self.events = JsonlTail(att.out_dir / "events.jsonl")
        self.pending_lines: list[str] = []
        self.next_seq = 0
        self.last_heartbeat = time.monotonic()
        self.watch = HangWatch(hang_rule(settings), self.last_heartbeat, att.checkpoint_interval)
        self.clock = AttemptClock(self.last_heartbeat, att.attempt, att.queued_s, att.prev_step)
        self.hang: Hang | None = None
        self.preempt_asked: float | None = None
        """time.monotonic() when the engine was asked to checkpoint and stop (preemption)."""
        self.preempted_step: int | None = None
        """The step the engine checkpointed at and stopped on when preempted (its 'preempted' event)."""
        self.engine_started = False
        """Whether the engine said it started (its ranks' signal handlers are in place by then)."""
        self.stop_sent = False
        self.redact = att.redact
        """Secret values out of every line and event this runner stores."""

    def tick(self, heartbeat: bool) -> str | None:
        """Flush logs, metrics and events; heartbeat. Returns 'cancel' / 'lost' when the loop must stop."""
        verdict = None
        session = get_sessionmaker(self.url)()
        try:
            # The shards of a gang write one job's log: each numbers its lines after the last stored
            # (a clash with another shard's insert rolls back and retries on the next tick).
            if self.next_seq == 0 or self.att.rendezvous is not None:
                self.next_seq = next_log_seq(session, self.att.job_id)
            seq = append_logs(
                session, self.att.job_id, self.pending_lines, self.next_seq, self.settings.max_log_lines
            )
            metrics, events = self.metrics.read(), self.events.read()
            now = time.monotonic()
            # Fed before the database: a re-read after a failed transaction is harmless to both.
            self.watch.observe_metrics(metrics, now)
            self.watch.observe_events(events, now)
            self.clock.observe_metrics(metrics, now)
            self.clock.observe_events(events)
            for row in events:
                if row.get("event") == "preempted" and isinstance(row.get("step"), int):
                    self.preempted_step = row["step"]
                self.engine_started |= row.get("event") == "started"
            ingest_metrics(session, self.att.job_id, metrics)
            ingest_events(session, self.att.job_id, self.redact.value(events), self.att.attempt)
            verdict = self.check(session, heartbeat)
            session.commit()
        except SQLAlchemyError as exc:
            # A database blip must not kill the training run: keep the lines, re-read the files next tick.
            session.rollback()
            log.warning("job %s: database error while reporting (will retry): %s", self.att.job_id, exc)
            if len(self.pending_lines) > self.settings.max_log_lines:
                del self.pending_lines[: -self.settings.max_log_lines]
            return None
        finally:
            session.close()
        self.next_seq = seq
        self.pending_lines = []
        self.metrics.commit()
        self.events.commit()
        return verdict

    def check(self, session: Session, heartbeat: bool) -> str | None:
        """Heartbeat the job this runner owns; 'lost' when it no longer does, 'cancel' when asked,
        'preempt' when the scheduler preempts it for a higher-priority job."""
        verdict = None
        if heartbeat:
            owned = session.execute(
                update(Job)
                .where(
                    Job.id == self.att.job_id,
                    Job.status == RUNNING,
                    Job.runner_host == self.host,
                    Job.runner_pid == self.pid,
                )
                .values(heartbeat_at=utcnow())
                .execution_options(synchronize_session=False)
            ).rowcount
            if owned != 1:
                verdict = "lost"
        row = session.execute(
            select(Job.status, Job.cancel_requested, Job.runner_pid, Job.preempt_for).where(
                Job.id == self.att.job_id
            )
        ).first()
        if row is None or row.status != RUNNING or row.runner_pid != self.pid:
            verdict = "lost"
        elif row.cancel_requested:
            verdict = "cancel"
        elif row.preempt_for is not None:
            verdict = "preempt"
        return verdict

    def finish(self, outcome: str, rc: int) -> None:
        """Move the job out of running according to how the attempt ended. A failed attempt's reason
        is one line (its traceback is in the job's log); its ranks' records decide whether it is
        retried: an error of the job's own inputs would only repeat, so it fails the job at once."""
        job_id, att = self.att.job_id, self.att
        silent: list[tuple[str, str]] = []
        if outcome == "exited" and rc != 0 and att.rendezvous is not None:
            from megatrain.worker.gang import silent_shares

            silent = silent_shares(self.settings, att)
        failure = None
        clear: dict[str, object] = {"runner_pid": None, "runner_host": None, "heartbeat_at": None}
        with session_scope(self.url) as s:
            if outcome == "lost":
                log.warning("job %s: no longer owned by this runner; engine stopped", job_id)
                return
            # Avoiding the node that failed is a preference: placement still uses it if nothing
            # else has room.
            avoid = sorted({*self._avoid_nodes(s), att.node_id}) if att.node_id else None
            if outcome == "hung" and self.hang is not None:
                failure = "hung"
                retrying = retry_allowed(att)
                reason = self.hang.reason() + ("; retrying from the latest checkpoint" if retrying else "")
                data = self.hang.data() | {"attempt": att.attempt}
                to, fields = (QUEUED, clear | {"avoid_nodes": avoid}) if retrying else (FAILED, {})
                ok = transition(s, job_id, to, from_statuses=(RUNNING,), reason=reason, data=data, **fields)
            elif outcome == "cancel":
                ok = transition(s, job_id, CANCELLED, from_statuses=(RUNNING,), reason="cancelled by request")
            elif outcome == "preempt" and rc != 0:
                ok = requeue_preempted(s, att, self.preempted_step, clear)
            elif outcome == "time_limit" and rc != 0 and self.stop is not None:
                ok = end_at_time_limit(s, att, self.preempted_step, self.stop, clear)
            elif outcome == "timeout":
                reason = f"exceeded max_runtime_s={att.max_runtime_s:g}"
                ok = transition(s, job_id, FAILED, from_statuses=(RUNNING,), reason=reason)
            elif rc == 0:
                ok = transition(s, job_id, SUCCEEDED, from_statuses=(RUNNING,), reason="engine exited 0")
            else:
                ok, infra = end_failed_attempt(s, att, rc, silent, self.node)
                failure = "infrastructure" if infra else None
            if not ok:
                log.warning("job %s: someone else moved it out of running before this runner", job_id)
                return
            status = s.scalar(select(Job.status).where(Job.id == job_id)) or outcome
            if outcome in ("preempt", "time_limit") and status == QUEUED:
                status = "preempted" if outcome == "preempt" else "continued"
            self._record_ledger(s, status, failure)

    def _avoid_nodes(self, s: Session) -> list[str]:
        return list(s.scalar(select(Job.avoid_nodes).where(Job.id == self.att.job_id)) or ())

    def _record_ledger(self, s: Session, outcome: str, failure: str | None) -> None:
        """The attempt's row in the goodput ledger; an infrastructure failure may quarantine its node."""
        att = self.att
        self.clock.hang_s = self.hang.stalled_s if self.hang is not None else 0.0
        now = time.monotonic()
        seconds = self.clock.seconds(now)
        if self.preempt_asked is not None:
            # Checkpointing and stopping on request is lost time, not progress.
            lost = min(max(now - self.preempt_asked, 0.0), seconds["productive_s"])
            seconds |= {"preempt_s": lost, "productive_s": seconds["productive_s"] - lost}
        record_attempt(s, att.job_id, att.node_id, att.attempt, outcome, failure, seconds)
        if failure is not None and att.node_id is not None:
            why = quarantine_if_failing(s, att.node_id, self.settings)
            if why is not None:
                log.warning("node %s quarantined: %s", self.host, why)


def run_shard(
    job_id: str, settings: Settings | None = None, gang: bool = False, stop: TimeLimit | None = None
) -> int:
    """Run one attempt of a scheduled job to its end; returns the engine's exit code (0 if skipped).
    `gang`: the job spans several nodes and this is node rank 0's shard (worker.gang). `stop`: the
    allocation's time limit (Slurm), before which the attempt checkpoints and stops."""
    settings = settings or get_settings()
    att = _claim(settings, job_id, gang)
    if att is None:
        return 0
    url, interval = settings.resolved_database_url, settings.heartbeat_interval_s
    heartbeat = Heartbeat(url, job_id, socket.gethostname(), os.getpid(), interval).start()
    try:
        _backfill_earlier_attempts(settings, att)
        return supervise(settings, att, _Runner(settings, att, stop), heartbeat)
    finally:
        heartbeat.stop()


def supervise(settings: Settings, att: Attempt, runner: _Runner, heartbeat: Heartbeat | None = None) -> int:
    """Start the engine for `att` and report it through `runner` until it ends; the engine's exit
    code. `heartbeat`: the job's heartbeat thread (node rank 0's), told each pass that this loop lives."""
    job_id = att.job_id
    checkpoint_url = f"{settings.resolved_storage_url}/jobs/{job_id}/checkpoints"
    cmd = engine_command(att.num_procs, att.out_dir, checkpoint_url, att.rendezvous)
    env = att.engine_env()
    log.info("job %s attempt %d: %s", job_id, att.attempt, " ".join(cmd))
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=att.out_dir,
            start_new_session=True,  # its own process group, killed as one
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
    except OSError as exc:
        runner.pending_lines.append(f"could not start the engine: {exc}")
        runner.tick(heartbeat=False)
        runner.finish("exited", 127)
        return 127
    lines: queue.Queue[str | None] = queue.Queue()
    pump = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True, name=f"pump-{job_id}")
    pump.start()
    started = time.monotonic()
    outcome = "exited"
    while True:
        if heartbeat is not None:
            heartbeat.touch()
        exited = proc.poll() is not None
        _drain(lines, runner)
        now = time.monotonic()
        beat = now - runner.last_heartbeat >= settings.heartbeat_interval_s
        if beat:
            runner.last_heartbeat = now
        verdict = runner.tick(heartbeat=beat)
        if verdict is None and runner.stop is not None and runner.stop.reached():
            verdict = "time_limit"
        if verdict in ("preempt", "time_limit"):
            outcome = verdict
            why = "preempted" if verdict == "preempt" else "the allocation's time limit is near"
            verdict = verdict if ask_to_stop(settings, proc, att, runner, now, why) else None
        if exited:
            break
        if verdict is None and now - started > att.max_runtime_s:
            verdict = "timeout"
        if verdict is None and (hang := runner.watch.check(now, att.out_dir, runner.host)) is not None:
            verdict = "hung"
            _report_hang(runner, hang, lines)
        if verdict is not None:
            outcome = verdict
            log.info("job %s: stopping the engine (%s)", job_id, verdict)
            terminate_tree(proc, KILL_GRACE_S)
            break
        time.sleep(POLL_S)
    # Whatever the engine wrote last (its final metrics, the last lines of a traceback) still counts.
    pump.join(timeout=5)
    _drain(lines, runner)
    for _ in range(3):
        if runner.tick(heartbeat=False) is not None or not runner.pending_lines:
            break
        time.sleep(1)
    rc = proc.returncode
    if outcome == "exited" and rc != 0 and runner.oom.conclude(rc, att.out_dir, runner.node) is not None:
        log.warning("job %s: the kernel's OOM killer ended a rank on %s", job_id, runner.node)
    for delay in (0, 1, 5):
        time.sleep(delay)
        try:
            runner.finish(outcome, rc)
            break
        except SQLAlchemyError as exc:
            # If this keeps failing the reconciler requeues the job once heartbeats stop.
            log.warning("job %s: could not record the attempt's end (%s); retrying", job_id, exc)
    return rc


def _report_hang(runner: _Runner, hang: Hang, lines: queue.Queue[str | None]) -> None:
    """Name the hang in the log and collect the stopped ranks' stacks before the attempt ends."""
    runner.hang = hang
    log.warning("job %s: %s", runner.att.job_id, hang.reason())
    runner.pending_lines.append(f"megatrain: {hang.reason()}; dumping the stacks of pids {list(hang.pids)}")
    runner.pending_lines += dump_stacks(hang.pids)
    time.sleep(STACK_DUMP_WAIT_S)  # faulthandler writes to the engine's stderr: let it arrive
    _drain(lines, runner)


def _drain(lines: queue.Queue[str | None], runner: _Runner) -> None:
    while True:
        try:
            line = lines.get_nowait()
        except queue.Empty:
            return
        if line is not None:
            runner.pending_lines.append(runner.redact.text(line))
            runner.oom.observe(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatrain.worker.shard", description=__doc__)
    parser.add_argument("--job-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rc = run_shard(args.job_id, get_settings())
    sys.exit(0 if rc == 0 else 1)


if __name__ == "__main__":
    main()
