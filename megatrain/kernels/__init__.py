"""The kernels models call, picked by name and device through one registry.

Each kernel has backends: "torch" (our autograd Functions with hand-written backward passes:
megatrain.kernels.rms_norm, .swiglu, .rope, .linear_cross_entropy, .grad_accumulation, .moe_combine) and
"reference" (the same maths in plain torch ops, autograd deriving the backward: the twin the tests
compare against, and the fallback). A later backend (Triton, flash-attention, Transformer Engine)
registers itself with the devices it runs on and a check that it is usable, and the models pick it
up without a change:

    kernels.register("rms_norm", "triton", "megatrain.kernels.triton_rms_norm:rms_norm",
                     devices=("cuda",), available=triton_is_usable, priority=20)

`get(name, device_type)` gives the usable backend of highest priority for that device type (memoised:
models call it in forward). `MEGATRAIN_KERNELS` forces backends, for debugging a numerical
difference: "reference" for every kernel, or "rms_norm=reference,swiglu=torch".

Importing this package imports no torch (the memory planner reads megatrain.kernels.policy); a
backend's module is imported on first use.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV = "MEGATRAIN_KERNELS"


@dataclass(frozen=True)
class Backend:
    kernel: str
    name: str
    target: str
    """"module:attribute" of the function."""
    devices: tuple[str, ...] | None = None
    """Device types it runs on (None: any)."""
    available: Callable[[], bool] | None = None
    priority: int = 0

    def load(self) -> Callable[..., Any]:
        module, _, attr = self.target.partition(":")
        fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
        return fn


_BACKENDS: dict[str, list[Backend]] = {}
_CHOSEN: dict[tuple[str, str, str | None, str | None, str], Callable[..., Any]] = {}


def register(
    kernel: str,
    backend: str,
    target: str,
    *,
    devices: tuple[str, ...] | None = None,
    available: Callable[[], bool] | None = None,
    priority: int = 0,
) -> None:
    """Add (or replace) `backend` of `kernel`; higher priority wins where it runs and is available."""
    entries = [b for b in _BACKENDS.get(kernel, []) if b.name != backend]
    entries.append(Backend(kernel, backend, target, devices, available, priority))
    _BACKENDS[kernel] = sorted(entries, key=lambda b: -b.priority)
    _CHOSEN.clear()


def names() -> list[str]:
    return sorted(_BACKENDS)


def backends(kernel: str) -> list[str]:
    """The backends of `kernel`, highest priority first."""
    return [b.name for b in _entries(kernel)]


def _entries(kernel: str) -> list[Backend]:
    if kernel not in _BACKENDS:
        raise KeyError(f"no kernel named {kernel!r}; known: {', '.join(names())}")
    return _BACKENDS[kernel]


def forced_backends(value: str | None = None) -> dict[str, str]:
    """MEGATRAIN_KERNELS read as {kernel: backend} ("*" for every kernel)."""
    value = os.environ.get(ENV, "") if value is None else value
    forced: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        kernel, sep, backend = part.partition("=")
        forced[kernel.strip() if sep else "*"] = (backend if sep else kernel).strip()
    return forced


def get(
    kernel: str, device_type: str = "cpu", backend: str | None = None, prefer: str | None = None
) -> Callable[..., Any]:
    """The function of `kernel` for `device_type` ("cpu", "cuda"): `backend` if given (or forced by
    MEGATRAIN_KERNELS), else `prefer` (a model's own choice, e.g. its attention backend, which
    MEGATRAIN_KERNELS overrides for debugging), else the usable backend of highest priority."""
    key = (kernel, device_type, backend, prefer, os.environ.get(ENV, ""))
    fn = _CHOSEN.get(key)
    if fn is None:
        fn = _CHOSEN[key] = _choose(kernel, device_type, backend, prefer).load()
    return fn


def _choose(kernel: str, device_type: str, backend: str | None, prefer: str | None = None) -> Backend:
    entries = _entries(kernel)
    forced = forced_backends()
    wanted = backend or forced.get(kernel) or forced.get("*") or prefer
    if wanted is not None:
        for b in entries:
            if b.name == wanted:
                return b
        raise KeyError(f"kernel {kernel!r} has no backend {wanted!r}; it has: {', '.join(backends(kernel))}")
    for b in entries:
        if (b.devices is None or device_type in b.devices) and (b.available is None or b.available()):
            return b
    raise KeyError(f"no backend of kernel {kernel!r} runs on {device_type!r}")


def _builtin() -> None:
    pkg = "megatrain.kernels"
    for kernel, module, fn in (
        ("rms_norm", "rms_norm", "rms_norm"),
        ("swiglu", "swiglu", "swiglu"),
        ("apply_rope", "rope", "apply_rope"),
        ("apply_rope_qk", "rope", "apply_rope_qk"),
        ("layer_norm", "layer_norm", "layer_norm"),
        ("geglu", "geglu", "geglu"),
        ("linear_cross_entropy", "linear_cross_entropy", "linear_cross_entropy"),
        (
            "vocab_parallel_linear_cross_entropy",
            "vocab_parallel_linear_cross_entropy",
            "vocab_parallel_linear_cross_entropy",
        ),
        ("linear", "grad_accumulation", "linear"),
        ("embedding", "grad_accumulation", "embedding"),
        ("grouped_mlp", "grouped_mlp", "grouped_mlp"),
        ("moe_combine", "moe_combine", "moe_combine"),
    ):
        register(kernel, "torch", f"{pkg}.{module}:{fn}", priority=10)
        register(kernel, "reference", f"{pkg}.{module}:{fn}_reference")
    # Attention (model.attention_backend names one; auto: the highest priority usable here): SDPA
    # everywhere, flash-attn on CUDA where installed; Transformer Engine and flex only when asked for.
    register("attention", "sdpa", f"{pkg}.attention:attention", priority=10)
    register("attention", "reference", f"{pkg}.attention:attention_reference")
    register(
        "attention",
        "flash",
        f"{pkg}.attention_flash:attention_flash",
        devices=("cuda",),
        available=_flash_attn_available,
        priority=20,
    )
    register(
        "attention", "te", f"{pkg}.attention_flash:attention_te", devices=("cuda",), available=_te_available
    )
    register("attention", "flex", f"{pkg}.attention_flex:attention_flex")

    # The fused LM head + loss: each chunk's cross-entropy in Triton on CUDA (GEMMs stay in torch).
    for kernel in ("linear_cross_entropy", "vocab_parallel_linear_cross_entropy"):
        register(
            kernel,
            "triton",
            f"{pkg}.triton.cross_entropy:{kernel}",
            devices=("cuda",),
            available=_triton_usable,
            priority=20,
        )

    # Mixture-of-experts: torch._grouped_mm on CUDA where this torch has it.
    register(
        "grouped_mlp",
        "grouped_mm",
        f"{pkg}.grouped_mlp:grouped_mlp_grouped_mm",
        devices=("cuda",),
        available=_grouped_mm_available,
        priority=20,
    )
    # One attention block with its log-sum-exp (ring attention's unit of work, forward and backward).
    for kernel, fn in (
        ("attention_block", "attention_block"),
        ("attention_block_backward", "attention_block_backward"),
    ):
        register(kernel, "reference", f"{pkg}.attention_block:{fn}_reference")
        register(kernel, "torch", f"{pkg}.attention_block:{fn}_cpu", devices=("cpu",), priority=10)
        register(
            kernel,
            "sdpa",
            f"{pkg}.attention_block:{fn}_sdpa",
            devices=("cuda",),
            available=_cuda_available,
            priority=10,
        )


# -- Triton kernels (issue 18): norms, RoPE, gated activations ---------------------------------
def _triton() -> None:
    """On CUDA where triton is installed, above the "torch" twins; MEGATRAIN_KERNELS=<kernel>=triton
    forces one (the CPU tests run them under Triton's interpreter)."""
    for kernel, module in (
        ("rms_norm", "rms_norm"),
        ("layer_norm", "layer_norm"),
        ("apply_rope", "rope"),
        ("apply_rope_qk", "rope"),
        ("swiglu", "glu"),
        ("geglu", "glu"),
    ):
        register(
            kernel,
            "triton",
            f"megatrain.kernels.triton.{module}:{kernel}",
            devices=("cuda",),
            available=_triton_usable,
            priority=20,
        )


def _triton_usable() -> bool:
    from megatrain.kernels.triton import triton_usable

    return triton_usable()


# -- end of the Triton kernels -----------------------------------------------------------------


# --- fp8 (precision: fp8) ------------------------------------------------------------------------
def _register_fp8() -> None:
    """`linear_fp8`: the transformer layers' linear layers under precision fp8 (the `linear` kernel
    sends weights tagged `fp8` here). torchao's float8 training on any device (emulated off CUDA SM
    8.9+); the reference twin is torchao's Float8Linear function itself, gradients in `.grad`.
    Transformer Engine on CUDA where installed, below torchao: only a spec's fp8_backend te picks it."""
    pkg = "megatrain.kernels.fp8_linear"
    register("linear_fp8", "torchao", f"{pkg}:linear_fp8", available=_torchao_available, priority=10)
    register(
        "linear_fp8",
        "te",
        "megatrain.kernels.fp8_te:linear_fp8_te",
        devices=("cuda",),
        available=_te_linear_available,
        priority=5,
    )
    register("linear_fp8", "reference", f"{pkg}:linear_fp8_reference", available=_torchao_available)


def _torchao_available() -> bool:
    from megatrain.kernels.fp8_linear import torchao_available

    return torchao_available()


def _te_linear_available() -> bool:
    from megatrain.kernels.fp8_te import te_available

    return te_available()


# --- end fp8 -------------------------------------------------------------------------------------


def _grouped_mm_available() -> bool:
    from megatrain.kernels.grouped_mlp import grouped_mm_available

    return grouped_mm_available()


def _cuda_available() -> bool:
    from megatrain.kernels.attention_block import sdpa_available

    return sdpa_available()


def _flash_attn_available() -> bool:
    from megatrain.kernels.attention_flash import flash_attn_available

    return flash_attn_available()


def _te_available() -> bool:
    from megatrain.kernels.attention_flash import te_available

    return te_available()


_builtin()
_triton()
_register_fp8()  # fp8
