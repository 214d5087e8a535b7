"""What a LoRA run's adapters add to a layer's time (megatrain.plan.cost), per micro-batch on one rank.

Each target linear's adapter (megatrain.engine.lora) runs two GEMMs forward, x·Aᵀ (rows × in → parts·r)
and u·B̂ᵀ (rows × parts·r → out, B̂ the (out, parts·r) expansion of B that the engine multiplies by),
and two of each shape backward (the input's and the weight's gradient). At rank 16 they are skinny:
each costs the slower of its FLOPs at the GEMM curve's efficiency and its operands' traffic through
memory (a roofline; the input's read dominates). Around them, elementwise passes over the
(rows, out) update (the scale, the sum with the base's output, the scale's gradient) and the input
gradient's sum with the base's; with dropout a pass over the input and its mask each way.

Under tensor parallelism the adapter is split like its base (column-parallel: B split, A replicated;
row-parallel: A split, B replicated). With sequence parallelism a column-parallel base's adapter
multiplies the sequence shard by A and all-gathers the rank-r product forward, reduce-scattering its
gradient back: two small collectives per such target, paid mostly in latency. (The replicated
factors' gradients are summed over tp once per step: small, not counted.)

QLoRA (lora.quantize_base) holds the layer's frozen linear weights in NF4 and dequantises each per
GEMM, forward and again for the input gradient backward: a pass reading NF4_BYTES and writing the
activation dtype per weight, memory-bound, each way.
"""

from __future__ import annotations

from typing import NamedTuple

from megatrain.plan.cost_constants import CostConstants, gemm_efficiency
from megatrain.plan.links import ring_time
from megatrain.plan.shapes import NF4_BYTES, ModelShape, lora_layer_targets, lora_linears, nf4_layer_params


class LoRASeconds(NamedTuple):
    """Seconds of one layer's adapters for one micro-batch."""

    forward: float
    """Forward GEMMs and elementwise passes (what a recomputed layer runs again)."""
    compute: float
    """Forward + backward."""
    tp_comm: float
    """The rank-r all-gathers (forward) and reduce-scatters (backward) under sequence parallelism."""


def lora_layer_seconds(
    m: ModelShape,
    *,
    moe: bool,
    tp: int,
    sp: bool,
    tokens: float,
    act: int,
    peak: float,
    bandwidth: float,
    c: CostConstants,
    tp_bandwidth_gbps: float,
    tp_latency_us: float,
) -> LoRASeconds:
    """The adapters of one (dense or MoE) layer: `tokens` per rank and micro-batch (before the
    sequence split), `peak` in FLOP/s, `bandwidth` in bytes/s (module docstring)."""
    if m.lora is None:
        return LoRASeconds(0.0, 0.0, 0.0)

    def gemm(rows: float, k: float, n: float) -> float:
        flops_s = 2 * rows * k * n / (peak * gemm_efficiency(rows, k, n, c))
        return max(flops_s, act * (rows * k + k * n + rows * n) / bandwidth)

    forward = backward = comm = 0.0
    for target in lora_layer_targets(m, moe):
        n_in, n_out, parts, column = lora_linears(m, moe)[target]
        pr = parts * m.lora.rank
        # Rows of the input side (a sequence shard under sp on a column-parallel base) and the output side.
        rows_in = tokens / tp if (sp and column) else tokens
        k_in, n_out_local = (n_in, n_out / tp) if column else (n_in / tp, n_out)
        fwd_gemms = gemm(rows_in, k_in, pr) + gemm(tokens, pr, n_out_local)
        out_pass = act * tokens * n_out_local / bandwidth  # one pass over the (rows, out) update
        in_pass = act * rows_in * k_in / bandwidth
        dropout = 2 * in_pass if m.lora.dropout > 0 else 0.0  # the dropped input and its mask
        forward += fwd_gemms + 5 * out_pass + dropout  # scale (read, write), sum (two reads, a write)
        backward += 2 * fwd_gemms + 2 * out_pass + 3 * in_pass + dropout
        if sp and column:
            u = act * tokens * pr  # the gathered rank-r product
            comm += 2 * ring_time("all_gather", u, tp, tp_bandwidth_gbps, tp_latency_us)
    if m.lora.quantize_base:
        dequantize = nf4_layer_params(m, tp, moe) * (NF4_BYTES + act) / bandwidth
        forward += dequantize
        backward += dequantize
    return LoRASeconds(forward, forward + backward, comm)


__all__ = ["LoRASeconds", "lora_layer_seconds"]
