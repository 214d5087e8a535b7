"""Shared by engine_cpu.py and engine_gpu.py: twin models with identical shapes and weights, timing.

`build_pair(flavour, shape)` makes our GPTModel and the matching Hugging Face model
(GPT2LMHeadModel / LlamaForCausalLM with attn_implementation="sdpa") and copies our weights into
it, so both start from the same parameters and compute the same function: the first losses must
agree, which the scripts check before timing anything.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from megatrain.engine.config import FLAVOURS, TransformerConfig
from megatrain.engine.models.gpt import GPTModel


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    seq: int
    batch: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def our_config(flavour: str, s: Shape) -> TransformerConfig:
    common = dict(
        num_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        ffn_hidden_size=s.ffn,
        seq_length=s.seq,
        vocab_size=s.vocab,
    )
    groups = s.heads if flavour == "gpt2" else s.groups
    return TransformerConfig(**common, **FLAVOURS[flavour], num_query_groups=groups)


def hf_model(flavour: str, s: Shape) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    if flavour == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=s.layers,
            n_embd=s.hidden,
            n_head=s.heads,
            n_inner=s.ffn,
            vocab_size=s.vocab,
            n_positions=s.seq,
            activation_function="gelu_new",  # tanh GELU, as ours
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            use_cache=False,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=s.layers,
            hidden_size=s.hidden,
            num_attention_heads=s.heads,
            num_key_value_heads=s.groups,
            intermediate_size=s.ffn,
            vocab_size=s.vocab,
            max_position_embeddings=s.seq,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            use_cache=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    return model


def _split_qkv_rows(w: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Our group-by-group fused rows [per group: its q heads, k, v] -> (Q, K, V) rows, head order kept."""
    per = heads // groups
    w = w.reshape(groups, per + 2, head_dim, *w.shape[1:])
    q = w[:, :per].reshape(heads * head_dim, *w.shape[3:])
    k = w[:, per].reshape(groups * head_dim, *w.shape[3:])
    v = w[:, per + 1].reshape(groups * head_dim, *w.shape[3:])
    return q, k, v


@torch.no_grad()
def copy_weights(ours: GPTModel, hf: nn.Module, flavour: str) -> None:
    cfg = ours.config
    hd = cfg.head_dim
    split = (cfg.num_attention_heads, cfg.num_query_groups, hd)
    if flavour == "gpt2":
        t = hf.transformer
        t.wte.weight.copy_(ours.embed.weight)
        t.wpe.weight.copy_(ours.pos_embed.weight)
        for ly, hl in zip(ours.layers, t.h, strict=True):
            hl.ln_1.load_state_dict(ly.attn_norm.state_dict())
            hl.ln_2.load_state_dict(ly.mlp_norm.state_dict())
            # HF's Conv1D keeps weights (in, out): ours transposed, qkv regrouped to [Q; K; V].
            hl.attn.c_attn.weight.copy_(torch.cat(_split_qkv_rows(ly.attn.qkv.weight, *split)).t())
            hl.attn.c_attn.bias.copy_(torch.cat(_split_qkv_rows(ly.attn.qkv.bias, *split)))
            hl.attn.c_proj.weight.copy_(ly.attn.proj.weight.t())
            hl.attn.c_proj.bias.copy_(ly.attn.proj.bias)
            hl.mlp.c_fc.weight.copy_(ly.mlp.fc1.weight.t())
            hl.mlp.c_fc.bias.copy_(ly.mlp.fc1.bias)
            hl.mlp.c_proj.weight.copy_(ly.mlp.fc2.weight.t())
            hl.mlp.c_proj.bias.copy_(ly.mlp.fc2.bias)
        t.ln_f.load_state_dict(ours.final_norm.state_dict())
        return
    m = hf.model
    m.embed_tokens.weight.copy_(ours.embed.weight)
    for ly, hl in zip(ours.layers, m.layers, strict=True):
        hl.input_layernorm.weight.copy_(ly.attn_norm.weight)
        hl.post_attention_layernorm.weight.copy_(ly.mlp_norm.weight)
        q, k, v = _split_qkv_rows(ly.attn.qkv.weight, *split)
        hl.self_attn.q_proj.weight.copy_(q)
        hl.self_attn.k_proj.weight.copy_(k)
        hl.self_attn.v_proj.weight.copy_(v)
        hl.self_attn.o_proj.weight.copy_(ly.attn.proj.weight)
        gate, up = ly.mlp.fc1.weight.chunk(2, dim=0)
        hl.mlp.gate_proj.weight.copy_(gate)
        hl.mlp.up_proj.weight.copy_(up)
        hl.mlp.down_proj.weight.copy_(ly.mlp.fc2.weight)
    m.norm.weight.copy_(ours.final_norm.weight)
    hf.lm_head.weight.copy_(ours.lm_head.weight)


def build_pair(flavour: str, shape: Shape, seed: int = 0) -> tuple[GPTModel, nn.Module]:
    torch.manual_seed(seed)
    ours = GPTModel(our_config(flavour, shape))
    hf = hf_model(flavour, shape)
    copy_weights(ours, hf, flavour)
    n_ours, n_hf = ours.num_parameters(), sum(p.numel() for p in hf.parameters())
    if n_ours != n_hf:
        raise RuntimeError(f"{flavour}: {n_ours} parameters in ours but {n_hf} in Hugging Face's")
    return ours.train(), hf.train()


def hf_logits(hf: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tokens: hf(input_ids=tokens, use_cache=False).logits


def adamw(model: nn.Module, impl: str, **kw: Any) -> torch.optim.Optimizer:
    """AdamW as the engine builds it: no weight decay on 1-D parameters; impl foreach or fused."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **{impl: True}, **kw)


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not on every platform
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved_medians(
    steps: dict[str, Callable[[], Any]],
    rounds: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
    settle: int = 0,
) -> dict[str, dict[str, float]]:
    """Run every step function `warmup` times, then `rounds` rounds of one timed call each (A B A B …,
    the order rotating each round so no variant always follows another); seconds per call, and the
    process's minor page faults per call (fresh memory the kernel maps and zeroes: on a CPU the
    cost of allocating large temporaries every step).

    settle: untimed calls of the same variant before each timed one. On a CPU the heap a step finds
    (what the previous step freed, what malloc gave back to the kernel) decides how many pages it
    faults in; settling times each variant in its own steady state, as in a process training only
    it, rather than in whatever state the variant before it left."""
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    sync()
    times: dict[str, list[float]] = {n: [] for n in names}
    faults = dict.fromkeys(names, 0)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            for _ in range(settle):
                steps[name]()
            sync()
            f0 = _minor_faults()
            t0 = time.perf_counter()
            steps[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
            faults[name] += _minor_faults() - f0
    return {
        n: {
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "rounds": len(v),
            "page_faults_per_step": faults[n] / len(v),
        }
        for n, v in times.items()
    }
