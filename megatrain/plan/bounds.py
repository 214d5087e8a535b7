"""Lower bounds of a candidate layout's memory, cheap enough to prune the planner's search before
the cost model or the full estimate (megatrain.plan.memory) sees a candidate. Pure arithmetic."""

from __future__ import annotations

from megatrain.plan.activation_memory import layer_activations
from megatrain.plan.moe_memory import moe_layer_activations
from megatrain.plan.shapes import (
    NF4_BYTES,
    ModelShape,
    expert_params,
    layer_params,
    lora_expert_params,
    lora_layer_params,
    lora_stage_params,
    nf4_layer_params,
    nf4_stage_params,
    stage_params,
)


def _static(precision: str, ranks: int) -> float:
    """Bytes per trainable parameter: weights, fp32 gradient, optimizer state sharded over `ranks`."""
    return (4.0 + 4.0 + 8.0 / ranks) if precision == "fp32" else (2.0 + 4.0 + 12.0 / ranks)


def layer_state_bytes(m: ModelShape, precision: str, tp: int, shard: int, ep: int = 1) -> tuple[float, float]:
    """Bytes of params + grads + optimizer of one (dense, MoE) layer on a rank, sharded as
    model_state_floor says: what a stage holds for each of its layers, whatever else it holds."""
    expert_shard = max(1, shard // ep)
    frozen = 4.0 if precision == "fp32" else 2.0
    dense_b = frozen if m.lora else _static(precision, shard)
    expert_b = frozen if m.lora else _static(precision, expert_shard)
    nf4_saves = frozen - NF4_BYTES  # per QLoRA weight held in NF4
    adapter_b = _static(precision, shard)
    dense = layer_params(m, tp) * dense_b + lora_layer_params(m, tp) * adapter_b
    dense -= nf4_layer_params(m, tp) * nf4_saves
    if m.moe is None:
        return dense, dense
    moe = layer_params(m, tp, moe=True) * dense_b + expert_params(m, tp, ep) * expert_b
    moe += lora_layer_params(m, tp, moe=True) * adapter_b - nf4_layer_params(m, tp, moe=True) * nf4_saves
    moe += lora_expert_params(m, tp, ep) * _static(precision, expert_shard)
    return dense, moe


def model_state_floor(m: ModelShape, precision: str, tp: int, pp: int, shard: int, ep: int = 1) -> int:
    """Bytes of params + grads + optimizer on the worst stage, optimizer state sharded over `shard`
    ranks (dp·cp with the distributed optimizer, else 1) and the routed experts' over shard/ep: a
    lower bound of any estimate (whatever the split, some stage holds at least ceil(layers / pp)
    layers, and some stage at least ceil(MoE layers / pp) MoE layers). A LoRA run's frozen
    parameters count their bytes only, its adapters as trainable ones."""
    if pp == 1:
        frozen = 4.0 if precision == "fp32" else 2.0
        dense_b = frozen if m.lora else _static(precision, shard)
        expert_b = frozen if m.lora else _static(precision, max(1, shard // ep))
        parts = stage_params(m, tp, 1, 0, ep=ep)
        experts = parts.get("experts", 0)
        adapters = lora_stage_params(m, tp, 1, 0, ep=ep) * _static(precision, shard)
        nf4 = nf4_stage_params(m, tp, 1, 0) * (frozen - NF4_BYTES)
        return int((sum(parts.values()) - experts) * dense_b + experts * expert_b + adapters - nf4)
    dense, moe = layer_state_bytes(m, precision, tp, shard, ep)
    if m.moe is None:
        # (T5: some stage holds ceil(all layers / pp), each at least an encoder layer's.)
        return int(-(-m.total_layers // pp) * dense)
    return int(max(-(-m.num_layers // pp) * min(dense, moe), -(-m.num_moe_layers // pp) * moe))


def saved_per_token(m: ModelShape, precision: str, tp: int, sp: bool) -> dict[str, tuple[float, float]]:
    """Bytes per token a (dense, MoE) layer keeps for backward under each recompute (full: its input
    only), as megatrain.plan.memory counts them with flash attention (the least any backend keeps)."""
    act = 4 if precision == "fp32" else 2
    out = {"full": (act * m.hidden_size / (tp if sp else 1),) * 2}
    for rc in ("none", "selective"):
        terms = layer_activations(m, tp=tp, sp=sp, act=act, mask=1, attention="flash", selective=rc != "none")
        moe = moe_layer_activations(m, terms, tp=tp, act=act) if m.moe is not None else terms
        out[rc] = (sum(terms.values()), sum(moe.values()))
    return out


__all__ = ["layer_state_bytes", "model_state_floor", "saved_per_token"]
