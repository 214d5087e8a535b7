"""The experts of a mixture-of-experts layer as one grouped computation: the `grouped_mlp` kernel.

    y = kernels.get("grouped_mlp", x.device.type)(x, tokens_per_expert, fc1_weight, fc2_weight,
                                                   fc1_bias, fc2_bias, activation)

x (M, C) holds the routed tokens grouped by expert (expert-major: the first tokens_per_expert[0] rows
go to expert 0, and so on); fc1_weight (E, W, C) with W = 2F ([gate; up] rows) for SwiGLU or F for
GELU, fc2_weight (E, C, F), biases (E, W) and (E, C) or None; y (M, C): expert e's MLP on its rows.

Backends: "reference" (a loop over experts in plain torch ops, autograd deriving the backward),
"torch" (the same loop with the fused SwiGLU kernel; on CPU it measured faster than a bmm over
groups padded to the largest: see benchmarks/moe.py) and "grouped_mm" (CUDA: torch._grouped_mm, one
launch per matmul for all experts, bf16 only; other dtypes fall back to the loop).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain import kernels


def _activate(h: torch.Tensor, activation: str, fused: bool) -> torch.Tensor:
    if activation == "swiglu":
        if fused:
            return kernels.get("swiglu", h.device.type)(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def _loop(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_bias: torch.Tensor | None,
    activation: str,
    fused: bool,
) -> torch.Tensor:
    if len(tokens_per_expert) != fc1_weight.shape[0]:
        raise ValueError(f"{len(tokens_per_expert)} token counts for {fc1_weight.shape[0]} experts")
    outs = []
    for e, rows in enumerate(x.split(tokens_per_expert)):  # rows (n_e, C)
        if rows.shape[0] == 0:
            continue
        h = F.linear(rows, fc1_weight[e], None if fc1_bias is None else fc1_bias[e])  # (n_e, W)
        h = _activate(h, activation, fused)  # (n_e, F)
        outs.append(F.linear(h, fc2_weight[e], None if fc2_bias is None else fc2_bias[e]))  # (n_e, C)
    if not outs:  # no token routed here: an empty result still tied to the weights' graph
        return x.new_zeros(0, fc2_weight.shape[1]) + 0.0 * fc2_weight.sum()
    return torch.cat(outs)


def grouped_mlp(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Expert e's MLP on its rows of x, for every e: (M, C) -> (M, C)."""
    return _loop(x, tokens_per_expert, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation, fused=True)


def grouped_mlp_reference(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """The same in plain torch ops (autograd derives the backward)."""
    return _loop(x, tokens_per_expert, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation, fused=False)


def grouped_mm_available() -> bool:
    """torch._grouped_mm exists and a CUDA device of compute capability 8.0 or above is present."""
    if not hasattr(torch, "_grouped_mm") or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


def grouped_mlp_grouped_mm(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Both matmuls as torch._grouped_mm over every expert at once (bf16 on CUDA; else the loop)."""
    if x.dtype != torch.bfloat16 or x.shape[0] == 0:
        return grouped_mlp(x, tokens_per_expert, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation)
    counts = torch.tensor(tokens_per_expert, device=x.device)
    offs = counts.cumsum(0).to(torch.int32)  # (E,) end row of each expert's group
    # (E, W, C) viewed as (E, C, W): the column-major operand _grouped_mm wants, no copy.
    h = torch._grouped_mm(x, fc1_weight.transpose(1, 2), offs=offs)  # (M, W)
    if fc1_bias is not None:
        h = h + fc1_bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
    h = _activate(h, activation, fused=True)  # (M, F)
    y = torch._grouped_mm(h, fc2_weight.transpose(1, 2), offs=offs)  # (M, C)
    if fc2_bias is not None:
        y = y + fc2_bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
    return y
