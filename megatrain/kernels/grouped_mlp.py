"""The experts of a mixture-of-experts layer as one grouped computation: the `grouped_mlp` kernel.

    y = kernels.get("grouped_mlp", x.device.type)(x, tokens_per_expert, fc1_weight, fc2_weight,
                                                   fc1_bias, fc2_bias, activation)

x (M, C) holds the routed tokens grouped by expert (expert-major: the first tokens_per_expert[0] rows
go to expert 0, and so on); fc1_weight (E, W, C) with W = 2F ([gate; up] rows) for SwiGLU or F for
GELU, fc2_weight (E, C, F), biases (E, W) and (E, C) or None; y (M, C): expert e's MLP on its rows.

Backends: "reference" (a loop over experts in plain torch ops, autograd deriving the backward),
"torch" (one bmm over the groups padded to the largest while the padding is small, else the loop,
with the fused SwiGLU kernel: see PADDING_LIMIT and benchmarks/moe.py) and "grouped_mm" (CUDA:
torch._grouped_mm, one launch per matmul for all experts, bf16 only; other dtypes take the loop).
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
    # unbind, not w[e]: its backward stacks the E gradients once, where indexing would add each
    # expert's gradient into its own zeroed (E, W, C) tensor.
    w1, w2 = fc1_weight.unbind(0), fc2_weight.unbind(0)
    b1 = fc1_bias.unbind(0) if fc1_bias is not None else [None] * len(w1)
    b2 = fc2_bias.unbind(0) if fc2_bias is not None else [None] * len(w1)
    outs = []
    for e, rows in enumerate(x.split(tokens_per_expert)):  # rows (n_e, C)
        if rows.shape[0] == 0:
            continue
        h = _activate(F.linear(rows, w1[e], b1[e]), activation, fused)  # (n_e, W) -> (n_e, F)
        outs.append(F.linear(h, w2[e], b2[e]))  # (n_e, C)
    if not outs:
        # No token routed here: an empty result still tied to the weights' graph and to x's, so that
        # under expert parallelism backward reaches the exchange that brought x (its reverse
        # all-to-all must run on every rank, including one that received no rows).
        return x.new_zeros(0, fc2_weight.shape[1]) + 0.0 * (fc2_weight.sum() + x.sum())
    return torch.cat(outs)


def _padded(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_bias: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    e, longest, c = len(tokens_per_expert), max(tokens_per_expert), x.shape[1]
    counts = torch.tensor(tokens_per_expert, device=x.device)
    rows = torch.arange(longest, device=x.device) < counts[:, None]  # (E, L): real rows
    # masked_scatter fills the real rows in (expert, row) order: x's own order.
    padded = x.new_zeros(e, longest, c).masked_scatter(rows.unsqueeze(-1), x)  # (E, L, C)
    w1, w2 = fc1_weight.transpose(1, 2), fc2_weight.transpose(1, 2)  # (E, C, W), (E, F, C)
    h = torch.bmm(padded, w1) if fc1_bias is None else torch.baddbmm(fc1_bias.unsqueeze(1), padded, w1)
    h = _activate(h, activation, fused=True)  # (E, L, F)
    y = torch.bmm(h, w2) if fc2_bias is None else torch.baddbmm(fc2_bias.unsqueeze(1), h, w2)
    return y[rows]  # (M, C): padding rows dropped, so they get no gradient


PADDING_LIMIT = 1.5
"""The torch backend pads while E·(largest group) <= 1.5·M rows: on a CPU one bmm over padded groups
measured ~25% faster than the loop at balanced routing (benchmarks/moe.py); past that the padding's
wasted FLOPs cost more than the loop's per-expert overhead saves."""


def grouped_mlp(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Expert e's MLP on its rows of x, for every e: (M, C) -> (M, C). One bmm over groups padded
    to the largest while the padding is small (PADDING_LIMIT), else a loop over the experts."""
    if len(tokens_per_expert) != fc1_weight.shape[0]:
        raise ValueError(f"{len(tokens_per_expert)} token counts for {fc1_weight.shape[0]} experts")
    m = x.shape[0]
    if m and len(tokens_per_expert) * max(tokens_per_expert) <= PADDING_LIMIT * m:
        return _padded(x, tokens_per_expert, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation)
    return grouped_mlp_loop(x, tokens_per_expert, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation)


def grouped_mlp_loop(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """A loop over the experts (the fused SwiGLU kernel): what grouped_mlp falls back to."""
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


def grouped_linear(
    x: torch.Tensor, tokens_per_expert: list[int], weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Each expert's rows of x (M, in) times its weight (E, out, in)ᵀ -> (M, out): torch._grouped_mm
    where it runs (bf16 on CUDA, 16-byte strides), else a loop over the experts."""
    widths = (x.shape[1], weight.shape[1])
    if x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] and not any(w % 8 for w in widths):
        offs = torch.tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)
    else:
        groups = zip(x.split(tokens_per_expert), weight.unbind(0), strict=True)
        y = torch.cat([F.linear(rows, w) for rows, w in groups])
    if bias is not None:
        counts = torch.tensor(tokens_per_expert, device=x.device)
        y = y + bias.repeat_interleave(counts, dim=0, output_size=x.shape[0])
    return y


def grouped_mlp_lora(
    x: torch.Tensor,
    tokens_per_expert: list[int],
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_bias: torch.Tensor | None,
    activation: str,
    adapters: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """grouped_mlp with a LoRA adapter on each expert's fc1 and fc2 (engine.lora.ExpertLoRA:
    A1 (E, r, C), B1 (E, W, r), A2 (E, r, F), B2 (E, C, r)): y = f(x W1ᵀ + s·(x A1ᵀ) B1ᵀ) W2ᵀ + ...
    On the activations, rank-r products only: no weight-sized W + s·B·A is formed, or kept for the
    backward, per layer."""
    a1, b1, a2, b2 = adapters
    n = tokens_per_expert

    def adapted(
        inp: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        return grouped_linear(inp, n, w, bias) + scale * grouped_linear(grouped_linear(inp, n, a), n, b)

    h = _activate(adapted(x, fc1_weight, fc1_bias, a1, b1), activation, fused=True)
    return adapted(h, fc2_weight, fc2_bias, a2, b2)


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
    """Both matmuls as torch._grouped_mm over every expert at once (bf16 on CUDA, every width a
    multiple of 8 elements: the 16-byte strides it needs; else the loop)."""
    widths = (x.shape[1], fc1_weight.shape[1], fc2_weight.shape[2])
    if x.dtype != torch.bfloat16 or x.shape[0] == 0 or any(w % 8 for w in widths):
        return grouped_mlp_loop(x, tokens_per_expert, fc1_weight, fc2_weight, fc1_bias, fc2_bias, activation)
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
