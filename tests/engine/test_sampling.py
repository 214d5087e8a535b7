from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.engine.checkpoint import save_model
from megatrain.engine.config import transformer_config
from megatrain.engine.data import build_tokenizer
from megatrain.engine.generate import generate
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.sampling import CheckpointSampler
from megatrain.spec import parse_spec

from .helpers import tiny_spec


def test_samples_equal_generate_and_models_are_cached(tmp_path: Path, corpus: Path) -> None:
    spec = parse_spec(tiny_spec(corpus))
    torch.manual_seed(0)
    model = GPTModel(transformer_config(spec, 257)).eval()
    urls = [save_model((tmp_path / name).as_uri(), 1, model, spec).uri for name in ("a", "b", "c")]
    sampler = CheckpointSampler(keep=2)
    got = sampler.sample(urls[0], "def f", 8)
    tok = build_tokenizer(spec.data.tokenizer)
    want = generate(model, tok.encode("def f"), 8, eos_id=tok.eod, vocab_limit=257)
    assert got.prompt_ids == tok.encode("def f") and got.new_ids == want
    assert got.text == tok.decode(want)
    a = sampler.sample(urls[0], "def f", 8, temperature=0.9, top_p=0.9, seed=3)
    b = sampler.sample(urls[0], "def f", 8, temperature=0.9, top_p=0.9, seed=3)
    assert (a.new_ids, a.text) == (b.new_ids, b.text)  # seeded: the same text
    for url in urls:
        sampler.sample(url, "x", 1)
    assert list(sampler._models) == urls[1:]  # the least recently used is dropped
    with pytest.raises(ValueError, match="reads at most 31"):
        sampler.sample(urls[2], "y" * 40, 4)
