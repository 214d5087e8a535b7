"""RopeScalingSpec: the model's `rope_scaling:` block (rotary-frequency scaling), apart from spec.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from megatrain.spec_base import Strict as _Strict
from megatrain.spec_base import rule as _rule
from megatrain.spec_errors import Problem, report_rules


class RopeScalingSpec(_Strict):
    """Rotary-frequency scaling as Hugging Face defines it (transformers' modeling_rope_utils)."""

    type: Literal["linear", "llama3"]
    """linear: every frequency divided by factor. llama3: the low frequencies divided by factor, the
    high ones kept, the ones between interpolated (Llama 3.1)."""
    factor: float = Field(..., gt=0.0, le=1e6)
    low_freq_factor: float | None = Field(None, gt=0.0, le=1e6)
    """llama3 only (1.0 in Llama 3.1)."""
    high_freq_factor: float | None = Field(None, gt=0.0, le=1e6)
    """llama3 only (4.0 in Llama 3.1)."""
    original_max_position_embeddings: int | None = Field(None, ge=1, le=1 << 24)
    """llama3 only: the context length of pretraining (8192 in Llama 3.1)."""

    @model_validator(mode="after")
    def _llama3_fields(self, info: ValidationInfo) -> RopeScalingSpec:
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        given = [k for k in llama3 if getattr(self, k) is not None]
        out: list[Problem] = []
        if self.type == "llama3" and len(given) < len(llama3):
            missing = ", ".join(f"model.rope_scaling.{k}" for k in llama3 if k not in given)
            out.append(_rule("model.rope_scaling", f"model.rope_scaling of type llama3 needs {missing}"))
        if self.type == "linear" and given:
            field = f"model.rope_scaling.{given[0]}"
            out.append(_rule(field, f"{field} is only for type llama3"))
        low, high = self.low_freq_factor, self.high_freq_factor
        if self.type == "llama3" and low is not None and high is not None and high <= low:
            field = "model.rope_scaling.high_freq_factor"
            out.append(_rule(field, f"{field} must exceed low_freq_factor"))
        report_rules(info, out)
        return self
