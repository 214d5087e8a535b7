"""Causal self-attention, optionally document-aware: the `attention` kernel and its backends.

    out = kernels.get("attention", q.device.type)(q, k, v, segments, dropout_p)

q (B, H, T, hd), k and v (B, G, T, hd) with G dividing H (grouped-query attention); out (B, H, T, hd).
`segments` is None for plain causal attention (SDPA with is_causal=True: the fast path of every
unpacked batch), or a `Segments` of packed documents: a token then attends only to earlier tokens of
its own segment (a block-diagonal causal mask, Megatron's reset_attention_mask). Every backend also
takes `causal=False` (an encoder: BERT): a token attends to every token of its segment, before and
after it; padding is a segment of its own, so real tokens never attend to it.

Backends: "sdpa" (here: SDPA; a boolean mask when packed), "reference" (the softmax written out in
fp32, the twin the tests compare against), and in their own modules "flash" and "te"
(megatrain.kernels.attention_flash: flash-attn and Transformer Engine on CUDA, where installed; packed
documents become one ragged batch described by cumulative sequence lengths, so no (T, T) mask exists)
and "flex" (megatrain.kernels.attention_flex: a block mask). A model picks one through
model.attention_backend (megatrain.spec_attention). A Segments object is built once per
forward and caches what each backend derives from the ids, so every layer reuses one mask, one
cu_seqlens or one block mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

# enable_gqa arrived in torch 2.5; SDPA is a builtin without a signature, so read its docstring.
_SDPA_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


class Segments:
    """The packed documents of a micro-batch: segment ids (B, T), each segment a contiguous run of
    tokens (as packing lays them out). Derived forms are computed on first use and kept."""

    def __init__(self, ids: torch.Tensor):
        if ids.dim() != 2:
            raise ValueError(f"segment_ids must be (batch, tokens), got shape {tuple(ids.shape)}")
        self.ids = ids
        self._mask: torch.Tensor | None = None
        self._varlen: tuple[torch.Tensor, int, bool] | None = None
        self._derived: dict[str, Any] = {}

    def derived(self, key: str, build: Callable[[Segments], Any]) -> Any:
        """`build(self)`, computed on the first call with `key` and kept (a backend's own form of the
        ids, e.g. flex attention's block mask)."""
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]

    @property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool, True where query t may attend key s: s <= t within t's segment."""
        if self._mask is None:
            t = self.ids.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=self.ids.device).tril()
            self._mask = self.same_segment & causal
        return self._mask

    @property
    def same_segment(self) -> torch.Tensor:
        """(B, 1, T, T) bool, True where query t and key s are in one segment: the bidirectional
        (encoder) mask."""
        return self.derived(
            "same_segment", lambda seg: (seg.ids.unsqueeze(2) == seg.ids.unsqueeze(1)).unsqueeze(1)
        )

    def mask_for(self, causal: bool) -> torch.Tensor:
        """The boolean mask of a causal or bidirectional attention over these segments."""
        return self.mask if causal else self.same_segment

    @property
    def varlen(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens int32 (N+1,), max_seqlen) over the flattened (B·T) tokens: a sequence starts
        at every row start and wherever the id changes. One host sync per forward."""
        cu, longest, _ = self._runs()
        return cu, longest

    @property
    def contiguous(self) -> bool:
        """Whether each segment is one run of tokens (as packing lays them out): only then do the
        varlen sequences equal the mask's blocks."""
        return self._runs()[2]

    def _runs(self) -> tuple[torch.Tensor, int, bool]:
        if self._varlen is None:
            b, t = self.ids.shape
            starts = torch.ones_like(self.ids, dtype=torch.bool)
            starts[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
            first = torch.nonzero(starts.reshape(-1)).squeeze(1)
            end = torch.tensor([b * t], device=first.device, dtype=first.dtype)
            cu = torch.cat([first, end]).to(torch.int32)
            # Distinct (row, id) pairs: as many as runs exactly when no id comes back after a gap.
            rows = torch.arange(b, device=self.ids.device).unsqueeze(1).expand(b, t)
            distinct = torch.unique(torch.stack([rows.reshape(-1), self.ids.reshape(-1)]), dim=1).shape[1]
            stats = torch.stack([(cu[1:] - cu[:-1]).max(), torch.tensor(distinct, device=cu.device)]).tolist()
            self._varlen = (cu, int(stats[0]), int(stats[1]) == len(first))
        return self._varlen


def _expand_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Query head h belongs to group h // (H/G): repeat each group's K/V that many times.
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """SDPA (flash / cuDNN / memory-efficient backends on a GPU): is_causal (or no mask at all for
    an encoder) without segments, else the block-diagonal mask."""
    gqa = k.shape[1] != q.shape[1]
    if gqa and not _SDPA_HAS_GQA:
        k, v = _expand_groups(q, k, v)
        gqa = False
    kw = {"enable_gqa": True} if gqa else {}
    if segments is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, **kw)
    mask = segments.mask_for(causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **kw)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
) -> torch.Tensor:
    """softmax(q kᵀ / √hd + mask) v written out in fp32 (autograd's backward); the twin."""
    if k.shape[1] != q.shape[1]:
        k, v = _expand_groups(q, k, v)
    t = q.shape[2]
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    if segments is None:
        allowed = torch.ones(t, t, dtype=torch.bool, device=q.device)
        allowed = allowed.tril() if causal else allowed
    else:
        allowed = segments.mask_for(causal)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return (probs @ v.float()).to(q.dtype)
