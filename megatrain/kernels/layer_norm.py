"""LayerNorm (GPT-2's norm) through the registry: ATen's fused layer_norm, and the reference twin.

The "torch" backend is F.layer_norm itself (what nn.LayerNorm runs): ATen's kernel already fuses the
forward and its backward, so a hand-written autograd Function would gain nothing; going through the
registry lets a Triton backend replace it on CUDA. bias may be None (a LayerNorm without bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernels._util import fp32_at_least


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) · weight + bias over the last dim (ATen's fused kernel)."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """The same written out in fp32 (biased variance, as LayerNorm's), returned in x's dtype."""
    xf = fp32_at_least(x)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * fp32_at_least(weight)
    if bias is not None:
        y = y + fp32_at_least(bias)
    return y.to(x.dtype)
