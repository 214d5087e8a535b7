"""LoRASpec: a spec's LoRA block (`training.lora`, with `training.method: lora`), apart from spec.py.

The names follow PEFT's LoraConfig (r is `rank`, lora_alpha `alpha`, lora_dropout `dropout`,
use_rslora) with our canonical linears as targets, so a PEFT recipe reads across.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LoRATarget = Literal["qkv", "proj", "fc1", "fc2", "experts"]


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
    v_proj or GPT-2's c_attn), proj (o_proj), fc1 (gate_proj and up_proj, or c_fc), fc2 (down_proj),
    the dense MLP's or an MoE layer's shared expert's; experts: every routed expert's fc1 and fc2,
    an adapter per expert (PEFT's target_parameters on transformers' stacked experts)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski 2023): scale alpha / √rank."""

    @field_validator("targets")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("training.lora.targets lists a linear twice")
        return v

    @model_validator(mode="after")
    def _experts_without_dropout(self) -> LoRASpec:
        if "experts" in self.targets and self.dropout > 0:
            # The adapters of stacked experts act on the weights (PEFT's ParamWrapper), where no
            # dropout of the adapter's input can be factored out: PEFT refuses it too.
            raise ValueError(
                "training.lora.dropout must be 0 when training.lora.targets include experts "
                "(routed experts' adapters have no dropout, as in PEFT)"
            )
        return self


def absent_targets(targets: list[str] | tuple[str, ...], moe: Any, num_layers: int) -> list[str]:
    """The targets a model has nothing to adapt for: experts without MoE, fc1 and fc2 where every
    layer is MoE and has no shared expert (Mixtral). `moe`: a spec's or the engine's MoE settings."""
    dense_mlp = moe is None or (moe.layer_freq > 1 and num_layers > 1)
    no_mlp = not dense_mlp and moe.shared_expert_ffn_hidden_size is None
    return [t for t in targets if (t == "experts" and moe is None) or (t in ("fc1", "fc2") and no_mlp)]


def lora_targets_of(lora: LoRASpec, moe: Any, num_layers: int) -> tuple[str, ...]:
    """The targets a run adapts: those listed (absent ones are a spec error), or the default ones
    the model has (the defaults name no fc1/fc2 on a Mixtral)."""
    if "targets" in lora.model_fields_set:
        return tuple(lora.targets)
    absent = absent_targets(lora.targets, moe, num_layers)
    return tuple(t for t in lora.targets if t not in absent)
