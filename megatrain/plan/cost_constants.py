"""The constants of the step-time model (megatrain.plan.cost): what a pool's hardware does besides
its datasheet peaks and link speeds, for GPU pools (H100-class defaults) and this project's CPU hosts
(fitted with benchmarks/planner_engine.py), and the GEMM efficiency curve they parametrise."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.plan.pool import PoolSpec


@dataclass(frozen=True)
class CostConstants:
    """What a pool's hardware does besides its datasheet peaks and link speeds."""

    max_fraction: float
    """The fraction of peak the largest GEMMs reach."""
    half_size: float
    """The geometric-mean GEMM dimension at which half of max_fraction is reached."""
    attention_fraction: float
    """The attention core's efficiency relative to a GEMM of the same size."""
    memory_bandwidth_gbps: float
    """Device memory bandwidth that elementwise work and the optimizer reach, GB/s."""
    elementwise_bytes: float
    """Bytes moved per token and hidden unit per layer, forward + backward, at 2-byte activations."""
    layer_overhead_s: float
    """Fixed cost of one layer's forward + backward on one micro-batch (launches, autograd)."""
    microbatch_overhead_s: float
    """Fixed cost of a micro-batch besides its layers (embedding, loss, schedule bookkeeping)."""
    step_overhead_s: float
    """Fixed cost of a step (optimizer launch, gradient clipping, the loss's reduction)."""
    dp_overlap: float = 1.0
    """The fraction of backward compute that can hide data-parallel communication (1: all of it)."""
    ring_step_overhead_s: float = 30e-6
    """Fixed cost of one ring-attention step forward + backward (its block kernels and merge launches)."""
    causal_attention_work: float = 1.0
    """The share of a causal attention core's counted FLOPs (every query against all s keys, as MFU
    counts them) that its kernel computes: flash kernels skip the masked tiles, about half."""
    tp_overlap: float = 0.0
    """The fraction of a GEMM's time that hides a tensor-parallel collective running beside it (the
    engine's backward re-gather and reduce-scatter; every one under Megatron's --tp-comm-overlap)."""


GPU_CONSTANTS = CostConstants(
    # H100-class. Four terms are fitted (least squares of log throughput on a grid, `python
    # benchmarks/planner.py --published --fit`) to five of Megatron-LM's published H100 weak-scaling
    # runs (its README's model table: GPT 1.7B, 16B, 70B, 177B, 462B); its other four sizes, the
    # 177B's strong scaling, Llama 3 405B, Mixtral 8x7B and Megatron-Bridge's fp8 runs are held out
    # (megatrain.plan.published; BENCHMARKS.md "Planner calibrated on published runs"):
    # - max_fraction 0.72 -> 0.58: what a large bf16 GEMM sustains inside a whole step (clocks under
    #   load, launch gaps), not cuBLAS's best alone. half_size stays 160 (the fit is flat to 640).
    # - elementwise_bytes 60 -> 240 per token, hidden unit and layer (fwd + bwd): what the small
    #   models pay beyond their GEMMs, growing as 1/h. At one sequence length the attention core's
    #   share grows as 1/h too, so the two are not separable on this table: attention keeps its
    #   prior (0.6 of a GEMM, a causal core computing half its counted FLOPs), and Megatron's GPT
    #   runs likely ran dropout (its default), which our engine's Llama runs do not.
    # - tp_overlap 0.5 (0 costs 11% rms, 1.0 only 0.4%: a floor more than a value) and dp_overlap
    #   0.9 (was 1.0; 0.8-1.0 within 0.4% rms, once the data-parallel ring uses every NIC of a node).
    max_fraction=0.58,
    half_size=160.0,
    attention_fraction=0.6,
    memory_bandwidth_gbps=2200.0,  # HBM3: 3.35 TB/s, ~2/3 of it reached
    elementwise_bytes=240.0,
    layer_overhead_s=100e-6,
    microbatch_overhead_s=500e-6,
    step_overhead_s=20e-3,
    dp_overlap=0.9,
    causal_attention_work=0.5,
    tp_overlap=0.5,
)
CPU_CONSTANTS = CostConstants(
    # Fitted on this project's 2-core AMD EPYC VM (benchmarks/planner_engine.py, BENCHMARKS.md
    # "Layout planner"): its fp32 GEMMs reach the measured peak (engine.calibrate, best of square
    # GEMMs up to 2048 in a 1.5 s budget) already at ~64-wide shapes, and mid-size ones ~10% above
    # it; what a tiny model pays beyond its FLOPs is per-op dispatch and autograd, ~0.9 ms per
    # layer and micro-batch (forward + backward) and ~0.5 ms per micro-batch for the rest.
    max_fraction=1.1,
    half_size=16.0,
    attention_fraction=0.2,  # SDPA on a CPU: softmax and the small per-head GEMMs
    memory_bandwidth_gbps=8.0,
    elementwise_bytes=40.0,
    layer_overhead_s=0.9e-3,
    microbatch_overhead_s=0.5e-3,
    step_overhead_s=4.0e-3,
    dp_overlap=0.5,  # gloo's progress thread competes with the rank's own compute threads
    ring_step_overhead_s=0.5e-3,  # not fitted yet: about half a layer's per-op overhead per ring step
)
CPU_LINKS: dict[str, float] = {
    # gloo between processes on one host over loopback. A bare all-reduce between two idle
    # processes measures ~1.6 GB/s and 200-270 us (`python benchmarks/planner.py --gloo`); inside
    # the engine a collective also waits for its peer to arrive, and the fit against whole steps
    # gives ~1 ms per collective. A second CPU host is assumed behind a 10 Gb/s network.
    "intra_node_bandwidth_gbps": 1.6,
    "intra_node_latency_us": 1000.0,
    "inter_node_bandwidth_gbps": 1.0,
    "inter_node_latency_us": 1500.0,
}
"""A CPU pool's links: PoolSpec fields."""


def constants_for(pool: PoolSpec) -> CostConstants:
    return CPU_CONSTANTS if pool.is_cpu else GPU_CONSTANTS


def gemm_efficiency(m: float, k: float, n: float, c: CostConstants) -> float:
    g = (m * k * n) ** (1.0 / 3.0)
    return c.max_fraction * g / (g + c.half_size)
