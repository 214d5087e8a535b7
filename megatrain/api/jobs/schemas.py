"""Response shapes of the jobs API (the request body is a JobSpec: megatrain/spec.py)."""

from __future__ import annotations

from collections import OrderedDict
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field

from megatrain.plan.shapes import spec_param_counts
from megatrain.spec import JobSpec

PARAM_COUNTS_KEPT = 4096
_param_counts_by_hash: OrderedDict[str, dict[str, int] | None] = OrderedDict()
"""A stored job's spec never changes, so its spec_hash names its parameter counts: validating the
whole JobSpec again for every answer was a fifth of a list page's CPU."""


def has_param_counts(spec_hash: str | None) -> bool:
    return spec_hash is not None and spec_hash in _param_counts_by_hash


def param_counts(spec_hash: str | None, spec: dict[str, Any] | None) -> dict[str, int] | None:
    """The planner's parameter counts of a stored spec (None when its vocabulary is a tokenizer
    file's, or the spec is one an older release wrote and this one cannot read)."""
    if spec_hash is not None and spec_hash in _param_counts_by_hash:
        _param_counts_by_hash.move_to_end(spec_hash)
        return _param_counts_by_hash[spec_hash]
    if spec is None:
        return None
    try:
        counts = spec_param_counts(JobSpec.model_validate(spec))
    except (ValidationError, ValueError):
        counts = None
    if spec_hash is not None:
        _param_counts_by_hash[spec_hash] = counts
        while len(_param_counts_by_hash) > PARAM_COUNTS_KEPT:
            _param_counts_by_hash.popitem(last=False)
    return counts


class JobPublic(BaseModel):
    """A job as every job endpoint returns it."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    kind: str
    status: str
    status_reason: str
    spec: dict[str, Any] | None
    """The job's spec; null in list pages unless asked for (`?include=spec`)."""
    spec_hash: str | None = Field(None, exclude=True)
    priority: int
    pool: str
    layout: dict[str, Any]
    num_procs: int
    attempt: int
    max_retries: int
    preemptions: int = 0
    """Attempts that ended preempted (requeued for a higher-priority job; not retries)."""
    max_preemptions: int = 10
    """resources.max_preemptions: once reached, the job is no longer preempted."""
    continuations: int = 0
    """Attempts that ended at an allocation's time limit and continued (not retries either)."""
    cancel_requested: bool
    idempotency_key: str | None
    current_step: int
    total_steps: int
    latest_loss: float | None
    latest_tokens_per_s: float | None
    latest_mfu: float | None
    num_params: int | None
    created_at: datetime
    updated_at: datetime
    scheduled_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None

    wait_reason: dict[str, Any] | None = Field(None, exclude=True)
    step_time_s: float | None = None
    """Running: the median of the recent iteration times the engine measured (seconds)."""
    eta_s: float | None = None
    """Running: steps left × step_time_s, counted from the newest measurement (eta_at - that)."""
    eta_at: datetime | None = None
    """Running: when it is expected to finish at its measured pace."""
    goodput: dict[str, Any] | None = None
    """GET /v1/jobs/{id} only: the goodput ledger over its ended attempts (db.goodput.job_goodput):
    productive_s, queued_s, restart_s, checkpoint_stall_s, hang_s, preempt_s, eval_s, attempts,
    goodput (share); null until an attempt has ended."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def progress(self) -> float | None:
        """current_step / total_steps, in [0, 1]; None before the step count is known."""
        return min(1.0, self.current_step / self.total_steps) if self.total_steps else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def queue_position(self) -> int | None:
        """Queued: its place in its pool's queue as the scheduler last decided (1 = next)."""
        position = (self.wait_reason or {}).get("position")
        return position if self.status == "queued" and isinstance(position, int) else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def wait(self) -> dict[str, Any] | None:
        """Queued: why it waits, as data (scheduler.reasons: a code and its numbers). A blocking
        job is left out here (it may be another tenant's); status_reason names it to its owner."""
        if self.status != "queued" or not self.wait_reason:
            return None
        return {k: v for k, v in self.wait_reason.items() if k not in ("job_id", "position")}

    @computed_field  # type: ignore[prop-decorator]
    @property
    def params_estimate(self) -> int | None:
        """Parameters of the model the spec builds, experts included (megatrain.plan.shapes, the
        planner's count; num_params is the engine's exact count once started). None when the
        vocabulary is a tokenizer file's without model.vocab_size."""
        counts = self._param_counts
        return counts["total"] if counts else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def params_active_estimate(self) -> int | None:
        """Of params_estimate, those one token runs through (an MoE model's unrouted experts left out)."""
        counts = self._param_counts
        return counts["active"] if counts else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def params_trainable_estimate(self) -> int | None:
        """A LoRA or QLoRA job's adapters (the parameters it trains, on top of params_estimate's
        frozen ones); None for a full-parameter job, which trains them all."""
        counts = self._param_counts
        return counts.get("trainable") if counts else None

    @property
    def _param_counts(self) -> dict[str, int] | None:
        return param_counts(self.spec_hash, self.spec)


class JobPage(BaseModel):
    items: list[JobPublic]
    next_cursor: str | None
    """Pass as ?cursor= for the next (older) page; null on the last page."""


class JobEventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    kind: str
    from_status: str | None
    to_status: str | None
    reason: str
    data: dict[str, Any]
    created_at: datetime


class LogLinePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    seq: int
    line: str
    created_at: datetime


class CheckpointPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    uri: str
    size_bytes: int
    created_at: datetime


class SpecCheck(BaseModel):
    """What POST /v1/spec/validate found: the spec as the API would store it, and its layout."""

    valid: bool
    spec: dict[str, Any]
    layout: dict[str, Any]
    num_procs: int
    plan: dict[str, Any] | None = None
    """The planner's layout and prediction (`predicted`: step time, tokens/s, MFU, memory per
    device); null when the spec's pool has no description and no nodes to plan on."""
    auto: dict[str, Any] = Field(default_factory=dict)
    """What each field the spec left to auto became, by field: `parallelism: auto`'s layout
    ("parallelism.tp": 2, ..., and "training.recompute" where planning changed it), dp auto's
    degree, micro_batch_size auto's size ({"training.micro_batch_size": 8}); empty when none."""
