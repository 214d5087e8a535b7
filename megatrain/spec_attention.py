"""model.attention_backend: the backends a model may ask for, what each needs installed, and the
rules between it and other fields. Torch-free (beside spec.py), so that the API refuses a spec naming
a backend that cannot run (megatrain.api.jobs.validation) with the same words the engine fails fast
with (megatrain.engine.train); megatrain.kernels holds the backends themselves.

    model.attention_backend: auto | sdpa | flash | te | flex

auto: flash-attn where installed and usable (CUDA, fp16/bf16, a head dimension it supports), else
SDPA; sdpa: torch's scaled_dot_product_attention; flash: flash-attn 2 (or 3's flash_attn_interface),
dense causal and varlen over packed documents; te: Transformer Engine's DotProductAttention (fused
attention); flex: torch's flex_attention with a causal / per-document block mask.
"""

from __future__ import annotations

import importlib.util
from typing import Literal, get_args

AttentionBackend = Literal["auto", "sdpa", "flash", "te", "flex"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)

PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "flash": (("flash_attn", "flash_attn_interface"), "flash-attn"),
    "te": (("transformer_engine",), "transformer-engine"),
}
"""backend → (modules, any one of which provides it; the distribution to install)."""

INSTALL_HINT = "pip install megatrain[gpu]"

NEEDS_16_BIT = ("flash", "te")
"""Backends whose kernels take only fp16/bf16 (refused with training.precision fp32)."""


def installed(backend: str) -> bool:
    """Whether the package `backend` needs is importable here (without importing it)."""
    modules, _ = PACKAGES.get(backend, ((), ""))
    return not modules or any(importlib.util.find_spec(m) is not None for m in modules)


def missing_package(backend: str) -> str | None:
    """The error for a backend whose package is not installed here, else None."""
    if installed(backend):
        return None
    _, dist = PACKAGES[backend]
    return (
        f"model.attention_backend={backend!r} needs the {dist} package, which is not installed "
        f"(install it with `{INSTALL_HINT}`, or choose auto or sdpa)"
    )


def dropout_problem(backend: str, attention_dropout: float) -> str | None:
    """flex_attention has no dropout."""
    if backend == "flex" and attention_dropout > 0:
        return (
            f"model.attention_backend='flex' runs no attention dropout; model.attention_dropout is "
            f"{attention_dropout} (set it to 0, or choose auto, sdpa, flash or te)"
        )
    return None


def context_parallel_problem(backend: str, cp: int) -> str | None:
    """With cp > 1 ring attention runs its own blocks (the attention_block kernels): a backend named
    for the model would silently not run."""
    if cp > 1 and backend not in ("auto", "sdpa"):
        return (
            f"model.attention_backend={backend!r} is not used with parallelism.cp={cp} (ring attention "
            "runs its own attention blocks); choose auto or sdpa"
        )
    return None


def precision_problem(backend: str, precision: str) -> str | None:
    """flash and te run fp16/bf16 kernels only: refused with fp32 training."""
    if backend in NEEDS_16_BIT and precision == "fp32":
        return (
            f"model.attention_backend={backend!r} runs only fp16/bf16 kernels; training.precision is fp32 "
            "(choose bf16 or fp16, or attention_backend auto or sdpa)"
        )
    return None


def runtime_problem(backend: str, device_type: str, precision: str) -> str | None:
    """Why a run on `device_type` at `precision` cannot use `backend` (the engine fails fast with it
    before building the model), else None."""
    if backend in PACKAGES:
        missing = missing_package(backend)
        if missing:
            return missing
        if device_type != "cuda":
            return f"model.attention_backend={backend!r} needs a CUDA GPU; this run is on {device_type}"
    return precision_problem(backend, precision)
