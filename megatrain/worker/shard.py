"""The shard runner: runs one attempt of a job under torchrun and reports it to the control plane.

`run_shard(job_id, settings)` claims a `scheduled` job (→ running), launches the engine, then loops:
forward its output to the job's log, its metrics.jsonl/events.jsonl to the job's tables, in numbered
batches (attempts.reports.report), heartbeat, honour cancel requests and max_runtime_s. On exit the
job succeeds, is queued again (the engine resumes from the latest checkpoint) or fails. Every call
goes through a worker.reporter.Reporter: the database itself, or the API with a node token.

CLI: `python -m megatrain.worker.shard --job-id ID` (what the local executor spawns).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from megatrain.failures import read_records
from megatrain.faults import checkpoints_to_corrupt, corrupt_checkpoint
from megatrain.settings import Settings, get_settings
from megatrain.storage import open_store
from megatrain.worker.attempt import Attempt, engine_env
from megatrain.worker.hang import Hang, dump_stacks, shard_progress, watch_attempt
from megatrain.worker.heartbeat import Heartbeat
from megatrain.worker.ingest import JsonlTail
from megatrain.worker.launch import (  # noqa: F401  (re-exported)
    DEFAULT_ENGINE_MODULE,
    ENGINE_MODULE_ENV,
    Rendezvous,
    engine_command,
    free_port,
)
from megatrain.worker.ledger import AttemptClock
from megatrain.worker.metrics import worker_metrics
from megatrain.worker.nodes import _packages, node_name, slot_cpus
from megatrain.worker.oom import OomWatch
from megatrain.worker.preempt import TimeLimit, ask_to_stop
from megatrain.worker.procs import start_engine, terminate_tree
from megatrain.worker.reporter import Reporter, ReportError, ReportRefused, reporter_for
from megatrain.worker.storage_access import StorageKeys, scoped

log = logging.getLogger(__name__)

KILL_GRACE_S = float(os.environ.get("MEGATRAIN_KILL_GRACE_S", "10"))
"""Seconds between SIGTERM and SIGKILL when a job is cancelled or runs out of time."""
POLL_S = 0.25
STACK_DUMP_WAIT_S = 2.0


MAX_BATCH_LINES = 5000
"""Log lines per batch of reports (the rest wait for the next tick)."""
IDLE_REPORT_S = 1.0
"""With nothing new to report, the control plane is still asked this often (its answer says whether
the job was cancelled or preempted); the loop itself looks at the engine every POLL_S."""
FLUSH_S = 60.0
"""How long an ended attempt's runner keeps trying to report the engine's last rows before it
reports the end anyway (the control plane may be restarting)."""
CLAIM_RETRY_S = (1, 2, 4, 8, 15, 30)
"""Waits between tries of a claim or an attempt's end the control plane could not take (an API
restarting): both are safe to repeat."""


def _claim(
    settings: Settings,
    job_id: str,
    gang: bool = False,
    reporter: Reporter | None = None,
    attempt: int | None = None,
) -> Attempt | None:
    """scheduled → running, owned by this process; None when there is nothing (more) to do.

    For a multi-node job (`gang`) this process is node rank 0's shard: it owns the attempt, runs its
    node's share and publishes the rendezvous endpoint the other shards join (worker.gang)."""
    reporter = reporter or reporter_for(settings)
    endpoint = f"{settings.node_address or socket.gethostname()}:{free_port()}" if gang else None
    node, host = node_name(settings), socket.gethostname()
    for delay in (*CLAIM_RETRY_S, None):
        try:
            answer = reporter.claim(
                job_id,
                node=node,
                host=host,
                pid=os.getpid(),
                packages=_packages(),
                endpoint=endpoint,
                attempt=attempt,
            )
            break
        except ReportRefused as exc:
            log.error("job %s: the control plane refused this node's claim: %s", job_id, exc)
            return None
        except ReportError as exc:
            if delay is None:
                raise
            log.warning("job %s: could not claim it yet (%s); retrying in %ss", job_id, exc, delay)
            time.sleep(delay)
    if "skip" in answer:
        log.info("job %s: nothing to run: %s", job_id, answer["skip"])
        return None
    wire = answer["attempt"]
    out_dir = settings.runs_dir / job_id / f"attempt-{wire['attempt']}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spec.json").write_text(json.dumps(answer["spec"], indent=2, sort_keys=True))
    (out_dir / "layout.json").write_text(json.dumps(answer["layout"], indent=2, sort_keys=True))
    return Attempt.from_wire(wire, out_dir)


def _backfill_earlier_attempts(settings: Settings, att: Attempt, reporter: Reporter) -> None:
    """Report what earlier attempts on this host wrote after their runner's last tick (a runner
    killed with -9 leaves such lines behind); the inserts are idempotent, so re-reading is safe."""
    for n in range(1, att.attempt):
        out = settings.runs_dir / att.job_id / f"attempt-{n}"
        if not out.is_dir():
            continue
        metrics = JsonlTail(out / "metrics.jsonl").read()
        # Checkpoint bookkeeping only (the control plane keeps those kinds): the attempt's
        # lifecycle events were reported by its own runner.
        events = JsonlTail(out / "events.jsonl").read()
        try:
            reporter.backfill(att.job_id, n, metrics, events)
        except ReportError as exc:
            log.warning("job %s: could not backfill attempt %d: %s", att.job_id, n, exc)


def _pump(stream: IO[bytes], lines: queue.Queue[str | None]) -> None:
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
    lines.put(None)


class _Runner:
    """One attempt's reporting loop: each tick sends one numbered batch (lines, metrics, events),
    and a batch the control plane did not acknowledge is sent again, unchanged, on the next."""

    follower = False
    """A non-zero node rank of a gang (worker.gang._FollowerRunner): it owns nothing."""

    def __init__(
        self,
        settings: Settings,
        att: Attempt,
        stop: TimeLimit | None = None,
        reporter: Reporter | None = None,
    ):
        self.settings = settings
        self.att = att
        self.stop = stop
        """Where the allocation's time limit comes from, on a cluster that has one (Slurm)."""
        self.reporter = reporter or reporter_for(settings)
        self.host = socket.gethostname()
        self.node = node_name(settings)
        self.oom = OomWatch(launcher=att.num_procs > 1 or att.rendezvous is not None)
        """The OOM kill counters from before the engine starts, and torchrun's report of its ranks."""
        self.pid = os.getpid()
        self.metrics = JsonlTail(att.out_dir / "metrics.jsonl")
        self.events = JsonlTail(att.out_dir / "events.jsonl")
        self.pending_lines: list[str] = []
        self.seq = 0
        self.unacked: dict[str, Any] | None = None
        """The batch sent last and not acknowledged: sent again as it is, with its number."""
        self.caught_up = False
        """Whether the last tick's batch, acknowledged, held everything the engine had written."""
        self.reported_at = float("-inf")
        """time.monotonic() of the last acknowledged batch."""
        self.last_heartbeat = time.monotonic()
        self.watch = watch_attempt(settings, att, self.last_heartbeat)
        self.clock = AttemptClock(self.last_heartbeat, att.attempt, att.queued_s, att.prev_step)
        self.live = worker_metrics().attempt(att.job_id)  # this worker's /metrics (worker.metrics)
        self.hang: Hang | None = None
        self.peers: list[dict[str, Any]] = []  # the other shards' ranks (node rank 0 of a gang)
        self.preempt_asked: float | None = None
        """time.monotonic() when the engine was asked to checkpoint and stop (preemption)."""
        self.preempted_step: int | None = None
        """The step the engine checkpointed at and stopped on when preempted (its 'preempted' event)."""
        self.engine_started = False
        """Whether the engine said it started (its ranks' signal handlers are in place by then)."""
        self.stop_sent = False
        self.redact = att.redact
        """Secret values out of every line and event this runner reports."""
        self.corrupt = checkpoints_to_corrupt()
        """Step → an operator's fault that corrupts the checkpoint saved there (megatrain.faults)."""

    def _inject_corruption(self, saved: dict[str, Any]) -> None:
        """An operator's `corrupt:` fault (megatrain.faults): one bit of the checkpoint just saved."""
        key = corrupt_checkpoint(open_store(str(saved.get("uri") or "")), self.corrupt[saved["step"]])
        if key is not None:
            step = saved["step"]
            line = (
                f"megatrain: injected fault corrupt: flipped a bit of {key} in the checkpoint at step {step}"
            )
            log.warning("job %s: %s", self.att.job_id, line)
            self.pending_lines.append(line)

    def prefix(self, lines: list[str]) -> list[str]:
        """The lines as the job's log shows them (a follower names its node)."""
        return lines

    def _next_batch(self, heartbeat: bool) -> dict[str, Any] | None:
        """Everything new since the last batch, numbered; the files' offsets move past it now (the
        batch holds the rows until the control plane acknowledges them). None when there is
        nothing new, no heartbeat is due and the control plane was asked within IDLE_REPORT_S."""
        metrics, events = self.metrics.read(), self.events.read()
        now = time.monotonic()
        self.watch.observe_metrics(metrics, now)
        self.watch.observe_events(events, now)
        self.clock.observe_metrics(metrics, now)
        self.clock.observe_events(events)
        self.live.observe(metrics, self.clock.resumed_from)
        for row in events:
            if row.get("event") == "preempted" and isinstance(row.get("step"), int):
                self.preempted_step = row["step"]
            self.engine_started |= row.get("event") == "started"
            if row.get("event") == "checkpoint_saved" and row.get("step") in self.corrupt:
                self._inject_corruption(row)
        self.metrics.commit()
        self.events.commit()
        idle = not (metrics or events or self.pending_lines or heartbeat)
        if idle and now - self.reported_at < IDLE_REPORT_S:
            return None
        lines = self.prefix(self.pending_lines[:MAX_BATCH_LINES])
        del self.pending_lines[:MAX_BATCH_LINES]
        self.seq += 1
        rank = self.att.rendezvous.node_rank if self.att.rendezvous is not None else 0
        batch = {
            "attempt": self.att.attempt,
            "node_rank": rank,
            "seq": self.seq,
            "host": self.host,
            "pid": self.pid,
            "follower": self.follower,
            "lines": lines,
            "metrics": metrics,
            "events": self.redact.value(events),
        }
        if self.att.rendezvous is not None:  # a gang: its shards' ranks meet in node rank 0's report
            batch |= (
                {"progress": shard_progress(self.att.out_dir, self.node)} if self.follower else {"gang": True}
            )
        return batch

    def tick(self, heartbeat: bool) -> str | None:
        """Report what is new; heartbeat. Returns 'cancel' / 'lost' / 'preempt' when the loop must stop."""
        fresh, self.caught_up = self.unacked is None, False
        if fresh:
            self.unacked = self._next_batch(heartbeat)
            if self.unacked is None:  # nothing new, and the last answer is recent
                self.caught_up = True
                return None
        try:
            answer = self.reporter.report(self.att.job_id, self.unacked | {"heartbeat": heartbeat})
        except ReportRefused as exc:
            log.warning("job %s: the control plane refused this runner's report: %s", self.att.job_id, exc)
            return "lost"
        except ReportError as exc:
            # A blip must not kill the training run: the batch goes again next tick, new lines wait.
            log.warning("job %s: could not report (will retry): %s", self.att.job_id, exc)
            if len(self.pending_lines) > self.settings.max_log_lines:
                del self.pending_lines[: -self.settings.max_log_lines]
            return None
        self.unacked = None
        self.reported_at = time.monotonic()
        self.peers = answer.get("peers") or self.peers
        self.caught_up = fresh and not self.pending_lines
        return answer.get("verdict")

    def finish(self, outcome: str, rc: int) -> None:
        """Tell the control plane how the attempt ended (attempts.reports.finish decides what becomes
        of the job). A failed attempt's records say whether it is retried: an error of the job's own
        inputs would only repeat, so it fails the job at once."""
        att = self.att
        if outcome == "lost":
            self.live.end(outcome, rc, None)
            log.warning("job %s: no longer owned by this runner; engine stopped", att.job_id)
            return
        silent: list[tuple[str, str]] = []
        if outcome == "exited" and rc != 0 and att.rendezvous is not None:
            from megatrain.worker.gang import silent_shares

            silent = silent_shares(self.settings, att, reporter=self.reporter)
        hang = None
        if outcome == "hung" and self.hang is not None:
            hang = {
                "reason": self.redact.text(self.hang.reason()),
                "data": self.redact.value(self.hang.data()),
            }
        end = {
            "outcome": outcome,
            "rc": rc,
            "node": self.node,
            "records": self.redact.value(read_records(att.out_dir, self.node)),
            "silent": silent,
            "preempted_step": self.preempted_step,
            "hang": hang,
            "time_limit_s": self.stop.limit_s if self.stop is not None else None,
            "seconds": self._ledger_seconds(),
        }
        self.live.end(outcome, rc, end["seconds"])
        if self.reporter.finish(att, end) is None:
            log.warning("job %s: someone else moved it out of running before this runner", att.job_id)

    def _ledger_seconds(self) -> dict[str, float]:
        """The attempt's row in the goodput ledger (worker.ledger)."""
        self.clock.hang_s = self.hang.stalled_s if self.hang is not None else 0.0
        now = time.monotonic()
        seconds = self.clock.seconds(now)
        if self.preempt_asked is not None:
            # Checkpointing and stopping on request is lost time, not progress.
            lost = min(max(now - self.preempt_asked, 0.0), seconds["productive_s"])
            seconds |= {"preempt_s": lost, "productive_s": seconds["productive_s"] - lost}
        return seconds


def run_shard(
    job_id: str,
    settings: Settings | None = None,
    gang: bool = False,
    stop: TimeLimit | None = None,
    attempt: int | None = None,
) -> int:
    """Run one attempt of a scheduled job to its end; returns the engine's exit code (0 if skipped).
    `gang`: the job spans several nodes and this is node rank 0's shard (worker.gang). `stop`: the
    allocation's time limit (Slurm), before which the attempt checkpoints and stops. `attempt`:
    the attempt this runner was started for (none other is run)."""
    settings = settings or get_settings()
    reporter = reporter_for(settings)
    att = _claim(settings, job_id, gang, reporter, attempt)
    if att is None:
        return 0
    interval = settings.heartbeat_interval_s
    heartbeat = Heartbeat(reporter, job_id, socket.gethostname(), os.getpid(), interval).start()
    try:
        _backfill_earlier_attempts(settings, att, reporter)
        return supervise(settings, att, _Runner(settings, att, stop, reporter), heartbeat)
    finally:
        heartbeat.stop()


def supervise(settings: Settings, att: Attempt, runner: _Runner, heartbeat: Heartbeat | None = None) -> int:
    """Start the engine for `att` and report it through `runner` until it ends; the engine's exit
    code. `heartbeat`: the job's heartbeat thread (node rank 0's), told each pass that this loop lives."""
    job_id = att.job_id
    checkpoint_url = f"{settings.resolved_storage_url}/jobs/{job_id}/checkpoints"
    cmd = engine_command(att.num_procs, att.out_dir, checkpoint_url, att.rendezvous)
    env = engine_env(att)
    keys = None
    if scoped(settings):
        try:
            keys = StorageKeys(runner.reporter, job_id, att.attempt, Path(att.out_dir) / "storage").start()
        except ReportError as exc:  # ReportRefused too
            runner.pending_lines.append(f"could not get the attempt's scoped storage key: {exc}")
            runner.tick(heartbeat=False)
            runner.finish("exited", 127)
            return 127
        env = keys.env(env)
    try:
        return _supervise(settings, att, runner, heartbeat, cmd, env)
    finally:
        if keys is not None:
            keys.stop()
        runner.live.end("runner_error", -1, None)  # counted by finish() unless the runner raised


def _supervise(
    settings: Settings,
    att: Attempt,
    runner: _Runner,
    heartbeat: Heartbeat | None,
    cmd: list[str],
    env: dict[str, str],
) -> int:
    job_id = att.job_id
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
            preexec_fn=functools.partial(start_engine, os.getpid(), _engine_cpus(att)),
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
        if (
            verdict is None
            and runner.hang is None
            and (hang := runner.watch.check(now, att.out_dir, runner.host, runner.peers)) is not None
        ):
            _report_hang(runner, hang, lines)
            # Node rank 0 ends a gang's attempt, naming the gang's lowest ranks; another shard puts its
            # ranks' stacks in the log and goes on until told the attempt is over.
            verdict = None if runner.follower else "hung"
        if verdict is not None:
            outcome = verdict
            log.info("job %s: stopping the engine (%s)", job_id, verdict)
            terminate_tree(proc, KILL_GRACE_S)
            break
        time.sleep(POLL_S)
    # Whatever the engine wrote last (its final metrics, the last lines of a traceback) still counts.
    pump.join(timeout=5)
    _drain(lines, runner)
    deadline = time.monotonic() + FLUSH_S
    while runner.tick(heartbeat=False) is None and not runner.caught_up and time.monotonic() < deadline:
        time.sleep(1)
    rc = proc.returncode
    if outcome == "exited" and rc != 0 and runner.oom.conclude(rc, att.out_dir, runner.node) is not None:
        log.warning("job %s: the kernel's OOM killer ended a rank on %s", job_id, runner.node)
    for delay in (0, *CLAIM_RETRY_S):
        time.sleep(delay)
        try:
            runner.finish(outcome, rc)
            break
        except ReportRefused as exc:
            log.warning("job %s: the control plane refused the attempt's end: %s", job_id, exc)
            break
        except ReportError as exc:
            # If this keeps failing the reconciler requeues the job once heartbeats stop.
            log.warning("job %s: could not record the attempt's end (%s); retrying", job_id, exc)
    return rc


def _engine_cpus(att: Attempt) -> set[int] | None:
    """The cores of the slots a CPU attempt was placed on (None: every core this runner has)."""
    if att.accelerator != "cpu":
        return None
    return slot_cpus(att.devices, att.node_slots, sorted(os.sched_getaffinity(0)))


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
