"""A Hugging Face byte-level BPE tokenizer as an equivalent tiktoken encoding, where it is one.

tiktoken's BPE core is 2.5-4x faster than `tokenizers` on the same vocabulary (measured:
BENCHMARKS.md, "Data preprocessing"): it builds no `Encoding` object, offsets or alignment per
document. The two agree token for token when the HF file is plain byte-level BPE, which is what
GPT-2, Llama 3, Qwen and most trained BPE files are:

- no normalizer, and a pre-tokenizer tiktoken can replay: `ByteLevel` with its GPT-2 regex, or a
  `Split` by one regex (isolated, not inverted) followed by `ByteLevel` without its regex;
- a BPE model without dropout, word prefixes or suffixes, or byte fallback, holding all 256 bytes;
- merges whose outputs are distinct, cover every multi-byte token, and have ids increasing with the
  merge's priority (tiktoken merges by the id of the merged token, HF by the merge's rank);
- every token's own bytes encode to that token (tiktoken looks a whole word up before merging);
- added tokens that match only themselves (no strip or word rules) and are none of them a prefix of
  another (HF matches them leftmost-longest, tiktoken leftmost-first).

`fast_encoding` checks all of it and returns None when anything differs, so a file outside these
rules keeps the `tokenizers` path. The checks cost about a second for a 128k vocabulary, once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

# The regex `tokenizers`' ByteLevel pre-tokenizer splits by when `use_regex` is set (GPT-2's).
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# A probe of what tends to differ between regex engines: scripts, digits, whitespace runs,
# contractions, newlines; checked against the HF tokenizer once the encoding is built.
_PROBE = (
    "Hello, world! It's 2026: the model's loss fell 3.14159 -> 2.71828.\n\n  Indented\tline\r\n"
    "über café naïve 東京 データ модель обучение عربى   spaces    end \u00a0nbsp \U0001f600 emoji\n"
    "CamelCase snake_case kebab-case x=1;y+=22; IT'S SHOUTING'LL'VE'D 1234567 ...!!! \n\n"
)


@dataclass(frozen=True)
class FastEncoding:
    """A tiktoken `Encoding` equal to an HF tokenizer, and whether texts may hold its added tokens."""

    encoding: Any  # tiktoken.Encoding
    match_added: bool
    """Encode added-token text as the added token (HF does unless it splits special tokens)."""

    def encode(self, text: str) -> list[int]:
        if self.match_added:
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call per text: tiktoken's own batch call starts a thread pool per call, and the
        # callers here are already one thread per core (each call releases the GIL).
        return [self.encode(t) for t in texts]


@cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in the vocabulary."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(rest)}


def _split_pattern(pre: dict[str, Any] | None) -> str | None:
    """The regex tiktoken must split by to replay this pre-tokenizer, or None if it can't."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        ok = pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
        return BYTE_LEVEL_PATTERN if ok else None
    if pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return None
    split, byte_level = pre["pretokenizers"]
    if (
        split.get("type") != "Split"
        or "Regex" not in (split.get("pattern") or {})
        or split.get("behavior") != "Isolated"
        or split.get("invert", False)
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex", True)
        or byte_level.get("add_prefix_space", False)
    ):
        return None
    return str(split["pattern"]["Regex"])


def _merges(model: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]  # type: ignore[misc]


def _ranks(model: dict[str, Any], added: set[str]) -> dict[bytes, int] | None:
    """tiktoken's mergeable ranks for this BPE model, or None where merge order and ids disagree."""
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    vocab: dict[str, int] = {t: i for t, i in model.get("vocab", {}).items() if t not in added}
    chars = _byte_of_char()
    try:
        ranks = {bytes(chars[c] for c in token): tid for token, tid in vocab.items()}
    except KeyError:
        return None  # a token outside the byte-level alphabet
    if len(ranks) != len(vocab) or sum(len(b) == 1 for b in ranks) != 256:
        return None
    outputs: set[str] = set()
    last = -1
    for a, b in _merges(model):
        tid = vocab.get(a + b)
        if tid is None or a not in vocab or b not in vocab or tid <= last or a + b in outputs:
            return None
        outputs.add(a + b)
        last = tid
    if any(len(t) > 1 and t not in outputs for t in vocab):
        return None  # a multi-byte token no merge makes: tiktoken could still make it
    return ranks


def _added_ok(added: list[dict[str, Any]]) -> bool:
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return False
    contents = sorted(t["content"] for t in added)
    return not any(b.startswith(a) for a, b in zip(contents, contents[1:], strict=False))


def _each_token_is_itself(model: Any, ranks: dict[bytes, int]) -> bool:
    """tiktoken looks a whole word up before merging: HF's merges must make each token from its bytes."""
    chars = {b: c for c, b in _byte_of_char().items()}
    for token_bytes, tid in ranks.items():
        if len(token_bytes) > 1:
            pieces = model.tokenize("".join(chars[b] for b in token_bytes))
            if len(pieces) != 1 or pieces[0].id != tid:
                return False
    return True


def fast_encoding(tokenizer_json: str, split_special_tokens: bool = False) -> FastEncoding | None:
    """The tiktoken twin of an HF tokenizers JSON, or None when it would not encode identically."""
    import tiktoken
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer_json)
    added = spec.get("added_tokens") or []
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    if spec.get("normalizer") is not None or pattern is None or not _added_ok(added):
        return None
    ranks = _ranks(spec.get("model") or {}, {t["content"] for t in added})
    if ranks is None:
        return None
    matched = {t["content"]: t["id"] for t in added if not (split_special_tokens and t.get("special"))}
    try:
        enc = tiktoken.Encoding(
            "hf-byte-level-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=matched
        )
    except ValueError:
        return None  # a regex tiktoken's engine does not take
    fast = FastEncoding(enc, match_added=bool(matched))
    hf = Tokenizer.from_str(tokenizer_json)
    hf.encode_special_tokens = split_special_tokens
    if not _each_token_is_itself(hf.model, ranks):
        return None
    probe = _PROBE + "".join(t["content"] + " x" for t in added)
    if fast.encode(probe) != hf.encode(probe, add_special_tokens=False).ids:
        return None
    return fast
