"""Throughput figures: model FLOPs per iteration, tokens/s, TFLOP/s per device, MFU.

FLOPs follow Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters", appendix): every matmul counts 2 FLOPs per multiply-add, the backward pass costs twice
the forward, attention scores are counted over the full sequence (no causal halving) and the LM
head is included. Recomputation is not useful work, so it is never counted. For the standard
GPT (MHA, 4h GELU MLP) this reduces to the paper's 72·B·s·l·h²·(1 + s/6h + V/12lh).
"""

from __future__ import annotations

from megatrain.engine.config import TransformerConfig

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


def flops_per_token(cfg: TransformerConfig, seq_length: int | None = None) -> float:
    """Forward + backward model FLOPs for one token at sequence length s."""
    s = seq_length or cfg.seq_length
    h, layers, v = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    qkv = 2 * h * (h + 2 * cfg.kv_size)  # fused Q, K, V projections (K, V narrower under GQA)
    scores_and_values = 2 * 2 * s * h  # QK^T and attention·V over all s keys, all heads
    proj = 2 * h * h
    mlp_matmuls = 3 if cfg.activation == "swiglu" else 2  # gate, up, down vs fc1, fc2
    mlp = mlp_matmuls * 2 * h * cfg.ffn_hidden_size
    forward = layers * (qkv + scores_and_values + proj + mlp) + 2 * h * v  # + LM head
    return 3.0 * forward  # backward = 2 × forward


def flops_per_iteration(
    cfg: TransformerConfig, global_batch_size: int, seq_length: int | None = None
) -> float:
    s = seq_length or cfg.seq_length
    return flops_per_token(cfg, s) * global_batch_size * s


def gpu_peak_tflops(device_name: str, precision: str) -> float | None:
    """The datasheet peak of a GPU by name for `precision`; None for a GPU or precision not listed."""
    for key, bf16, fp16, fp32 in GPU_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return {"bf16": bf16, "fp16": fp16, "fp32": fp32}.get(precision)
    return None


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Per-device peak for MFU: the GPU's datasheet figure, or on a CPU (name None) this host's
    measured matmul peak (calibrate.py: about a second the first time, then cached). None when
    unknown, so MFU is reported as n/a rather than against an invented figure."""
    if device_name is None:
        from megatrain.engine.calibrate import cpu_peak_tflops

        return cpu_peak_tflops(precision)
    return gpu_peak_tflops(device_name, precision)


def throughput(
    flops_per_iter: float,
    tokens_per_iter: int,
    iter_time_s: float,
    world_size: int,
    peak: float | None,
) -> dict[str, float | None]:
    """tokens/s for the whole job, achieved TFLOP/s per device and MFU (None without a known peak)."""
    tflops = flops_per_iter / iter_time_s / world_size / 1e12
    return {
        "tokens_per_s": tokens_per_iter / iter_time_s,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
    }
