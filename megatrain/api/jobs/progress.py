"""A running job's pace and ETA from what the engine measured: the median of its recent iteration
times (metrics rows' `iter_time_s`) times the steps left. One small indexed query per running job;
queued and finished jobs cost nothing."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from statistics import median

from sqlalchemy import select
from sqlalchemy.orm import Session

from megatrain.db.models import RUNNING, Job, JobMetric

RECENT_ROWS = 5
"""Log intervals the median looks at: recent enough to follow a change of pace, enough to ignore
one slow interval (a checkpoint, an evaluation)."""


@dataclass(frozen=True)
class Pace:
    step_time_s: float
    eta_s: float
    eta_at: datetime


def pace_from(
    iter_times: list[float], current_step: int, total_steps: int, measured_at: datetime
) -> Pace | None:
    """The ETA of a job at `current_step` of `total_steps` whose recent iterations took `iter_times`
    seconds, counted from when the newest of them was measured; None without a measurement."""
    times = [t for t in iter_times if t > 0]
    if not times or total_steps <= 0:
        return None
    step = median(times)
    eta = max(0, total_steps - current_step) * step
    return Pace(step, eta, measured_at + timedelta(seconds=eta))


def job_pace(session: Session, job: Job) -> Pace | None:
    """The pace of a running job (None for any other, or before its first metrics row)."""
    if job.status != RUNNING:
        return None
    rows = session.execute(
        select(JobMetric.data, JobMetric.created_at)
        .where(JobMetric.job_id == job.id, JobMetric.kind == "train")
        .order_by(JobMetric.step.desc())
        .limit(RECENT_ROWS)
    ).all()
    times = [float(r.data["iter_time_s"]) for r in rows if isinstance(r.data.get("iter_time_s"), int | float)]
    if not rows:
        return None
    return pace_from(times, job.current_step, job.total_steps, max(r.created_at for r in rows))
