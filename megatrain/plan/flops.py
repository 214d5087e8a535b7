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

The encoder families follow the same accounting, as Megatron-LM's num_floating_point_operations
(megatron/training/training.py) counts a transformer: per layer and token 12·h²·((1 + G/H + s/h)·r
+ f/h·g) + 6·h·V for the logits (r = heads·kv_channels/h, g = 3/2 when gated), 3× the forward.

- **BERT**: the same per-layer GEMMs, attention scores over all s keys (bidirectional: exact, no
  causal halving to undo), the LM head on every position as Megatron computes it (our engine
  projects only the masked rows, so BERT's MFU counts more than it runs, as Megatron's does), plus
  what a BERT adds: the masked-LM transform (h→h) on every position, and per sequence the pooler
  (h→h) and the binary classifier (h→2) on the first token:

      F = 3·B·[s·(L·(2h(q+2kv) + 4sq + 2qh + 2·m·h·f) + 2h² + 2hV) + 2h² + 4h]    (binary head)

  with q = heads·head_dim, m = 3 gated / 2 not. For BERT-large (q = kv = h, f = 4h) the layer
  term is Megatron's 24h² + 4sh per token.
- **T5**: encoder layers on the encoder's Te tokens, decoder layers on the decoder's Td tokens,
  each decoder layer with cross-attention: Q and the output projection on Td tokens, K and V
  projected from Te tokens (the encoder's output), scores Td×Te; the LM head on Td tokens:

      F = 3·B·[Te·Le·(2h(q+2kv) + 4·Te·q + 2qh + 2mhf)
               + Td·Ld·(2h(q+2kv) + 4·Td·q + 2qh + 2mhf + 2hq + 4·Te·q + 2qh) + Te·Ld·2h·2kv
               + Td·2hV]

  flops_per_token divides a sequence's by its Te encoder tokens (the tokens a step's throughput
  counts). Elementwise work (softmax, norms, the relative position bias, activations) is not
  counted, as in Megatron; a torch FLOP counter over transformers' BertForPreTraining and
  T5ForConditionalGeneration agrees (tests/plan/test_plan_families.py).

`model` is anything with hidden_size, num_layers, vocab_size, kv_size, ffn_hidden_size, activation,
seq_length and optionally moe (num_experts, router_topk, ffn_hidden_size, layer_freq,
shared_expert_ffn_hidden_size): the engine's TransformerConfig or T5Config, or the planner's
ModelShape.
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
    # h, but where T5's kv_channels differ (`model` may be any object with the fields)
    q = model.num_attention_heads * (getattr(model, "kv_channels", None) or h // model.num_attention_heads)
    # gate, up, down (SwiGLU, GeGLU) vs fc1, fc2
    mlp_matmuls = 3 if model.activation in ("swiglu", "geglu") else 2
    return {
        "qkv": 2.0 * h * (q + 2 * model.kv_size),  # fused Q, K, V (K, V narrower under GQA)
        "attention": 2.0 * 2 * s * q,
        "proj": 2.0 * q * h,
        "mlp": mlp_matmuls * 2.0 * h * model.ffn_hidden_size,
    }


def cross_attention_forward_flops(model: Any) -> dict[str, float]:
    """Forward FLOPs of one T5 decoder layer's cross-attention for one decoder token (q, the scores
    over the encoder's seq_length keys, proj) and, apart, for one encoder token (kv_per_encoder_token:
    K and V projected from the encoder's output)."""
    h, q, te = model.hidden_size, model.q_size, model.seq_length
    return {"q": 2.0 * h * q, "attention": 2.0 * 2 * te * q, "proj": 2.0 * q * h,
            "kv_per_encoder_token": 2.0 * h * 2 * model.kv_size}  # fmt: skip


def bert_heads_forward_flops(model: Any, seq_length: int | None = None) -> float:
    """Forward FLOPs per token of what BERT adds to a GPT's layers and LM head: the masked-LM
    transform on every position, and the pooler and binary classifier on each sequence's first."""
    m = ModelShape.of(model)
    h, s = m.hidden_size, seq_length or m.seq_length
    return 2.0 * h * h + ((2.0 * h * h + 2.0 * h * 2) / s if m.binary_head else 0.0)


def t5_forward_flops(model: Any) -> dict[str, float]:
    """Forward FLOPs of one T5 sequence, by part: the encoder's layers on Te tokens, the decoder's
    on Td (self- and cross-attention: K/V from Te tokens, scores Td×Te) and the LM head on Td."""
    m = ModelShape.of(model)
    te, td = m.seq_length, m.dec_seq_length
    dec = layer_forward_flops(m, td)
    cross = cross_attention_forward_flops(m)
    kv = cross.pop("kv_per_encoder_token")
    return {
        "encoder": te * m.num_layers * sum(layer_forward_flops(m, te).values()),
        "decoder": m.num_decoder_layers * (td * (sum(dec.values()) + sum(cross.values())) + te * kv),
        "head": td * head_forward_flops(m),
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
    LoRA run (a LoRAConfig, LoRASpec or LoRAShape; default: model.lora where the model has one).
    T5: a sequence's FLOPs (its own lengths) per encoder token."""
    family = ModelShape.of(model).family
    if family == "t5":
        if lora is not None or getattr(model, "lora", None) is not None:
            raise ValueError("LoRA FLOPs are counted for the GPT and BERT families, not T5")
        return 3.0 * sum(t5_forward_flops(model).values()) / ModelShape.of(model).seq_length
    parts = layer_forward_flops(model, seq_length)
    layer = sum(parts.values())
    forward = model.num_layers * layer + head_forward_flops(model)
    if family == "bert":
        forward += bert_heads_forward_flops(model, seq_length)
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
    """Forward + backward model FLOPs of a step of global_batch_size sequences (T5: of its lengths)."""
    if ModelShape.of(model).family == "t5":
        seq_length = ModelShape.of(model).seq_length
    s = seq_length or model.seq_length
    return flops_per_token(model, s, lora) * global_batch_size * s


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    """The datasheet peak of a GPU by name for `precision`; None for a GPU or precision not listed."""
    for key, bf16, fp16, fp32 in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return {"bf16": bf16, "fp16": fp16, "fp32": fp32}.get(precision)
    return None
