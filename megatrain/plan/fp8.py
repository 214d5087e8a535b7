"""What `training.precision: fp8` asks of a spec and its layout (torch-free, like the rest of plan/).

The float8 GEMMs (torch._scaled_mm, which torchao calls) need every dimension of both operands
divisible by 16. A linear layer's three GEMMs multiply over its input width (forward), its output
width (input gradient) and the tokens of a micro-batch (weight gradient), so each transformer
linear's in and out features on one tensor-parallel shard, and the tokens one rank multiplies (a T5's
encoder and decoder tokens), must be multiples of 16. The embedding, LM head, BERT's heads and the
MoE router/experts stay bf16 and are not checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatrain.plan.layout import Layout
    from megatrain.spec import JobSpec
    from megatrain.spec_errors import Problem

FP8_MULTIPLE = 16
"""torch._scaled_mm's alignment: every GEMM dimension a multiple of 16 bytes of float8."""


def fp8_linear_widths(spec: JobSpec, tp: int) -> dict[str, int]:
    """{what: width} of every transformer linear's in/out features on one tensor-parallel shard."""
    m = spec.model
    heads, groups = m.num_attention_heads, m.query_groups
    # A T5's heads are kv_channels wide (heads·kv_channels may differ from hidden_size); its
    # cross-attention q, kv and proj are H·d, 2·H·d and H·d wide: multiples of the widths below.
    head_dim = (m.t5_block.kv_channels or m.head_dim) if m.arch == "t5" else m.head_dim
    gated = m.mlp_activation in ("swiglu", "geglu")  # fc1 holds [gate; up]
    widths = {
        "model.hidden_size (the linear layers' model-side width)": m.hidden_size,
        "the qkv projection's width per tp shard": (heads + 2 * groups) * head_dim // tp,
        "the attention output's width per tp shard": heads * head_dim // tp,
        "the MLP's fc1 width per tp shard": (2 if gated else 1) * m.ffn_size // tp,
        "model.ffn_hidden_size per tp shard": m.ffn_size // tp,
    }
    shared = m.moe.shared_expert_ffn_hidden_size if m.moe is not None else None
    if shared:  # the shared expert is a dense MLP (the routed experts stay bf16)
        widths["model.moe.shared_expert_ffn_hidden_size per tp shard"] = shared // tp
        widths["the shared expert's fc1 width per tp shard"] = (2 if gated else 1) * shared // tp
    return widths


def fp8_width_problems(spec: JobSpec, tp: int, par: str = "") -> list[Problem]:
    """The transformer linears' widths on one of `tp` shards that float8 GEMMs cannot multiply
    (none for another precision); `par` prefixes tp in messages ("parallelism.")."""
    if spec.training.precision != "fp8":
        return []
    return [
        {
            "field": "training.precision",
            "message": f"training.precision=fp8 needs {what} divisible by {FP8_MULTIPLE} "
            f"(float8 GEMMs); it is {width} with {par}tp={tp}",
        }
        for what, width in fp8_linear_widths(spec, tp).items()
        if width % FP8_MULTIPLE
    ]


def fp8_problems(spec: JobSpec, layout: Layout) -> list[Problem]:
    """Every rule precision fp8 breaks for `spec` on `layout` (none for another precision)."""
    t = spec.training
    if t.precision != "fp8":
        return []
    # Its package is judged where the job runs (megatrain.spec_packages), not here.
    out: list[Problem] = []
    if t.fp8_backend == "te" and t.fp8_recipe != "tensorwise":
        out.append(
            {
                "field": "training.fp8_recipe",
                "message": f"training.fp8_recipe={t.fp8_recipe} is torchao's; fp8_backend te runs "
                "tensorwise (Float8CurrentScaling)",
            }
        )
    out += fp8_width_problems(spec, layout.tp, "parallelism.")
    from megatrain.plan.layout import micro_batch_size  # (layout imports this module)

    mbs, m = micro_batch_size(spec, layout), spec.model
    lengths = {"seq_length": m.seq_length}
    if m.arch == "t5":  # the decoder's linears multiply over its own tokens
        lengths["t5.decoder_seq_length"] = m.t5_block.decoder_seq_length or m.seq_length
    for length, value in lengths.items():
        tokens = mbs * value // layout.cp
        if tokens % FP8_MULTIPLE:
            out.append(
                {
                    "field": "training.precision",
                    "message": f"training.precision=fp8 needs the tokens of a micro-batch per context "
                    f"rank (micro_batch_size×{length}/cp = {tokens}) divisible by {FP8_MULTIPLE} "
                    "(the weight gradient's float8 GEMM multiplies over them)",
                }
            )
    return out
