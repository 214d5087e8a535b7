"""Tokenizers: `byte` (256 byte values + end-of-document) and `hf` (a tokenizers JSON file)."""

from __future__ import annotations

from typing import Protocol

from megatrain.spec import TokenizerSpec
from megatrain.storage import read_url

# Tried in order when an HF tokenizer has to name its end-of-document token.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


class Tokenizer(Protocol):
    vocab_size: int
    """Token ids are in [0, vocab_size); the model pads its embedding beyond this."""
    eod: int
    """End-of-document id, placed between documents in the token stream."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-document 256: vocab 257, no training, no files."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file, by local path, file:// or s3:// URL."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HFTokenizer

        with read_url(path) as f:
            self._tok = _HFTokenizer.from_str(f.read().decode("utf-8"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod()

    def _find_eod(self) -> int:
        for name in EOD_CANDIDATES:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return int(tid)
        specials = sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        if specials:
            return int(specials[0])
        raise ValueError(
            "the tokenizer has no end-of-document token: add one of "
            f"{', '.join(EOD_CANDIDATES)} as a special token"
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec.type == "byte":
        return ByteTokenizer()
    assert spec.path is not None  # the spec's validator guarantees it
    return HFTokenizer(spec.path)
