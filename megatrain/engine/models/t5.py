"""T5: an encoder-decoder transformer with relative position biases (T5 v1.0 and v1.1 / flan-t5).

v1.0: ReLU MLP, LM head tied to the embedding, the decoder output scaled by d_model**-0.5 before it.
v1.1: gated-GELU MLP (tanh-approximated gate), untied LM head, no scaling.
Both: pre-norm RMSNorm without mean or bias (T5LayerNorm), no biases anywhere, attention without the
1/sqrt(d) scaling, heads of kv_channels (H·kv_channels may differ from hidden_size). Each stack's
first layer owns a relative position bias (bidirectional buckets in the encoder, causal ones in the
decoder) that every layer of the stack adds; cross-attention has none.

Plain single-device nn.Module like gpt.py: no process groups, every Linear its own named submodule.

Parameter names (encoder layer i, decoder layer j), for mapping Hugging Face checkpoints
(interop.hf_t5; HF prefixes: encoder.block.i.layer., decoder.block.j.layer.):
  embed.weight                          shared (= encoder/decoder embed_tokens; rows padded)
  encoder.rel_bias.weight               encoder.block.0.layer.0.SelfAttention.relative_attention_bias
  encoder.layers.i.attn_norm.weight     0.layer_norm
  encoder.layers.i.attn.qkv.weight      0.SelfAttention.[q; k; v], rows regrouped per head [q_h; k_h; v_h]
  encoder.layers.i.attn.proj.weight     0.SelfAttention.o
  encoder.layers.i.mlp_norm.weight      1.layer_norm
  encoder.layers.i.mlp.fc1.weight       1.DenseReluDense.wi / [wi_0 (gate); wi_1 (up)]
  encoder.layers.i.mlp.fc2.weight       1.DenseReluDense.wo
  encoder.final_norm.weight             encoder.final_layer_norm
  decoder.rel_bias.weight               decoder.block.0.layer.0.SelfAttention.relative_attention_bias
  decoder.layers.j.attn_norm, attn.qkv, attn.proj       as the encoder's (layer.0)
  decoder.layers.j.cross_norm.weight    1.layer_norm
  decoder.layers.j.cross.q.weight       1.EncDecAttention.q
  decoder.layers.j.cross.kv.weight      1.EncDecAttention.[k; v], rows regrouped per head [k_h; v_h]
  decoder.layers.j.cross.proj.weight    1.EncDecAttention.o
  decoder.layers.j.mlp_norm, mlp.fc1, mlp.fc2           2.layer_norm, 2.DenseReluDense.*
  decoder.final_norm.weight             decoder.final_layer_norm
  lm_head.weight                        lm_head (untied only; tied, it is embed.weight)

Initial weights come from models.init's fill_box (seeded by one draw, the same for any layout)
with t5_init_rule: normal(0, init_method_std), std/sqrt(2·layers of the stack) for projections into
the residual stream, ones for norms. Unlike Mesh TensorFlow, 1/sqrt(kv_channels) is not folded into
the query init: with a small std the unscaled scores start small anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import noop_context_fn

from megatrain import kernels
from megatrain.engine.models.gpt import Embedding, Linear, RMSNorm
from megatrain.engine.models.init import draw_base_seed, fill_box
from megatrain.engine.models.t5_layers import (
    DecoderLayer,
    EncoderLayer,
    RelativeBias,
    T5KVCache,
    additive_mask,
    run_stack,
    set_recompute,
)

ACTIVATIONS = ("relu", "gated-gelu")


@dataclass(frozen=True)
class T5Config:
    """Everything T5Model needs (Hugging Face's T5Config names in the field docs)."""

    num_layers: int
    """Encoder layers (num_layers)."""
    num_decoder_layers: int
    hidden_size: int
    """d_model."""
    num_attention_heads: int
    kv_channels: int
    """Per-head width (d_kv); heads · kv_channels need not equal hidden_size."""
    ffn_hidden_size: int
    """d_ff."""
    vocab_size: int
    """Padded embedding rows (>= the real vocabulary)."""
    vocab_size_unpadded: int | None = None
    """The real vocabulary; rows beyond it are padding. None: vocab_size."""
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    activation: Literal["relu", "gated-gelu"] = "relu"
    """relu (T5 v1.0) or gated-gelu (v1.1, flan-t5: fc1 rows [gate; up], tanh-approximated gate)."""
    tie_embeddings: bool = True
    """v1.0: the LM head is the embedding and the decoder output is scaled by hidden_size**-0.5
    before it; v1.1 (False): an untied lm_head, no scaling."""
    norm_eps: float = 1e-6
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    """Dropout on embeddings, sublayer outputs, MLP activations and the final norms (dropout_rate)."""
    attention_dropout: float = 0.0
    encoder_seq_length: int = 512
    """The longest encoder input accepted (relative positions themselves have no limit)."""
    decoder_seq_length: int = 128

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_decoder_layers",
            "hidden_size",
            "num_attention_heads",
            "kv_channels",
            "ffn_hidden_size",
            "vocab_size",
            "encoder_seq_length",
            "decoder_seq_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.vocab_size_unpadded is not None and not 0 < self.vocab_size_unpadded <= self.vocab_size:
            raise ValueError(f"vocab_size_unpadded={self.vocab_size_unpadded} must be in [1, vocab_size]")
        # The causal buckets' exact half is num_buckets // 2 wide; the log buckets need room above it
        # (and the bidirectional ones, half as many, a fortiori).
        if self.relative_attention_num_buckets < 4:
            raise ValueError("relative_attention_num_buckets must be >= 4")
        if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
            raise ValueError(
                "relative_attention_max_distance must exceed relative_attention_num_buckets // 2"
            )

    @property
    def real_vocab_size(self) -> int:
        return self.vocab_size_unpadded or self.vocab_size

    # What the engine's model-agnostic code (the training loop, run reports, checkpoints) reads of any
    # model config: a T5 is no mixture of experts, no BERT-style encoder, and its sequence is the
    # encoder's (what a step's tokens count).
    moe = None
    is_encoder = False
    hf_family = "t5"

    @property
    def seq_length(self) -> int:
        return self.encoder_seq_length

    @property
    def gated_mlp(self) -> bool:
        return self.activation == "gated-gelu"

    @property
    def inner_size(self) -> int:
        """Attention width: num_attention_heads · kv_channels."""
        return self.num_attention_heads * self.kv_channels

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> T5Config:
        return cls(**data)


RESIDUAL = ("attn.proj.weight", "cross.proj.weight", "mlp.fc2.weight")
"""Weights that write into the residual stream: drawn with std/sqrt(2·layers of their stack)."""


def t5_init_rule(name: str, cfg: T5Config) -> tuple[str, float]:
    """models.init's rule ("normal", std) | ("ones", 0) for a canonical T5Model parameter name."""
    if name.endswith("norm.weight"):
        return "ones", 0.0
    std = cfg.init_method_std
    if name.endswith(RESIDUAL):
        layers = cfg.num_layers if name.startswith("encoder.") else cfg.num_decoder_layers
        return "normal", std / math.sqrt(2.0 * layers)
    return "normal", std


def encoder_attention_mask(
    rel_bias: RelativeBias, s: int, enc_mask: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """The encoder's self-attention mask (B | 1, H, S, S): every query sees every real key, with the
    bias of their relative position."""
    keys = None if enc_mask is None else enc_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
    return additive_mask(keys, rel_bias.bias(s, s), dtype)


def decoder_attention_masks(
    rel_bias: RelativeBias,
    t: int,
    start: int,
    enc_mask: torch.Tensor | None,
    dec_mask: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The decoder's self-attention mask for queries at positions start..start+t (causal, biased)
    and its cross-attention mask over the encoder's real tokens."""
    end = start + t
    positions = torch.arange(end, device=rel_bias.weight.device)
    allowed = positions <= positions[start:, None]  # (T, end): causal
    if dec_mask is not None:
        allowed = allowed & dec_mask.bool()[:, None, None, :end]  # (B, 1, T, end)
    self_mask = additive_mask(allowed, rel_bias.bias(t, end, start), dtype)
    keys = None if enc_mask is None else enc_mask.bool()[:, None, None, :]
    return self_mask, additive_mask(keys, None, dtype)


class Encoder(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.rel_bias = RelativeBias(cfg, bidirectional=True)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        # Sequence parallelism (parallel.parallelize_t5) hands the stack a 1/tp slice of the sequence;
        # the masks still cover all of it.
        self.sequence_shards = 1
        # Full recompute's checkpoint context_fn: tensor parallelism installs its RNG tracker's.
        self.recompute_context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn

    def forward(self, x: torch.Tensor, enc_mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, S, C) embedded -> (B, S, C). Every query sees every real key, by relative position."""
        s = x.shape[1] * self.sequence_shards
        mask = encoder_attention_mask(self.rel_bias, s, enc_mask, x.dtype)  # one for every layer
        x = self.dropout(x)
        x = run_stack(self.layers, x, mask, training=self.training, context_fn=self.recompute_context_fn)
        return self.dropout(self.final_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.rel_bias = RelativeBias(cfg, bidirectional=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.sequence_shards = 1  # as Encoder's
        self.recompute_context_fn: Callable[[], tuple[Any, Any]] = noop_context_fn

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        enc_mask: torch.Tensor | None,
        dec_mask: torch.Tensor | None,
        cache: T5KVCache | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) embedded, at positions cache.length.. (0.. without a cache), over the encoder
        output memory (B, S, C) -> (B, T, C)."""
        t = x.shape[1] * self.sequence_shards
        start = 0 if cache is None else cache.length
        self_mask, cross_mask = decoder_attention_masks(self.rel_bias, t, start, enc_mask, dec_mask, x.dtype)
        x = self.dropout(x)
        args = (memory, self_mask, cross_mask, cache)
        x = run_stack(self.layers, x, *args, training=self.training, context_fn=self.recompute_context_fn)
        if cache is not None:
            cache.length = start + t
        return self.dropout(self.final_norm(x))


class T5Model(nn.Module):
    """enc_tokens (B, S), dec_tokens (B, T) int64 -> logits (B, T, vocab_size). Masks (B, S) and
    (B, T): 1 for real tokens, 0 for padding (None: all real)."""

    def __init__(self, cfg: T5Config):
        super().__init__()
        self.config = cfg
        # As GPTModel: one draw from the global generator seeds every weight (models.init), and the
        # submodules' default inits run on a forked generator.
        self.init_seed = draw_base_seed()
        with torch.random.fork_rng(devices=[]):
            self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
            self.encoder = Encoder(cfg)
            self.decoder = Decoder(cfg)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every parameter from t5_init_rule, seeded by init_seed (meta tensors left alone)."""
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            rule = t5_init_rule(name, self.config)
            fill_box(
                p, seed=self.init_seed, name=name, shape=tuple(p.shape), offsets=(0,) * p.dim(), rule=rule
            )

    def set_recompute(self, mode: str, every: int = 1) -> None:
        """none | selective (every attention core, self and cross) | full (in each stack, the layers
        whose index is a multiple of `every`): as GPTModel.set_recompute, stack by stack."""
        set_recompute(enumerate(self.encoder.layers), mode, every)
        set_recompute(enumerate(self.decoder.layers), mode, every)

    def _check(self, tokens: torch.Tensor, mask: torch.Tensor | None, limit: int, what: str) -> None:
        """Shapes only (values would synchronise with the device)."""
        if tokens.shape[1] > limit:
            raise ValueError(f"{what} sequence of {tokens.shape[1]} tokens exceeds {limit}")
        if mask is not None and mask.shape != tokens.shape:
            raise ValueError(f"{what} mask of shape {tuple(mask.shape)} does not match {tuple(tokens.shape)}")

    def encode(self, enc_tokens: torch.Tensor, enc_mask: torch.Tensor | None = None) -> torch.Tensor:
        """enc_tokens (B, S) -> the encoder's output (B, S, C), cross-attention's memory."""
        self._check(enc_tokens, enc_mask, self.config.encoder_seq_length, "encoder")
        return self.encoder(self.embed(enc_tokens), enc_mask)

    def decoder_hidden(
        self,
        hidden_enc: torch.Tensor,
        enc_mask: torch.Tensor | None,
        dec_tokens: torch.Tensor,
        dec_mask: torch.Tensor | None = None,
        kv_cache: T5KVCache | None = None,
    ) -> torch.Tensor:
        """The LM head's input (B, T, C): the decoder's output, scaled when the head is tied."""
        start = 0 if kv_cache is None else kv_cache.length
        if start + dec_tokens.shape[1] > self.config.decoder_seq_length:
            raise ValueError(
                f"decoder position {start + dec_tokens.shape[1] - 1} is beyond "
                f"decoder_seq_length={self.config.decoder_seq_length}"
            )
        if dec_mask is not None and dec_mask.shape[1] < start + dec_tokens.shape[1]:
            raise ValueError("dec_mask must cover every decoder position, cached ones included")
        h = self.decoder(self.embed(dec_tokens), hidden_enc, enc_mask, dec_mask, kv_cache)
        # v1.0 shares the embedding with the head: the scale keeps logits of unit-variance size.
        return h * self.config.hidden_size**-0.5 if self.config.tie_embeddings else h

    def decode(
        self,
        hidden_enc: torch.Tensor,
        enc_mask: torch.Tensor | None,
        dec_tokens: torch.Tensor,
        kv_cache: T5KVCache | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) of dec_tokens (B, T) over the encoder output; with kv_cache, the tokens
        follow the cache's `length` positions, and the cache then holds them too."""
        return self.lm_head(self.decoder_hidden(hidden_enc, enc_mask, dec_tokens, None, kv_cache))

    def forward(
        self,
        enc_tokens: torch.Tensor,
        dec_tokens: torch.Tensor,
        enc_mask: torch.Tensor | None = None,
        dec_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V): teacher-forced decoding of dec_tokens (already shifted right)."""
        self._check(dec_tokens, dec_mask, self.config.decoder_seq_length, "decoder")
        hidden = self.decoder_hidden(self.encode(enc_tokens, enc_mask), enc_mask, dec_tokens, dec_mask)
        return self.lm_head(hidden)

    def loss(
        self,
        enc_tokens: torch.Tensor,
        dec_tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor | None,
        enc_mask: torch.Tensor | None = None,
        dec_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean cross-entropy of labels (B, T) over the tokens loss_mask (0/1) keeps; padding rows of
        the vocabulary are no classes. Head and loss run fused over token chunks (never the fp32
        tokens × vocab logits)."""
        self._check(dec_tokens, dec_mask, self.config.decoder_seq_length, "decoder")
        hidden = self.decoder_hidden(self.encode(enc_tokens, enc_mask), enc_mask, dec_tokens, dec_mask)
        loss = kernels.get("linear_cross_entropy", hidden.device.type)
        return loss(
            hidden, self.lm_head.weight, labels, loss_mask=loss_mask, vocab_limit=self.config.real_vocab_size
        )

    @torch.no_grad()
    def generate_greedy(
        self,
        enc_tokens: torch.Tensor,
        enc_mask: torch.Tensor | None,
        max_new_tokens: int,
        decoder_start_token_id: int = 0,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """(B, n) greedy tokens, n <= max_new_tokens, as transformers' generate (do_sample=False,
        num_beams=1) without its start token: a row that has emitted eos continues with pad_token_id
        (None: decoder_start_token_id, T5's pad) and decoding stops once every row has. The encoder
        and each layer's cross keys/values run once; self-attention reads a KV cache. Dropout is
        the caller's: call it in eval mode."""
        b = enc_tokens.shape[0]
        memory = self.encode(enc_tokens, enc_mask)
        cache = T5KVCache(max_new_tokens)
        pad = decoder_start_token_id if pad_token_id is None else pad_token_id
        token = enc_tokens.new_full((b, 1), decoder_start_token_id)
        done = torch.zeros(b, dtype=torch.bool, device=enc_tokens.device)
        out: list[torch.Tensor] = []
        for _ in range(max_new_tokens):
            logits = self.decode(memory, enc_mask, token, cache)[:, -1, : self.config.real_vocab_size]
            nxt = logits.argmax(-1)  # (B,)
            if eos_token_id is not None:
                nxt = torch.where(done, pad, nxt)
                done = done | (nxt == eos_token_id)
            out.append(nxt)
            token = nxt[:, None]
            if eos_token_id is not None and bool(done.all()):
                break
        return torch.stack(out, dim=1) if out else enc_tokens.new_zeros(b, 0)

    def num_parameters(self) -> int:
        """Unique parameters (a tied LM head counts once)."""
        return sum(p.numel() for p in self.parameters())
