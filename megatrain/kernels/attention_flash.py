"""The `attention` kernel's CUDA library backends: "flash" (flash-attn 2, or 3's flash_attn_interface)
and "te" (Transformer Engine's DotProductAttention), each with the kernel's signature

    out = attention_flash(q, k, v, segments, dropout_p)      # q (B, H, T, hd), k/v (B, G, T, hd)

Plain causal attention runs their dense kernels; packed documents (a `Segments` of contiguous runs)
run their varlen path: the (B·T) tokens become one ragged batch cut at every document boundary
(cumulative sequence lengths, computed once per forward and cached on the Segments), so no (T, T)
mask exists and masked blocks cost nothing. Both take grouped K/V heads as they are.

Inputs their kernels do not take (not CUDA, fp32, a head dimension they lack, ids that come back
after a gap) run SDPA instead: `auto` picks flash wherever it is installed, and an explicit choice
with fp32 is refused before anything runs (megatrain.spec).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from megatrain.kernels.attention import Segments, attention

_HALF = (torch.float16, torch.bfloat16)


def flash_module(dropout_p: float = 0.0) -> ModuleType | None:
    """flash-attn 3's interface where installed (Hopper; it has no dropout), else flash-attn 2's
    package; None when neither imports."""
    names = ("flash_attn",) if dropout_p > 0 else ("flash_attn_interface", "flash_attn")
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and flash_module() is not None


def flash_supports(q: torch.Tensor) -> bool:
    """Whether flash-attn's kernels take q: fp16/bf16 on CUDA, head dim a multiple of 8 up to 256."""
    hd = q.shape[-1]
    return q.is_cuda and q.dtype in _HALF and hd % 8 == 0 and hd <= 256


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, T, hd) -> (B·T, heads, hd): the varlen kernels' layout."""
    b, n, t, hd = x.shape
    return x.transpose(1, 2).reshape(b * t, n, hd)


def _out(result: Any) -> torch.Tensor:
    # flash-attn 3 returns (out, lse) in some releases; 2 returns out unless asked for more.
    return result[0] if isinstance(result, tuple) else result


def attention_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """flash-attn's dense kernel, or its varlen kernel over packed documents (causal or not)."""
    fa = flash_module(dropout_p)
    if fa is None or not flash_supports(q) or (segments is not None and not segments.contiguous):
        return attention(q, k, v, segments, dropout_p, causal)
    # flash-attn 3 takes no dropout_p (flash_module gave 2 whenever there is dropout).
    drop = {"dropout_p": dropout_p} if fa.__name__ == "flash_attn" else {}
    b, h, t, hd = q.shape
    if segments is None:
        # (B, T, heads, hd) in and out; causal with fewer K/V heads handled by the kernel.
        out = _out(fa.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal, **drop))
        return out.transpose(1, 2)
    cu, longest = segments.varlen
    out = _out(
        fa.flash_attn_varlen_func(
            _tokens_first(q), _tokens_first(k), _tokens_first(v), cu, cu, longest, longest,
            causal=causal, **drop,
        )
    )  # fmt: skip
    return out.reshape(b, t, h, hd).transpose(1, 2)


def te_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except ImportError:
        return False
    return True


def te_supports(q: torch.Tensor) -> bool:
    """Whether TE's fused attention takes q: fp16/bf16 on CUDA (it picks a kernel for the head dim)."""
    return q.is_cuda and q.dtype in _HALF


@functools.lru_cache(maxsize=64)
def _te_attention(
    heads: int, groups: int, head_dim: int, dropout_p: float, packed: bool, causal: bool = True
) -> Any:
    """One DotProductAttention per shape and mask kind (it holds no weights, only its choices)."""
    import transformer_engine.pytorch as te

    return te.DotProductAttention(
        heads,
        head_dim,
        num_gqa_groups=groups,
        attention_dropout=dropout_p,
        qkv_format="thd" if packed else "bshd",
        attn_mask_type=("padding_causal" if packed else "causal")
        if causal
        else ("padding" if packed else "no_mask"),
    )


def attention_te(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """Transformer Engine's fused attention (cuDNN or its flash kernels, as TE picks): bshd, or thd
    with cumulative sequence lengths over packed documents; causal or not."""
    if not te_supports(q) or (segments is not None and not segments.contiguous):
        return attention(q, k, v, segments, dropout_p, causal)
    b, h, t, hd = q.shape
    core = _te_attention(h, k.shape[1], hd, dropout_p, segments is not None, causal)
    core.train(dropout_p > 0)  # TE drops out only in training mode; the caller passes 0 in eval
    if segments is None:
        out = core(*(x.transpose(1, 2).contiguous() for x in (q, k, v)))  # (B, T, H·hd)
    else:
        cu, longest = segments.varlen
        out = core(
            _tokens_first(q), _tokens_first(k), _tokens_first(v),
            cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
        )  # fmt: skip  # (B·T, H·hd)
    return out.reshape(b, t, h, hd).transpose(1, 2)
