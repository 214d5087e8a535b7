"""The OpenAI ids of our rows, and back: pure functions, no database.

- a fine-tuning job: "ft" + its job id ("job-3fa…" → "ftjob-3fa…")
- its model: "ft:BASE:TENANT:SUFFIX:ID" (SUFFIX may be empty; ID the job id's hex), and a
  checkpoint of it: that + ":ckpt-step-STEP"
- a checkpoint object: "ftckpt-ID-STEP"; an event: "ftevent-ID-eN" (a job event) or "-mN" (a metric)
Registered model names and tenant names hold no colon (NAME_PATTERN), nor does a suffix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

JOB_PREFIX = "job-"
FT_JOB_PREFIX = "ftjob-"
_HEX = r"[0-9a-f]{1,32}"
_MODEL = re.compile(rf"^ft:([^:]+):([^:]+):([^:]*):({_HEX})(?::ckpt-step-(\d{{1,10}}))?$")
_CHECKPOINT = re.compile(rf"^ftckpt-({_HEX})-(\d{{1,10}})$")
_EVENT = re.compile(rf"^ftevent-({_HEX})-([em])(\d{{1,19}})$")


def ft_job_id(job_id: str) -> str:
    return "ft" + job_id


def job_id_of(ft_id: str) -> str | None:
    """Our job id of a fine-tuning job id, or None for anything else."""
    return ft_id.removeprefix("ft") if ft_id.startswith(FT_JOB_PREFIX) else None


def _hex(job_id: str) -> str:
    return job_id.removeprefix(JOB_PREFIX)


def fine_tuned_model(base: str, tenant: str, suffix: str | None, job_id: str) -> str:
    return f"ft:{base}:{tenant}:{suffix or ''}:{_hex(job_id)}"


def checkpoint_model(fine_tuned: str, step: int) -> str:
    return f"{fine_tuned}:ckpt-step-{step}"


@dataclass(frozen=True)
class ModelId:
    """A parsed ft: model id: its parts, its job, and the step of a checkpoint's (else None)."""

    base: str
    tenant: str
    suffix: str
    job_id: str
    step: int | None


def parse_model(model: str) -> ModelId | None:
    m = _MODEL.match(model)
    if m is None:
        return None
    base, tenant, suffix, hexid, step = m.groups()
    return ModelId(base, tenant, suffix, JOB_PREFIX + hexid, int(step) if step else None)


def checkpoint_id(job_id: str, step: int) -> str:
    return f"ftckpt-{_hex(job_id)}-{step}"


def parse_checkpoint_id(ckpt_id: str) -> tuple[str, int] | None:
    """(job id, step) of a checkpoint object's id."""
    m = _CHECKPOINT.match(ckpt_id)
    return (JOB_PREFIX + m.group(1), int(m.group(2))) if m else None


def event_id(job_id: str, table: str, row_id: int) -> str:
    """`table`: "e" for job_event, "m" for job_metric."""
    return f"ftevent-{_hex(job_id)}-{table}{row_id}"


def parse_event_id(ev_id: str) -> tuple[str, str, int] | None:
    """(job id, table, row id) of an event's id."""
    m = _EVENT.match(ev_id)
    return (JOB_PREFIX + m.group(1), m.group(2), int(m.group(3))) if m else None
