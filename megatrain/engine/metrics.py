"""Throughput figures: tokens/s, TFLOP/s per device, MFU.

The FLOPs formula (Narayanan et al. 2021) and the GPUs' datasheet peaks live in megatrain.plan.flops,
torch-free, so the planner predicts with the very formula the engine reports with; they are
re-exported here for the engine's callers. A LoRA run's FLOPs (`flops_per_iteration(..., lora=)`)
count a frozen weight's backward as its input gradient only, plus the adapters' own.
"""

from __future__ import annotations

from megatrain.plan.flops import GPU_PEAK_TFLOPS, flops_per_iteration, flops_per_token, gpu_peak_tflops


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Per-device peak for MFU: the GPU's datasheet figure, or on a CPU (name None) this host's
    measured matmul peak (calibrate.py: about a second the first time, then cached). None when
    unknown, so MFU is reported as n/a rather than against an invented figure.

    fp8 reports against the bf16 peak (Megatron's and torchtitan's convention): only the linear
    layers' GEMMs run in float8, and one scale makes an fp8 run's MFU comparable with its bf16 run's
    (a faster step shows as a higher MFU; it may then exceed what bf16 alone could reach)."""
    precision = "bf16" if precision == "fp8" else precision
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


__all__ = [
    "GPU_PEAK_TFLOPS",
    "flops_per_iteration",
    "flops_per_token",
    "gpu_peak_tflops",
    "peak_tflops",
    "throughput",
]
