"""DPOSpec: preference training's block (`training.dpo`, with `kind: dpo`), apart from spec.py.

The names and the losses are TRL's DPOConfig (beta, loss_type, label_smoothing), so a TRL recipe
reads across. The rules between this block and the rest of a spec (kind dpo, even micro-batches)
are `dpo_problems`, which spec.py's JobSpec runs on the whole spec.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from megatrain.spec_base import rule
from megatrain.spec_errors import Problem, report_rules

DPOLoss = Literal["sigmoid", "ipo", "hinge"]


class DPOSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    beta: float = Field(0.1, gt=0.0, le=1e4)
    """How far the policy may move from the reference: the implicit reward is beta · (log π − log
    π_ref) summed over the response's tokens (for ipo, the regularisation τ)."""
    loss_type: DPOLoss = "sigmoid"
    """sigmoid: −log σ(beta·Δ), the DPO paper's loss (Rafailov et al. 2023). ipo: (Δ̄ − 1/(2·beta))²
    with Δ̄ the log-ratio difference averaged per response token (Azar et al. 2023, as TRL
    normalises it). hinge: max(0, 1 − beta·Δ) (SLiC). Δ is the chosen response's log-ratio minus
    the rejected one's."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """sigmoid only: the assumed share of pairs whose labels are flipped (conservative DPO):
    −(1−ε)·log σ(beta·Δ) − ε·log σ(−beta·Δ). 0 is plain DPO."""

    @model_validator(mode="after")
    def _smoothing(self, info: ValidationInfo) -> DPOSpec:
        if self.label_smoothing and self.loss_type != "sigmoid":
            field = "training.dpo.label_smoothing"
            report_rules(info, [rule(field, f"{field} is for loss_type sigmoid, not {self.loss_type}")])
        return self


def dpo_problems(spec: Any) -> list[Problem]:  # a JobSpec (spec.py imports this module)
    """The rules of preference training between training.dpo, the batch and the layout."""
    t = spec.training
    out: list[Problem] = []
    if spec.kind != "dpo":
        if t.dpo is not None:
            why = f"training.dpo is set but kind is '{spec.kind}' (set it to 'dpo')"
            out.append(rule("training.dpo", why))
        return out
    mbs = t.micro_batch_size
    if mbs != "auto" and mbs % 2:
        out.append(
            rule(
                "training.micro_batch_size",
                f"training.micro_batch_size={mbs} must be an even number for kind dpo (it counts "
                "sequences: each pair's chosen and rejected response train in one micro-batch)",
            )
        )
    elif mbs == "auto" and t.global_batch_size % 2:
        # (an even micro-batch divides the global batch, so a number written makes it even too)
        gbs = t.global_batch_size
        why = f"training.global_batch_size={gbs} must be even for kind dpo (two sequences a pair)"
        out.append(rule("training.global_batch_size", why))
    if spec.data.packing:
        out.append(rule("data.packing", "data.packing must be off for kind dpo (one sequence per row)"))
    return out
