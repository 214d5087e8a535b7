"""One block of attention with its log-sum-exp, forward and backward: the `attention_block` and
`attention_block_backward` kernels that ring attention (megatrain.engine.parallel.context) calls once
per K/V block.

    out, lse = kernels.get("attention_block", dev)(q, k, v, causal, mask, scale)
    dq, dk, dv = kernels.get("attention_block_backward", dev)(dout, q, k, v, out, lse, causal, mask, scale)

q (B, H, Tq, hd), k and v (B, G, Tk, hd) with G dividing H (grouped-query attention). `causal`: query
i sees keys j <= i (Tq == Tk, both in the same order); `mask` (B, 1, Tq, Tk) bool or None: the pairs
allowed (packed documents), and-ed with the causal rule. out (B, H, Tq, hd) and lse (B, H, Tq) are
fp32 so that blocks merge exactly; a row with no allowed key has out 0 and lse -inf.

The backward is flash-attention's: given the *merged* out and lse of a query row over every block,
P = exp(S - lse) is that row's final attention to this block's keys, and
dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)); so each block's gradients are exact on their own and only add up.

Backends: "reference" (fp32 PyTorch, materialising the (Tq, Tk) scores: the twin), "torch" (CPU:
torch's tiled flash kernel for CPU, which returns the log-sum-exp and takes an additive mask) and
"sdpa" (CUDA: torch's fused SDPA kernels; flash for 16-bit blocks without a mask, memory-efficient
with an additive bias otherwise). The fused ones never hold a block's (Tq, Tk) scores, so a rank's
attention memory stays linear in its tokens.
"""

from __future__ import annotations

import math

import torch

_NEG_INF = float("-inf")


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, G, T, hd) -> (B, H, T, hd): query head h reads group h // (H/G)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, T, hd) gradients -> (B, G, T, hd): a group's K/V gradient sums over its query heads."""
    b, h, t, hd = x.shape
    return x if h == groups else x.view(b, groups, h // groups, t, hd).sum(2)


def _allowed(
    tq: int, tk: int, causal: bool, mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """(Tq, Tk) or (B, 1, Tq, Tk) bool, or None when every pair is allowed."""
    allowed = mask
    if causal:
        tril = torch.ones(tq, tk, dtype=torch.bool, device=device).tril()
        allowed = tril if allowed is None else allowed & tril
    return allowed


def _probs(
    q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Masked fp32 scores (B, H, Tq, Tk), -inf where not allowed."""
    s = (q.float() @ _expand(k, q.shape[1]).float().transpose(-1, -2)) * scale
    allowed = _allowed(q.shape[2], k.shape[2], causal, mask, q.device)
    return s if allowed is None else s.masked_fill(~allowed, _NEG_INF)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A row with no allowed key has lse -inf; subtract 0 there instead (exp(-inf - 0) = 0, no NaN).
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def attention_block_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ·scale + mask) v over this block's keys, and the rows' log-sum-exp, in fp32."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _probs(q, k, causal, mask, scale)  # (B, H, Tq, Tk)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return p @ _expand(v, q.shape[1]).float(), lse


def attention_block_backward_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 dq (B, H, Tq, hd), dk and dv (B, G, Tk, hd) of this block, from the merged out and lse."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads, groups = q.shape[1], k.shape[1]
    p = torch.exp(_probs(q, k, causal, mask, scale) - _finite(lse).float().unsqueeze(-1))  # (B, H, Tq, Tk)
    do = dout.float()
    dv = p.transpose(-1, -2) @ do  # (B, H, Tk, hd)
    dp = do @ _expand(v, heads).float().transpose(-1, -2)  # (B, H, Tq, Tk)
    delta = (do * out.float()).sum(-1, keepdim=True)  # (B, H, Tq, 1)
    ds = p * (dp - delta) * scale
    dq = ds @ _expand(k, heads).float()
    dk = ds.transpose(-1, -2) @ q.float()
    return dq, _fold(dk, groups), _fold(dv, groups)


def _empty_rows(
    out: torch.Tensor, lse: torch.Tensor, causal: bool, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused kernel's (out, lse) in the twin's convention: fp32, and out 0 / lse -inf on rows with no
    allowed key (the kernels return a finite lse, or NaN, there)."""
    out, lse = out.float(), lse[..., : out.shape[2]].float()  # some kernels pad lse's rows to a tile
    if mask is not None:
        allowed = _allowed(out.shape[2], mask.shape[-1], causal, mask, out.device)
        assert allowed is not None
        empty = ~allowed.any(-1)  # (B, 1, Tq)
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def attention_block_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused flash kernel for CPU (tiled: no (Tq, Tk) scores held), which returns the lse."""
    heads = q.shape[1]
    bias = None if mask is None else _bias(mask, causal, q, k.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _expand(k, heads), _expand(v, heads), 0.0, causal and mask is None, attn_mask=bias, scale=scale
    )
    return _empty_rows(out, lse, causal, mask)


def attention_block_backward_cpu(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's backward, fed the merged out and lse."""
    heads, groups = q.shape[1], k.shape[1]
    bias = None if mask is None else _bias(mask, causal, q, k.shape[2])
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.to(q.dtype).contiguous(), q, _expand(k, heads), _expand(v, heads), out.to(q.dtype).contiguous(),
        _finite(lse).float().contiguous(), 0.0, causal and mask is None, attn_mask=bias, scale=scale,
    )  # fmt: skip
    return dq.float(), _fold(dk.float(), groups), _fold(dv.float(), groups)


def _bias(mask: torch.Tensor | None, causal: bool, q: torch.Tensor, tk: int) -> torch.Tensor:
    """The additive bias the efficient kernel takes: (B, H, Tq, Tk) in q's dtype, 0 or -inf, stored
    with its rows padded to a multiple of 16 elements (the kernel's alignment), as SDPA does."""
    b, h, tq = q.shape[0], q.shape[1], q.shape[2]
    allowed = _allowed(tq, tk, causal, mask, q.device)
    padded = torch.zeros(b, h, tq, -(-tk // 16) * 16, dtype=q.dtype, device=q.device)
    bias = padded[..., :tk]
    if allowed is not None:
        bias.masked_fill_(~allowed.expand(b, h, tq, tk), _NEG_INF)
    return bias


def _flash(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """torch's flash kernel: 16-bit inputs and no mask (it takes only the causal flag)."""
    return mask is None and q.dtype in (torch.float16, torch.bfloat16)


def attention_block_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused SDPA kernels on CUDA (flash for 16-bit unmasked blocks, memory-efficient with
    a bias otherwise): out in fp32, lse (B, H, Tq) fp32, -inf on rows with no allowed key."""
    heads, tq, tk = q.shape[1], q.shape[2], k.shape[2]
    kk, vv = _expand(k, heads), _expand(v, heads)
    if _flash(q, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, kk, vv, 0.0, causal, False, scale=scale
        )[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, kk, vv, _bias(mask, causal, q, tk), True, 0.0, False, scale=scale
        )[:2]
    lse = lse[..., :tq].float()  # the efficient kernel pads the rows to a multiple of its tile
    allowed = _allowed(tq, tk, causal, mask, q.device)
    if allowed is not None:  # rows with no allowed key: the twin's convention
        lse = lse.masked_fill(~allowed.any(-1), _NEG_INF)
    return out.float().masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0), lse


def attention_block_backward_sdpa(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernels' backward, fed the merged out and lse (flash-attention's recomputation)."""
    heads, groups, tq, tk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kk, vv = _expand(k, heads), _expand(v, heads)
    do, o = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    if _flash(q, mask):
        cum = torch.empty(0, dtype=torch.int32, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, kk, vv, o, lse.float().contiguous(), cum, cum, tq, tk, 0.0, causal, zero, zero, scale=scale
        )
    else:
        lse_in = torch.full(
            (*lse.shape[:-1], -(-tq // 32) * 32), _NEG_INF, dtype=torch.float32, device=q.device
        )
        lse_in[..., :tq] = _finite(lse)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, kk, vv, _bias(mask, causal, q, tk), o, lse_in, zero, zero, 0.0,
            [True, True, True, False], False, scale=scale,
        )  # fmt: skip
    return dq.float(), _fold(dk.float(), groups), _fold(dv.float(), groups)


def sdpa_available() -> bool:
    return torch.cuda.is_available()
