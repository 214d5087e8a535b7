"""The `linear_fp8` kernel: a linear layer whose three GEMMs run in float8, through torchao.

`precision: fp8` (megatrain.engine.fp8) tags the weights of the transformer layers' linear layers
with an `Fp8Linear` (`weight.fp8`); the `linear` kernel sends those through here. Weights and
activations stay bf16; each GEMM casts its two operands to float8 with dynamic scaling (a scale from
the operand's absolute maximum, per tensor or per row as the recipe says) and returns bf16:

    forward       y  = x · Wᵀ          x (N, in) e4m3,  W (out, in) e4m3
    grad input    dx = dy · W          dy e5m2 (tensorwise) / e4m3 (rowwise),  W e4m3
    grad weight   dW = dyᵀ · x         accumulated into W.main_grad under DataParallel

The casts and GEMMs are torchao's own (the autograd Function behind its Float8Linear), called from
ours so that the weight gradient still lands in main_grad (megatrain.kernels.grad_accumulation):
the numerics are torchao's exactly. torchao saves the bf16 input and weight for backward and casts
them again there, so the saved activations are those of a bf16 linear.

On CUDA with compute capability 8.9+ the GEMMs are torch._scaled_mm; elsewhere torchao's emulation
runs the same casts and multiplies the float8 values in fp32 (the numerics of the real kernel up to
its accumulation order): the tests run that on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from megatrain.kernels.grad_accumulation import fusable, placeholder

RECIPES = ("tensorwise", "rowwise")
"""torchao's Float8LinearRecipeName values we train with."""


@dataclass(frozen=True)
class Fp8Linear:
    """What `weight.fp8` holds: the scaling recipe and the backend that runs it."""

    recipe: str = "tensorwise"
    backend: str | None = None
    """A `linear_fp8` backend by name; None lets the kernel registry pick."""


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def native_fp8(device: torch.device) -> bool:
    """Whether `device` multiplies float8 in hardware (torch._scaled_mm: CUDA SM 8.9+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def _configs(recipe: str, emulate: bool) -> tuple[Any, Any]:
    """(torchao's Float8LinearConfig for `recipe`, the LinearMMConfig of its three GEMMs)."""
    from torchao.float8 import Float8LinearConfig, LinearMMConfig, ScaledMMConfig

    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    gemms = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    # fp8_output=False: every GEMM returns the high-precision dtype of its inputs.
    mm = LinearMMConfig(
        *(ScaledMMConfig(emulate, g.use_fast_accum, False, config.pad_inner_dim) for g in gemms)
    )
    return config, mm


def torchao_config(recipe: str, device: torch.device) -> tuple[Any, Any]:
    """torchao's (Float8LinearConfig, LinearMMConfig) for `recipe` on `device` (emulated off SM 8.9+)."""
    return _configs(recipe, not native_fp8(device))


def _matmul() -> Any:
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args


class _Float8LinearFunction(torch.autograd.Function):
    """torchao's float8 matmul (forward and both backward GEMMs) with the weight gradient added
    into main_grad. torchao's Function is driven through our ctx: its forward saves what its
    backward reads on the ctx it is given."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str
    ) -> torch.Tensor:
        config, mm = torchao_config(recipe, x.device)
        ctx.param = weight  # the Parameter itself, for main_grad (as in grad_accumulation)
        ctx.has_bias = bias is not None
        y = _matmul().forward(ctx, x, weight.t(), mm, config)  # (..., out)
        return y if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, None]:
        grad_x, grad_weight_t, *_ = _matmul().backward(ctx, grad_out)
        weight = ctx.param
        main = weight.main_grad
        main.add_(grad_weight_t.t())  # (out, in), a float8 GEMM's bf16 output, summed in fp32
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, placeholder(weight), grad_bias, None


def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "tensorwise"
) -> torch.Tensor:
    """F.linear with its GEMMs in float8 (torchao, `recipe` scaling); the weight gradient goes into
    weight.main_grad where DataParallel asked for it, else into `.grad`."""
    if torch.is_grad_enabled() and weight.requires_grad and fusable(weight):
        return _Float8LinearFunction.apply(x, weight, bias, recipe)
    return linear_fp8_reference(x, weight, bias, recipe)


def linear_fp8_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "tensorwise"
) -> torch.Tensor:
    """What torchao's Float8Linear computes (its autograd Function; gradients land in `.grad`)."""
    config, mm = torchao_config(recipe, x.device)
    y = _matmul().apply(x, weight.t(), mm, config)
    return y if bias is None else y + bias.to(y.dtype)
