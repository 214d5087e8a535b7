"""T5's building blocks: relative position bias, attention without 1/sqrt(d) scaling, the ReLU or
gated-GELU MLP, encoder and decoder layers, and the decoding cache (models.t5 assembles them).

Every Linear, Embedding and RMSNorm is gpt.py's (the kernel registry's ops, gradient-accumulation
fusion under DataParallel); the attention core is SDPA with scale=1.0 and one float additive mask
per stack: the position bias where a key may be seen, the dtype's minimum where it may not (a
replacement, not a sum, so that masked scores never overflow to -inf and a fully masked row stays
finite, as transformers' T5 does).

Recompute (set_recompute, as gpt.GPTModel's): full reruns whole layers in backward (run_stack),
selective only the attention cores, self and cross (SDPA's math path, a CPU's, keeps their
(B, H, T, S) probabilities; a GPU's memory-efficient kernel on T5's float mask keeps none). Each
carries a torch.utils.checkpoint context_fn that tensor parallelism replaces with its RNG tracker's,
so recomputed dropout masks equal the first pass's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from megatrain import kernels
from megatrain.engine.models.gpt import Embedding, Linear, RMSNorm

if TYPE_CHECKING:
    from megatrain.engine.models.t5 import T5Config

KV = tuple[torch.Tensor, torch.Tensor]


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Mesh TensorFlow's buckets for (key position - query position): exact buckets for small
    distances, logarithmic ones up to max_distance, one bucket beyond. Bidirectional (the encoder)
    spends half the buckets on keys after the query; causal (the decoder) clamps those to 0."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -relative_position.clamp(max=0)
    max_exact = num_buckets // 2
    # The same float ops in the same order as the reference, so bucket edges round alike; the clamp
    # only keeps log(0) out of the positions that take the exact branch anyway.
    scaled = (
        torch.log(distance.clamp(min=1).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    large = (max_exact + scaled.long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class RelativeBias(Embedding):
    """One learned scalar per (bucket, head), shared by every layer of a stack: weight (buckets, H)."""

    def __init__(self, cfg: T5Config, bidirectional: bool):
        super().__init__(cfg.relative_attention_num_buckets, cfg.num_attention_heads)
        self.bidirectional = bidirectional
        self.max_distance = cfg.relative_attention_max_distance

    def bias(self, q_len: int, k_len: int, offset: int = 0) -> torch.Tensor:
        """(1, H, q_len, k_len) for queries at positions offset.. and keys at 0..k_len-1."""
        device = self.weight.device
        query = torch.arange(offset, offset + q_len, device=device)[:, None]
        relative = torch.arange(k_len, device=device)[None, :] - query  # (q, k)
        buckets = relative_position_bucket(
            relative, self.bidirectional, self.num_embeddings, self.max_distance
        )
        return self(buckets).permute(2, 0, 1).unsqueeze(0)


def additive_mask(
    allowed: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """SDPA's float mask: bias (or 0) where `allowed`, the dtype's minimum elsewhere (both broadcast)."""
    if allowed is None:
        return bias
    if bias is None:
        bias = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, bias, torch.finfo(bias.dtype).min)


class T5KVCache:
    """A decoder's keys and values for generation: each self-attention layer's for positions
    [0, length) in (B, H, max_len, d) buffers allocated on first write, and each cross-attention
    layer's over the encoder output, computed once. T5Model.decode(..., kv_cache=cache) runs the
    next tokens and then advances `length`."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self._self: dict[nn.Module, KV] = {}
        self._cross: dict[nn.Module, KV] = {}

    def append(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor) -> KV:
        """Store k, v (B, H, T, d) at the next T positions; return every position's so far."""
        b, h, t, d = k.shape
        start, end = self.length, self.length + t
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {end} were asked for")
        if layer not in self._self:
            self._self[layer] = (k.new_zeros(b, h, self.max_len, d), v.new_zeros(b, h, self.max_len, d))
        keys, values = self._self[layer]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        return keys[:, :, :end], values[:, :, :end]

    def cross(self, layer: nn.Module, compute: Callable[[], KV]) -> KV:
        """The layer's cross-attention keys and values: the encoder output does not change."""
        if layer not in self._cross:
            self._cross[layer] = compute()
        return self._cross[layer]


class _AttentionCore(nn.Module):
    """What self- and cross-attention share: the core over (B, H, T, d) heads, with its hooks."""

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.head_dim = cfg.kv_channels
        self.dropout = cfg.attention_dropout
        self.recompute_core = False
        """Selective recompute: the core reruns in backward (set by set_recompute)."""
        # No-ops on one device. Tensor parallelism draws the dropout of its heads from the tracker's
        # per-rank stream, and replays that stream when the core is recomputed.
        self.core_rng_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self.recompute_context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        with self.core_rng_context():
            return _core(q, k, v, mask, self.dropout if self.training else 0.0)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q (B, H, T, d), k and v (B, H, S, d) -> (B, T, H·d); only q, k, v and the mask are kept
        for backward under selective recompute."""
        if self.recompute_core and self.training and torch.is_grad_enabled():
            return checkpoint(
                self._attend, q, k, v, mask, use_reentrant=False, context_fn=self.recompute_context_fn
            )
        return self._attend(q, k, v, mask)


class SelfAttention(_AttentionCore):
    """qkv rows laid out per head [q_h; k_h; v_h] (gpt.Attention's layout with one head per group):
    a column split hands each tensor-parallel rank whole heads."""

    def __init__(self, cfg: T5Config):
        super().__init__(cfg)
        inner = cfg.num_attention_heads * cfg.kv_channels  # may differ from hidden_size (t5-11b)
        self.qkv = Linear(cfg.hidden_size, 3 * inner, bias=False)
        self.proj = Linear(inner, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, cache: T5KVCache | None = None
    ) -> torch.Tensor:
        """x (B, T, C), mask broadcastable to (B, H, T, S) -> (B, T, C); with a cache, S counts the
        cached positions too."""
        # Heads from the width, not the config: a tensor-parallel rank holds only some of them; the
        # length from the projection, not x: under sequence parallelism x is a slice of T.
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(3)  # (B, H, T, d)
        if cache is not None:
            k, v = cache.append(self, k, v)
        return self.proj(self.attend(q, k, v, mask))


class CrossAttention(_AttentionCore):
    """Decoder queries over the encoder output: q, and kv with rows per head [k_h; v_h]."""

    def __init__(self, cfg: T5Config):
        super().__init__(cfg)
        inner = cfg.num_attention_heads * cfg.kv_channels
        self.q = Linear(cfg.hidden_size, inner, bias=False)
        self.kv = Linear(cfg.hidden_size, 2 * inner, bias=False)
        self.proj = Linear(inner, cfg.hidden_size, bias=False)

    def keys_values(self, memory: torch.Tensor) -> KV:
        kv = self.kv(memory)  # (B, S, 2·H·d): the whole encoder sequence, under sequence parallelism too
        b, s, _ = kv.shape
        k, v = kv.view(b, s, -1, 2, self.head_dim).transpose(1, 2).unbind(3)  # (B, H, S, d)
        return k, v

    def forward(
        self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None, cache: T5KVCache | None = None
    ) -> torch.Tensor:
        """x (B, T, C) over memory (B, S, C) -> (B, T, C)."""
        q = self.q(x)
        b, t, _ = q.shape
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        if cache is None:
            k, v = self.keys_values(memory)
        else:
            k, v = cache.cross(self, lambda: self.keys_values(memory))
        return self.proj(self.attend(q, k, v, mask))


def _core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """(B, H, T, d) each -> (B, T, H·d). T5 folds 1/sqrt(d) into its initialisation: scale 1."""
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=1.0)
    b, _, t, _ = q.shape
    return y.transpose(1, 2).reshape(b, t, -1)


class T5MLP(nn.Module):
    """ReLU (T5 v1.0), or gated GELU (v1.1) with fc1 rows [gate; up] and a tanh-approximated gate."""

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.gated = cfg.gated_mlp
        width = 2 * cfg.ffn_hidden_size if self.gated else cfg.ffn_hidden_size
        self.fc1 = Linear(cfg.hidden_size, width, bias=False)
        self.fc2 = Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)
        self.dropout = nn.Dropout(cfg.hidden_dropout)  # T5 drops the hidden activations too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = kernels.get("geglu", h.device.type)(h) if self.gated else F.relu(h)
        return self.fc2(self.dropout(h))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = SelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = T5MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.recompute = False
        """Full recompute: the whole layer reruns in backward (set by set_recompute)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = SelfAttention(cfg)
        self.cross_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.cross = CrossAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = T5MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.recompute = False
        """Full recompute: the whole layer reruns in backward (set by set_recompute)."""

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        self_mask: torch.Tensor | None,
        cross_mask: torch.Tensor | None,
        cache: T5KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), self_mask, cache))
        x = x + self.dropout(self.cross(self.cross_norm(x), memory, cross_mask, cache))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def set_recompute(layers: Iterable[tuple[int, nn.Module]], mode: str, every: int = 1) -> None:
    """none | selective (every layer's attention cores, self and cross) | full (the layers whose
    index in their stack is a multiple of `every`), over (index in the stack, layer) pairs."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"recompute mode {mode!r} is not one of none, selective, full")
    if every < 1:
        raise ValueError(f"recompute every={every} must be >= 1")
    for i, layer in layers:
        layer.recompute = mode == "full" and i % every == 0
        for core in (layer.attn, getattr(layer, "cross", None)):
            if core is not None:
                core.recompute_core = mode == "selective"


def run_stack(
    layers: Iterable[nn.Module],
    x: torch.Tensor,
    *args: Any,
    training: bool,
    context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn,
) -> torch.Tensor:
    """The residual stream x through `layers` (one stack's, in order), each given *args (masks,
    the encoder output) and rerun in backward when its `recompute` is set and the model trains
    (context_fn restores the tracker's RNG streams in the rerun)."""
    for layer in layers:
        if layer.recompute and training and torch.is_grad_enabled():
            x = checkpoint(layer, x, *args, use_reentrant=False, context_fn=context_fn)
        else:
            x = layer(x, *args)
    return x
