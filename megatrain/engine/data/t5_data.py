"""An arch t5 job's data, served to the trainer as Batches of encoder-decoder rows (data.batch):

- kind pretrain: Megatron's T5 span corruption. Each `data.train` source becomes a sentence-split
  `.bin`/`.idx` prefix (an indexed dataset as given; a JSONL file tokenized once into the cache with
  one sequence per sentence, as `preprocess_data.py --split-sentences` writes it), its documents
  split by `data.split`, each split served by a T5Dataset (t5_dataset.py: ~15% of the word pieces cut
  out in spans, each replaced by the next sentinel in the encoder's input, the decoder predicting
  the sentinels and what they stand for) sized for what the run consumes, sources blended by weight.
  The tokenizer is an hf WordPiece one with [CLS] [SEP] [MASK] [PAD] [BOS] [EOS] and <extra_id_N>
  sentinels (masking.WordPieceVocab; examples/data/make_t5_vocab.py writes one).
- kind finetune: text-to-text pairs from JSONL (t5_pairs.py).

Either way a row is: tokens = the encoder's input (B, S), dec_tokens = the decoder's input (B, T)
starting with the decoder start token, labels = the decoder's targets (the input shifted left,
ending in the end token), loss_mask = 1 on every target token, enc_mask / dec_mask = 1 on real
tokens. Labels under padding are 0, an id every embedding has (Megatron's -1 is none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.gpt_dataset import (
    SampleDataset,
)
from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.data.masking import WordPieceVocab
from megatrain.engine.data.t5_dataset import T5Dataset
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.spec import JobSpec

START_PIECES = ("[BOS]", "<s>")
"""The decoder's start token, by name; a vocabulary with none starts with its padding (T5's own
convention: decoder_start_token_id = pad_token_id)."""
END_PIECES = ("[EOS]", "</s>")
PAD_PIECES = ("[PAD]", "<pad>")


@dataclass(frozen=True)
class T5Specials:
    """The ids a T5 row needs besides its text."""

    start: int
    """The decoder's first input token."""
    end: int
    """The last target: where generation stops."""
    pad: int


def t5_specials(tokenizer: Tokenizer) -> T5Specials:
    """The start, end and pad ids of an `hf` tokenizer (START_PIECES, END_PIECES, PAD_PIECES, by
    name); ValueError naming what is missing."""
    text = getattr(tokenizer, "json", None)
    if text is None:
        raise ValueError("arch t5 needs data.tokenizer type hf (a tokenizer.json with [EOS] or </s>)")
    from tokenizers import Tokenizer as RustTokenizer

    vocab = RustTokenizer.from_str(text).get_vocab(with_added_tokens=True)

    def first(pieces: Sequence[str]) -> int | None:
        return next((vocab[p] for p in pieces if p in vocab), None)

    end, pad = first(END_PIECES), first(PAD_PIECES)
    if end is None:
        raise ValueError(f"data.tokenizer has no end token ({' or '.join(END_PIECES)}) for T5 targets")
    pad = 0 if pad is None else pad
    start = first(START_PIECES)
    return T5Specials(start=pad if start is None else start, end=end, pad=pad)


def sentinel_vocab(tokenizer: Tokenizer) -> WordPieceVocab:
    """The pieces span corruption needs ([CLS] [SEP] [MASK] [BOS] [EOS], the sentinels) from an `hf`
    tokenizer; ValueError naming what is missing."""
    text = getattr(tokenizer, "json", None)
    if text is None:
        raise ValueError(
            "T5 pretraining needs data.tokenizer type hf (a WordPiece tokenizer.json with sentinels)"
        )
    try:
        vocab = WordPieceVocab.from_hf(text)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"data.tokenizer cannot make T5 samples: {exc}") from None
    missing = [n for n, i in (("[BOS]", vocab.bos), ("[EOS]", vocab.eos)) if i is None]
    if missing or not vocab.additional_special_tokens_ids:
        what = ", ".join(
            missing + ([] if vocab.additional_special_tokens_ids else ["<extra_id_N> sentinels"])
        )
        raise ValueError(f"data.tokenizer cannot make T5 samples: it has no {what}")
    return vocab


class T5Samples:
    """A T5Dataset (span corruption) as the trainer's SampleDataset."""

    def __init__(self, dataset: T5Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        d = self.dataset.batch(sample_ids)
        target = d["loss_mask"] > 0
        return Batch(
            tokens=d["text_enc"].astype(np.int64),
            labels=np.where(target, d["labels"], 0).astype(np.int64),
            loss_mask=target.astype(np.float32),
            dec_tokens=d["text_dec"].astype(np.int64),
            enc_mask=d["enc_mask"].astype(np.int64),
            dec_mask=d["dec_mask"].astype(np.int64),
        )


def build_t5_datasets(
    spec: JobSpec, tokenizer: Tokenizer, cache_root: Path
) -> dict[str, SampleDataset | None]:
    """train/valid/test datasets (None for an empty split) of an arch t5 spec: span corruption for
    kind pretrain, input/target pairs for kind finetune."""
    if spec.kind == "finetune":
        from megatrain.engine.data.t5_pairs import build_pair_datasets

        return build_pair_datasets(spec, tokenizer, cache_root / "t5-pairs")  # type: ignore[return-value]
    return build_span_datasets(spec, tokenizer, cache_root)


def build_span_datasets(
    spec: JobSpec, tokenizer: Tokenizer, cache_root: Path
) -> dict[str, SampleDataset | None]:
    """train/valid/test span-corruption datasets for `spec`'s data (see the module docstring)."""
    from megatrain.engine.data.encoder import sentence_datasets

    m = spec.model
    vocab = sentinel_vocab(tokenizer)
    decoder_length = m.t5_block.decoder_seq_length or m.seq_length

    def make(
        indexed: IndexedDataset,
        documents: tuple[int, int],
        planned: int,
        cache: Path,
        description: dict[str, Any],
    ) -> SampleDataset:
        ds = T5Dataset(
            indexed,
            documents,
            m.seq_length,
            decoder_length,
            planned,
            spec.training.seed,
            cache,
            description,
            vocab,
        )
        return T5Samples(ds)

    return sentence_datasets(spec, cache_root, make, "T5 sample")
