"""What a mixture-of-experts layer adds to a rank's activation memory (megatrain.plan.memory).

Pure arithmetic on a ModelShape with `moe` set. What it assumes of the engine (Megatron's all-to-all
token dispatcher, with the experts split over tp as the dense MLP is):

- Routed tokens: each token goes to router_topk experts. Dropless routing is taken as balanced (each
  ep rank receives tokens·topk on average; a skewed router needs more, which no static estimate can
  know). With a capacity factor every expert holds at most capacity_factor·tokens·topk/num_experts
  tokens, so the routed activations are bounded by capacity_factor·tokens·topk.
- The experts see every token of the tensor-parallel group (a sequence-parallel shard is gathered
  after the all-to-all, as Megatron's dispatcher does), so routed tensors are whole over tp; only the
  experts' intermediate (ffn-wide) tensors are split by tp.
- Saved for backward, per routed token: the experts' input (fc1's weight gradient), fc1's output
  and the activation's product (as the dense MLP), and the experts' output as it arrives back at
  the combine (megatrain.kernels.moe_combine, for the probabilities' gradient; the composite it
  replaced kept two fp32 copies instead, 8·h bytes). The router keeps the fp32 cast of its
  input (its gate's weight gradient), its fp32 logits/probabilities (E per token) and the top-k
  choices. A shared expert saves what a dense MLP of its width does. (Counted op by op on fake
  tensors: megatrain.engine.dryrun, tests/engine/test_dryrun.py.)
- Transient: a dispatch or combine holds the permuted copy and the all-to-all's receive buffer at
  once (2 routed h-wide tensors); in backward the experts' GEMMs hold the same per-routed-token
  gradients as a dense MLP's plus one weight-gradient temporary per local expert (a grouped GEMM
  computes them together).
"""

from __future__ import annotations

from megatrain.plan.shapes import ModelShape


def routed_tokens_per_token(m: ModelShape) -> float:
    """Routed copies held per token of the rank's micro-batch: topk, × the capacity bound when set."""
    assert m.moe is not None
    return m.moe.router_topk * (m.moe.capacity_factor or 1.0)


def moe_layer_activations(
    m: ModelShape, dense_terms: dict[str, float], *, tp: int, act: int
) -> dict[str, float]:
    """Bytes per token one MoE layer saves for backward: the dense layer's terms (layer_activations)
    with "mlp" replaced by the router's, the routed experts' and the shared expert's."""
    assert m.moe is not None
    moe, h = m.moe, m.hidden_size
    routed = routed_tokens_per_token(m)
    terms = {k: v for k, v in dense_terms.items() if k != "mlp"}
    if not moe.shared_expert_ffn_hidden_size:
        # Of the dense layer's two linear inputs only qkv's remains: the routed experts save their
        # permuted rows (moe_routed_io) and the router its fp32 cast (moe_router), not the norm's
        # output; a shared expert's fc1 saves it, as a dense MLP does.
        terms["linear_inputs"] = dense_terms["linear_inputs"] / 2
    # fp32 input cast, fp32 probs; top-k probs, ids
    terms["moe_router"] = 4.0 * h + 4.0 * moe.num_experts + 12.0 * moe.router_topk
    # The experts' input, and their output kept by the combine.
    terms["moe_routed_io"] = routed * 2 * act * h
    terms["moe_experts"] = routed * act * _mlp_saved_width(m, moe.ffn_hidden_size) / tp
    shared = moe.shared_expert_ffn_hidden_size
    if shared:
        terms["moe_shared_expert"] = act * _mlp_saved_width(m, shared) / tp
    return terms


def _mlp_saved_width(m: ModelShape, ffn: int) -> int:
    """Elements per token an MLP of width ffn saves: SwiGLU's [gate; up] and product, GELU's two."""
    return m.mlp_fc1_width(ffn) + ffn if m.activation == "swiglu" else 2 * ffn


def moe_backward_peak(
    m: ModelShape, tokens: float, *, tp: int, ep: int, act: int, frozen: bool = False
) -> float:
    """The largest transient of an MoE layer's backward, in bytes (see the module docstring); frozen
    experts (a LoRA run) have no weight-gradient temporaries."""
    assert m.moe is not None
    moe, h = m.moe, m.hidden_size
    f, fw = moe.ffn_hidden_size, m.mlp_fc1_width(moe.ffn_hidden_size)
    rows = tokens * routed_tokens_per_token(m)
    local = 0 if frozen else moe.num_experts // ep  # experts with a weight-gradient temporary
    fc2 = rows * act * (f / tp + h) + local * act * f * h / tp
    activation = rows * act * (fw + f) / tp
    fc1 = rows * act * (fw / tp + h) + local * act * h * fw / tp
    permute = 2 * rows * act * h  # the combine's gradient: permuted copy + all-to-all buffer
    return max(fc2, activation, fc1) + permute


def moe_dispatch_transient(m: ModelShape, tokens: float, *, act: int) -> float:
    """Forward: a dispatch's permuted copy and all-to-all receive buffer, alive together."""
    return 2 * tokens * routed_tokens_per_token(m) * act * m.hidden_size


__all__ = ["moe_backward_peak", "moe_dispatch_transient", "moe_layer_activations", "routed_tokens_per_token"]
