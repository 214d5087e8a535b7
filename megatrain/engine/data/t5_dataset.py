"""Megatron-Core's T5MaskedWordPieceDataset: span-corruption samples for an encoder-decoder.

A sample is a run of whole sentences of one document (masking.py's mapping, aiming at seq_length - 2
tokens), cut to its target length. ~15% of its pieces are masked in spans of whole words (n drawn
from a geometric distribution, p = 0.2, clipped at 10: spans of ~3 words on average). Each span is
cut out of the encoder's input and replaced by the next sentinel (<extra_id_0>, <extra_id_1>, ...);
the decoder reads [BOS] then each sentinel followed by the span it stands for, and predicts the same
sequence shifted by one, ending in [EOS].

Fields, as Megatron 0.16 returns them (int64 arrays; ints for the flags):
  text_enc   (seq_length,)          encoder input, padding as 0
  text_dec   (decoder_seq_length,)  decoder input: [BOS] s0 span0 s1 span1 ..., padding as 0
  labels     (decoder_seq_length,)  s0 span0 s1 span1 ... [EOS], then -1
  loss_mask  (decoder_seq_length,)  1 on the decoder's tokens
  enc_mask   (seq_length,)          1 on the encoder's tokens, 0 on padding
  dec_mask   (decoder_seq_length,)  1 on the decoder's tokens, 0 on padding
  truncated  1 when the sentences were cut to the target
Megatron builds the (B, 1, q, k) attention masks from enc_mask/dec_mask at batch time, per backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.data.masking import (
    T5_MASKING,
    MaskedSentenceDataset,
    Masker,
    MaskingConfig,
    SentinelTokenizer,
    pad_id,
)


class T5Dataset(MaskedSentenceDataset):
    """T5 samples of documents [start, end) of a sentence-split indexed dataset."""

    kind = "T5MaskedWordPieceDataset"

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: tuple[int, int],
        seq_length: int,
        decoder_seq_length: int,
        num_samples: int | None,
        seed: int,
        cache_dir: Path,
        description: dict[str, Any],
        tokenizer: SentinelTokenizer,
        config: MaskingConfig = T5_MASKING,
    ):
        """`seq_length`: the encoder's; `num_samples`: at least this many (whole epochs of the
        mapping), None for one epoch; `description`: what else names the data in the cache key."""
        missing = [k for k in ("bos", "eos") if getattr(tokenizer, k, None) is None]
        if missing or not tokenizer.additional_special_tokens_ids:
            what = ", ".join(missing + ([] if tokenizer.additional_special_tokens_ids else ["sentinels"]))
            raise ValueError(f"T5 samples need the tokenizer's {what} (e.g. [BOS], [EOS], <extra_id_N>)")
        self.tokenizer, self.decoder_seq_length = tokenizer, decoder_seq_length
        self.pad = pad_id(tokenizer)
        mask = tokenizer.mask
        self.masker = Masker(tokenizer, config, lambda rng, original: mask)  # no draw: always [MASK]
        super().__init__(
            indexed,
            documents,
            seq_length,
            num_samples,
            seed,
            cache_dir,
            description | {"decoder_seq_length": decoder_seq_length},
            config,
            special_tokens=2,
            min_sentences=1,
        )

    def __getitem__(self, index: int) -> dict[str, Any]:
        sentences, target, rng = self.sentences(index)
        tokens = [t for s in sentences for t in s]
        truncated = len(tokens) > target
        masked = self.masker(tokens[:target], target, rng)
        sentinels = self.tokenizer.additional_special_tokens_ids
        if len(masked.spans) > len(sentinels):
            raise ValueError(f"sample {index}: {len(masked.spans)} masked spans, {len(sentinels)} sentinels")
        encoder: list[int] = []
        decoder = [self.tokenizer.bos]
        at = 0  # the next unmasked position of the sample
        for (positions, originals), sentinel in zip(masked.spans, sentinels, strict=False):
            encoder += [*masked.tokens[at : positions[0]], sentinel]
            decoder += [sentinel, *originals]
            at = positions[-1] + 1
        encoder += masked.tokens[at:]
        targets = [*decoder[1:], self.tokenizer.eos]  # the decoder's input shifted left by one
        if len(decoder) > self.decoder_seq_length:
            raise ValueError(
                f"sample {index}: the decoder needs {len(decoder)} tokens, decoder_seq_length is "
                f"{self.decoder_seq_length}"
            )

        pad = self.pad
        text_enc = np.full(self.seq_length, pad, dtype=np.int64)
        text_enc[: len(encoder)] = encoder
        text_dec = np.full(self.decoder_seq_length, pad, dtype=np.int64)
        text_dec[: len(decoder)] = decoder
        # Padding is found by value, as Megatron does: a real token equal to the pad id is masked too.
        enc_mask = (text_enc != pad).astype(np.int64)
        dec_mask = (text_dec != pad).astype(np.int64)
        labels = np.full(self.decoder_seq_length, -1, dtype=np.int64)
        labels[: len(targets)] = targets
        loss_mask = np.zeros(self.decoder_seq_length, dtype=np.int64)
        loss_mask[: len(decoder)] = 1
        for array in (text_enc, text_dec, labels):
            array[array == pad] = 0  # an id the embedding has (-1 is none)
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": labels,
            "loss_mask": loss_mask,
            "truncated": int(truncated),
            "enc_mask": enc_mask,
            "dec_mask": dec_mask,
        }
