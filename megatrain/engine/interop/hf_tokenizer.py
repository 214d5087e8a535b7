"""The job's tokenizer as files transformers loads: `AutoTokenizer.from_pretrained(export)` encodes
text to the ids the model was trained on, for every tokenizer kind we train with.

- `hf`: the job's tokenizer.json as it is.
- `byte`: a byte-level BPE without merges (id = the byte, 256 = <|endoftext|>).
- `sentencepiece`: the .model's pieces, model (BPE or Unigram) and normalizer (its precompiled
  character map, whitespace handling, dummy prefix) as a tokenizers pipeline; the .model rides along
  as tokenizer.model for sentencepiece users.
- `tiktoken`: a byte-level BPE of the encoding's ranks, split by its pattern, with whole pieces
  taken as they are (tiktoken's shortcut; tokenizers' `ignore_merges`).

Every tokenizer.json is built with the `tokenizers` library (no transformers needed on a worker),
then checked against our own tokenizer on PROBES: one that encodes any of them differently is a
ValueError naming the text, so an export never carries a tokenizer that silently disagrees.
byte, sentencepiece and tiktoken encode special-token text in a document as plain text (as our
encoders do), which tokenizer_config.json's `split_special_tokens` tells transformers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from megatrain.engine.data.tokenizers import (
    TIKTOKEN_EOD,
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    build_tokenizer,
    describe,
)
from megatrain.engine.interop import spm_proto
from megatrain.spec import TokenizerSpec

PROBES = (
    "Hello, world! def add(a, b):\n    return a + b\n",
    "  leading,   inner  and trailing spaces  \n\n\ttabs\tand\r\nnew lines ",
    "héllo wörld, naïve café — “quotes” 世界 こんにちは 🙂👍🏽 ﬁ",
    "numbers 12345 3.14159 1,000,000 and CamelCaseWords don't won't",
    SPECIAL_TEXT := "<|endoftext|> </s> <s> <unk> as plain text",
)
"""Texts every exported tokenizer must encode exactly as ours does (unicode, whitespace, digits,
special-token text)."""
BYTE_EOS = "<|endoftext|>"


@dataclass
class TokenizerExport:
    """What an export carries for its tokenizer."""

    files: dict[str, bytes]
    """tokenizer.json (+ tokenizer.model), tokenizer_config.json, special_tokens_map.json."""
    special_ids: dict[str, int] = field(default_factory=dict)
    """bos_token_id / eos_token_id / pad_token_id for config.json and generation_config.json."""


def export_tokenizer(
    spec: TokenizerSpec, *, chat_template: str | None = None, model_max_length: int | None = None
) -> TokenizerExport:
    """The files for the tokenizer `spec` names; ValueError (one line) if it cannot be built here
    or cannot be written so that transformers encodes as we do."""
    ours = build_tokenizer(spec)
    what = describe(spec)
    extra: dict[str, bytes] = {}
    split_special = True  # our byte / sentencepiece / tiktoken encoders treat special text as text
    probes = PROBES
    if isinstance(ours, ByteTokenizer):
        tok, tokens = _byte_tokenizer(), {"eos_token": BYTE_EOS}
    elif isinstance(ours, SentencePieceTokenizer):
        tok, unigram = _spm_tokenizer(ours.model_proto, what)
        if unigram:  # tokenizers' Unigram lattice holds the control pieces SentencePiece's leaves out
            probes = tuple(p for p in PROBES if p not in SPECIAL_TEXT)
        extra["tokenizer.model"] = ours.model_proto
        tokens = ours.special_pieces()
    elif isinstance(ours, TiktokenTokenizer):
        tok, tokens = _tiktoken_tokenizer(ours, what), {"eos_token": TIKTOKEN_EOD}
    elif isinstance(ours, HFTokenizer):
        from tokenizers import Tokenizer as RustTokenizer

        tok, tokens = RustTokenizer.from_str(ours.json), {"eos_token": ours.id_to_token(ours.eod)}
        split_special = False  # the Rust encoder matches added tokens in text, for training too
    else:  # pragma: no cover - build_tokenizer returns one of the above
        raise TypeError(type(ours).__name__)
    tok.encode_special_tokens = split_special
    _check_same(tok, ours, probes, what)
    tokens.setdefault("pad_token", tokens["eos_token"])  # batched generate() needs a pad id
    ids = {f"{k}_id": _token_id(tok, v, what) for k, v in tokens.items() if k != "unk_token"}
    if ids["eos_token_id"] != ours.eod:
        raise ValueError(
            f"the {what} tokenizer's {tokens['eos_token']!r} is id {ids['eos_token_id']} in the Hugging Face "
            f"tokenizer, {ours.eod} in ours"
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokens,
        "split_special_tokens": split_special,
        "add_bos_token": False,  # our datasets put no BOS before a document
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if chat_template is not None:
        config["chat_template"] = chat_template
    tokenizer_json = ours.json.encode() if isinstance(ours, HFTokenizer) else tok.to_str().encode()
    files = {
        "tokenizer.json": tokenizer_json,
        **extra,
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(tokens),
    }
    return TokenizerExport(files, ids)


def _json(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()


def _token_id(tok: Any, token: str, what: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(f"the {what} tokenizer has no id for its special token {token!r}")
    return int(tid)


def _check_same(tok: Any, ours: Tokenizer, probes: tuple[str, ...], what: str) -> None:
    for text in probes:
        theirs, want = tok.encode(text, add_special_tokens=False).ids, ours.encode(text)
        if theirs != want:
            at = next((i for i, (a, b) in enumerate(zip(theirs, want, strict=False)) if a != b), len(want))
            raise ValueError(
                f"the {what} tokenizer cannot be written as a Hugging Face tokenizer that encodes as "
                f"ours: {text!r} gives {theirs[at : at + 4]} at token {at}, ours {want[at : at + 4]}"
            )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    spans = (("!", "~"), ("¡", "¬"), ("®", "ÿ"))
    out = {b: chr(b) for lo, hi in spans for b in range(ord(lo), ord(hi) + 1)}
    for n, b in enumerate(b for b in range(256) if b not in out):
        out[b] = chr(256 + n)
    return out


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]], split: str | None) -> Any:
    """A byte-level BPE (GPT-2's alphabet), its pre-tokens split by the regex `split` if given."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if split is None:
        tok.pre_tokenizer = byte_level
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _byte_tokenizer() -> Any:
    from tokenizers import AddedToken

    alphabet = _bytes_to_unicode()
    tok = _byte_level({alphabet[b]: b for b in range(256)}, [], None)  # id = the byte: no merges
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True, normalized=False)])
    return tok


def _cannot(what: str, why: object) -> ValueError:
    return ValueError(f"the {what} tokenizer cannot be written as a Hugging Face tokenizer: {why}")


def _tiktoken_tokenizer(ours: TiktokenTokenizer, what: str) -> Any:
    """tiktoken's ranks as a byte-level BPE: each token of rank r is merged from every split into
    two tokens of lower rank, in rank order (tiktoken merges the lowest-ranked pair first)."""
    from tokenizers import AddedToken

    ranks, pattern, specials = ours.bpe_parts()
    alphabet = _bytes_to_unicode()
    vocab = {"".join(alphabet[b] for b in token): rank for token, rank in ranks.items()}
    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        for i in range(1, len(token)):
            left, right = ranks.get(token[:i]), ranks.get(token[i:])
            if left is not None and right is not None and left < rank and right < rank:
                merges.append(
                    ("".join(alphabet[b] for b in token[:i]), "".join(alphabet[b] for b in token[i:]))
                )
    # Special tokens keep their tiktoken ids: tokenizers numbers an added token past the vocabulary
    # unless the vocabulary holds it, so they (and placeholders for unused ids) go in the vocabulary.
    vocab.update(specials)
    taken = set(vocab.values())
    vocab.update({f"<|unused_{i}|>": i for i in range(max(taken) + 1) if i not in taken})
    try:
        tok = _byte_level(vocab, merges, pattern)
    except Exception as exc:  # noqa: BLE001 - the Rust side raises a bare Exception (e.g. its regex)
        raise _cannot(what, exc) from None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def _spm_tokenizer(raw: bytes, what: str) -> tuple[Any, bool]:
    """A SentencePiece model as a tokenizers pipeline that encodes as SentencePieceProcessor does,
    and whether it is a Unigram model."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    try:
        m = spm_proto.parse_spm_model(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the {what} model cannot be read: {exc}") from None
    why = {spm_proto.WORD: "its model type is word", spm_proto.CHAR: "its model type is char"}
    why = why.get(m.model_type)
    if m.treat_whitespace_as_suffix:
        why = "it treats whitespace as a suffix"
    if why:
        raise _cannot(what, why)
    unk = m.pieces[m.unk_id].piece
    user = [p.piece for p in m.pieces if p.type == spm_proto.USER_DEFINED]
    if m.model_type == spm_proto.UNIGRAM:
        model = models.Unigram([(p.piece, p.score) for p in m.pieces], m.unk_id, m.byte_fallback)
    else:
        # SentencePiece's BPE merges the adjacent pair whose union is the highest-scored piece.
        normal = {p.piece: (-p.score, i) for i, p in enumerate(m.pieces) if p.type == spm_proto.NORMAL}
        ranked = sorted(
            (rank, piece[:i], piece[i:])
            for piece, rank in normal.items()
            for i in range(1, len(piece))
            if piece[:i] in normal and piece[i:] in normal
        )
        vocab = {p.piece: i for i, p in enumerate(m.pieces)}
        model = models.BPE(
            vocab, [(a, b) for _, a, b in ranked], unk_token=unk, fuse_unk=True,
            byte_fallback=m.byte_fallback, ignore_merges=bool(user),
        )  # fmt: skip
    tok = Tokenizer(model)
    steps: list[Any] = []
    if m.precompiled_charsmap:
        steps.append(normalizers.Precompiled(m.precompiled_charsmap))
    if m.remove_extra_whitespaces:  # spaces only, after the character map (as SentencePiece does)
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if m.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if m.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁" if m.escape_whitespaces else " "))  # not on empty text
    tok.normalizer = normalizers.Sequence(steps)
    if user:  # emitted whole, never merged into or across
        pattern = "|".join(re.escape(p) for p in sorted(user, key=len, reverse=True))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    parts: list[Any] = [decoders.Replace("▁", " ")]
    if m.byte_fallback:
        parts.append(decoders.ByteFallback())
    parts.append(decoders.Fuse())
    if m.add_dummy_prefix:
        parts.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(parts)
    controls = [p.piece for p in m.pieces if p.type in (spm_proto.CONTROL, spm_proto.UNKNOWN)]
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in controls])
    return tok, m.model_type == spm_proto.UNIGRAM
