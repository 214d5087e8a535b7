"""MoESpec: a spec's mixture-of-experts block (`model.moe`), apart from spec.py to keep it short.

The names follow Megatron-LM's --moe-* arguments without the prefix (router_topk is
--moe-router-topk), so a Megatron recipe reads across. Rules between these fields and the parallel
layout (ep divides num_experts) live in megatrain.plan.layout.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from megatrain.spec_errors import Problem, report_rules


class MoESpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_experts: int = Field(ge=2, le=4096)
    """Routed experts in every MoE layer."""
    router_topk: int = Field(2, ge=1, le=64)
    """Experts each token is sent to."""
    ffn_hidden_size: int | None = Field(None, ge=1, le=1 << 20)
    """Each routed expert's MLP width; None: model.ffn_hidden_size (as the dense layers)."""
    layer_freq: int = Field(1, ge=1, le=1024)
    """MoE on every k-th layer (layers 0, k, 2k, ...); the others keep the dense MLP."""
    shared_expert_ffn_hidden_size: int | None = Field(None, ge=1, le=1 << 20)
    """Width of an always-on shared expert beside the routed ones (DeepSeek, Qwen-MoE); None: none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output per token by sigmoid(g·x), g a learned (1, hidden) gate
    (Qwen2-MoE; Megatron's --moe-shared-expert-gate)."""
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """softmax over all experts (Mixtral) or a sigmoid per expert, renormalised over the chosen top-k
    (DeepSeek-V3)."""
    router_pre_softmax: bool = False
    """softmax scoring only. False (Megatron's default; Mixtral): the chosen top-k probabilities are
    renormalised to sum to 1 (a softmax over their logits). True (--moe-router-pre-softmax; Qwen2-MoE
    without norm_topk_prob): they are used as the softmax over all experts gave them."""
    router_num_groups: int | None = Field(None, ge=1, le=4096)
    """Group-limited routing: experts split into this many groups (e.g. one per node) ..."""
    router_group_topk: int | None = Field(None, ge=1, le=4096)
    """... and each token picks its experts from the best router_group_topk groups only."""
    aux_loss_coeff: float = Field(1e-2, ge=0.0, le=10.0)
    """Load-balancing loss coefficient (Switch/GShard: E·Σ fraction_e·mean_prob_e); 0 turns it off."""
    z_loss_coeff: float = Field(0.0, ge=0.0, le=10.0)
    """Router z-loss coefficient (ST-MoE: mean logsumexp(logits)²), which keeps router logits small."""
    capacity_factor: float | None = Field(None, gt=0.0, le=64.0)
    """None: dropless (every routed token is computed). Else each expert takes at most
    capacity_factor·tokens·topk/num_experts tokens per micro-batch and drops the lowest-scored rest."""

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> MoESpec:
        out: list[Problem] = []

        def rule(field: str, message: str) -> None:
            out.append({"field": f"model.moe.{field}", "message": message})

        if self.router_topk > self.num_experts:
            rule(
                "router_topk",
                f"model.moe.router_topk={self.router_topk} exceeds model.moe.num_experts={self.num_experts}",
            )
        if self.shared_expert_gate and self.shared_expert_ffn_hidden_size is None:
            rule(
                "shared_expert_gate",
                "model.moe.shared_expert_gate needs a shared expert (shared_expert_ffn_hidden_size)",
            )
        if self.router_pre_softmax and self.router_score_function != "softmax":
            rule("router_pre_softmax", "model.moe.router_pre_softmax is for router_score_function softmax")
        groups, group_topk = self.router_num_groups, self.router_group_topk
        if (groups is None) != (group_topk is None):
            rule(
                "router_group_topk" if groups is not None else "router_num_groups",
                "model.moe.router_num_groups and model.moe.router_group_topk go together (group-limited "
                "routing needs both)",
            )
        elif groups is not None and group_topk is not None:
            if self.num_experts % groups:
                rule(
                    "router_num_groups",
                    f"model.moe.num_experts={self.num_experts} is not divisible by "
                    f"model.moe.router_num_groups={groups}",
                )
            elif group_topk > groups:
                rule(
                    "router_group_topk",
                    f"model.moe.router_group_topk={group_topk} exceeds model.moe.router_num_groups={groups}",
                )
            elif self.router_topk > group_topk * (self.num_experts // groups):
                rule(
                    "router_topk",
                    f"model.moe.router_topk={self.router_topk} exceeds the experts in the chosen groups "
                    f"(router_group_topk×num_experts/router_num_groups = "
                    f"{group_topk}×{self.num_experts // groups})",
                )
        report_rules(info, out)
        return self
