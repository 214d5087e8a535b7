"""T5 checkpoints in and out: a transformers T5ForConditionalGeneration folder (config.json +
safetensors) <-> T5Model's canonical weights, one Rule per canonical tensor (interop.hf_mapping):
  self-attention q, k, v regroup into qkv rows per head [q_h; k_h; v_h]; cross-attention k, v into
  kv rows per head [k_h; v_h]; a gated MLP's wi_0 (gate) and wi_1 (up) stack into fc1; the shared
  embedding's and an untied head's rows are zero-padded to the model's vocabulary on import and cut
  to the real one on export.

Tied or not: Hub configs of T5 v1.1 / flan-t5 say tie_word_embeddings=false; transformers 5 always
writes true and records the output scaling as scale_decoder_outputs, untying the head when the files
hold a different lm_head. Here the scaling decides (T5Model ties exactly when it scales): an untied
head absent from the files starts as a copy of the embedding, and a tied, scaled model whose files
hold a different head is refused.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megatrain.engine.interop.hf import (
    CONFIG_FILE,
    DTYPE_NAMES,
    SINGLE_FILE,
    HFReader,
    folder_store,
    hf_reader,
    put_files,
    read_hf_config,
)
from megatrain.engine.interop.hf_mapping import Rule, _gate_up, _pad_rows, _same, group_qkv, split_qkv
from megatrain.engine.models.t5 import ACTIVATIONS, T5Config, T5Model
from megatrain.spec import VOCAB_PAD_MULTIPLE

Tensor = torch.Tensor

EMBEDDING_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
"""The shared embedding again, as some checkpoints store it: accepted when equal to shared.weight."""
IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
"""Older checkpoints' unused cross-attention bias (transformers ignores it too)."""

HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32128,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 6,
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "relu",
    "n_positions": 512,
}
"""transformers' T5Config defaults, for the keys older config.json files leave out."""


def group_kv(k: Tensor, v: Tensor, heads: int) -> Tensor:
    """k, v (H·d, C) -> kv rows per head [k_h; v_h] (2·H·d, C)."""
    return torch.stack([k.reshape(heads, -1, k.shape[-1]), v.reshape(heads, -1, v.shape[-1])], 1).flatten(
        0, 2
    )


def split_kv(kv: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """group_kv's inverse."""
    k, v = kv.reshape(heads, 2, -1, kv.shape[-1]).unbind(1)
    return k.flatten(0, 1), v.flatten(0, 1)


def _vocab(name: str, hf: str, cfg: T5Config, fallback: Rule | None = None) -> Rule:
    real = cfg.real_vocab_size
    return Rule(name, (hf,), lambda t: (t[:real],), lambda t: _pad_rows(t, cfg.vocab_size), fallback)


def t5_rules(cfg: T5Config) -> list[Rule]:
    """T5Model's canonical tensors <-> T5ForConditionalGeneration's, in state-dict order."""
    h = cfg.num_attention_heads

    def qkv_to_hf(t: Tensor) -> tuple[Tensor, ...]:
        return split_qkv(t, h, h)

    def qkv_from_hf(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return group_qkv(q, k, v, h, h)

    rules = [_vocab("embed.weight", "shared.weight", cfg)]
    for stack, count in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        rules.append(_same(f"{stack}.rel_bias.weight", bias))  # (buckets, H)
        for i in range(count):
            ours, hf = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            attn = hf + "0.SelfAttention."
            rules += [
                _same(ours + "attn_norm.weight", hf + "0.layer_norm.weight"),
                Rule(
                    ours + "attn.qkv.weight",
                    tuple(f"{attn}{x}.weight" for x in "qkv"),
                    qkv_to_hf,
                    qkv_from_hf,
                ),
                _same(ours + "attn.proj.weight", attn + "o.weight"),
            ]
            mlp = hf + "1."
            if stack == "decoder":
                cross = hf + "1.EncDecAttention."
                rules += [
                    _same(ours + "cross_norm.weight", hf + "1.layer_norm.weight"),
                    _same(ours + "cross.q.weight", cross + "q.weight"),
                    Rule(
                        ours + "cross.kv.weight",
                        (cross + "k.weight", cross + "v.weight"),
                        lambda t: split_kv(t, h),
                        lambda k, v: group_kv(k, v, h),
                    ),
                    _same(ours + "cross.proj.weight", cross + "o.weight"),
                ]
                mlp = hf + "2."
            dense = mlp + "DenseReluDense."
            fc1 = (
                _gate_up(ours + "mlp.fc1.weight", dense + "wi_0.weight", dense + "wi_1.weight")
                if cfg.gated_mlp
                else _same(ours + "mlp.fc1.weight", dense + "wi.weight")
            )
            rules += [
                _same(ours + "mlp_norm.weight", mlp + "layer_norm.weight"),
                fc1,
                _same(ours + "mlp.fc2.weight", dense + "wo.weight"),
            ]
        rules.append(_same(f"{stack}.final_norm.weight", f"{stack}.final_layer_norm.weight"))
    if not cfg.tie_embeddings:
        # A head the files lack is transformers' tied one: the embedding (unscaled), copied.
        rules.append(
            _vocab("lm_head.weight", "lm_head.weight", cfg, _vocab("lm_head.weight", "shared.weight", cfg))
        )
    return rules


def t5_config_from_hf(
    config: dict[str, Any], encoder_seq_length: int | None = None, decoder_seq_length: int | None = None
) -> T5Config:
    """Our T5Config for a config.json (T5 v1.0, v1.1, flan-t5), its vocabulary padded to a multiple
    of 128 rows; sequence lengths default to n_positions. Raises ValueError for what T5Model cannot
    hold (another model_type, a decoder-only or encoder-only config, another feed_forward_proj)."""
    if config.get("model_type") != "t5":
        raise ValueError(f"model_type {config.get('model_type')!r} is not t5")
    if not config.get("is_encoder_decoder", True) or config.get("is_decoder", False):
        raise ValueError("only encoder-decoder T5 configs are supported (is_encoder_decoder, not is_decoder)")
    c = {**HF_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if c["feed_forward_proj"] not in ACTIVATIONS:
        raise ValueError(
            f"feed_forward_proj {c['feed_forward_proj']!r} is not one of {', '.join(ACTIVATIONS)}"
        )
    # transformers 5 keeps the scaling apart from the (always true) tie flag; older configs only tie.
    scaled = bool(c.get("scale_decoder_outputs", c.get("tie_word_embeddings", True) is not False))
    vocab = int(c["vocab_size"])
    positions = int(c["n_positions"])
    return T5Config(
        num_layers=int(c["num_layers"]),
        num_decoder_layers=int(c.get("num_decoder_layers") or c["num_layers"]),
        hidden_size=int(c["d_model"]),
        num_attention_heads=int(c["num_heads"]),
        kv_channels=int(c["d_kv"]),
        ffn_hidden_size=int(c["d_ff"]),
        vocab_size=-(-vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE,
        vocab_size_unpadded=vocab,
        relative_attention_num_buckets=int(c["relative_attention_num_buckets"]),
        relative_attention_max_distance=int(c["relative_attention_max_distance"]),
        activation=c["feed_forward_proj"],
        tie_embeddings=scaled,
        norm_eps=float(c["layer_norm_epsilon"]),
        hidden_dropout=float(c["dropout_rate"]),
        attention_dropout=float(c["dropout_rate"]),
        encoder_seq_length=encoder_seq_length or positions,
        decoder_seq_length=decoder_seq_length or positions,
    )


def t5_hf_config(cfg: T5Config, dtype: str = "float32") -> dict[str, Any]:
    """config.json for T5ForConditionalGeneration (T5's own pad 0, eos 1, decoder start 0)."""
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": cfg.real_vocab_size,
        "d_model": cfg.hidden_size,
        "d_kv": cfg.kv_channels,
        "d_ff": cfg.ffn_hidden_size,
        "num_layers": cfg.num_layers,
        "num_decoder_layers": cfg.num_decoder_layers,
        "num_heads": cfg.num_attention_heads,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "feed_forward_proj": cfg.activation,
        "dense_act_fn": "gelu_new" if cfg.gated_mlp else "relu",
        "is_gated_act": cfg.gated_mlp,
        # Both spellings: older transformers read the tie flag, transformers 5 the scaling.
        "tie_word_embeddings": cfg.tie_embeddings,
        "scale_decoder_outputs": cfg.tie_embeddings,
        "layer_norm_epsilon": cfg.norm_eps,
        "dropout_rate": cfg.hidden_dropout,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "n_positions": max(cfg.encoder_seq_length, cfg.decoder_seq_length),
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def resolve_t5_rules(names: Collection[str], cfg: T5Config, where: str = "the checkpoint") -> list[Rule]:
    """The rule (the spelling present in `names`) for each canonical tensor. Raises ValueError naming
    tensors nothing maps and tensors a rule needs that are missing."""
    rules = t5_rules(cfg)
    used = {n for rule in rules for spelling in rule.spellings() for n in spelling.hf}
    known = used | set(EMBEDDING_COPIES) | set(IGNORED) | {"lm_head.weight"}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{where} has tensors this T5 model cannot hold: {unknown[:8]}")
    out = []
    for rule in rules:
        found = [r for r in rule.spellings() if all(n in names for n in r.hf)]
        if not found:
            raise ValueError(f"{where} lacks {[n for n in rule.hf if n not in names][:8]}")
        out.append(found[0])
    return out


def t5_state_from_hf(
    tensors: Mapping[str, Tensor], cfg: T5Config, where: str = "the checkpoint"
) -> dict[str, Tensor]:
    """Hugging Face T5 tensors (a state dict, or a folder's lazily read tensors) under T5Model's
    canonical names. Raises ValueError for tensors nothing maps, missing ones, and copies of the
    embedding (or, tied, a head) that differ from it: one embedding is all the model holds."""
    names = list(tensors)
    rules = resolve_t5_rules(names, cfg, where)
    copies = [n for n in EMBEDDING_COPIES if n in names]
    if cfg.tie_embeddings and "lm_head.weight" in names:
        copies.append("lm_head.weight")
    if copies:
        shared = tensors["shared.weight"]
        for name in copies:
            if torch.equal(tensors[name], shared):
                continue
            if name == "lm_head.weight":
                raise ValueError(
                    f"{where}: the config scales the decoder output (a tied head) but lm_head.weight "
                    "differs from shared.weight; T5Model cannot hold a scaled, untied head"
                )
            raise ValueError(f"{where}: {name} differs from shared.weight; T5Model holds one embedding")
    return {r.name: r.from_hf(*(tensors[n] for n in r.hf)).contiguous() for r in rules}


def t5_model_from_state(
    state: Mapping[str, Tensor], cfg: T5Config, device: str | torch.device = "cpu"
) -> T5Model:
    """A fp32 T5Model (eval mode) holding `state` (canonical names; a tied head need not be there)."""
    with torch.device("meta"):  # no random init of weights about to be overwritten
        model = T5Model(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    with torch.no_grad():
        for name, target in model.state_dict().items():
            if cfg.tie_embeddings and name == "lm_head.weight":
                continue
            target.copy_(state[name])
    return model.eval()


class _FolderTensors(Mapping[str, Tensor]):
    """A folder's tensors by name, each read when asked for."""

    def __init__(self, reader: HFReader):
        self.reader = reader

    def __getitem__(self, name: str) -> Tensor:
        return self.reader.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self.reader.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.reader.files)

    def __len__(self) -> int:
        return len(self.reader.files)


def load_hf_t5(
    folder: str | Path,
    device: str | torch.device = "cpu",
    encoder_seq_length: int | None = None,
    decoder_seq_length: int | None = None,
) -> tuple[T5Model, T5Config]:
    """A fp32 T5Model (eval mode) holding a Hugging Face T5 folder's weights (a local path or a
    file:// / s3:// URL), and its config (t5_config_from_hf)."""
    cfg = t5_config_from_hf(read_hf_config(folder), encoder_seq_length, decoder_seq_length)
    with hf_reader(folder) as reader:
        state = t5_state_from_hf(_FolderTensors(reader), cfg, f"the Hugging Face model at {folder}")
    return t5_model_from_state(state, cfg, device), cfg


def export_t5_hf(
    model: T5Model,
    dest: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    extra_config: dict[str, Any] | None = None,
    tokenizer_files: dict[str, bytes | Path] | None = None,
) -> list[str]:
    """Write config.json and model.safetensors at `dest` (a directory or a file:// / s3:// URL) that
    T5ForConditionalGeneration.from_pretrained loads, and the tokenizer files given; extra_config
    overrides config.json keys (a tokenizer's pad/eos ids). fp32 by default: T5 checkpoints on the
    Hub are, and transformers keeps the MLP's wo in fp32 anyway. Returns the keys written,
    config.json last (a folder with a config is complete)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"export dtype {dtype} is not one of {', '.join(DTYPE_NAMES.values())}")
    cfg = model.config
    state = model.state_dict()
    tensors: dict[str, Tensor] = {}
    for rule in t5_rules(cfg):
        for name, t in zip(rule.hf, rule.to_hf(state[rule.name].detach()), strict=True):
            # Own, contiguous storage: safetensors refuses views that share memory.
            tensors[name] = t.to(device="cpu", dtype=dtype).contiguous().clone()
    config = {**t5_hf_config(cfg, DTYPE_NAMES[dtype]), **(extra_config or {})}
    store = folder_store(dest)
    with tempfile.TemporaryDirectory(prefix="hf-t5-export-") as tmp:
        path = Path(tmp) / SINGLE_FILE
        save_file(tensors, str(path), metadata={"format": "pt"})
        store.put_file(SINGLE_FILE, path)
    special = {k: config[k] for k in ("decoder_start_token_id", "pad_token_id", "eos_token_id")}
    generation = {"_from_model_config": True, **special}
    store.put_bytes("generation_config.json", (json.dumps(generation, indent=2) + "\n").encode())
    files = put_files(store, tokenizer_files or {})
    store.put_bytes(CONFIG_FILE, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return [SINGLE_FILE, "generation_config.json", *files, CONFIG_FILE]


def export_t5_checkpoint_hf(
    reader: Any,
    dest: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer_files: dict[str, bytes | Path] | None = None,
    extra_config: dict[str, Any] | None = None,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """export_t5_hf of a T5 job's checkpoint (a checkpoint.CheckpointReader), its decoder start,
    end and pad ids those the job's tokenizer gave its rows (data.t5_data.t5_specials; over
    extra_config's). Unlike interop.hf.export_hf, which writes shard by shard, the whole model is
    read into this process first (max_shard_bytes is not used: one safetensors file)."""
    from megatrain.engine.data.t5_data import t5_specials
    from megatrain.engine.data.tokenizers import build_tokenizer

    cfg = reader.model_config
    model = t5_model_from_state(reader.model_state(), cfg)
    specials = t5_specials(build_tokenizer(reader.spec.data.tokenizer))
    ids = {
        "decoder_start_token_id": specials.start,
        "eos_token_id": specials.end,
        "pad_token_id": specials.pad,
    }
    extra = {**(extra_config or {}), **ids}
    return export_t5_hf(model, dest, dtype=dtype, extra_config=extra, tokenizer_files=tokenizer_files)


T5_SPEC_FIELDS = {
    "num_layers": "model.num_layers",
    "num_decoder_layers": "model.t5.num_decoder_layers",
    "hidden_size": "model.hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "kv_channels": "model.t5.kv_channels",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "relative_attention_num_buckets": "model.t5.relative_attention_num_buckets",
    "relative_attention_max_distance": "model.t5.relative_attention_max_distance",
    "activation": "model.t5.feed_forward",
    "tie_embeddings": "model.tie_embeddings",
}
"""T5Config's shape fields and the spec fields that set them."""


def t5_config_mismatches(config: dict[str, Any], cfg: T5Config) -> list[str]:
    """How a config.json's T5 differs from the model `cfg` describes, each naming the spec field
    (a larger, padded vocabulary is fine; sequence lengths are the spec's)."""
    theirs = t5_config_from_hf(config, cfg.encoder_seq_length, cfg.decoder_seq_length)
    out = [
        f"{field}: checkpoint {getattr(theirs, k)!r}, model {getattr(cfg, k)!r}"
        for k, field in T5_SPEC_FIELDS.items()
        if getattr(theirs, k) != getattr(cfg, k)
    ]
    if not math.isclose(theirs.norm_eps, cfg.norm_eps, rel_tol=1e-6):
        out.append(f"model.norm_eps: checkpoint {theirs.norm_eps}, model {cfg.norm_eps}")
    if theirs.real_vocab_size > cfg.vocab_size:
        out.append(f"model.vocab_size: checkpoint {theirs.real_vocab_size}, model rows {cfg.vocab_size}")
    return out


@contextmanager
def t5_hf_slices(url: str | Path, cfg: T5Config) -> Iterator[Any]:
    """A T5ForConditionalGeneration folder opened for the model `cfg` describes, read by slice as
    interop.hf_slices reads a GPT's (its HFSlices over t5_rules: each rank reads only the rows and
    columns of the boxes it keeps). Raises ValueError naming every spec field where the folder
    disagrees, a tensor nothing maps and one a rule needs that the folder lacks. Unlike
    t5_state_from_hf, copies of the embedding in the files are not compared with it (that would
    read them whole): the model takes shared.weight."""
    from megatrain.engine.interop.hf_slices import HFSlices  # it imports interop.hf as this does

    mismatches = t5_config_mismatches(read_hf_config(url), cfg)
    if mismatches:
        raise ValueError(f"the Hugging Face model at {url} does not fit this model: " + "; ".join(mismatches))
    with hf_reader(url) as reader:
        rules = resolve_t5_rules(list(reader.files), cfg, f"the Hugging Face model at {url}")
        yield HFSlices(reader, {r.name: r for r in rules}, cfg)  # type: ignore[arg-type]
