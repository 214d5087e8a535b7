from __future__ import annotations

import io
from pathlib import Path

import pytest

from megatrain.engine.data import ByteTokenizer, HFTokenizer, build_tokenizer
from megatrain.engine.data.tokenizers import SentencePieceTokenizer, TiktokenTokenizer
from megatrain.spec import TokenizerSpec

from .helpers import tiktoken_ranks_file


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


# -- batch encoding, tiktoken, SentencePiece: each against the library's own direct use ------------

TEXTS = [
    "hello world, hello there",
    "the hell of it: 世界 ✓",
    "tab\tand\nnewline  spaces",
    "plain <|endoftext|> inside a document",
    "",
]


def test_byte_batch_equals_one_by_one() -> None:
    tok = build_tokenizer(TokenizerSpec(type="byte"))
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_hf_batch_equals_the_rust_batch_encoder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    path = _train_hf(tmp_path / "tokenizer.json", "<|endoftext|>")
    tok = build_tokenizer(TokenizerSpec.model_validate(f"hf:{path}"))  # the CLI's shorthand
    direct = Tokenizer.from_file(str(path))
    assert tok.encode_batch(TEXTS) == [e.ids for e in direct.encode_batch(TEXTS, add_special_tokens=False)]
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_hf_unreadable_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the tokenizer file .*missing.json"):
        HFTokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a Hugging Face tokenizers JSON file"):
        HFTokenizer(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("name", ["r50k_base", "gpt2"])
def test_tiktoken_from_a_ranks_file_equals_tiktoken(tmp_path: Path, name: str) -> None:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    path = tiktoken_ranks_file(tmp_path / "r.tiktoken")
    tok = build_tokenizer(TokenizerSpec(type="tiktoken", name=name, path=path.as_uri()))
    direct = tiktoken.Encoding(
        name="direct",
        pat_str=r50k_pat_str,
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens={"<|endoftext|>": 50256},
    )
    assert isinstance(tok, TiktokenTokenizer) and tok.eod == 50256 and tok.vocab_size == 50257
    assert tok.encode_batch(TEXTS) == [direct.encode_ordinary(t) for t in TEXTS]
    assert tok.encode("hello world") == [259, 263]  # the merges were used
    assert tok.eod not in tok.encode(TEXTS[3])  # special-token text in a document is plain text
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]


def test_tiktoken_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'nope'; known: .*cl100k_base"):
        build_tokenizer(TokenizerSpec(type="tiktoken", name="nope"))
    with pytest.raises(ValueError, match="unknown tiktoken encoding 'nope'"):
        build_tokenizer(
            TokenizerSpec(type="tiktoken", name="nope", path=str(tiktoken_ranks_file(tmp_path / "r")))
        )
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(ValueError, match="bad.tiktoken is not a tiktoken ranks file"):
        build_tokenizer(TokenizerSpec(type="tiktoken", name="gpt2", path=str(tmp_path / "bad.tiktoken")))


def _train_sentencepiece(path: Path) -> Path:
    import numpy as np
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "hello", "world", "train", "model", "世界"]
    texts = [" ".join(rng.choice(words, size=12)) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, vocab_size=60, model_type="bpe", minloglevel=2
    )
    path.write_bytes(model.getvalue())
    return path


def test_sentencepiece_equals_sentencepiece(tmp_path: Path) -> None:
    import sentencepiece as spm

    path = _train_sentencepiece(tmp_path / "sp.model")
    tok = build_tokenizer(TokenizerSpec.model_validate(f"sentencepiece:{path.as_uri()}"))
    direct = spm.SentencePieceProcessor(model_file=str(path))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.eod) == (direct.get_piece_size(), direct.eos_id()) == (60, 2)
    assert tok.encode_batch(TEXTS) == [direct.encode(t) for t in TEXTS]
    assert tok.encode(TEXTS[0]) == direct.encode(TEXTS[0])
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_sentencepiece_from_s3(tmp_path: Path, s3_bucket_url: str) -> None:
    from megatrain.storage import open_store

    path = _train_sentencepiece(tmp_path / "sp.model")
    open_store(s3_bucket_url).put_file("tok/sp.model", path)
    tok = build_tokenizer(TokenizerSpec(type="sentencepiece", path=f"{s3_bucket_url}/tok/sp.model"))
    assert tok.encode_batch(TEXTS) == SentencePieceTokenizer(str(path)).encode_batch(TEXTS)


def test_sentencepiece_refusals(tmp_path: Path) -> None:
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="bad.model is not a SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "bad.model"))
    with pytest.raises(ValueError, match="cannot read the SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "missing.model"))
