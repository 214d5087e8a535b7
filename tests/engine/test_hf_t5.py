"""T5 Hugging Face interop (interop.hf_t5) proven with transformers itself: its save_pretrained
folders load into T5Model with its logits, our export loads with its from_pretrained and gives ours,
and config.json dialects (Hub v1.0, Hub v1.1 / flan-t5, transformers 5's own) map to the right
flavour. Tiny random models, fp32, CPU; 100 real vocabulary rows padded to 128.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatrain.engine.interop.hf_t5 import (
    export_t5_hf,
    load_hf_t5,
    t5_config_from_hf,
    t5_rules,
    t5_state_from_hf,
)
from megatrain.engine.models.t5 import T5Config, T5Model

VOCAB = 100
# The same fp32 weights; only reduction orders differ. Logits reach ~5 at init std 0.3, and the
# rounding through the stack reaches 1.7e-5 of them with 1-2 threads (7.5e-6 with 4): MKL's order.
ATOL, RTOL = 4e-5, 1e-5
FLAVOURS = {"v1.0": ("relu", True), "v1.1": ("gated-gelu", False)}
T5_SMALL = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_ff": 2048, "d_kv": 64,
            "d_model": 512, "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1,
            "initializer_factor": 1.0, "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06,
            "n_positions": 512, "num_heads": 8, "num_layers": 6, "pad_token_id": 0,
            "relative_attention_num_buckets": 32, "vocab_size": 32128}  # fmt: skip
"""google-t5/t5-small's config.json: no feed_forward_proj, no tie flag (v1.0 defaults)."""
FLAN_BASE = {**T5_SMALL, "d_ff": 2048, "d_model": 768, "num_heads": 12, "num_layers": 12,
             "num_decoder_layers": 12, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
             "relative_attention_max_distance": 128}  # fmt: skip
"""google/flan-t5-base's, in substance."""


def hf_t5(flavour: str) -> transformers.T5ForConditionalGeneration:
    """A random transformers T5 (its own init, eval mode); v1.1 gets its own head (transformers 5
    ties it in memory whatever the config says; save_pretrained then keeps both)."""
    proj, tied = FLAVOURS[flavour]
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, feed_forward_proj=proj,
        tie_word_embeddings=tied, dropout_rate=0.0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.5)
    return model.eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    enc = torch.randint(2, VOCAB, (2, 9), generator=g)
    enc_mask = torch.ones_like(enc)
    enc_mask[1, 5:] = 0
    return enc, enc_mask, torch.randint(2, VOCAB, (2, 6), generator=g)


def hf_logits(model: transformers.T5ForConditionalGeneration) -> torch.Tensor:
    enc, enc_mask, dec = inputs()
    with torch.no_grad():
        return model(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec).logits


def our_logits(model: T5Model) -> torch.Tensor:
    enc, enc_mask, dec = inputs()
    with torch.no_grad():
        return model(enc, dec, enc_mask)[..., :VOCAB]


def test_config_dialects() -> None:
    small = t5_config_from_hf(T5_SMALL)
    assert (small.activation, small.tie_embeddings) == ("relu", True)
    assert (small.num_layers, small.num_decoder_layers, small.kv_channels) == (6, 6, 64)
    assert (small.vocab_size, small.real_vocab_size, small.relative_attention_max_distance) == (
        32128,
        32128,
        128,
    )
    assert (small.encoder_seq_length, small.decoder_seq_length, small.hidden_dropout) == (512, 512, 0.1)
    flan = t5_config_from_hf(FLAN_BASE, encoder_seq_length=1024, decoder_seq_length=256)
    assert (flan.activation, flan.tie_embeddings, flan.hidden_size) == ("gated-gelu", False, 768)
    assert (flan.encoder_seq_length, flan.decoder_seq_length) == (1024, 256)
    # transformers 5 writes tie_word_embeddings=true always, and the scaling on its own.
    saved = t5_config_from_hf({**FLAN_BASE, "tie_word_embeddings": True, "scale_decoder_outputs": False})
    assert saved.tie_embeddings is False
    odd = t5_config_from_hf({**T5_SMALL, "vocab_size": 1000, "num_decoder_layers": 2})
    assert (odd.vocab_size, odd.vocab_size_unpadded, odd.num_decoder_layers) == (1024, 1000, 2)
    # Every dialect means to transformers what it means to us.
    for config in (
        T5_SMALL,
        FLAN_BASE,
        {**FLAN_BASE, "tie_word_embeddings": True, "scale_decoder_outputs": False},
    ):
        theirs = transformers.T5Config.from_dict(config)
        ours = t5_config_from_hf(config)
        assert theirs.scale_decoder_outputs == ours.tie_embeddings
        assert theirs.is_gated_act == ours.gated_mlp


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "bart"}, "model_type 'bart' is not t5"),
        ({"model_type": "mt5"}, "model_type 'mt5' is not t5"),
        ({"feed_forward_proj": "gated-silu"}, "feed_forward_proj 'gated-silu'"),
        ({"feed_forward_proj": "gelu"}, "feed_forward_proj 'gelu'"),
        ({"is_encoder_decoder": False}, "encoder-decoder"),
        ({"is_decoder": True}, "encoder-decoder"),
    ],
)
def test_config_refusals(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        t5_config_from_hf({**T5_SMALL, **change})


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_load_save_pretrained_folder(flavour: str, tmp_path: Path) -> None:
    """transformers' own folder (its config dialect, its tensor names) -> T5Model with its logits."""
    hf = hf_t5(flavour)
    hf.save_pretrained(tmp_path)
    model, cfg = load_hf_t5(tmp_path)
    assert cfg.tie_embeddings == (flavour == "v1.0") and cfg.num_decoder_layers == 3
    assert (model.lm_head.weight is model.embed.weight) == cfg.tie_embeddings
    assert not model.training
    torch.testing.assert_close(our_logits(model), hf_logits(hf), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_export_loads_in_transformers(flavour: str, tmp_path: Path) -> None:
    """Our export -> from_pretrained gives our logits; loading it back gives our weights."""
    proj, tied = FLAVOURS[flavour]
    cfg = T5Config(num_layers=2, num_decoder_layers=1, hidden_size=32, num_attention_heads=4, kv_channels=6,
                   ffn_hidden_size=40, vocab_size=128, vocab_size_unpadded=VOCAB, activation=proj,  # type: ignore[arg-type]
                   tie_embeddings=tied, init_method_std=0.3, relative_attention_num_buckets=8,
                   relative_attention_max_distance=20)  # fmt: skip
    torch.manual_seed(3)
    ours = T5Model(cfg).eval()
    written = export_t5_hf(ours, tmp_path)
    assert written[-1] == "config.json"
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.d_kv == 6 and hf.config.vocab_size == VOCAB
    assert (hf.lm_head.weight is hf.shared.weight) == tied
    torch.testing.assert_close(hf_logits(hf), our_logits(ours), atol=ATOL, rtol=RTOL)
    back, back_cfg = load_hf_t5(tmp_path, encoder_seq_length=512, decoder_seq_length=128)
    assert dataclasses.replace(back_cfg, init_method_std=0.3) == cfg  # an init std is no checkpoint's
    for name, t in ours.state_dict().items():
        # Padding rows of the vocabulary are not exported: they come back as zeros.
        rows = VOCAB if name in ("embed.weight", "lm_head.weight") else None
        assert torch.equal(back.state_dict()[name][:rows], t[:rows]), name
    assert torch.all(back.embed.weight[VOCAB:] == 0)


def test_rules_round_trip() -> None:
    """from_hf then to_hf returns transformers' tensors exactly, for every rule of both flavours."""
    for flavour in FLAVOURS:
        hf = hf_t5(flavour)
        state = hf.state_dict()
        cfg = t5_config_from_hf(hf.config.to_dict())
        for rule in t5_rules(cfg):
            back = rule.to_hf(rule.from_hf(*(state[n] for n in rule.hf)))
            for name, t in zip(rule.hf, back, strict=True):
                assert torch.equal(t, state[name]), name


def test_folder_variants(tmp_path: Path) -> None:
    """Copies of the embedding are accepted when equal and refused when not; a tied model's head
    must be its embedding; unknown and missing tensors are named; an untied head the files lack is
    the embedding, as transformers reads it."""
    hf = hf_t5("v1.0")
    hf.save_pretrained(tmp_path / "base")
    config = json.loads((tmp_path / "base/config.json").read_text())
    tensors = load_file(tmp_path / "base/model.safetensors")
    shared = tensors["shared.weight"]

    def folder(name: str, files: dict[str, torch.Tensor], cfg: dict[str, Any] = config) -> Path:
        (tmp_path / name).mkdir()
        save_file({k: v.contiguous() for k, v in files.items()}, tmp_path / name / "model.safetensors")
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return tmp_path / name

    copies = {"encoder.embed_tokens.weight": shared.clone(), "decoder.embed_tokens.weight": shared.clone()}
    model, _ = load_hf_t5(folder("copies", {**tensors, **copies, "lm_head.weight": shared.clone()}))
    torch.testing.assert_close(our_logits(model), hf_logits(hf), atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="encoder.embed_tokens.weight differs"):
        load_hf_t5(folder("two-embeddings", {**tensors, "encoder.embed_tokens.weight": shared + 1}))
    with pytest.raises(ValueError, match="scales the decoder output.*lm_head.weight differs"):
        load_hf_t5(folder("scaled-untied", {**tensors, "lm_head.weight": shared + 1}))
    with pytest.raises(ValueError, match="cannot hold.*extra.weight"):
        load_hf_t5(folder("unknown", {**tensors, "extra.weight": shared.clone()}))
    missing = {k: v for k, v in tensors.items() if "block.1.layer.1" not in k}
    with pytest.raises(ValueError, match="lacks.*encoder.block.1.layer.1"):
        load_hf_t5(folder("missing", missing))
    # An unscaled (v1.1) config over files with the embedding alone: transformers ties the head.
    unscaled = {**config, "scale_decoder_outputs": False}
    path = folder("unscaled-tied", tensors, unscaled)
    model, cfg = load_hf_t5(path)
    assert not cfg.tie_embeddings and torch.equal(model.lm_head.weight[:VOCAB], shared)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    torch.testing.assert_close(our_logits(model), hf_logits(theirs), atol=ATOL, rtol=RTOL)


def test_state_from_an_in_memory_model() -> None:
    """transformers' in-memory state dict (every tied alias present) maps as its files do."""
    hf = hf_t5("v1.1")
    cfg = t5_config_from_hf(hf.config.to_dict())
    state = t5_state_from_hf(hf.state_dict(), cfg)
    assert torch.equal(state["lm_head.weight"][:VOCAB], hf.lm_head.weight)
    assert torch.all(state["embed.weight"][VOCAB:] == 0)
