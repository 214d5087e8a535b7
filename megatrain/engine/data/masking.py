"""What Megatron-Core's masked word-piece datasets (BERT and T5) share: samples of whole sentences,
their masking, and the tokenizer they need.

Both read a sentence-split indexed dataset (preprocess.py's `split_sentences`: one sequence per
sentence, documents in the document index) and, for the same .bin/.idx, seed and settings, give
every sample exactly as megatron-core 0.16's MaskedWordPieceDataset subclasses do
(tests/engine/test_bert_t5_data.py runs both). Reproduced from reading Megatron's algorithm:

- The sample mapping (its C++ `build_mapping`): epoch after epoch, each document of the split with
  at least `min_sentences` sentences (and, when it has more than one, none over 512 tokens) is cut
  into runs of sentences: a run ends at the first sentence where it reaches a target length, holds
  `min_sentences` and leaves at least two sentences, or at the document's end. The target is the
  model's length less its special tokens, or with probability 1/round(1/short_seq_prob) a length
  uniform in [2, max]. Rows (first sentence, end sentence, target) are then shuffled. Megatron draws
  targets from C++'s std::mt19937(seed), which numpy's MT19937 equals output for output, and
  shuffles with std::mt19937_64(seed + 1), written out below.
- The masking (`_create_masked_lm_predictions`), per sample from numpy's RandomState(seed + index):
  candidates are words (a piece and the "##" continuations after it, the tokenizer's inv_vocab says
  which) with whole-word masking, else single pieces; n-grams of 1..max_ngram candidates, n drawn
  with P(n) ∝ 1/n (or SpanBERT's geometric p=0.2), are masked in a shuffled order until about
  `probability` of the tokens are. Each masked piece is replaced as the model family says (BERT:
  80% [MASK], 10% a random id, 10% kept; T5: [MASK], later cut out for a sentinel).
Megatron's permutation option is left out: it draws from numpy's global RNG, so no run repeats it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from megatrain.engine.data.indexed import IndexedDataset

LONG_SENTENCE = 512
"""A document of several sentences with one longer than this (tokens) gives no sample (Megatron's)."""
NO_PAD = -1
"""The pad id when the tokenizer has none, or one that collides with another special token."""


class WordPieceTokenizer(Protocol):
    """What BERT samples need of a tokenizer (Megatron's BERT tokenizer has these names)."""

    cls: int
    sep: int
    mask: int
    pad: int | None
    inv_vocab: Mapping[int, str]
    """id -> piece: "##" marks a word's continuation; the keys, in order, are the random replacements."""


class SentinelTokenizer(WordPieceTokenizer, Protocol):
    """What T5 samples need besides: decoder start and end, and the sentinels spans are replaced by."""

    bos: int
    eos: int
    additional_special_tokens_ids: Sequence[int]


DEFAULT_SPECIALS = {
    "cls": "[CLS]",
    "sep": "[SEP]",
    "mask": "[MASK]",
    "pad": "[PAD]",
    "bos": "[BOS]",
    "eos": "[EOS]",
}
"""The special pieces WordPieceVocab.from_vocab looks for (Megatron's BERT tokenizer's)."""


@dataclass(frozen=True)
class WordPieceVocab:
    """A WordPieceTokenizer (and SentinelTokenizer when bos, eos and sentinels exist) from a vocab."""

    inv_vocab: Mapping[int, str]
    cls: int
    sep: int
    mask: int
    pad: int | None
    bos: int | None = None
    eos: int | None = None
    additional_special_tokens_ids: tuple[int, ...] = ()

    @classmethod
    def from_vocab(
        cls,
        vocab: Mapping[str, int],
        *,
        tokens: Mapping[str, str] | None = None,
        sentinel_prefix: str = "<extra_id_",
    ) -> WordPieceVocab:
        """From piece -> id. `tokens` renames the specials (defaults: DEFAULT_SPECIALS);
        sentinels are `<extra_id_N>` by N."""
        names = dict(DEFAULT_SPECIALS) | dict(tokens or {})
        missing = [names[k] for k in ("cls", "sep", "mask") if names[k] not in vocab]
        if missing:
            raise ValueError(f"the vocabulary has no {', '.join(missing)}: not a BERT-style word-piece one")
        sentinel = re.compile(re.escape(sentinel_prefix) + r"(\d+)>")
        sentinels = sorted((int(m[1]), i) for piece, i in vocab.items() if (m := sentinel.fullmatch(piece)))
        return cls(
            inv_vocab={i: piece for piece, i in sorted(vocab.items(), key=lambda kv: kv[1])},
            cls=vocab[names["cls"]],
            sep=vocab[names["sep"]],
            mask=vocab[names["mask"]],
            pad=vocab.get(names["pad"]),
            bos=vocab.get(names["bos"]),
            eos=vocab.get(names["eos"]),
            additional_special_tokens_ids=tuple(i for _, i in sentinels),
        )

    @classmethod
    def from_hf(cls, tokenizer_json: str, **kwargs: Any) -> WordPieceVocab:
        """From a Hugging Face tokenizers JSON text (HFTokenizer.json), added tokens included."""
        from tokenizers import Tokenizer

        return cls.from_vocab(Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True), **kwargs)


def pad_id(tokenizer: WordPieceTokenizer) -> int:
    """The id samples are padded with: the tokenizer's pad, unless it has none or it equals another
    special id (Megatron then pads with -1, so that no real token is taken for padding)."""
    pad = getattr(tokenizer, "pad", None)
    others = [getattr(tokenizer, k, None) for k in ("cls", "sep", "mask", "bos", "eos")]
    others += list(getattr(tokenizer, "additional_special_tokens_ids", ()))
    return NO_PAD if pad is None or pad in others else int(pad)


@dataclass(frozen=True)
class MaskingConfig:
    """Megatron's MaskedWordPieceDatasetConfig, less the permutation it cannot repeat."""

    probability: float = 0.15
    """Share of a sample's tokens to mask (Megatron's --mask-prob)."""
    short_seq_prob: float = 0.1
    """Chance a sample aims at a shorter length (Megatron's --short-seq-prob)."""
    max_ngram: int = 3
    """Longest run of candidates (words with whole_word) masked together."""
    whole_word: bool = True
    """Mask a word's "##" continuations with it."""
    longer_ngrams: bool = False
    """P(n) ∝ 1/(max_ngram + 1 - n) instead of 1/n (ignored with geometric)."""
    geometric: bool = True
    """Draw n from a geometric distribution (p = 0.2, clipped at max_ngram), as SpanBERT does."""

    def __post_init__(self) -> None:
        if not 0 < self.probability < 1:
            raise ValueError(f"masking probability must be in (0, 1), not {self.probability}")
        if not 0 <= self.short_seq_prob <= 1:
            raise ValueError(f"short_seq_prob must be in [0, 1], not {self.short_seq_prob}")
        if self.max_ngram < 1:
            raise ValueError(f"max_ngram must be at least 1, not {self.max_ngram}")


BERT_MASKING = MaskingConfig(max_ngram=3)
"""Megatron-LM's pretrain_bert.py settings."""
T5_MASKING = MaskingConfig(max_ngram=10)
"""Megatron-LM's pretrain_t5.py settings."""


# --- Megatron's random streams -------------------------------------------------------------------


class Mt32:
    """std::mt19937(seed)'s outputs: numpy's MT19937 seeded the legacy way is the same generator."""

    def __init__(self, seed: int):
        self._gen = np.random.MT19937()
        key = np.random.RandomState(seed).get_state()[1]
        self._gen.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
        self._buf: list[int] = []
        self._at = 0

    def __call__(self) -> int:
        if self._at == len(self._buf):
            self._buf, self._at = self._gen.random_raw(4096).tolist(), 0
        self._at += 1
        return self._buf[self._at - 1]


class Mt64:
    """std::mt19937_64: numpy has no 64-bit Mersenne Twister, so here is one (whole-state twists)."""

    N, M = 312, 156
    _UPPER, _LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)
    _MATRIX = np.uint64(0xB5026F5AA96619E9)

    def __init__(self, seed: int):
        state, x = [], seed & (2**64 - 1)
        for i in range(self.N):
            state.append(x)
            x = (6364136223846793005 * (x ^ (x >> 62)) + i + 1) & (2**64 - 1)
        self._mt = np.array(state, dtype=np.uint64)

    def _mix(self, cur: np.ndarray, nxt: np.ndarray, far: np.ndarray) -> np.ndarray:
        y = (cur & self._UPPER) | (nxt & self._LOWER)
        return far ^ (y >> np.uint64(1)) ^ np.where(y & np.uint64(1), self._MATRIX, np.uint64(0))

    def _twist(self) -> None:
        # Word i takes words i+1 and i+M; those below i are already new. N = 2M, so the words fall in
        # three slices each computed from values the sequential loop would see.
        mt, n, m = self._mt, self.N, self.M
        mt[: n - m] = self._mix(mt[: n - m], mt[1 : n - m + 1], mt[m:n])
        mt[n - m : n - 1] = self._mix(mt[n - m : n - 1], mt[n - m + 1 : n], mt[: m - 1])
        mt[n - 1 :] = self._mix(mt[n - 1 :], mt[:1], mt[m - 1 : m])

    def draws(self, count: int) -> np.ndarray:
        """The next `count` outputs (uint64); a generator is used for one call."""
        blocks = []
        for _ in range(-(-count // self.N)):
            self._twist()
            y = self._mt.copy()
            y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
            y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
            y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
            y ^= y >> np.uint64(43)
            blocks.append(y)
        return np.concatenate(blocks)[:count] if blocks else np.zeros(0, np.uint64)


# --- the sample mapping --------------------------------------------------------------------------


def build_sample_mapping(
    doc_bounds: np.ndarray,
    sizes: np.ndarray,
    max_length: int,
    short_seq_prob: float,
    seed: int,
    min_sentences: int,
    num_samples: int | None = None,
) -> np.ndarray:
    """(samples, 3) rows of (first sentence, end sentence, target length), shuffled: Megatron's
    build_mapping for the documents whose sentences `doc_bounds` delimits. Whole epochs are built
    until there are `num_samples` rows (one epoch when None). uint32, or uint64 for over 2^32
    sentences, as Megatron returns it."""
    bounds = np.asarray(doc_bounds, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    # C's round() (half away from zero), not Python's banker's rounding: 1/0.4 gives 3, not 2.
    ratio = math.floor(1.0 / short_seq_prob + 0.5) if short_seq_prob > 0 else 0
    draw = Mt32(seed)

    def target() -> int:
        if ratio == 0:
            return max_length
        r = draw()
        return 2 + r % (max_length - 1) if r % ratio == 0 else max_length

    ends = np.concatenate(([0], np.cumsum(sizes)))  # ends[s]: tokens before sentence s
    firsts, lasts = bounds[:-1], bounds[1:]
    counts = lasts - firsts
    longs = np.concatenate(([0], np.cumsum(sizes > LONG_SENTENCE)))  # long sentences before s
    has_long = (longs[lasts] - longs[firsts] > 0) & (counts > 1)  # a lone sentence may be long
    usable = (counts >= min_sentences) & ~has_long
    docs = [(int(a), int(b)) for a, b in zip(firsts[usable], lasts[usable], strict=True)]
    rows = array("q")  # flat (first, end, target) triples: 24 bytes a sample, not a tuple's ~100
    while True:
        before = len(rows)
        for first, last in docs:
            start, goal = first, target()
            while start < last:
                # First sentence where the run reaches `goal` tokens, holds min_sentences and leaves
                # two or more behind; failing that, the document's last.
                end = int(np.searchsorted(ends, ends[start] + goal, side="left")) - 1
                end = max(end, start + min_sentences - 1)
                if end > last - 3:
                    end = last - 1
                rows.extend((start, end + 1, goal))
                start, goal = end + 1, target()
        if len(rows) == before:
            raise ValueError(
                f"no document of {min_sentences} sentence(s) or more (none over {LONG_SENTENCE} tokens)"
            )
        if num_samples is None or len(rows) >= 3 * num_samples:
            break
    dtype = np.uint64 if len(sizes) > np.iinfo(np.uint32).max else np.uint32
    mapping = np.frombuffer(rows, dtype=np.int64).astype(dtype).reshape(-1, 3)
    # Fisher-Yates from the back, each j = draw % (i + 1), as Megatron swaps its rows.
    count = len(mapping)
    steps = np.arange(count - 1, 0, -1, dtype=np.uint64)
    picks = (Mt64(seed + 1).draws(len(steps)) % (steps + np.uint64(1))).tolist()
    order = list(range(count))
    for i, j in zip(steps.tolist(), picks, strict=True):
        order[i], order[j] = order[j], order[i]
    return mapping[order]


def cached_array(
    cache_dir: Path, kind: str, description: dict[str, Any], build: Callable[[], np.ndarray]
) -> np.ndarray:
    """`build()` once per description: saved as `{md5}-{kind}-sample_index.npy` in `cache_dir` (one
    file lock per key, so one process of a node builds and the others map the file)."""
    text = json.dumps(description, sort_keys=True, indent=4, default=str)
    key = hashlib.md5(text.encode()).hexdigest()
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{key}-{kind}-sample_index.npy"
    with open(cache_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
            with open(tmp, "wb") as f:
                np.save(f, build())
            os.replace(tmp, path)  # complete files only under the final name
            (cache_dir / f"{key}-{kind}-description.txt").write_text(text)
    return np.load(path, mmap_mode="r")


# --- masking -------------------------------------------------------------------------------------


@dataclass
class Masked:
    """One sample's masking: the tokens with masked pieces replaced, and what was masked."""

    tokens: list[int]
    positions: list[int] = field(default_factory=list)
    """Masked positions, ascending."""
    labels: list[int] = field(default_factory=list)
    """The original piece at each masked position."""
    spans: list[tuple[list[int], list[int]]] = field(default_factory=list)
    """(positions, original pieces) of each masked n-gram, by first position."""


Replace = Callable[[np.random.RandomState, int], int]
"""How a masked piece is replaced: (the sample's RNG, the original id) -> the id in its place."""


class Masker:
    """Megatron's MLM masking over one tokenizer and config (the per-piece lookups built once)."""

    def __init__(self, tokenizer: WordPieceTokenizer, config: MaskingConfig, replace: Replace):
        self.config, self.replace = config, replace
        self.boundary = {int(tokenizer.cls), int(tokenizer.sep)}
        inv = tokenizer.inv_vocab
        self.continuation = np.zeros(max(inv) + 1, dtype=bool)
        for i, piece in inv.items():
            self.continuation[i] = piece.startswith("##")
        lengths = np.arange(config.max_ngram, dtype=np.int64) + 1
        self.ngram_sizes = lengths
        probs = 1.0 / lengths
        probs = probs / probs.sum(keepdims=True)
        self.ngram_probs = probs[::-1] if config.longer_ngrams else probs

    def candidates(self, tokens: list[int]) -> list[list[int]]:
        """Positions to mask together: words (whole-word) or pieces; [CLS] and [SEP] never."""
        out: list[list[int]] = []
        for i, t in enumerate(tokens):
            if t in self.boundary:
                continue
            if self.continuation[t] and self.config.whole_word and out:
                out[-1].append(i)  # Megatron's rule: even across a [SEP], to the word before it
            else:
                out.append([i])
        return out

    def __call__(self, tokens: list[int], target_length: int, rng: np.random.RandomState) -> Masked:
        cfg = self.config
        cands = self.candidates(tokens)
        budget = min(cfg.probability * target_length, max(1, int(round(len(tokens) * cfg.probability))))
        order = list(range(len(cands)))
        rng.shuffle(order)  # as Megatron shuffles its list of per-candidate n-grams: same draws
        p = self.ngram_probs / self.ngram_probs.sum(keepdims=True)
        out = Masked(list(tokens))
        taken: set[int] = set()
        for c in order:
            if len(out.positions) >= budget:
                break
            if cfg.geometric:
                n = min(int(rng.geometric(0.2)), cfg.max_ngram)
            else:
                n = int(rng.choice(self.ngram_sizes, p=p))
            # The longest n-gram from n down that still fits the budget; none: skip the candidate.
            while n > 0:
                span = [i for cand in cands[c : c + n] for i in cand]
                if budget >= len(out.positions) + len(span):
                    break
                n -= 1
            if n == 0 or any(i in taken for i in span):
                continue
            for i in span:
                taken.add(i)
                out.tokens[i] = self.replace(rng, tokens[i])
                out.positions.append(i)
                out.labels.append(tokens[i])
            out.spans.append((span, [tokens[i] for i in span]))
        by_position = sorted(zip(out.positions, out.labels, strict=True))
        out.positions = [i for i, _ in by_position]
        out.labels = [t for _, t in by_position]
        out.spans.sort(key=lambda s: s[0][0])
        return out


class MaskedSentenceDataset:
    """Samples of whole sentences of a document range, as Megatron's MaskedWordPieceDataset maps
    them; subclasses turn sample `index`'s sentences into the model's fields."""

    kind = "MaskedWordPieceDataset"

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: tuple[int, int],
        seq_length: int,
        num_samples: int | None,
        seed: int,
        cache_dir: Path,
        description: dict[str, Any],
        config: MaskingConfig,
        special_tokens: int,
        min_sentences: int,
    ):
        """`documents`: the split's [start, end) document ids; `special_tokens`: those each sample
        adds (BERT 3, T5 2), taken off seq_length for the sentences' target."""
        lo, hi = documents
        if not 0 <= lo < hi <= indexed.num_documents:
            raise ValueError(f"documents {lo}..{hi}: {indexed.idx_path} has {indexed.num_documents}")
        self.indexed, self.seq_length, self.seed, self.config = indexed, seq_length, seed, config
        max_length = seq_length - special_tokens
        desc = {
            "class": self.kind,
            **description,
            "documents": [lo, hi],
            "num_samples": num_samples,
            "random_seed": seed,
            "sequence_length": seq_length,
            "min_sentences": min_sentences,
            "masking": asdict(config),
        }
        bounds = indexed.document_indices[lo : hi + 1]
        sizes = indexed.sequence_lengths
        self.sample_index = cached_array(
            cache_dir,
            self.kind,
            desc,
            lambda: build_sample_mapping(
                bounds, sizes, max_length, config.short_seq_prob, seed, min_sentences, num_samples
            ),
        )

    def __len__(self) -> int:
        return len(self.sample_index)

    def sentences(self, index: int) -> tuple[list[list[int]], int, np.random.RandomState]:
        """Sample `index`'s sentences, its target length and its RNG (Megatron's: seed + index).
        An index past the end wraps around: a further pass over the same samples."""
        index %= len(self)
        first, end, target = (int(x) for x in self.sample_index[index])
        rng = np.random.RandomState((self.seed + index) % 2**32)
        return [self.indexed[i].tolist() for i in range(first, end)], target, rng

    def __getitem__(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def batch(self, sample_ids: Sequence[int]) -> dict[str, np.ndarray]:
        """The samples' fields stacked: arrays (B, T), scalars (B,)."""
        samples = [self[int(i)] for i in sample_ids]
        return {k: np.stack([np.asarray(s[k]) for s in samples]) for k in samples[0]}
