"""LoRASpec: a spec's LoRA block (`training.lora`, with `training.method: lora`), apart from spec.py.

The names follow PEFT's LoraConfig (r is `rank`, lora_alpha `alpha`, lora_dropout `dropout`,
use_rslora) with our canonical linears as targets, so a PEFT recipe reads across.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

LoRATarget = Literal["qkv", "proj", "fc1", "fc2"]


class LoRASpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    rank: int = Field(16, ge=1, le=4096)
    """r: the adapters' rank (PEFT's `r`)."""
    alpha: float = Field(32.0, gt=0.0, le=1e6)
    """The update is scaled by alpha / rank (alpha / √rank with use_rslora)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input (the base's input is not dropped)."""
    targets: list[LoRATarget] = Field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"], min_length=1)
    """The linears of every layer that get adapters: qkv (attention's q/k/v; PEFT's q_proj, k_proj,
    v_proj or GPT-2's c_attn), proj (o_proj), fc1 (gate_proj and up_proj, or c_fc), fc2 (down_proj).
    An MoE layer's experts get none yet."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski 2023): scale alpha / √rank."""

    @field_validator("targets")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("training.lora.targets lists a linear twice")
        return v
