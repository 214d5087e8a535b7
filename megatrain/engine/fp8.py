"""precision fp8: which linear layers multiply in float8.

The transformer layers' linear layers (qkv, proj, fc1, fc2, a shared expert's: gpt.Linear and the
tensor-parallel Column/RowParallelLinear) get their weight tagged with the recipe; the `linear`
kernel sends tagged weights to `linear_fp8` (megatrain.kernels.fp8_linear). The rest stays bf16,
as in Megatron's and torchtitan's fp8 training: the embedding is a lookup (no GEMM); the LM head's
logits feed the softmax, whose accuracy float8's 3-bit mantissa would cost most (and the fused
linear + cross-entropy computes it in chunks); the MoE router's few columns make no GEMM worth
casting and its top-k is sensitive to rounding; the experts use the grouped GEMM kernel.
"""

from __future__ import annotations

from torch import nn

from megatrain.engine.models.gpt import Linear
from megatrain.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatrain.kernels.fp8_linear import Fp8Linear

FP8_LINEARS = (Linear, ColumnParallelLinear, RowParallelLinear)
KEPT_HIGH_PRECISION = ("lm_head",)


def enable_fp8(model: nn.Module, recipe: str, backend: str | None = None) -> list[str]:
    """Tag the weights of `model`'s transformer linear layers for float8 GEMMs; their names."""
    tag = Fp8Linear(recipe=recipe, backend=backend)
    names = []
    for name, module in model.named_modules():
        if isinstance(module, FP8_LINEARS) and name.rsplit(".", 1)[-1] not in KEPT_HIGH_PRECISION:
            module.weight.fp8 = tag  # type: ignore[union-attr]
            names.append(name)
    return names
