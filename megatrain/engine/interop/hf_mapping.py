"""Our canonical parameters <-> Hugging Face tensors, one Rule per canonical tensor.

A Rule names the HF tensors a canonical tensor is made of and converts both ways, so import and
export share one table and cannot drift apart:
  GPT-2:  Conv1D weights are stored (in, out): transposed; c_attn's columns are [q; k; v] over all
          heads, regrouped into our per-head [q_h; k_h; v_h] (Attention's layout with G = H).
  Llama:  q_proj, k_proj, v_proj are regrouped group by group (H/G query heads, then the group's key
          and value head); gate_proj and up_proj stack into fc1 ([gate; up]).
  MoE:    (Mixtral, Qwen2-MoE) the router gate as it is; each expert's gate/up (w1/w3) and down
          (w2) projections stack into experts.fc1_weight (E, 2F, C) = [gate; up] per expert and
          fc2_weight (E, C, F): one canonical tensor from 2E (or E) Hub tensors. Import also takes
          transformers' in-memory fused tensors (a Rule's fallback); export writes the Hub's names.
  Both:   embedding and untied LM-head rows are zero-padded to cfg.vocab_size on import and cut to
          the real vocabulary on export; a tied head is stored only as the embedding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatrain.engine.config import TransformerConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class Rule:
    name: str
    """Canonical (GPTModel state-dict) name."""
    hf: tuple[str, ...]
    """The Hugging Face tensors it is made of, in from_hf's argument order."""
    to_hf: Callable[[Tensor], tuple[Tensor, ...]]
    from_hf: Callable[..., Tensor]
    fallback: Rule | None = None
    """Another spelling import accepts when `hf` is absent (transformers' fused in-memory MoE
    tensors, `mlp.experts.gate_up_proj`); export always writes `hf`."""

    def spellings(self) -> tuple[Rule, ...]:
        return (self,) if self.fallback is None else (self, self.fallback)


IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
"""Buffers older checkpoints carry (GPT-2's causal mask, Llama's rotary frequencies): not weights."""


def group_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, groups: int) -> Tensor:
    """q (H·hd, ...), k and v (G·hd, ...) -> our qkv rows: per group [H/G query heads; k; v]."""
    rest = q.shape[1:]
    hd = q.shape[0] // heads
    q = q.reshape(groups, heads // groups, hd, *rest)
    k, v = k.reshape(groups, 1, hd, *rest), v.reshape(groups, 1, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, heads: int, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """group_qkv's inverse: our qkv rows -> q (H·hd, ...), k (G·hd, ...), v (G·hd, ...)."""
    rest = qkv.shape[1:]
    per = heads // groups
    hd = qkv.shape[0] // (heads + 2 * groups)
    q, k, v = qkv.reshape(groups, per + 2, hd, *rest).split([per, 1, 1], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"a vocabulary of {t.shape[0]} rows does not fit the model's {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


def _same(name: str, hf: str) -> Rule:
    return Rule(name, (hf,), lambda t: (t,), lambda t: t)


def _transposed(name: str, hf: str) -> Rule:
    """GPT-2 Conv1D: weight (in, out), ours (out, in)."""
    return Rule(name, (hf,), lambda t: (t.t(),), lambda t: t.t())


def _vocab(name: str, hf: str, cfg: TransformerConfig) -> Rule:
    real = cfg.real_vocab_size
    return Rule(name, (hf,), lambda t: (t[:real],), lambda t: _pad_rows(t, cfg.vocab_size))


def _gate_up(name: str, gate: str, up: str) -> Rule:
    """A SwiGLU fc1 (2F, C): rows [gate; up]."""
    return Rule(name, (gate, up), lambda t: tuple(t.chunk(2)), lambda g, u: torch.cat([g, u]))


def gpt2_rules(cfg: TransformerConfig, prefix: str = "transformer.") -> list[Rule]:
    h = cfg.num_attention_heads

    def qkv_to_hf(t: Tensor) -> tuple[Tensor, ...]:
        return (torch.cat(split_qkv(t, h, h)).t(),)  # Conv1D: (C, 3C), columns [q; k; v]

    def qkv_from_hf(t: Tensor) -> Tensor:
        return group_qkv(*t.t().chunk(3), h, h)

    def qkv_bias_to_hf(t: Tensor) -> tuple[Tensor, ...]:
        return (torch.cat(split_qkv(t, h, h)),)

    def qkv_bias_from_hf(t: Tensor) -> Tensor:
        return group_qkv(*t.chunk(3), h, h)

    p = prefix
    rules = [
        _vocab("embed.weight", f"{p}wte.weight", cfg),
        # Positions beyond a shorter seq_length are dropped; export writes n_positions = seq_length.
        Rule("pos_embed.weight", (f"{p}wpe.weight",), lambda t: (t,), lambda t: t[: cfg.seq_length]),
    ]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"{p}h.{i}."
        rules += [
            _same(ours + "attn_norm.weight", hf + "ln_1.weight"),
            _same(ours + "attn_norm.bias", hf + "ln_1.bias"),
            Rule(ours + "attn.qkv.weight", (hf + "attn.c_attn.weight",), qkv_to_hf, qkv_from_hf),
            Rule(ours + "attn.qkv.bias", (hf + "attn.c_attn.bias",), qkv_bias_to_hf, qkv_bias_from_hf),
            _transposed(ours + "attn.proj.weight", hf + "attn.c_proj.weight"),
            _same(ours + "attn.proj.bias", hf + "attn.c_proj.bias"),
            _same(ours + "mlp_norm.weight", hf + "ln_2.weight"),
            _same(ours + "mlp_norm.bias", hf + "ln_2.bias"),
            _transposed(ours + "mlp.fc1.weight", hf + "mlp.c_fc.weight"),
            _same(ours + "mlp.fc1.bias", hf + "mlp.c_fc.bias"),
            _transposed(ours + "mlp.fc2.weight", hf + "mlp.c_proj.weight"),
            _same(ours + "mlp.fc2.bias", hf + "mlp.c_proj.bias"),
        ]
    rules += [_same("final_norm.weight", f"{p}ln_f.weight"), _same("final_norm.bias", f"{p}ln_f.bias")]
    if not cfg.tie_embeddings:
        rules.append(_vocab("lm_head.weight", "lm_head.weight", cfg))
    return rules


def llama_rules(cfg: TransformerConfig, model_type: str = "llama") -> list[Rule]:
    """Llama, Mistral and Qwen2 (whose q/k/v carry biases) share these names; so do Mixtral and
    Qwen2-MoE but for their MoE layers' MLPs (moe_rules)."""
    h, g = cfg.num_attention_heads, cfg.num_query_groups

    def qkv_to_hf(t: Tensor) -> tuple[Tensor, ...]:
        return split_qkv(t, h, g)

    def qkv_from_hf(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return group_qkv(q, k, v, h, g)

    rules = [_vocab("embed.weight", "model.embed_tokens.weight", cfg)]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        proj = [f"{hf}self_attn.{x}_proj" for x in "qkv"]
        rules += [
            _same(ours + "attn_norm.weight", hf + "input_layernorm.weight"),
            Rule(ours + "attn.qkv.weight", tuple(p + ".weight" for p in proj), qkv_to_hf, qkv_from_hf),
        ]
        if cfg.has_qkv_bias:
            rules.append(
                Rule(ours + "attn.qkv.bias", tuple(p + ".bias" for p in proj), qkv_to_hf, qkv_from_hf)
            )
        rules += [
            _same(ours + "attn.proj.weight", hf + "self_attn.o_proj.weight"),
            _same(ours + "mlp_norm.weight", hf + "post_attention_layernorm.weight"),
        ]
        if cfg.moe is not None and cfg.moe.is_moe_layer(i):
            rules += moe_rules(cfg, i, model_type)
            continue
        rules += [
            _gate_up(ours + "mlp.fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
            _same(ours + "mlp.fc2.weight", hf + "mlp.down_proj.weight"),
        ]
    rules.append(_same("final_norm.weight", "model.norm.weight"))
    if not cfg.tie_embeddings:
        rules.append(_vocab("lm_head.weight", "lm_head.weight", cfg))
    return rules


MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
             "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}  # fmt: skip
"""Per family: the MoE block's name in a layer and its experts' gate, up and down projections."""


def moe_rules(cfg: TransformerConfig, layer: int, model_type: str) -> list[Rule]:
    """One MoE layer's MLP: router, stacked experts, and Qwen2-MoE's gated shared expert."""
    moe = cfg.moe
    if moe is None or model_type not in MOE_NAMES:
        raise ValueError(f"a {model_type} checkpoint has no experts for layer {layer}")
    block, gate, up, down = MOE_NAMES[model_type]
    ours, hf = f"layers.{layer}.mlp.", f"model.layers.{layer}."
    experts = [f"{hf}{block}.experts.{e}." for e in range(moe.num_experts)]
    fused = hf + "mlp."  # transformers' in-memory module names, the same in both families

    def fc1_to_hf(t: Tensor) -> tuple[Tensor, ...]:
        return tuple(half for w in t for half in w.chunk(2))  # (E, 2F, C) -> gate_0, up_0, gate_1, ...

    def fc1_from_hf(*t: Tensor) -> Tensor:
        return torch.stack([torch.cat(t[i : i + 2]) for i in range(0, len(t), 2)])  # (E, 2F, C)

    router = _same(ours + "router.gate.weight", f"{hf}{block}.gate.weight")  # (E, C)
    if block != "mlp":
        router = dataclasses.replace(router, fallback=_same(router.name, fused + "gate.weight"))
    rules = [
        router,
        Rule(
            ours + "experts.fc1_weight",
            tuple(f"{p}{x}.weight" for p in experts for x in (gate, up)),
            fc1_to_hf,
            fc1_from_hf,
            fallback=_same(ours + "experts.fc1_weight", fused + "experts.gate_up_proj"),  # (E, 2F, C)
        ),
        Rule(
            ours + "experts.fc2_weight",
            tuple(f"{p}{down}.weight" for p in experts),
            lambda t: tuple(t.unbind(0)),  # (E, C, F) -> E of (C, F)
            lambda *t: torch.stack(t),
            fallback=_same(ours + "experts.fc2_weight", fused + "experts.down_proj"),  # (E, C, F)
        ),
    ]
    if moe.shared_expert_ffn_hidden_size is not None:
        shared = f"{hf}{block}.shared_expert."
        rules += [
            _gate_up(
                ours + "shared_expert.fc1.weight", shared + "gate_proj.weight", shared + "up_proj.weight"
            ),
            _same(ours + "shared_expert.fc2.weight", shared + "down_proj.weight"),
        ]
    if moe.shared_expert_gate:
        rules.append(_same(ours + "shared_expert_gate.weight", f"{hf}{block}.shared_expert_gate.weight"))
    return rules


def rules_for(
    cfg: TransformerConfig, model_type: str, gpt2_prefix: str = "transformer.", bert_prefix: str = "bert."
) -> list[Rule]:
    """The table for a config.json's model_type (gpt2 | llama | mistral | qwen2 | mixtral | qwen2_moe |
    bert)."""
    if model_type == "gpt2":
        return gpt2_rules(cfg, gpt2_prefix)
    if model_type == "bert":
        from megatrain.engine.interop.hf_mapping_bert import bert_rules  # it imports this module

        return bert_rules(cfg, bert_prefix)
    return llama_rules(cfg, model_type)
