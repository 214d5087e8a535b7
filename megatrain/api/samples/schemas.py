"""Request and response shapes of /v1/jobs/{job_id}/samples."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

MAX_PROMPT_CHARS = 4000
MAX_NEW_TOKENS = 256


class SampleCreate(BaseModel):
    """POST /v1/jobs/{job_id}/samples: the prompt, which checkpoint, and how to decode. Greedy when
    temperature, top_k and top_p are all unset; sampled (reproducibly with `seed`) otherwise."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    step: int | None = Field(None, ge=0, le=10**9)
    """The checkpoint's step; null: the latest."""
    max_new_tokens: int = Field(64, ge=1, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, gt=0, le=10)
    top_k: int | None = Field(None, ge=0, le=100_000)
    """0 or null: no top-k cut."""
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


class SamplePublic(BaseModel):
    """A sample as every sample endpoint returns it: `status` pending → running → ready | failed."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    job_id: str
    step: int
    status: str
    prompt: str
    max_new_tokens: int
    temperature: float | None
    top_k: int | None
    top_p: float | None
    seed: int | None
    text: str | None
    """The continuation alone (the prompt not repeated), once ready."""
    prompt_tokens: int | None
    new_tokens: int | None
    elapsed_s: float | None
    error: str
    """Why it failed (e.g. a prompt longer than the model reads), or why a lost worker is retried."""
    attempt: int
    created_at: datetime
    finished_at: datetime | None
