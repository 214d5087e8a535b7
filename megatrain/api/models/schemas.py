"""Request and response shapes of /v1/models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from megatrain.spec import NAME_PATTERN


class ModelCreate(BaseModel):
    """POST /v1/models: register a Hugging Face model folder under a name."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME_PATTERN)
    """What a JobSpec names: `model.init_from: hf:NAME`."""
    url: str = Field(..., min_length=1, max_length=2048)
    """The folder (file:///abs/path, s3://bucket/key, or /abs/path) holding config.json and the
    safetensors weights, or a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors);
    the tenant must be allowed to read it (the rule of a job's data paths)."""
    base: str | None = Field(None, pattern=NAME_PATTERN)
    """An adapter only: the registered model it was trained on (its name)."""


class ModelPublic(BaseModel):
    """A registered model as every model endpoint returns it."""

    id: str
    name: str
    shared: bool
    """Registered by the operator for every tenant (read-only to tenants)."""
    url: str
    model_type: str
    arch: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    seq_length: int
    """The longest sequence the checkpoint supports (its max_position_embeddings, or its window)."""
    fields: dict[str, Any]
    """Every model.* field the config maps to: what a job naming it gets filled in (an adapter's
    are its base's)."""
    kind: str = "model"
    """model, or adapter: a PEFT LoRA folder; `model.init_from: hf:NAME` then starts a LoRA run from
    its base (base_url) with these adapters (training.lora filled from `adapter` when not given)."""
    base_url: str | None = None
    adapter: dict[str, Any] | None = None
    created_at: datetime


class ModelList(BaseModel):
    items: list[ModelPublic]
