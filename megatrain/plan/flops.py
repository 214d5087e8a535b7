"""The model FLOPs formula and the GPUs' datasheet peaks: torch-free, shared by the engine's
throughput figures (megatrain.engine.metrics) and the planner's cost model (megatrain.plan.cost).

FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters", appendix): every matmul counts 2 FLOPs per multiply-add, the backward pass costs twice
the forward, attention scores are counted over the full sequence (no causal halving) and the LM
head is included. Recomputation is not useful work, so it is never counted here (the cost model
adds it to the time, not to the useful FLOPs). For the standard GPT (MHA, 4h GELU MLP) this reduces
to the paper's 72·B·s·l·h²·(1 + s/6h + V/12lh).

Mixture of experts: FLOPs are the active ones, as Megatron and DeepSeek report them. An MoE layer
(every moe.layer_freq-th, from layer 0) counts its router (h × num_experts), router_topk routed
experts of moe.ffn_hidden_size and the shared expert per token, in place of the dense MLP; tokens a
capacity factor drops are still counted (the formula does not know the routing).

LoRA (a frozen model with trained adapters, megatrain.plan.shapes): a frozen weight's backward
computes only its input's gradient, one GEMM per forward one instead of two, so every weighted GEMM
(the linears, the MoE router and experts, the LM head) counts twice its forward; the attention core
has no weights and still counts three times; the adapters train, 6 FLOPs per parameter and token
(x·Aᵀ and u·Bᵀ forward, their input and weight gradients backward). About 4N + 6·adapters, not 6N.
(The first layer's input needs no gradient when nothing trains before it; that GEMM is still counted.)

`model` is anything with hidden_size, num_layers, vocab_size, kv_size, ffn_hidden_size, activation,
seq_length and optionally moe (num_experts, router_topk, ffn_hidden_size, layer_freq,
shared_expert_ffn_hidden_size): the engine's TransformerConfig or the planner's ModelShape.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatrain.plan.shapes import LoRAShape, ModelShape, lora_expert_params, lora_stage_params

# Dense (no sparsity) datasheet peaks in TFLOP/s per device: (bf16, fp16, fp32). bf16 and fp16 run
# on the same tensor cores at the same rate; None where the GPU has no such units (no bf16 before
# Ampere). fp32 is the non-tensor-core figure: PyTorch leaves TF32 matmuls off by default and so do
# we. First substring match of torch.cuda.get_device_name() wins, so specific names come first.
GPU_PEAK_TFLOPS: list[tuple[str, float | None, float, float]] = [
    ("H100 PCIe", 756.5, 756.5, 51.2),
    ("H100 NVL", 835.5, 835.5, 60.0),
    ("H100", 989.4, 989.4, 66.9),  # SXM
    ("GH200", 989.4, 989.4, 66.9),
    ("H200", 989.4, 989.4, 66.9),
    ("H800", 989.4, 989.4, 66.9),
    ("B200", 2250.0, 2250.0, 80.0),
    ("A100", 312.0, 312.0, 19.5),
    ("A800", 312.0, 312.0, 19.5),
    ("L40S", 362.05, 362.05, 91.6),
    ("L40", 181.0, 181.0, 90.5),
    ("L4", 121.0, 121.0, 30.3),
    ("A10G", 70.0, 70.0, 31.2),
    ("A10", 125.0, 125.0, 31.2),
    ("RTX 4090", 165.2, 165.2, 82.6),
    ("RTX 3090", 71.0, 71.0, 35.6),
    ("V100", None, 125.0, 15.7),  # SXM2; Volta's tensor cores are fp16 only
    ("T4", None, 65.0, 8.1),
]


def layer_forward_flops(model: Any, seq_length: int | None = None) -> dict[str, float]:
    """Forward FLOPs of one transformer layer for one token, by part: the GEMMs (qkv, proj, mlp)
    and the attention core (QK^T and attention·V over all s keys, all heads)."""
    s = seq_length or model.seq_length
    h = model.hidden_size
    # gate, up, down (SwiGLU, GeGLU) vs fc1, fc2
    mlp_matmuls = 3 if model.activation in ("swiglu", "geglu") else 2
    return {
        "qkv": 2.0 * h * (h + 2 * model.kv_size),  # fused Q, K, V (K, V narrower under GQA)
        "attention": 2.0 * 2 * s * h,
        "proj": 2.0 * h * h,
        "mlp": mlp_matmuls * 2.0 * h * model.ffn_hidden_size,
    }


def moe_mlp_forward_flops(model: Any) -> float:
    """Forward FLOPs of one MoE layer's router and experts for one token (what replaces "mlp")."""
    moe, h = model.moe, model.hidden_size
    mlp_matmuls = 3 if model.activation == "swiglu" else 2
    experts = moe.router_topk * (moe.ffn_hidden_size or model.ffn_hidden_size)
    experts += moe.shared_expert_ffn_hidden_size or 0
    return 2.0 * h * moe.num_experts + mlp_matmuls * 2.0 * h * experts


def num_moe_layers(model: Any) -> int:
    """Layers 0, k, 2k, ... (k = moe.layer_freq) are MoE layers; none without model.moe."""
    moe = getattr(model, "moe", None)
    return 0 if moe is None else -(-model.num_layers // moe.layer_freq)


def head_forward_flops(model: Any) -> float:
    """Forward FLOPs of the LM head for one token."""
    return 2.0 * model.hidden_size * model.vocab_size


def lora_forward_flops(model: Any, lora: Any) -> float:
    """Forward FLOPs of a LoRA run's adapters for one token: 2 per adapter parameter it runs
    through (each part's x·Aᵀ and u·Bᵀ; of the routed experts' adapters, its top-k experts').
    `lora`: a LoRAConfig, LoRASpec or LoRAShape."""
    shape = replace(ModelShape.of(model), lora=LoRAShape.of(lora))
    experts = 0.0
    if shape.moe is not None:
        idle = 1.0 - shape.moe.router_topk / shape.moe.num_experts
        experts = shape.num_moe_layers * lora_expert_params(shape, 1, 1) * idle
    return 2.0 * (lora_stage_params(shape, 1, 1, 0) - experts)


def flops_per_token(model: Any, seq_length: int | None = None, lora: Any = None) -> float:
    """Forward + backward model FLOPs for one token at sequence length s. `lora`: the adapters of a
    LoRA run (a LoRAConfig, LoRASpec or LoRAShape; default: model.lora where the model has one)."""
    parts = layer_forward_flops(model, seq_length)
    layer = sum(parts.values())
    forward = model.num_layers * layer + head_forward_flops(model)
    n_moe = num_moe_layers(model)
    if n_moe:
        forward += n_moe * (moe_mlp_forward_flops(model) - parts["mlp"])
    lora = getattr(model, "lora", None) if lora is None else lora
    if lora is None:
        return 3.0 * forward  # backward = 2 × forward
    # Frozen weights: backward = the input gradients only, 1 × forward; the attention core 2 × forward.
    core = model.num_layers * parts["attention"]
    return 2.0 * (forward - core) + 3.0 * core + 3.0 * lora_forward_flops(model, lora)


def flops_per_iteration(
    model: Any, global_batch_size: int, seq_length: int | None = None, lora: Any = None
) -> float:
    s = seq_length or model.seq_length
    return flops_per_token(model, s, lora) * global_batch_size * s


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    """The datasheet peak of a GPU by name for `precision`; None for a GPU or precision not listed."""
    for key, bf16, fp16, fp32 in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return {"bf16": bf16, "fp16": fp16, "fp32": fp32}.get(precision)
    return None
