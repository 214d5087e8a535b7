"""What the soak kept, read back from the control plane's database after the run: each job's goodput
from the ledger (attempt_ledger), the steps it recomputed past its last checkpoint, rows lost or
doubled, and for each fault the time to the first step of the attempt that resumed after it.

Rows lost or doubled are judged from what the engine printed against what the database holds:
- log lines: within each attempt the engine prints `step N/M | loss …` at every log_interval, from
  the step after the one it resumed from (`resumed from … step R`, or step 0 on a fresh start, the
  `START` line); a step line missing from that sequence is a lost row, one seen twice a doubled one;
- metrics: every logged training step (each log_interval, and the last) has its row;
- checkpoints: the final step's checkpoint is recorded and its files are whole (manifest checked).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

STEP = re.compile(r"\bstep (\d+)/(\d+) \| loss")
RESUMED = re.compile(r"\bresumed from \S+ step (\d+)")
START = re.compile(r"\bmodel \S+ params \| layout ")
"""The line the engine prints as it starts (engine/run_report.py), after any `resumed from`."""

ENDING_FAULTS = ("kill_rank", "stop_rank", "corrupt_checkpoint", "kill_node")
"""Faults that end the attempt they hit."""
PARTITIONS = ("silence", "storage_outage")
"""Faults that may end it: a node cut from the API past the node-lost bound, or from storage past
its retries while it saves. Such a fault ended an attempt if the job started another within
RESUME_WINDOW_S of the partition's end and before the next fault on that job. The others
(restart_api, drop_db) must end none."""
RESUME_WINDOW_S = 90.0


@dataclass
class Fault:
    kind: str
    at: datetime
    job_id: str | None = None
    attempt: int | None = None
    node: str | None = None
    detail: str = ""
    window_s: float = 0.0
    """How long a partition lasted."""
    ended_attempt: bool = False
    resume_s: float | None = None
    bystanders: int = 0
    """Other jobs' attempts it ended too (the other jobs of a killed node: a Slurm node runs two)."""


@dataclass
class JobResult:
    job_id: str
    tenant: str
    status: str
    reason: str
    attempts: int
    steps: int
    seconds: dict[str, float]
    recomputed_steps: int = 0
    lost: int = 0
    doubled: int = 0
    checkpoint_period_s: float | None = None
    problems: list[str] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    """Why each of its attempts but the last ended (when, and the control plane's reason): what an
    attempt ended by no fault is explained by."""

    @property
    def goodput(self) -> float | None:
        total = sum(self.seconds.values())
        return self.seconds["productive_s"] / total if total else None

    @property
    def running_goodput(self) -> float | None:
        """Productive over the time the job held its slot (its wait in the queue left out)."""
        total = sum(self.seconds.values()) - self.seconds["queued_s"]
        return self.seconds["productive_s"] / total if total > 0 else None


def audit_lines(lines: list[str], log_interval: int) -> tuple[int, int, int]:
    """(lost, doubled, recomputed steps) of one job's log lines, in order."""
    lost = doubled = recomputed = 0
    expected, reached = log_interval, 0
    start: int | None = None
    """Where the attempt whose lines these are began, until its first step line."""
    for line in lines:
        if m := RESUMED.search(line):
            start = int(m.group(1))
        elif START.search(line) and start is None:
            start = 0  # a fresh start (the engine says `resumed from` before this line)
        elif m := STEP.search(line):
            step, total = int(m.group(1)), int(m.group(2))
            if start is not None:
                recomputed += max(reached - start, 0)
                expected, start = start + log_interval - start % log_interval, None
            nxt = min(expected, total)
            if step > nxt:
                lost += (step - nxt + log_interval - 1) // log_interval
            elif step < nxt:
                doubled += 1
            reached, expected = max(reached, step), max(expected, step + log_interval)
    return lost, doubled, recomputed


def expected_metric_steps(total: int, log_interval: int) -> set[int]:
    return set(range(log_interval, total + 1, log_interval)) | {total}


def collect(cluster: Any, job_ids: list[str], faults: list[Fault], log_interval: int) -> list[JobResult]:
    """Each job's result, and each attempt-ending fault's resume_s, from the database."""
    from sqlalchemy import select

    from megatrain.db.goodput import FIELDS
    from megatrain.db.models import AttemptLedger, Checkpoint, Job, JobEvent, JobLog, JobMetric, Tenant

    results = []
    with cluster.session() as s:
        for job_id in job_ids:
            job = s.get(Job, job_id)
            tenant = s.get(Tenant, job.tenant_id).name
            ledger = list(s.scalars(select(AttemptLedger).where(AttemptLedger.job_id == job_id)))
            seconds = {k: sum(float(getattr(r, k) or 0.0) for r in ledger) for k in FIELDS}
            lines = list(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
            lost, doubled, recomputed = audit_lines(lines, log_interval)
            res = JobResult(job_id, tenant, job.status, job.status_reason or "", job.attempt,
                            job.current_step, seconds, recomputed, lost, doubled)  # fmt: skip
            ends = select(JobEvent.created_at, JobEvent.reason).where(
                JobEvent.job_id == job_id,
                JobEvent.from_status == "running",
                JobEvent.to_status != "succeeded",
            )
            res.ends = [f"{at:%H:%M:%S} {why}" for at, why in s.execute(ends.order_by(JobEvent.id))]
            if job.status == "succeeded":
                q = select(JobMetric.step).where(JobMetric.job_id == job_id, JobMetric.kind == "train")
                missing = expected_metric_steps(job.total_steps, log_interval) - set(s.scalars(q))
                res.lost += len(missing)
                if missing:
                    res.problems.append(f"metric rows missing at steps {sorted(missing)[:5]}")
                ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
                res.problems += _checkpoint_problems(ckpts, job.total_steps)
                res.checkpoint_period_s = _period(sorted(c.created_at for c in ckpts))
            results.append(res)
        for fault in faults:
            if fault.job_id is None or fault.kind not in (*ENDING_FAULTS, *PARTITIONS):
                continue
            q = select(JobEvent.created_at).where(
                JobEvent.job_id == fault.job_id,
                JobEvent.kind == "started",
                JobEvent.created_at > fault.at,
            )
            if fault.kind in PARTITIONS:  # a restart after the next fault on that job is that fault's
                later = [f.at for f in faults if f.job_id == fault.job_id and f.at > fault.at]
                until = min([fault.at + timedelta(seconds=fault.window_s + RESUME_WINDOW_S), *later])
                q = q.where(JobEvent.created_at <= until)
            started = s.scalar(q.order_by(JobEvent.created_at).limit(1))
            fault.ended_attempt = fault.kind in ENDING_FAULTS or started is not None
            if started is None:
                continue
            first_step = s.scalar(
                select(JobLog.created_at)
                .where(
                    JobLog.job_id == fault.job_id,
                    JobLog.created_at >= started,
                    JobLog.line.contains(" | loss "),
                )
                .order_by(JobLog.seq)
                .limit(1)
            )
            # An attempt that resumed at the job's last step has no step to run: its start is it.
            fault.resume_s = ((first_step or started) - fault.at).total_seconds()
    return results


def _period(times: list[datetime]) -> float | None:
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def _checkpoint_problems(ckpts: list[Any], total: int) -> list[str]:
    from megatrain.engine.checkpoint.folder import check_files, read_manifest
    from megatrain.storage import open_store

    final = [c for c in ckpts if c.step == total]
    if not final:
        return [f"no checkpoint at the final step {total}"]
    folder = open_store(final[0].uri)
    try:
        check_files(folder, read_manifest(folder), deep=True)
    except (OSError, ValueError) as exc:
        return [f"final checkpoint: {exc}"]
    return []


def summarize(results: list[JobResult], faults: list[Fault], wall_s: float) -> dict[str, Any]:
    sums = {k: sum(r.seconds[k] for r in results) for k in results[0].seconds} if results else {}
    total = sum(sums.values())
    held = total - sums.get("queued_s", 0.0)
    ending = [f for f in faults if f.ended_attempt]
    resumes = [f.resume_s for f in ending if f.resume_s is not None]
    attempts = sum(r.attempts for r in results)
    return {
        "wall_s": round(wall_s, 1),
        "jobs": len(results),
        "succeeded": sum(r.status == "succeeded" for r in results),
        "failed": {r.job_id: r.reason for r in results if r.status != "succeeded"},
        "faults": len(faults),
        "faults_by_kind": _by_kind(faults),
        "attempts_ended_by_kind": {
            k: n + sum(f.bystanders for f in ending if f.kind == k) for k, n in _by_kind(ending).items()
        },
        "goodput": round(sums["productive_s"] / total, 4) if total else None,
        "running_goodput": round(sums["productive_s"] / held, 4) if held > 0 else None,
        "seconds": {k: round(v, 1) for k, v in sums.items()},
        "recomputed_steps": sum(r.recomputed_steps for r in results),
        "lost": sum(r.lost for r in results),
        "doubled": sum(r.doubled for r in results),
        "problems": {r.job_id: r.problems for r in results if r.problems},
        "attempt_ends": {r.job_id: r.ends for r in results if r.ends},
        "resume_s_max": round(max(resumes), 1) if resumes else None,
        "resume_s_median": round(statistics.median(resumes), 1) if resumes else None,
        "resumes_missing": sum(f.resume_s is None for f in ending),
        "unplanned_attempts": attempts - len(results) - len(ending) - sum(f.bystanders for f in ending),
        "checkpoint_period_s": _median([r.checkpoint_period_s for r in results]),
        "fault_log": [asdict(f) | {"at": f.at.isoformat()} for f in faults],
    }


def _by_kind(faults: list[Fault]) -> dict[str, int]:
    return {k: sum(f.kind == k for f in faults) for k in sorted({f.kind for f in faults})}


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 1) if kept else None


def table(results: list[JobResult], summary: dict[str, Any]) -> str:
    rows = ["| job | tenant | status | attempts | goodput | while held | recomputed | lost | doubled |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results:
        g, h = r.goodput, r.running_goodput
        rows.append(
            f"| {r.job_id} | {r.tenant} | {r.status} | {r.attempts} | {_pct(g)} | {_pct(h)} | "
            f"{r.recomputed_steps} | {r.lost} | {r.doubled} |"
        )
    s = summary
    rows += [
        "",
        f"wall {s['wall_s']:.0f} s; {s['jobs']} jobs, {s['succeeded']} succeeded; {s['faults']} faults "
        f"{s['faults_by_kind']}; attempts they ended {s['attempts_ended_by_kind']}",
        f"goodput {_pct(s['goodput'])} (ledger: productive over all job time, queue included); "
        f"{_pct(s['running_goodput'])} while holding a slot; seconds {s['seconds']}",
        f"recomputed steps {s['recomputed_steps']}; rows lost {s['lost']}, doubled {s['doubled']}; "
        f"attempts ended by no fault {s['unplanned_attempts']}",
        f"fault -> first resumed step: median {s['resume_s_median']} s, max {s['resume_s_max']} s "
        f"({s['resumes_missing']} without a resume); checkpoint every {s['checkpoint_period_s']} s",
    ]
    if s["failed"]:
        rows.append(f"failed: {s['failed']}")
    if s["problems"]:
        rows.append(f"problems: {s['problems']}")
    if s["unplanned_attempts"]:
        fault_times = ", ".join(f"{f['kind']} {f['job_id'] or ''} {f['at'][11:19]}" for f in s["fault_log"])
        rows.append(f"faults at: {fault_times}")
        rows += [f"{job} ended: {end}" for job, ends in s["attempt_ends"].items() for end in ends]
    return "\n".join(rows)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"
