"""The `linear_fp8` kernel through NVIDIA Transformer Engine (CUDA, where installed).

`training.fp8_backend: te` sends the tagged linear layers here instead of torchao. Each weight gets
a bias-free te.Linear that holds that very Parameter (nothing copied: the optimizer, DataParallel
and checkpoints see the one tensor), run under TE's fp8 autocast with current scaling
(Float8CurrentScaling: a per-tensor scale from this step's absolute maximum, e4m3 forward and e5m2
gradients — the recipe torchao calls tensorwise). The bias is added outside, in the model's dtype.

The weight gradient lands in `.grad` and DataParallel adds it to main_grad (the unfused route of
megatrain.kernels.grad_accumulation): TE's own fused accumulation signals differently from ours.
Tensor parallelism stays ours: TE multiplies the local shard, as torchao does.

Only tensorwise exists here (TE's rowwise-like recipes are blockwise or MXFP8, other numerics);
the spec rules refuse te with another recipe (megatrain.plan.fp8).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def te_available() -> bool:
    """Whether Transformer Engine's PyTorch API imports here (it needs CUDA and its libraries)."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 — ImportError, or its CUDA libraries failing to load
        return False
    return True


def _autocast() -> contextlib.AbstractContextManager[Any]:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8CurrentScaling

    recipe = Float8CurrentScaling()
    if hasattr(te, "autocast"):  # TE >= 2.8 (fp8_autocast is deprecated there)
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _te_linear(weight: torch.Tensor) -> Any:
    """The te.Linear holding `weight`, built once per Parameter."""
    module = weight.__dict__.get("_te_linear")
    if module is None:
        import transformer_engine.pytorch as te

        out_features, in_features = weight.shape
        module = te.Linear(
            in_features, out_features, bias=False, params_dtype=weight.dtype, device=weight.device
        )
        module.weight = weight  # replaces TE's own (freshly initialised) Parameter
        weight.__dict__["_te_linear"] = module
    return module


def linear_fp8_te(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "tensorwise"
) -> torch.Tensor:
    """F.linear with Transformer Engine's float8 GEMMs (current scaling); gradients in `.grad`."""
    if x.device.type != "cuda":
        raise RuntimeError("training.fp8_backend te runs on CUDA devices only")
    if recipe != "tensorwise":
        raise ValueError(f"training.fp8_backend te runs the tensorwise recipe, not {recipe!r}")
    with _autocast():
        y = _te_linear(weight)(x)
    return y if bias is None else y + bias.to(y.dtype)
