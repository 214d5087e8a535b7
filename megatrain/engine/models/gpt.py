"""One decoder-only transformer for both flavours: GPT-2 and Llama.

GPT-2: learned positions, LayerNorm, GELU MLP, biases, tied embeddings.
Llama: RoPE, RMSNorm, SwiGLU MLP, no biases, grouped-query attention, untied LM head.
Either may run a GELU, SwiGLU or GeGLU MLP instead (model.activation).

Plain single-device nn.Module: no process groups, no globals. Every Linear is its own named
submodule (attn.qkv, attn.proj, mlp.fc1, mlp.fc2, lm_head) so tensor-parallel layers can replace them;
Linear and Embedding are torch's, with gradient-accumulation fusion under DataParallel; norms,
activations, rotary embedding and the fused LM-head loss come from the kernel registry
(megatrain.kernels), so other backends drop in without a change here.

Parameter names (per layer i), for mapping Hugging Face checkpoints:
  embed.weight                     wte / embed_tokens
  pos_embed.weight                 wpe                       (learned positions only)
  layers.i.attn_norm               ln_1 / input_layernorm
  layers.i.attn.qkv                c_attn / [q_proj; k_proj; v_proj] regrouped (see Attention)
  layers.i.attn.proj               c_proj / o_proj
  layers.i.mlp_norm                ln_2 / post_attention_layernorm
  layers.i.mlp.fc1                 c_fc / [gate_proj; up_proj]
  layers.i.mlp.fc2                 c_proj / down_proj
  layers.i.mlp.router.gate, .experts.fc{1,2}_weight, .shared_expert.fc{1,2}, .shared_expert_gate  (moe.py)
  final_norm, lm_head              ln_f / norm, lm_head (absent from the state dict when tied)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from megatrain import kernels
from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.init import draw_base_seed, fill_box, init_rule
from megatrain.engine.models.rope import Rope, rope_for, rope_inv_freq, rope_tables  # noqa: F401  (re-exported)
from megatrain.kernels.attention import Segments


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) through the `linear` kernel: under DataParallel
    its weight gradient accumulates straight into main_grad (megatrain.kernels.grad_accumulation).
    A LoRA adapter (engine.lora) may be attached as `lora`: its update is added to the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kernels.get("linear", x.device.type)(x, self.weight, self.bias)
        lora = self._modules.get("lora")
        return y if lora is None or not lora.enabled else y + lora(x)


class Embedding(nn.Embedding):
    """nn.Embedding (no padding_idx, max_norm or sparse gradients) through the `embedding` kernel."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return kernels.get("embedding", tokens.device.type)(tokens, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 whatever the model dtype; the reduction is the sensitive part.
        return kernels.get("rms_norm", x.device.type)(x, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (its parameters, state-dict keys and init) through the `layer_norm` kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.get("layer_norm", x.device.type)(x, self.weight, self.bias, self.eps)


def make_norm(cfg: TransformerConfig) -> nn.Module:
    if cfg.normalization == "layernorm":
        return LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
    return RMSNorm(cfg.hidden_size, cfg.norm_eps)


def positions_for(t: int, position_ids: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Learned-position indices: 0..t-1 (T,) shared by every row, or the given (B, T) ids."""
    return torch.arange(t, device=device) if position_ids is None else position_ids


def check_inputs(
    tokens: torch.Tensor, seq_length: int, position_ids: torch.Tensor | None, segment_ids: torch.Tensor | None
) -> None:
    """Shapes only (no values: that would synchronise with the device every step)."""
    t = tokens.shape[1]
    if t > seq_length:
        raise ValueError(f"sequence of {t} tokens exceeds seq_length={seq_length}")
    for name, ids in (("position_ids", position_ids), ("segment_ids", segment_ids)):
        if ids is not None and ids.shape != tokens.shape:
            raise ValueError(f"{name} of shape {tuple(ids.shape)} do not match tokens {tuple(tokens.shape)}")


class KVCache:
    """Every attention layer's keys and values for positions [0, length), for decoding.

    Each layer's buffers, (B, G, max_len, hd) in the model's dtype and device, are allocated on its
    first write. GPTModel.hidden_states(tokens, kv_cache=cache) runs tokens (B, T) at positions
    length .. length+T-1 and then advances length: a prompt in one forward, then a token per step.
    """

    # SDPA reads grouped keys and values itself from torch 2.5 (a builtin: no signature to inspect).
    _sdpa_gqa = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        """Positions held (the same in every layer between forwards)."""
        self._buffers: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(
        self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
    ) -> torch.Tensor:
        """Store k, v (B, G, T, hd) at the next T positions of `layer`'s buffers; attend q (B, H, T, hd)
        over positions [0, length+T): each new token sees every earlier position and itself."""
        b, g, t, hd = k.shape
        start, end = self.length, self.length + t
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {end} were asked for")
        if layer not in self._buffers:
            self._buffers[layer] = (k.new_zeros(b, g, self.max_len, hd), v.new_zeros(b, g, self.max_len, hd))
        keys, values = self._buffers[layer]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        k, v = keys[:, :, :end], values[:, :, :end]  # (B, G, end, hd)
        # SDPA's is_causal aligns the mask top-left: right only while the cache was empty (T == end).
        mask = None
        if start > 0 and t > 1:
            mask = torch.arange(end, device=q.device) <= torch.arange(start, end, device=q.device)[:, None]
        kw: dict[str, Any] = {}
        if g != q.shape[1] and self._sdpa_gqa:
            kw["enable_gqa"] = True
        elif g != q.shape[1]:  # query head h reads group h // (H/G): a copy of the cache per step
            k, v = k.repeat_interleave(q.shape[1] // g, dim=1), v.repeat_interleave(q.shape[1] // g, dim=1)
        causal = start == 0 and t > 1
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, **kw
        )


class Attention(nn.Module):
    """Causal self-attention with one fused QKV projection and grouped-query support.

    The qkv output is laid out group by group, Megatron style: for each of the G key/value groups,
    its H/G query heads, then its key head, then its value head. A tensor-parallel split of the
    output dimension into contiguous chunks then hands each rank whole groups.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_groups = cfg.num_query_groups
        self.head_dim = cfg.head_dim
        self.dropout = cfg.attention_dropout
        self.causal = not cfg.bidirectional
        # The `attention` kernel's backend this model asked for (None: the registry's choice).
        self.attention_backend = None if cfg.attention_backend == "auto" else cfg.attention_backend
        self.recompute_core = False
        # Hooks that stay no-ops on one device. Tensor parallelism installs an RNG-tracker fork around
        # the core (ranks hold different heads, so their dropout masks must differ) and a checkpoint
        # context that restores the tracker's streams when the core is recomputed.
        self.core_rng_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        self.recompute_context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn
        # Context parallelism installs ring attention here (the `attention` kernel's signature); None:
        # the kernel registry's attention over the whole local sequence.
        self.core_attention: Callable[..., torch.Tensor] | None = None
        out = (self.num_heads + 2 * self.num_groups) * self.head_dim
        self.qkv = Linear(cfg.hidden_size, out, bias=cfg.has_qkv_bias)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.add_bias)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, (H+2G)·hd) -> q (B, H, T, hd), k and v (B, G, T, hd)."""
        b, t, _ = qkv.shape
        per_group = self.num_heads // self.num_groups
        qkv = qkv.view(b, t, self.num_groups, per_group + 2, self.head_dim)
        # One split (its backward is one cat) rather than three slices, whose backward would fill
        # three zeroed qkv-sized tensors and add them up.
        q, k, v = qkv.split([per_group, 1, 1], dim=3)
        q = q.reshape(b, t, self.num_heads, self.head_dim)
        return q.transpose(1, 2), k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments | None
    ) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        with self.core_rng_context():
            # Causal (is_causal) without segments; block-diagonal causal over packed documents.
            attend = self.core_attention or kernels.get(
                "attention", q.device.type, prefer=self.attention_backend
            )
            return attend(q, k, v, segments, dropout, self.causal)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None,
        segments: Segments | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). With kv_cache, x holds the tokens at the cache's next positions
        (rope already sliced to them) and attends over every cached position too."""
        q, k, v = self.split_qkv(self.qkv(x))
        # Shapes from q, not x: under sequence parallelism x is a sequence shard that qkv all-gathers.
        b, _, t, _ = q.shape
        if rope is not None:
            cos, sin = rope
            if cos.dim() == 2:  # positions 0..T-1: the tables' first T rows
                cos, sin = cos[:t], sin[:t]
            q, k = kernels.get("apply_rope_qk", q.device.type)(q, k, cos, sin)
        if kv_cache is not None:
            if not self.causal:
                raise ValueError("an encoder (bidirectional attention) does not decode with a KV cache")
            y = kv_cache.attend(self, q, k, v, self.dropout if self.training else 0.0)
        elif self.recompute_core and self.training:
            y = checkpoint(
                self._core, q, k, v, segments, use_reentrant=False, context_fn=self.recompute_context_fn
            )
        else:
            y = self._core(q, k, v, segments)  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, H·hd)


class MLP(nn.Module):
    """GELU MLP, or SwiGLU / GeGLU with gate and up fused in fc1 (output rows: [gate; up])."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gated = cfg.activation if cfg.gated_mlp else None  # the kernel: swiglu or geglu
        width = 2 * cfg.ffn_hidden_size if self.gated else cfg.ffn_hidden_size
        self.fc1 = Linear(cfg.hidden_size, width, bias=cfg.add_bias)
        self.fc2 = Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=cfg.add_bias)
        self.gelu_approximate = cfg.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.gated:
            h = kernels.get(self.gated, h.device.type)(h)
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)  # tanh: GPT-2's gelu_new; none: BERT's
        return self.fc2(h)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp: nn.Module
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer):
            from megatrain.engine.models.moe import MoELayer  # moe imports this module (MLP)

            self.mlp = MoELayer(cfg)
        else:
            self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.post_layernorm = cfg.post_layernorm
        self.recompute = False
        """Full recompute of this block in backward (set by GPTModel.set_recompute)."""

    def forward(self, x: torch.Tensor, rope: Rope | None, segments: Segments | None = None) -> torch.Tensor:
        if self.post_layernorm:  # the original BERT: each sublayer's residual sum normalised
            x = self.attn_norm(x + self.dropout(self.attn(x, rope, segments)))
            return self.mlp_norm(x + self.dropout(self.mlp(x)))
        x = x + self.dropout(self.attn(self.attn_norm(x), rope, segments))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class GPTModel(nn.Module):
    """tokens (B, T) int64 -> logits (B, T, vocab_size)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        # One draw from torch's global generator seeds every initial weight (models.init): built
        # whole here or as any rank's shards (engine.build), `torch.manual_seed(s)` first gives the
        # same weights. Submodules' own default inits run on a forked generator, so the global
        # stream is left where every layout leaves it.
        self.init_seed = draw_base_seed()
        with torch.random.fork_rng(devices=[]):
            self._build(cfg)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def _build(self, cfg: TransformerConfig) -> None:
        # torch.utils.checkpoint context_fn for block recompute; tensor parallelism installs one that
        # restores its RNG-tracker streams so recomputed dropout masks equal the first pass.
        self.recompute_context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = (
            Embedding(cfg.seq_length, cfg.hidden_size) if cfg.position_embedding == "learned" else None
        )
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = make_norm(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """The buffers derived from the config (RoPE's tables), on the parameters' device."""
        cfg = self.config
        if cfg.position_embedding == "rope":
            cos, sin = rope_tables(cfg.seq_length, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            device = self.embed.weight.device
            # Not persistent: derived from the config, so checkpoints carry weights only.
            self.register_buffer("rope_cos", cos.to(device), persistent=False)
            self.register_buffer("rope_sin", sin.to(device), persistent=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter from models.init (normal(0, std); std/sqrt(2·layers) for the projections
        into the residual stream; ones for norms, zeros for biases), seeded by init_seed. A model on
        the meta device is left to be materialised shard by shard (engine.build)."""
        for name, p in self.named_parameters():  # a tied head is the embedding: drawn once
            if p.is_meta:
                continue
            rule, whole = init_rule(name, self.config), tuple(p.shape)
            fill_box(p, seed=self.init_seed, name=name, shape=whole, offsets=(0,) * p.dim(), rule=rule)

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """none | selective (attention core of every block) | full (blocks with index % every == 0).

        Recompute trades FLOPs for memory; full with every=k recomputes about 1/k of the blocks.
        """
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"recompute mode {mode!r} is not one of none, selective, full")
        if every < 1:
            raise ValueError(f"recompute every={every} must be >= 1")
        for i, layer in enumerate(self.layers):
            layer.recompute = mode == "full" and i % every == 0
            layer.attn.recompute_core = mode == "selective"

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V); see hidden_states for the ids and the cache."""
        return self.lm_head(self.hidden_states(tokens, position_ids, segment_ids, kv_cache))  # (B, T, V)

    def loss(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean next-token loss over the loss tokens, equal to lm_loss(self(tokens, ...), labels,
        loss_mask). With a plain (single-device) head, the head and the cross-entropy run fused over
        token chunks (the linear_cross_entropy kernel), never holding the fp32 (tokens × vocab)
        logits. A tensor-parallel head (after parallelize_model) needs parallelize.parallel_lm_loss
        on the logits instead."""
        if not isinstance(self.lm_head, nn.Linear):
            raise TypeError("a tensor-parallel LM head needs parallel_lm_loss(model(tokens), labels, state)")
        hidden = self.hidden_states(tokens, position_ids, segment_ids)
        loss = kernels.get("linear_cross_entropy", hidden.device.type)
        # Rows past the real vocabulary are padding: left out of the softmax.
        return loss(
            hidden, self.lm_head.weight, labels, loss_mask=loss_mask, vocab_limit=self.config.real_vocab_size
        )

    def hidden_states(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> the final norm's output (B, T, C), the LM head's input.

        position_ids (B, T): each token's position (None: 0..T-1); segment_ids (B, T): tokens attend
        only to earlier tokens of their segment (None: plain causal attention over each row).
        kv_cache: decode; the tokens follow the cache's `length` positions (None: the ids from
        there on) and attend over them; the cache then holds these tokens too."""
        check_inputs(tokens, self.config.seq_length, position_ids, segment_ids)
        t = tokens.shape[1]
        start = 0
        if kv_cache is not None:
            if segment_ids is not None:
                raise ValueError("a KV cache decodes one sequence per row: no segment_ids")
            start = kv_cache.length
            if start + t > self.config.seq_length:
                raise ValueError(f"position {start + t - 1} is beyond seq_length={self.config.seq_length}")
        x = self.embed(tokens)  # (B, T, C)
        rope = None
        if self.pos_embed is not None:
            if position_ids is None and start:
                position_ids = torch.arange(start, start + t, device=tokens.device)  # (T,)
            x = x + self.pos_embed(positions_for(t, position_ids, tokens.device))
        elif position_ids is None and start:
            rope = self.rope_cos[start : start + t], self.rope_sin[start : start + t]  # (T, hd) each
        else:
            rope = rope_for(self.rope_cos, self.rope_sin, position_ids)
        segments = Segments(segment_ids) if segment_ids is not None else None
        x = self.dropout(x)
        if kv_cache is None:
            return self.final_norm(
                run_layers(self.layers, x, rope, segments, self.training, self.recompute_context_fn)
            )
        for layer in self.layers:
            # TransformerBlock.forward with the cache handed to attention.
            x = x + layer.dropout(layer.attn(layer.attn_norm(x), rope, kv_cache=kv_cache))
            x = x + layer.dropout(layer.mlp(layer.mlp_norm(x)))
        kv_cache.length += t
        return self.final_norm(x)

    def num_parameters(self) -> int:
        """Unique parameters (a tied LM head counts once)."""
        return sum(p.numel() for p in self.parameters())


def run_layers(
    layers: Any,
    x: torch.Tensor,
    rope: Rope | None,
    segments: Segments | None,
    training: bool,
    context_fn: Callable[[], tuple[Any, Any]],
) -> torch.Tensor:
    """The residual stream through `layers` (TransformerBlocks, in order), each recomputed in
    backward when its `recompute` is set and the model trains (context_fn restores RNG streams)."""
    for layer in layers:
        if layer.recompute and training:
            x = checkpoint(layer, x, rope, segments, use_reentrant=False, context_fn=context_fn)
        else:
            x = layer(x, rope, segments)
    return x


def compile_layers(module: nn.Module) -> int:
    """torch.compile every TransformerBlock inside `module` in place (per block, as torchtitan does:
    identical blocks share one compiled graph, and recompute, pipeline stages and parallel wrappers
    around them stay eager). Returns how many blocks were compiled."""
    blocks = [m for m in module.modules() if isinstance(m, TransformerBlock)]
    for block in blocks:
        block.compile(dynamic=False)
    return len(blocks)


def lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean next-token cross-entropy over the loss tokens, in fp32. logits (B, T, V), labels (B, T),
    loss_mask (B, T) of 0/1 (None: every token counts); 0 when no token counts."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    if loss_mask is None:
        return F.cross_entropy(flat, labels.reshape(-1))
    mask = loss_mask.reshape(-1).float()
    per_token = F.cross_entropy(flat, labels.reshape(-1), reduction="none")
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)
