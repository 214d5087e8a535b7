"""Generation with a KV cache (megatrain/engine/generate.py, models.gpt.KVCache): against a full
recompute of every step, and against transformers' own logits processors and generate()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.generate import filter_logits, generate, generate_batch
from megatrain.engine.models.gpt import GPTModel, KVCache

# (preset, overrides): both flavours, each with one key/value group per head and with fewer (GQA).
FLAVOURS = {
    "gpt2": ("tiny-gpt2", {}),
    "gpt2-gqa": ("tiny-gpt2", {"num_query_groups": 2}),
    "llama-gqa": ("tiny-llama", {}),
    "llama-mha": ("tiny-llama", {"num_query_groups": 4}),
}


def make_model(flavour: str, seed: int = 0) -> GPTModel:
    preset, overrides = FLAVOURS[flavour]
    torch.manual_seed(seed)
    # A wider init than training's 0.02 gives peaked logits: no near-ties for argmax to flip on.
    return GPTModel(TransformerConfig.preset(preset, init_method_std=0.3, **overrides)).eval()


@torch.no_grad()
def full_recompute(
    model: GPTModel, prompt: list[int], steps: int, vocab_limit: int | None = None
) -> list[int]:
    """Greedy decoding without a cache: the whole sequence through the model at every step."""
    seq = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([seq], device=model.embed.weight.device))[0, -1]
        if vocab_limit is not None:
            logits[vocab_limit:] = float("-inf")
        seq.append(int(logits.argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cached_logits_equal_the_full_forward(flavour: str) -> None:
    model = make_model(flavour)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    cache = KVCache(16)
    # A prefill, a second chunk over a non-empty cache, then one token at a time.
    chunks = [tokens[:, :5], tokens[:, 5:9]] + [tokens[:, i : i + 1] for i in range(9, 16)]
    cached = torch.cat([model(chunk, kv_cache=cache) for chunk in chunks], dim=1)
    assert cache.length == 16
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="seq_length"):
        model(tokens[:, :1], kv_cache=cache)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_cached_greedy_equals_full_recompute(flavour: str) -> None:
    model = make_model(flavour)
    prompt = [5, 17, 99, 3]
    out = generate(model, prompt, 12)
    assert out == full_recompute(model, prompt, 12)
    assert len(out) == 12


def test_stops_at_seq_length_and_at_eos() -> None:
    model = make_model("llama-gqa")
    prompt = list(range(10, 22))  # 12 of the 16 positions
    out = generate(model, prompt, 50)
    assert out == full_recompute(model, prompt, 4)  # the sequence fills seq_length=16
    longer = generate(model, [1, 2], 14)
    eos = longer[5]
    assert generate(model, [1, 2], 14, eos_id=eos) == longer[: longer.index(eos) + 1]
    assert generate(model, [1, 2], 0) == []
    assert len(generate(model, list(range(16)), 5)) == 0  # already full


def test_batched_rows_equal_single_prompts() -> None:
    model = make_model("gpt2-gqa")
    prompts = torch.tensor([[1, 2, 3], [40, 50, 60], [7, 7, 7]])
    single = [generate(model, row, 8) for row in prompts]
    assert generate_batch(model, prompts, 8) == single
    # One row stops at its eos, the others go on to max_new_tokens.
    eos = single[0][2]
    rows = generate_batch(model, prompts, 8, eos_id=eos)
    for row, alone in zip(rows, single, strict=True):
        assert row == (alone[: alone.index(eos) + 1] if eos in alone else alone)


def test_padding_rows_are_never_generated() -> None:
    model = make_model("llama-gqa")
    prompt = [3, 4, 5]
    free = generate(model, prompt, 10)
    # A limit just at the first token the whole vocabulary would choose: it must now be avoided.
    limit = max(free[0], 1)
    limited = generate(model, prompt, 10, vocab_limit=limit)
    assert limited == full_recompute(model, prompt, 10, vocab_limit=limit)
    assert max(limited) < limit
    sampled = generate(model, prompt, 10, greedy=False, temperature=5.0, seed=0, vocab_limit=limit)
    assert max(sampled) < limit


def test_sampling_is_reproducible_and_top_k_one_is_greedy() -> None:
    model = make_model("gpt2")
    prompt = [9, 8, 7]
    kw = {"greedy": False, "temperature": 2.0, "top_p": 0.95}
    a, b = generate(model, prompt, 12, seed=3, **kw), generate(model, prompt, 12, seed=3, **kw)
    assert a == b
    draws = {tuple(generate(model, prompt, 12, seed=s, **kw)) for s in range(4)}
    assert len(draws) > 1  # the seed matters
    assert generate(model, prompt, 12, greedy=False, top_k=1, temperature=3.0, seed=5) == generate(
        model, prompt, 12
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("flavour", ["gpt2", "llama-gqa"])
def test_on_cuda(flavour: str) -> None:
    model = make_model(flavour).cuda()
    prompt = [5, 17, 99, 3]
    assert generate(model, prompt, 12) == full_recompute(model, prompt, 12)
    kw = {"greedy": False, "temperature": 1.5, "top_p": 0.9, "seed": 2}
    assert generate(model, prompt, 12, **kw) == generate(model, prompt, 12, **kw)
    half = make_model(flavour).to("cuda", torch.bfloat16)  # the cache in the model's dtype
    assert len(generate(half, prompt, 12)) == 12


def test_bad_arguments_are_value_errors() -> None:
    model = make_model("llama-gqa")
    for kwargs, match in [
        ({"prompt_ids": [], "max_new_tokens": 1}, "at least one token"),
        ({"prompt_ids": list(range(17)), "max_new_tokens": 1}, "seq_length"),
        ({"prompt_ids": [128], "max_new_tokens": 1}, "outside the vocabulary"),
        ({"prompt_ids": [-1], "max_new_tokens": 1}, "outside the vocabulary"),
        ({"prompt_ids": [1], "max_new_tokens": 1, "top_k": 3}, "greedy"),
        ({"prompt_ids": [1], "max_new_tokens": 1, "greedy": False, "temperature": 0.0}, "temperature"),
        ({"prompt_ids": [1], "max_new_tokens": 1, "greedy": False, "top_p": 0.0}, "top_p"),
        ({"prompt_ids": [1], "max_new_tokens": -1}, "max_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            generate(model, **kwargs)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (1.3, 7, 0.6)]
)
def test_filter_logits_equals_transformers_warpers(temperature: float, top_k: int, top_p: float) -> None:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    expected = warpers(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    torch.testing.assert_close(filter_logits(logits, temperature, top_k, top_p), expected, rtol=0, atol=0)


# -- against transformers' generate() ------------------------------------------------------------


def hf_model(arch: str, tmp_path: Path) -> tuple[torch.nn.Module, GPTModel]:
    """A tiny random transformers model (a vocabulary of 100: our embedding pads it to 128 rows)
    and the same weights loaded through load_hf_model."""
    import transformers

    from megatrain.engine.interop.hf import load_hf_model

    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    else:
        config = transformers.LlamaConfig(
            vocab_size=100, max_position_embeddings=32, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
            eos_token_id=2, bos_token_id=1,
        )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf_model(str(tmp_path))
    assert cfg.vocab_size == 128 and cfg.vocab_size_unpadded == 100
    return hf, ours


def hf_generate(hf: torch.nn.Module, prompt: list[int], n: int, **kwargs: object) -> list[int]:
    """transformers' generate(): the new ids only, stopping at the config's eos as ours does."""
    ids = torch.tensor([prompt])
    eos = hf.config.eos_token_id
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, pad_token_id=eos, **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_equals_transformers_generate(arch: str, tmp_path: Path) -> None:
    pytest.importorskip("megatrain.engine.interop.hf")
    hf, ours = hf_model(arch, tmp_path)
    eos = hf.config.eos_token_id
    for prompt in ([5, 17, 99, 3], [42]):
        want = hf_generate(hf, prompt, 20, do_sample=False)
        assert generate(ours, prompt, 20, eos_id=eos) == want
    # The padding rows (zero weights: logit 0) are never chosen, though here they often outscore all.
    assert max(generate(ours, [1, 2, 3], 25, greedy=False, temperature=50.0, seed=0)) < 100


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_seeded_sampling_equals_transformers_generate(arch: str, tmp_path: Path) -> None:
    """transformers draws from the global CPU generator, we from our own seeded one: one stream."""
    pytest.importorskip("megatrain.engine.interop.hf")
    hf, ours = hf_model(arch, tmp_path)
    eos = hf.config.eos_token_id
    sampling = {"temperature": 1.7, "top_k": 40, "top_p": 0.9}
    for seed in (0, 1):
        torch.manual_seed(seed)
        want = hf_generate(hf, [7, 8, 9], 20, do_sample=True, **sampling)
        got = generate(ours, [7, 8, 9], 20, greedy=False, seed=seed, eos_id=eos, **sampling)
        assert got == want
