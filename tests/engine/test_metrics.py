from __future__ import annotations

from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.metrics import flops_per_iteration, flops_per_token, peak_tflops, throughput


def cfg(**kw) -> TransformerConfig:
    base = dict(num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=2,
                ffn_hidden_size=32, seq_length=4, vocab_size=16, activation="gelu")  # fmt: skip
    return TransformerConfig(**{**base, **kw})


def test_hand_count_gelu_mha() -> None:
    # One token, one layer, h=8, s=4, ffn=32; multiply-adds of each matmul:
    #   qkv 8×24=192, scores 4 keys × 8 = 32, attn·V 32, proj 64, fc1 256, fc2 256  -> 832 per layer
    #   LM head 8×16 = 128. Forward FLOPs = 2·(2·832 + 128) = 3584; with backward ×3 = 10752.
    assert flops_per_token(cfg()) == 10752
    assert flops_per_iteration(cfg(), global_batch_size=3) == 10752 * 3 * 4


def test_hand_count_swiglu_gqa() -> None:
    # GQA with one K/V group of head_dim 4: qkv 8×(8+4+4)=128; SwiGLU: gate+up 2·256, down 256.
    # Per layer 128 + 32 + 32 + 64 + 768 = 1024; forward 2·(2·1024 + 128) = 4352; ×3 = 13056.
    c = cfg(num_query_groups=1, activation="swiglu")
    assert flops_per_token(c) == 13056


def test_hand_count_lora() -> None:
    # The GELU model above frozen, rank-2 adapters on qkv (RoPE: q, k, v, 3 parts) and fc2:
    #   qkv A 3·2×8 + B 24×2 = 96, fc2 A 2×32 + B 8×2 = 80 per layer: 352 adapter parameters.
    # Weighted GEMMs 2·(2·768 + 128) = 3328 forward FLOPs, counted twice (the input gradients only):
    # 6656; the attention core 2·2·64 = 256, three times: 768; the adapters 6·352 = 2112.
    lora = LoRAConfig(rank=2, targets=("qkv", "fc2"))
    assert lora.num_params(cfg()) == 352
    assert flops_per_token(cfg(), lora=lora) == 6656 + 768 + 2112
    assert flops_per_iteration(cfg(), global_batch_size=3, lora=lora) == (6656 + 768 + 2112) * 3 * 4


def test_matches_narayanan_closed_form() -> None:
    # 72·B·s·l·h²·(1 + s/6h + V/12lh) for the standard GPT (MHA, 4h GELU MLP).
    b, s, l, h, v = 8, 2048, 24, 2048, 51200  # noqa: E741
    c = cfg(num_layers=l, hidden_size=h, num_attention_heads=16, num_query_groups=16,
            ffn_hidden_size=4 * h, seq_length=s, vocab_size=v)  # fmt: skip
    closed = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert abs(flops_per_iteration(c, b) - closed) / closed < 1e-12


def test_fp16_uses_the_16_bit_tensor_core_peak() -> None:
    # fp16 and bf16 run on the same tensor cores at the same dense rate on every listed GPU;
    # dividing by the fp32 (CUDA core) peak overstated fp16 MFU ~15x on an H100.
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp32") == 66.9
    # V100 and T4 have no bf16 but do have fp16 tensor cores.
    assert peak_tflops("Tesla V100-SXM2-16GB", "fp16") == 125.0
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None


def test_peaks_and_mfu() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.5
    assert peak_tflops("NVIDIA H200", "bf16") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("Some Future GPU", "bf16") is None
    r = throughput(flops_per_iter=4e12, tokens_per_iter=1000, iter_time_s=2.0, world_size=2, peak=2.0)
    assert r == {"tokens_per_s": 500.0, "tflops_per_device": 1.0, "mfu": 0.5}
    assert throughput(1e12, 10, 1.0, 1, None)["mfu"] is None
