from __future__ import annotations

from pathlib import Path

import pytest

from megatrain.engine.data import ByteTokenizer, HFTokenizer, build_tokenizer
from megatrain.spec import TokenizerSpec


def test_byte_round_trip() -> None:
    tok = build_tokenizer(TokenizerSpec(type="byte"))
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eod == 256
    text = "def f(x):\n    return 'héllo → 世界'\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eod]) == text  # the end-of-document id decodes to nothing


def _train_hf(path: Path, special: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["[UNK]", special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def return import class self while for if else"] * 50, trainer)
    tok.save(str(path))
    return path


@pytest.mark.parametrize("special", ["<|endoftext|>", "</s>"])
def test_hf_round_trip_and_eod(tmp_path: Path, special: str) -> None:
    path = _train_hf(tmp_path / "tokenizer.json", special)
    tok = build_tokenizer(TokenizerSpec(type="hf", path=path.as_uri()))
    assert isinstance(tok, HFTokenizer)
    assert tok.eod == tok._tok.token_to_id(special)
    text = "def f(self):\n    return import while"
    ids = tok.encode(text)
    assert tok.eod not in ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    # A plain local path works as well as a file:// URL.
    assert HFTokenizer(str(path)).encode(text) == ids


def test_hf_without_eod_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    path = tmp_path / "t.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(path))
    with pytest.raises(ValueError, match="end-of-document"):
        HFTokenizer(str(path))
