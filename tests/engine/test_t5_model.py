"""T5Model against transformers' T5ForConditionalGeneration on the same weights (tiny random
configs, fp32, CPU): logits, every gradient, the loss on masked targets, greedy generation.

Two flavours: T5 v1.0 (relu MLP, tied head behind the d_model**-0.5 scaling) and v1.1 / flan-t5
(gated-gelu MLP, untied head). Heads of d_kv=6 (4 heads: 24 wide against d_model 32) exercise an
attention width other than hidden_size, as t5-11b has; a vocabulary of 100 real rows padded to 128
exercises the padding. The reference runs transformers' eager attention: the textbook matmuls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.t5.modeling_t5 import T5Attention

from megatrain.engine.interop.hf_t5 import t5_config_from_hf, t5_model_from_state, t5_rules, t5_state_from_hf
from megatrain.engine.models.t5 import T5Config, T5Model
from megatrain.engine.models.t5_layers import T5KVCache, relative_position_bucket

VOCAB = 100
# fp32 with the same weights: only reduction orders differ (fused qkv, SDPA against matmuls), a few
# ulps per op through 4 layers; logits reach ~20 (v1.1's std-1 head), hence the relative part.
ATOL, RTOL = 1e-5, 1e-5
FLAVOURS = {"v1.0": ("relu", True), "v1.1": ("gated-gelu", False)}


def hf_t5(flavour: str, seed: int = 0) -> transformers.T5ForConditionalGeneration:
    """A random transformers T5 in eval mode. Weights are redrawn larger than its init (which leaves
    attention near uniform and makes a tied model repeat its start token): sharp attention, relative
    biases that matter, norms away from 1. transformers 5 ties the head in memory whatever the
    config says (the scaling follows tie_word_embeddings): v1.1 gets its own head."""
    proj, tied = FLAVOURS[flavour]
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=6, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, feed_forward_proj=proj,
        tie_word_embeddings=tied, dropout_rate=0.0, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(torch.empty(VOCAB, 32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.normal_(1.0, 0.2)
            elif "relative_attention_bias" in name:
                p.normal_(0.0, 1.0)
            elif name != "shared.weight":  # the embedding keeps its std-1 init
                p.normal_(0.0, 0.3)
    return model.eval()


def ours_from(hf: transformers.T5ForConditionalGeneration) -> T5Model:
    cfg = t5_config_from_hf(hf.config.to_dict())
    return t5_model_from_state(t5_state_from_hf(hf.state_dict(), cfg), cfg)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """enc (3, 12) with right padding in two rows (one padded after 2 tokens: relative distances up
    to 11 cross the log buckets), its mask, dec (3, 7) and its mask (one row padded)."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(2, VOCAB, (3, 12), generator=g)
    enc_mask = torch.ones_like(enc)
    enc_mask[1, 8:], enc_mask[2, 2:] = 0, 0
    dec = torch.randint(2, VOCAB, (3, 7), generator=g)
    dec_mask = torch.ones_like(dec)
    dec_mask[0, 5:] = 0
    return enc, enc_mask, dec, dec_mask


BUCKET_CASES = [(True, 32, 128), (False, 32, 128), (True, 8, 20), (False, 8, 20)]


@pytest.mark.parametrize(("bidirectional", "buckets", "distance"), BUCKET_CASES)
def test_relative_position_bucket_matches_transformers(
    bidirectional: bool, buckets: int, distance: int
) -> None:
    relative = torch.arange(-300, 301)[None, :] - torch.arange(0, 5)[:, None]
    theirs = T5Attention._relative_position_bucket(relative, bidirectional, buckets, distance)
    assert torch.equal(relative_position_bucket(relative, bidirectional, buckets, distance), theirs)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_logits_match_transformers(flavour: str) -> None:
    hf = hf_t5(flavour)
    ours = ours_from(hf)
    assert ours.config.tie_embeddings == (flavour == "v1.0")
    assert ours.config.inner_size == 24 and ours.config.vocab_size == 128
    enc, enc_mask, dec, dec_mask = batch()
    with torch.no_grad():
        out = hf(
            input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask
        )
        logits = ours(enc, dec, enc_mask, dec_mask)
        hidden = ours.encode(enc, enc_mask)
    assert logits.shape == (3, 7, 128)
    real, kept = enc_mask.bool(), dec_mask.bool()
    torch.testing.assert_close(hidden[real], out.encoder_last_hidden_state[real], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(logits[..., :VOCAB][kept], out.logits[kept], atol=ATOL, rtol=RTOL)
    # The padded rows of a tied head are zero embeddings: zero logits, never a prediction.
    assert torch.all(logits[..., VOCAB:] == 0) if flavour == "v1.0" else True


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_gradients_match_transformers(flavour: str) -> None:
    """The same loss (some targets masked) backpropagates to the same gradient in every parameter:
    transformers' gradients mapped through the import rules (linear: permutations and stacking)."""
    hf = hf_t5(flavour)
    ours = ours_from(hf)
    enc, enc_mask, dec, _ = batch()
    labels = torch.roll(dec, -1, dims=1)
    labels[0, 4:], labels[2, 0] = -100, -100
    theirs = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec, labels=labels).loss
    theirs.backward()
    loss = ours.loss(enc, dec, labels.clamp(min=0), labels != -100, enc_mask)
    loss.backward()
    torch.testing.assert_close(loss, theirs, atol=ATOL, rtol=RTOL)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    expected = {r.name: r.from_hf(*(hf_grads[n] for n in r.hf)) for r in t5_rules(ours.config)}
    params = dict(ours.named_parameters())
    assert set(params) == set(expected)
    for name, p in params.items():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, expected[name], atol=ATOL, rtol=1e-4, msg=name)
    assert torch.all(ours.embed.weight.grad[VOCAB:] == 0)  # padding rows: neither input nor class


def test_loss_counts_only_masked_targets() -> None:
    """loss = mean cross-entropy over the kept tokens of forward's logits within the real vocabulary;
    a target outside the mask changes nothing."""
    ours = ours_from(hf_t5("v1.1"))
    enc, enc_mask, dec, dec_mask = batch(seed=2)
    labels = torch.randint(0, VOCAB, dec.shape)
    keep = torch.rand(dec.shape, generator=torch.Generator().manual_seed(3)) < 0.5
    with torch.no_grad():
        logits = ours(enc, dec, enc_mask, dec_mask)[..., :VOCAB]
        expected = F.cross_entropy(logits[keep], labels[keep])
        loss = ours.loss(enc, dec, labels, keep.long(), enc_mask, dec_mask)
        other = labels.masked_fill(~keep, VOCAB - 1)
        again = ours.loss(enc, dec, other, keep.long(), enc_mask, dec_mask)
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=RTOL)
    assert torch.equal(loss, again)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cached_decoding_matches_full_decoding(flavour: str) -> None:
    """Decoding with a KV cache (a 3-token prefix, then token by token) gives the full pass's logits."""
    ours = ours_from(hf_t5(flavour))
    enc, enc_mask, dec, _ = batch()
    with torch.no_grad():
        memory = ours.encode(enc, enc_mask)
        full = ours.decode(memory, enc_mask, dec)
        cache = T5KVCache(dec.shape[1])
        steps = [ours.decode(memory, enc_mask, dec[:, :3], cache)]
        steps += [ours.decode(memory, enc_mask, dec[:, i : i + 1], cache) for i in range(3, dec.shape[1])]
    assert cache.length == dec.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="holds 7 positions"):
        ours.decode(memory, enc_mask, dec[:, :1], cache)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_generate_greedy_matches_transformers(flavour: str) -> None:
    """Token for token as transformers' greedy generate (without its start token), with no eos and
    with an eos that ends one row early: that row continues with pad, as theirs does."""
    hf = hf_t5(flavour)
    ours = ours_from(hf)
    enc, enc_mask, _, _ = batch()
    hf.generation_config.eos_token_id = None
    kw = {"do_sample": False, "num_beams": 1, "decoder_start_token_id": 0, "pad_token_id": 0}
    with torch.no_grad():
        free = ours.generate_greedy(enc, enc_mask, 8)
        theirs = hf.generate(input_ids=enc, attention_mask=enc_mask, max_new_tokens=8, **kw)
        assert torch.equal(free, theirs[:, 1:])
        eos = int(free[2, 3])  # ends the last row midway (and any row that meets it sooner)
        stopped = ours.generate_greedy(enc, enc_mask, 8, eos_token_id=eos)
        theirs = hf.generate(input_ids=enc, attention_mask=enc_mask, max_new_tokens=8, eos_token_id=eos, **kw)
    assert torch.equal(stopped, theirs[:, 1:])
    assert (stopped == eos).any()


def test_init_is_a_function_of_the_seed() -> None:
    cfg = T5Config(num_layers=2, num_decoder_layers=3, hidden_size=32, num_attention_heads=4, kv_channels=8,
                   ffn_hidden_size=48, vocab_size=128, vocab_size_unpadded=100)  # fmt: skip
    torch.manual_seed(7)
    a = T5Model(cfg)
    torch.manual_seed(7)
    b = T5Model(cfg)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert a.lm_head.weight is a.embed.weight
    assert torch.all(a.decoder.final_norm.weight == 1)
    # Residual writers are drawn smaller: std / sqrt(2 · layers of their stack).
    std = a.encoder.layers[0].attn.qkv.weight.std()
    assert 0.015 < std < 0.025
    assert a.decoder.layers[0].cross.proj.weight.std() < std / 2
    torch.manual_seed(8)
    assert not torch.equal(T5Model(cfg).embed.weight, a.embed.weight)


def test_config_and_input_checks() -> None:
    base = {"num_layers": 1, "num_decoder_layers": 1, "hidden_size": 16, "num_attention_heads": 2,
            "kv_channels": 8, "ffn_hidden_size": 32, "vocab_size": 64}  # fmt: skip
    with pytest.raises(ValueError, match="activation"):
        T5Config(**base, activation="swiglu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocab_size_unpadded"):
        T5Config(**base, vocab_size_unpadded=65)
    with pytest.raises(ValueError, match="max_distance"):
        T5Config(**base, relative_attention_num_buckets=32, relative_attention_max_distance=16)
    cfg = T5Config(**base, encoder_seq_length=8, decoder_seq_length=4)
    assert T5Config.from_dict(cfg.to_dict()) == cfg
    model = T5Model(cfg)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="encoder sequence of 9"):
        model(torch.zeros(1, 9, dtype=torch.long), tokens)
    with pytest.raises(ValueError, match="decoder sequence of 5"):
        model(tokens, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="mask of shape"):
        model(tokens, tokens, enc_mask=torch.ones(1, 3))
