"""Tokenizers: `byte`, `hf` (a tokenizers JSON file), `tiktoken` (an encoding by name) and
`sentencepiece` (a .model file), built from a TokenizerSpec.

Each encodes one text (`encode`) or many at once (`encode_batch`, through the library's own batch
encoder where it has one), and names its vocabulary size and end-of-document id. An `hf` file that
is plain byte-level BPE encodes through its tiktoken twin (bpe_fast.py): token for token the same,
2.5-4x faster. Special-token text inside a document is encoded as plain text by tiktoken (tiktoken
would otherwise refuse it); the other libraries follow their own rules.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol
from unittest import mock

from megatrain.engine.data.bpe_fast import FastEncoding, fast_encoding
from megatrain.spec import TokenizerSpec
from megatrain.storage import StorageError, read_url

# Tried in order when an HF tokenizer has to name its end-of-document token.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
TIKTOKEN_EOD = "<|endoftext|>"


class Tokenizer(Protocol):
    vocab_size: int
    """Token ids are in [0, vocab_size); the model pads its embedding beyond this."""
    eod: int
    """End-of-document id, placed between documents in the token stream."""

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...


def _read(url: str, what: str) -> bytes:
    try:
        with read_url(url) as f:
            return f.read()
    except (StorageError, OSError) as exc:
        raise ValueError(f"cannot read the {what} {url}: {exc}") from None


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-document 256: vocab 257, no training, no files."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file, by local path, file:// or s3:// URL. `eos_token` names
    the end-of-document token (else the first of EOD_CANDIDATES it has); `split_special_tokens`
    encodes special-token text as text (as a tokenizer_config.json of that setting asks).
    `twin=False` keeps every encode on `tokenizers` (baselines), not its tiktoken twin."""

    def __init__(
        self, path: str, eos_token: str | None = None, split_special_tokens: bool = False, twin: bool = True
    ):
        from tokenizers import Tokenizer as _HFTokenizer

        raw = _read(path, "tokenizer file")
        try:
            self.json = raw.decode("utf-8")
            """The tokenizers JSON as read (an export carries it unchanged)."""
            self._tok = _HFTokenizer.from_str(self.json)
        except Exception as exc:  # noqa: BLE001 - the Rust side raises a bare Exception
            raise ValueError(f"{path} is not a Hugging Face tokenizers JSON file: {exc}") from None
        self._tok.encode_special_tokens = split_special_tokens
        self._split_special_tokens = split_special_tokens
        self._fast_lock = threading.Lock()
        self._fast_built = not twin
        self._fast: FastEncoding | None = None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._find_eod(eos_token)

    def _find_eod(self, eos_token: str | None) -> int:
        for name in (eos_token,) if eos_token else EOD_CANDIDATES:
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

    def fast(self) -> FastEncoding | None:
        """The tiktoken twin that encodes exactly as this file does (bpe_fast.py), if it has one."""
        with self._fast_lock:  # preprocessing threads share one tokenizer; build it once
            if not self._fast_built:
                self._fast = fast_encoding(self.json, self._split_special_tokens)
                self._fast_built = True
        return self._fast

    def encode(self, text: str) -> list[int]:
        if (fast := self.fast()) is not None:
            return fast.encode(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if (fast := self.fast()) is not None:
            return fast.encode_batch(texts)
        # The Rust batch encoder; the fast variant (tokenizers >= 0.21) skips computing offsets.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def id_to_token(self, tid: int) -> str:
        return str(self._tok.id_to_token(tid))


# tiktoken's named encodings load their ranks inside their constructors; swapping the loaders for
# the duration of one call is the only way to reuse a name's pattern and special tokens with ranks
# from a file. The lock keeps two threads from swapping at once.
_TIKTOKEN_LOCK = threading.Lock()


def _tiktoken_params(name: str, ranks: dict[bytes, int]) -> dict[str, Any]:
    import tiktoken
    import tiktoken.registry

    with _TIKTOKEN_LOCK:
        tiktoken.list_encoding_names()  # fills the registry's table of constructors
        constructor = (tiktoken.registry.ENCODING_CONSTRUCTORS or {}).get(name)
        if constructor is None:
            raise ValueError(_unknown_tiktoken(name))
        patched = {
            k: (lambda *a, **kw: ranks)
            for k in ("load_tiktoken_bpe", "data_gym_to_mergeable_bpe_ranks")
            if k in constructor.__globals__
        }
        with mock.patch.dict(constructor.__globals__, patched):
            params = dict(constructor())
    params["mergeable_ranks"] = ranks
    params.pop("explicit_n_vocab", None)  # a ranks file of another size is still a valid encoding
    return params


def _unknown_tiktoken(name: str) -> str:
    import tiktoken

    return f"unknown tiktoken encoding {name!r}; known: {', '.join(sorted(tiktoken.list_encoding_names()))}"


class TiktokenTokenizer:
    """A tiktoken encoding by name; ranks from `path` (a .tiktoken file) when given, else from
    tiktoken's cache (TIKTOKEN_CACHE_DIR) or its download. `<|endoftext|>` ends a document."""

    def __init__(self, name: str, path: str | None = None):
        import tiktoken

        if path is not None:
            from tiktoken.load import load_tiktoken_bpe

            raw = _read(path, "tiktoken ranks file")
            ranks = _parse_ranks(raw, path, load_tiktoken_bpe)
            self._enc = tiktoken.Encoding(**_tiktoken_params(name, ranks))
        else:
            if name not in tiktoken.list_encoding_names():
                raise ValueError(_unknown_tiktoken(name))
            try:
                self._enc = tiktoken.get_encoding(name)
            except Exception as exc:  # noqa: BLE001 - requests/hash errors: one message either way
                raise ValueError(
                    f"tiktoken could not load the ranks of {name!r} ({type(exc).__name__}: {exc}); "
                    "offline, pass its .tiktoken file as the tokenizer's path or set TIKTOKEN_CACHE_DIR"
                ) from None
        if TIKTOKEN_EOD not in self._enc.special_tokens_set:
            raise ValueError(f"tiktoken encoding {name!r} has no {TIKTOKEN_EOD} token to end documents")
        self.eod = self._enc.encode_single_token(TIKTOKEN_EOD)
        self.vocab_size = self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def bpe_parts(self) -> tuple[dict[bytes, int], str, dict[str, int]]:
        """(mergeable ranks, split pattern, special tokens): the encoding, for an export to rebuild."""
        enc = self._enc
        return dict(enc._mergeable_ranks), str(enc._pat_str), dict(enc._special_tokens)


def _parse_ranks(raw: bytes, url: str, load: Any) -> dict[bytes, int]:
    # tiktoken's own parser reads a local path; hand it the bytes read from any URL through a
    # temporary file, with its cache disabled so nothing is copied elsewhere.
    import os
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".tiktoken") as f:
        f.write(raw)
        f.flush()
        with mock.patch.dict(os.environ, {"TIKTOKEN_CACHE_DIR": ""}):
            try:
                ranks: dict[bytes, int] = load(f.name)
            except ValueError as exc:
                raise ValueError(f"{url} is not a tiktoken ranks file: {exc}") from None
    if not ranks:
        raise ValueError(f"{url} is not a tiktoken ranks file: no ranks in it")
    return ranks


class SentencePieceTokenizer:
    """A SentencePiece `.model` file by local path, file:// or s3:// URL; its eos ends a document."""

    def __init__(self, path: str):
        import sentencepiece as spm

        raw = _read(path, "SentencePiece model")
        self.model_proto = raw
        """The .model file's bytes (a serialized ModelProto)."""
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(raw)
        except Exception as exc:  # noqa: BLE001 - a RuntimeError or OSError from the C++ side
            raise ValueError(f"{path} is not a SentencePiece model: {exc}") from None
        self.vocab_size = int(self._sp.get_piece_size())
        self.eod = int(self._sp.eos_id())
        if self.eod < 0:
            raise ValueError(f"{path}: the SentencePiece model has no eos piece to end documents")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)

    def special_pieces(self) -> dict[str, str]:
        """{"bos_token": piece, "eos_token": ..., "unk_token": ..., "pad_token": ...}, those the model has."""
        sp = self._sp
        ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id(),
               "pad_token": sp.pad_id()}  # fmt: skip
        return {name: str(sp.id_to_piece(i)) for name, i in ids.items() if i >= 0}


def describe(spec: TokenizerSpec) -> str:
    """The tokenizer in the CLI's shorthand: `byte`, `hf:PATH`, `tiktoken:NAME`, `sentencepiece:PATH`."""
    if spec.type == "byte":
        return "byte"
    if spec.type == "tiktoken":
        return f"tiktoken:{spec.name}" + (f" ({spec.path})" if spec.path else "")
    return f"{spec.type}:{spec.path}"


def build_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer a spec names; a file that is missing or of the wrong kind is a ValueError."""
    if spec.type == "byte":
        return ByteTokenizer()
    if spec.type == "tiktoken":
        assert spec.name is not None  # the spec's validator guarantees it
        return TiktokenTokenizer(spec.name, spec.path)
    assert spec.path is not None  # the spec's validator guarantees it
    if spec.type == "sentencepiece":
        return SentencePieceTokenizer(spec.path)
    return HFTokenizer(spec.path)
