"""Request and response shapes of /v1/jobs/{job_id}/exports."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ExportCreate(BaseModel):
    """POST /v1/jobs/{job_id}/exports: which checkpoint, to which format and dtype."""

    model_config = ConfigDict(extra="forbid")

    step: int | None = Field(None, ge=0, le=10**9)
    """The checkpoint's step; null: the latest."""
    format: Literal["hf"] = "hf"
    """hf: a transformers model folder (config.json + safetensors, the job's tokenizer as tokenizer.json +
    tokenizer_config.json, generation_config.json)."""
    form: Literal["model", "adapter"] = "model"
    """model: the whole model (a LoRA job's with its adapters merged in, a plain transformers model).
    adapter: a LoRA job's adapters alone, as PEFT's folder (adapter_config.json +
    adapter_model.safetensors, and the tokenizer files), for `peft.PeftModel.from_pretrained(base, folder)`;
    a job that trained every weight has none (422)."""
    dtype: Literal["bf16", "fp32"] = "bf16"


class ExportPublic(BaseModel):
    """An export as every export endpoint returns it: `status` pending → running → ready | failed."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    job_id: str
    step: int
    format: str
    form: str
    dtype: str
    status: str
    error: str
    """Why it failed (or why a lost worker's attempt is being retried)."""
    uri: str | None
    """Storage URL of the folder, once ready."""
    size_bytes: int | None
    attempt: int
    created_at: datetime
    finished_at: datetime | None
