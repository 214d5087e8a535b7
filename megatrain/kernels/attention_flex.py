"""The `attention` kernel's "flex" backend: torch's flex_attention with a block mask, causal or
causal within each packed document (or, for an encoder, the whole document either way), so fully
masked (T/128)² blocks are skipped rather than computed.

    out = attention_flex(q, k, v, segments)      # q (B, H, T, hd), k/v (B, G, T, hd)

The block mask is built once per forward: the causal one per (T, device) here, the documents' one on
the Segments (its `derived` cache), so every layer reuses it. On CUDA flex_attention is compiled (a
fused kernel, its backward too). Elsewhere torch runs it eagerly, materialising the scores, and has no
backward for it on CPU: there the forward is flex's (out and its log-sum-exp) and the backward is the
`attention_block_backward` kernel's (flash-attention's backward from that out and lse, the one ring
attention uses), so CPU training runs exactly the numbers a GPU would compute, only slower.

flex_attention has no dropout: a spec with attention_dropout > 0 and flex is refused (megatrain.spec).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from megatrain import kernels
from megatrain.kernels.attention import Segments

_BLOCK_MASK_KEY = "flex_block_mask"


def _causal(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=16)
def causal_block_mask(t: int, device: str) -> BlockMask:
    """The causal mask over T tokens (one for every row and head: broadcast over B and H)."""
    return create_block_mask(_causal, None, None, t, t, device=device)


def document_block_mask(segments: Segments, causal: bool = True) -> BlockMask:
    """Causal within each packed document (a row's tokens attend to earlier tokens of their own
    segment), or the whole document when not causal; built on the first call for these Segments
    and kept on them."""

    def build(seg: Segments) -> BlockMask:
        ids = seg.ids  # (B, T)
        b, t = ids.shape

        def same_document(bi: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return (q_idx >= kv_idx) & (ids[bi, q_idx] == ids[bi, kv_idx])

        def whole_document(bi: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return ids[bi, q_idx] == ids[bi, kv_idx]

        rule = same_document if causal else whole_document
        return create_block_mask(rule, b, None, t, t, device=str(ids.device))

    mask: BlockMask = segments.derived(_BLOCK_MASK_KEY if causal else _BLOCK_MASK_KEY + "_full", build)
    return mask


def _everything(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= 0  # every pair (a tensor, as flex's mask functions return)


@functools.lru_cache(maxsize=16)
def full_block_mask(t: int, device: str) -> BlockMask:
    """No mask over T tokens: an encoder's unpacked rows."""
    return create_block_mask(_everything, None, None, t, t, device=device)


@functools.cache
def _compiled() -> Any:
    return torch.compile(flex_attention, dynamic=False)


def _flex_eager(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse fp32 (B, H, T)) from the unfused implementation (no autograd)."""
    # Detached: torch refuses flex on CPU inputs that require grad (it has no backward there).
    q, k, v = q.detach(), k.detach(), v.detach()
    with warnings.catch_warnings():
        # Eager flex is the intended path off CUDA: its advice to compile is for GPUs.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = flex_attention(
            q,
            k,
            v,
            block_mask=block_mask,
            enable_gqa=k.shape[1] != q.shape[1],
            return_aux=AuxRequest(lse=True),
        )
    return out, aux.lse


class _FlexEager(torch.autograd.Function):
    """flex's eager forward; the backward from its out and lse (attention_block_backward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_mask: BlockMask,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        out, lse = _flex_eager(q, k, v, block_mask)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        grad = kernels.get("attention_block_backward", q.device.type)
        # `mask` holds the documents (None: one per row); the causal rule is and-ed in where causal.
        dq, dk, dv = grad(dout, q, k, v, out, lse, ctx.causal, mask, 1.0 / math.sqrt(q.shape[-1]))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """flex_attention under the causal or per-document block mask (no dropout); an encoder's
    unpacked rows (causal False, no segments) need no mask at all."""
    if dropout_p > 0:
        raise ValueError("flex attention runs no dropout: set model.attention_dropout=0 or choose sdpa")
    t = q.shape[2]
    if segments is not None:
        block_mask = document_block_mask(segments, causal)
    elif causal:
        block_mask = causal_block_mask(t, str(q.device))
    else:
        block_mask = full_block_mask(t, str(q.device))
    if q.is_cuda:
        out: torch.Tensor = _compiled()(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
        return out
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        return _flex_eager(q, k, v, block_mask)[0]
    mask = None if segments is None else segments.mask_for(causal)
    result: torch.Tensor = _FlexEager.apply(q, k, v, block_mask, mask, causal)
    return result
