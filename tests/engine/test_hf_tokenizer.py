"""An export's tokenizer files for every tokenizer kind we train with, proven with transformers' own
AutoTokenizer: it encodes text (unicode, whitespace, digits) to the ids our tokenizer gives, knows
the end-of-document id, and carries the chat template; a kind that cannot be expressed is refused
with one line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from megatrain.engine.data.tokenizers import build_tokenizer
from megatrain.engine.interop.hf_tokenizer import PROBES, export_tokenizer
from megatrain.spec import TokenizerSpec

from .helpers import tiktoken_ranks_file

transformers = pytest.importorskip("transformers")

TEXTS = (
    *PROBES,
    "x   y",
    "a<sep>b foo",
    "",
    "\n",
    "ÅΩ≈ç√∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "model alpha 世界 beta naïve café world",
)


def _sentencepiece(path: Path, model_type: str, vocab_size: int, **options: object) -> Path:
    import numpy as np
    import sentencepiece as spm

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "hello", "world", "train", "model", "世界", "naïve", "café"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(" ".join(rng.choice(words, size=12)) for _ in range(300)),
        model_writer=model, vocab_size=vocab_size, model_type=model_type, minloglevel=2, **options,
    )  # fmt: skip
    path.write_bytes(model.getvalue())
    return path


def _spec(kind: str, tmp: Path) -> TokenizerSpec:
    from fixtures.checkpoints import write_bpe_tokenizer

    if kind == "byte":
        return TokenizerSpec(type="byte")
    if kind == "hf":
        return TokenizerSpec(type="hf", path=str(write_bpe_tokenizer(tmp / "bpe.json")))
    if kind.startswith("sentencepiece"):
        shapes = {"bpe": ("bpe", 60, {}), "bytes": ("bpe", 320, {"byte_fallback": True}),
                  "unigram": ("unigram", 38, {"user_defined_symbols": ["<sep>", "foo"]})}  # fmt: skip
        model_type, size, options = shapes[kind.split("-")[1]]
        return TokenizerSpec(
            type="sentencepiece", path=str(_sentencepiece(tmp / "sp.model", model_type, size, **options))
        )
    return TokenizerSpec(
        type="tiktoken", name=kind.split("-")[1], path=str(tiktoken_ranks_file(tmp / "r.tiktoken"))
    )


KINDS = ["byte", "hf", "sentencepiece-bpe", "sentencepiece-unigram", "sentencepiece-bytes",
         "tiktoken-gpt2", "tiktoken-cl100k_base"]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_autotokenizer_encodes_as_ours(kind: str, tmp_path: Path) -> None:
    spec = _spec(kind, tmp_path)
    out = export_tokenizer(spec, chat_template="{{ messages[0]['content'] }}", model_max_length=64)
    folder = tmp_path / "export"
    folder.mkdir()
    for name, content in out.files.items():
        (folder / name).write_bytes(content)
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(out.files)
    assert ("tokenizer.model" in out.files) == kind.startswith("sentencepiece")

    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ours = build_tokenizer(spec)
    texts = TEXTS if kind != "sentencepiece-unigram" else [t for t in TEXTS if "</s>" not in t]
    for text in texts:
        assert theirs.encode(text) == ours.encode(text), text
    assert theirs.eos_token_id == out.special_ids["eos_token_id"] == ours.eod
    assert theirs.pad_token_id == out.special_ids["pad_token_id"]
    assert theirs.model_max_length == 64
    assert theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
    if kind not in ("hf", "sentencepiece-unigram"):  # special-token text in a document is text,
        assert ours.eod not in theirs.encode("a <|endoftext|> b </s>")  # as our encoders take it
    if kind in ("byte", "tiktoken-gpt2", "sentencepiece-bytes"):  # every text round-trips
        for text in TEXTS:
            assert theirs.decode(theirs.encode(text)) == ours.decode(ours.encode(text)), text


def test_a_kind_that_cannot_be_expressed_is_refused(tmp_path: Path) -> None:
    path = _sentencepiece(tmp_path / "char.model", "char", 30)
    with pytest.raises(
        ValueError, match=r"cannot be written as a Hugging Face tokenizer: its model type is char"
    ):
        export_tokenizer(TokenizerSpec(type="sentencepiece", path=str(path)))
