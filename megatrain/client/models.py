"""Plain dataclasses the SDK returns; each keeps the server's whole object in `raw`.

The API may add fields at any time; unknown ones land in `raw` rather than breaking old clients.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Self

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


def _pick(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls) if f.name != "raw"}
    return {k: v for k, v in data.items() if k in names}


@dataclass
class Job:
    id: str
    name: str = ""
    kind: str = ""
    status: str = ""
    status_reason: str = ""
    created_at: str | None = None
    updated_at: str | None = None
    scheduled_at: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    current_step: int = 0
    total_steps: int = 0
    latest_loss: float | None = None
    latest_tokens_per_s: float | None = None
    latest_mfu: float | None = None
    num_params: int | None = None
    layout: dict[str, Any] | None = None
    num_procs: int | None = None
    attempt: int = 0
    max_retries: int | None = None
    preemptions: int = 0
    max_preemptions: int | None = None
    continuations: int = 0
    cancel_requested: bool = False
    priority: int | None = None
    pool: str | None = None
    idempotency_key: str | None = None
    spec: dict[str, Any] | None = field(default=None, repr=False)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        return cls(**_pick(cls, data), raw=dict(data))

    @property
    def done(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def no_checkpoints(self) -> str:
        """Says the job has no checkpoint; "yet" only while it may still save one."""
        if self.done:
            return f"job {self.id} {self.status} without saving a checkpoint"
        return f"job {self.id} has no checkpoints yet"

    @property
    def progress(self) -> float:
        """Fraction of total_steps done, in [0, 1]."""
        return min(1.0, self.current_step / self.total_steps) if self.total_steps else 0.0


@dataclass
class Checkpoint:
    step: int
    uri: str = ""
    size_bytes: int = 0
    created_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Checkpoint:
        return cls(**_pick(cls, data), raw=dict(data))


class _Record:
    """`from_dict` for a dataclass with a `raw` field."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**_pick(cls, data), raw=dict(data))  # type: ignore[call-arg]


@dataclass
class Export(_Record):
    """A checkpoint export: `status` pending → running → ready | failed (`error` says why). `form`:
    model (the whole model, a LoRA job's merged) or adapter (a LoRA job's adapters, PEFT's folder)."""

    id: str
    job_id: str = ""
    step: int = 0
    format: str = "hf"
    form: str = "model"
    dtype: str = "bf16"
    status: str = ""
    error: str = ""
    uri: str | None = None
    size_bytes: int | None = None
    attempt: int = 0
    created_at: str | None = None
    finished_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def done(self) -> bool:
        return self.status in ("ready", "failed")

    @property
    def marker(self) -> str:
        """The file its folder is complete with (written last)."""
        return "adapter_config.json" if self.form == "adapter" else "config.json"


@dataclass
class Sample(_Record):
    """Text generated from a checkpoint: `status` pending → running → ready (`text`, the continuation
    alone) | failed (`error` says why)."""

    id: str
    job_id: str = ""
    step: int = 0
    status: str = ""
    prompt: str = ""
    text: str | None = None
    max_new_tokens: int = 64
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    prompt_tokens: int | None = None
    new_tokens: int | None = None
    elapsed_s: float | None = None
    error: str = ""
    created_at: str | None = None
    finished_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class LogLine:
    seq: int
    line: str
    created_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LogLine:
        return cls(**_pick(cls, data), raw=dict(data))


@dataclass
class Dataset:
    """A registered dataset: `state` pending → processing → ready | failed; statistics once ready."""

    name: str
    id: str = ""
    state: str = ""
    state_reason: str = ""
    shared: bool = False
    path: str = ""
    source_url: str = ""
    uploaded: bool = False
    tokenizer: dict[str, Any] = field(default_factory=dict)
    json_key: str = "text"
    append_eod: bool = True
    record_format: str = "text"
    records_url: str | None = None
    documents: int | None = None
    tokens: int | None = None
    vocab_size: int | None = None
    input_bytes: int | None = None
    output_bytes: int | None = None
    attempt: int = 0
    created_at: str | None = None
    updated_at: str | None = None
    finished_at: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Dataset:
        return cls(**_pick(cls, data), raw=dict(data))

    @property
    def done(self) -> bool:
        return self.state in ("ready", "failed")
