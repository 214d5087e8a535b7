"""A transformers T5 config.json as our model fields (megatrain.hf_config_t5): the spec filled from
it builds the T5Config the engine reads from the same file (interop.hf_t5), for T5 v1.0 and v1.1
configs as transformers itself writes them; what T5Model cannot compute is refused by its key."""

from __future__ import annotations

from typing import Any

import pytest

from megatrain.hf_config import HFConfigError, check_spec_against_hf, model_fields_from_hf, spec_model_with_hf
from megatrain.spec import parse_spec

transformers = pytest.importorskip("transformers")

SHAPE = {"vocab_size": 300, "d_model": 64, "d_kv": 8, "d_ff": 96, "num_layers": 3,
         "num_decoder_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 16,
         "relative_attention_max_distance": 64}  # fmt: skip
BASE = {"name": "t5-hf", "kind": "finetune",
        "data": {"train": [{"path": "file:///d/pairs.jsonl"}], "tokenizer": "hf:/t/t.json"}}  # fmt: skip


@pytest.mark.parametrize("proj", ["relu", "gated-gelu"])
def test_the_filled_spec_builds_the_model_the_folder_holds(proj: str) -> None:
    from megatrain.engine.config import t5_config
    from megatrain.engine.interop.hf_t5 import t5_config_from_hf

    # (dropout_rate 0: dropout is the spec's training choice, model.hidden_dropout, 0 by default)
    config = transformers.T5Config(
        **SHAPE, feed_forward_proj=proj, tie_word_embeddings=proj == "relu", dropout_rate=0.0
    )
    hub = config.to_dict()
    fields = model_fields_from_hf(hub)
    assert fields["arch"] == "t5" and fields["t5"]["feed_forward"] == proj
    raw = {"init_from": "hf:/models/t5", "seq_length": 64, "t5": {"decoder_seq_length": 32}}
    assert check_spec_against_hf(raw, fields) == []
    spec = parse_spec({**BASE, "model": spec_model_with_hf(raw, fields)})
    ours = t5_config(spec, tokenizer_vocab=SHAPE["vocab_size"])
    assert ours == t5_config_from_hf(hub, 64, 32)


def test_a_spec_field_that_disagrees_is_named() -> None:
    fields = model_fields_from_hf(transformers.T5Config(**SHAPE).to_dict())
    errors = check_spec_against_hf(
        {"hidden_size": 32, "t5": {"kv_channels": 16, "decoder_seq_length": 8}}, fields
    )
    assert [e["field"] for e in errors] == ["model.hidden_size", "model.t5.kv_channels"]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"feed_forward_proj": "gated-relu"}, "feed_forward_proj"),
    ({"is_decoder": True}, "is_decoder"),
    ({"is_encoder_decoder": False}, "is_encoder_decoder"),
]


@pytest.mark.parametrize(("changes", "key"), BAD)
def test_what_t5model_cannot_compute_is_refused(changes: dict[str, Any], key: str) -> None:
    with pytest.raises(HFConfigError) as info:
        model_fields_from_hf({**transformers.T5Config(**SHAPE).to_dict(), **changes})
    assert info.value.key == key
