"""precision fp8: which linear layers multiply in float8.

The transformer layers' linear layers (qkv, proj, fc1, fc2, a shared expert's; a T5's cross-attention
q, kv and proj: gpt.Linear and the tensor-parallel Column/RowParallelLinear inside a stack's
`layers`) get their weight tagged with the recipe; the `linear` kernel sends tagged weights to
`linear_fp8` (megatrain.kernels.fp8_linear). The rest stays bf16, as in Megatron's and torchtitan's
fp8 training: the embedding is a lookup (no GEMM); the LM head's logits feed the softmax, whose
accuracy float8's 3-bit mantissa would cost most (and the fused linear + cross-entropy computes it in
chunks); BERT's heads (the masked-LM transform over the masked tokens only, the pooler and the
classifiers over one token per row, two or num_labels outputs) multiply over counts no float8 GEMM
can align to 16; the MoE router's few columns make no GEMM worth casting and its top-k is sensitive
to rounding; the experts use the grouped GEMM kernel.
"""

from __future__ import annotations

from torch import nn

from megatrain.engine.models.gpt import Linear
from megatrain.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatrain.kernels.fp8_linear import Fp8Linear

FP8_LINEARS = (Linear, ColumnParallelLinear, RowParallelLinear)
KEPT_HIGH_PRECISION = ("lm_head",)
LAYERS = "layers"
"""The container of a model's (or a pipeline chunk's, or a T5 stack's) transformer layers."""


def enable_fp8(model: nn.Module, recipe: str, backend: str | None = None) -> list[str]:
    """Tag the weights of `model`'s transformer linear layers for float8 GEMMs; their names."""
    tag = Fp8Linear(recipe=recipe, backend=backend)
    names = []
    for name, module in model.named_modules():
        path = name.split(".")
        if isinstance(module, FP8_LINEARS) and LAYERS in path and path[-1] not in KEPT_HIGH_PRECISION:
            module.weight.fp8 = tag  # type: ignore[union-attr]
            names.append(name)
    return names
