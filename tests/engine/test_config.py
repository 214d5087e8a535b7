from __future__ import annotations

import pytest

from megatrain.engine.config import padded_vocab_size, train_config, transformer_config
from megatrain.plan.layout import Layout, check_layout, with_micro_batch_size
from megatrain.spec import SpecError, parse_spec

from .helpers import tiny_spec


def test_vocab_padding() -> None:
    assert padded_vocab_size(257) == 384
    assert padded_vocab_size(256) == 256
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(257, 300) == 384  # the model's vocabulary, padded too
    with pytest.raises(SpecError) as err:
        padded_vocab_size(257, 200)
    assert err.value.errors[0]["field"] == "model.vocab_size"


def test_llama_and_gpt2_flavours(tmp_path) -> None:
    raw = tiny_spec(tmp_path / "c.jsonl")
    llama = transformer_config(parse_spec(raw), 257)
    assert (llama.position_embedding, llama.normalization, llama.activation) == ("rope", "rmsnorm", "swiglu")
    assert not llama.tie_embeddings and not llama.add_bias
    assert (llama.num_query_groups, llama.kv_size, llama.vocab_size) == (2, 16, 384)

    raw["model"].update(arch="gpt2", num_query_groups=None, ffn_hidden_size=None)
    gpt2 = transformer_config(parse_spec(raw), 257)
    assert (gpt2.position_embedding, gpt2.normalization, gpt2.activation) == ("learned", "layernorm", "gelu")
    assert gpt2.tie_embeddings and gpt2.add_bias
    assert gpt2.num_query_groups == 4 and gpt2.ffn_hidden_size == 4 * 32  # from spec.model.ffn_size


def test_train_config_accumulation(tmp_path) -> None:
    spec = parse_spec(tiny_spec(tmp_path / "c.jsonl", global_batch_size=16, micro_batch_size=2))
    assert train_config(spec, 1).grad_accum_steps == 8
    assert train_config(spec, 2).grad_accum_steps == 4
    # A batch that does not split over dp=3 never reaches the loop: the layout check refuses it.
    with pytest.raises(SpecError, match="training.global_batch_size=16 is not divisible"):
        check_layout(spec, Layout(dp=3), 3)
    # An auto micro-batch size is a number by the time the engine reads it (train.run resolves it).
    auto = parse_spec(tiny_spec(tmp_path / "c.jsonl", global_batch_size=16, micro_batch_size="auto"))
    with pytest.raises(ValueError, match="resolved on the layout"):
        train_config(auto, 2)
    assert train_config(with_micro_batch_size(auto, layout=Layout(dp=2)), 2).micro_batch_size == 4
