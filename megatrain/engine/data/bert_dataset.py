"""Megatron-Core's BERTMaskedWordPieceDataset: masked-LM samples, with sentence-order pairs.

A sample is a run of whole sentences of one document (masking.py's mapping, aiming at seq_length - 3
tokens: [CLS] A [SEP] B [SEP]). With the binary head the run (two sentences or more) is cut at a
random sentence into A and B, and with probability 1/2 the two are swapped: `is_random` = 1 says so
(sentence-order prediction, as Megatron does it, not BERT's random next sentence). The longer half
loses a token at a random end until the pair fits the target. Then ~15% of the pieces are masked
(whole words, n-grams; masking.py): 80% become [MASK], 10% a random id of the vocabulary, 10% stay.

Fields, as Megatron returns them (int64 arrays of seq_length; ints for the flags):
  text          the masked tokens, padding as 0
  types         0 for [CLS] A [SEP], 1 for B [SEP], the pad id on padding (Megatron's choice)
  labels        the original piece at masked positions, else -1
  is_random     1 when A and B were swapped
  padding_mask  1 on tokens, the pad id (normally 0) on padding
  loss_mask     1 at masked positions
  truncated     1 when the pair lost tokens to fit
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.data.masking import (
    BERT_MASKING,
    MaskedSentenceDataset,
    Masker,
    MaskingConfig,
    Replace,
    WordPieceTokenizer,
    pad_id,
)

MASK_SHARE, KEEP_OF_REST = 0.8, 0.5
"""80% [MASK]; of the other 20%, half kept and half a random id."""


def bert_replace(mask: int, lookup: Sequence[int]) -> Replace:
    """BERT's 80/10/10 replacement; `lookup` the ids a random replacement is drawn from."""
    ids = list(lookup)

    def replace(rng: np.random.RandomState, original: int) -> int:
        if rng.random() < MASK_SHARE:
            return mask
        if rng.random() >= KEEP_OF_REST:
            return int(ids[rng.randint(0, len(ids))])
        return original

    return replace


class BERTDataset(MaskedSentenceDataset):
    """BERT samples of documents [start, end) of a sentence-split indexed dataset."""

    kind = "BERTMaskedWordPieceDataset"

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: tuple[int, int],
        seq_length: int,
        num_samples: int | None,
        seed: int,
        cache_dir: Path,
        description: dict[str, Any],
        tokenizer: WordPieceTokenizer,
        binary_head: bool = True,
        config: MaskingConfig = BERT_MASKING,
    ):
        """`num_samples`: at least this many (whole epochs of the mapping), None for one epoch;
        `description`: what else names the data in the cache key (path, split, tokenizer)."""
        self.tokenizer, self.binary_head = tokenizer, binary_head
        self.pad = pad_id(tokenizer)
        # The random replacement draws from the vocabulary's ids in inv_vocab's order (Megatron's).
        self.masker = Masker(tokenizer, config, bert_replace(tokenizer.mask, list(tokenizer.inv_vocab)))
        super().__init__(
            indexed,
            documents,
            seq_length,
            num_samples,
            seed,
            cache_dir,
            description | {"binary_head": binary_head},
            config,
            special_tokens=3,
            min_sentences=2 if binary_head else 1,
        )

    def __getitem__(self, index: int) -> dict[str, Any]:
        sentences, target, rng = self.sentences(index)
        pivot, swapped = len(sentences), False
        if self.binary_head:
            pivot = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
            swapped = bool(rng.random() < 0.5)
        a = [t for s in sentences[:pivot] for t in s]
        b = [t for s in sentences[pivot:] for t in s]
        if swapped:
            a, b = b, a
        # Trim the longer half (B on a tie) at a random end; [lo, hi) bounds what is left of each.
        bounds = [[0, len(a)], [0, len(b)]]
        truncated = len(a) + len(b) > target
        while (size_a := bounds[0][1] - bounds[0][0]) + (size_b := bounds[1][1] - bounds[1][0]) > target:
            half = bounds[0] if size_a > size_b else bounds[1]
            if rng.random() < 0.5:
                half[0] += 1
            else:
                half[1] -= 1
        a, b = a[slice(*bounds[0])], b[slice(*bounds[1])]
        tok = self.tokenizer
        tokens = [tok.cls, *a, tok.sep]
        types = [0] * len(tokens)
        if b:
            tokens += [*b, tok.sep]
            types += [1] * (len(b) + 1)
        masked = self.masker(tokens, target, rng)

        n, pad = len(tokens), self.pad  # n <= target + 3 <= seq_length
        text = np.full(self.seq_length, pad, dtype=np.int64)
        text[:n] = masked.tokens
        type_ids = np.full(self.seq_length, pad, dtype=np.int64)
        type_ids[:n] = types
        # Padding is found by value, after masking: a random replacement equal to the pad id counts.
        padding_mask = np.ones(self.seq_length, dtype=np.int64)
        padding_mask[text == pad] = pad
        labels = np.full(self.seq_length, -1, dtype=np.int64)
        labels[masked.positions] = masked.labels
        loss_mask = np.zeros(self.seq_length, dtype=np.int64)
        loss_mask[masked.positions] = 1
        text[text == pad] = 0  # an id the embedding has (-1 is none)
        labels[labels == pad] = 0
        return {
            "text": text,
            "types": type_ids,
            "labels": labels,
            "is_random": int(swapped),
            "padding_mask": padding_mask,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
        }
