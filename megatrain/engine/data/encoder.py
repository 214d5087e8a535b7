"""A BERT job's data: sentence-split indexed datasets, masked as Megatron's BertDataset masks them,
served to the trainer as Batches (a sequence-classification fine-tune's records: classification.py).

Each `data.train` source becomes a sentence-split `.bin`/`.idx` prefix (an indexed dataset as given;
a JSONL file tokenized once into the cache with one sequence per sentence, no end-of-document
token, as Megatron's `preprocess_data.py --split-sentences` writes BERT data). Documents are split
by `data.split` (Megatron splits BERT data by document), each split's documents served by a
BERTDataset (bert_dataset.py) sized for what the run consumes, and sources blended by weight.

A sample becomes a Batch row: its masked tokens, the original ids at the masked positions (labels,
loss_mask), its sentence A / B types, padding as a segment of its own (the encoder's attention keeps
real tokens off it) and, with the binary head, the sentence-order label.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.bert_dataset import BERTDataset
from megatrain.engine.data.gpt_dataset import (
    SPLITS,
    BlendedDataset,
    SampleDataset,
    blended_sizes,
    split_bounds,
)
from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.data.masking import WordPieceVocab, pad_id
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.spec import JobSpec


class BertSamples:
    """A BERTDataset as the trainer's SampleDataset."""

    def __init__(self, dataset: BERTDataset):
        self.dataset = dataset
        self.pad = pad_id(dataset.tokenizer)

    def __len__(self) -> int:
        return len(self.dataset)

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        d = self.dataset.batch(sample_ids)
        text = d["text"].astype(np.int64)
        # Padding by value, as Megatron finds it (its padding_mask is 1 on every other token).
        real = text != self.pad if self.pad >= 0 else np.ones_like(text, dtype=bool)
        masked = d["loss_mask"] > 0
        return Batch(
            tokens=text,
            labels=np.where(masked, d["labels"], 0).astype(np.int64),
            loss_mask=masked.astype(np.float32),
            segment_ids=(~real).astype(np.int64),
            token_type_ids=np.where(real, d["types"], 0).astype(np.int64),
            binary_labels=d["is_random"].astype(np.int64) if self.dataset.binary_head else None,
        )


def wordpiece_vocab(tokenizer: Tokenizer) -> WordPieceVocab:
    """The special pieces a BERT sample needs ([CLS], [SEP], [MASK], [PAD]) from an `hf` tokenizer;
    ValueError naming what is missing."""
    text = getattr(tokenizer, "json", None)
    if text is None:
        raise ValueError(
            "arch bert needs data.tokenizer type hf (a WordPiece tokenizer.json with [CLS], [SEP], [MASK])"
        )
    try:
        return WordPieceVocab.from_hf(text)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"data.tokenizer cannot make BERT samples: {exc}") from None


SplitMaker = Callable[[IndexedDataset, tuple[int, int], int, Path, dict[str, Any]], SampleDataset]
"""make(indexed, documents [start, end), samples planned, cache dir, description) -> a split's dataset."""


def sentence_datasets(
    spec: JobSpec, cache_root: Path, make: SplitMaker, what: str
) -> dict[str, SampleDataset | None]:
    """train/valid/test datasets of sentence-split sources (BERT's and T5's): each data.train source
    split by documents as data.split says, data.valid's held out whole, every split's sources blended
    by weight; `make` builds one source's split (`what` names its samples in errors)."""
    from megatrain.engine.data.dataset import SplitSizes, indices_dir, local_prefix

    data, sizes = spec.data, SplitSizes.for_spec(spec)
    tok_id = json.dumps(data.tokenizer.model_dump(mode="json"), sort_keys=True)
    per_split: dict[str, list[tuple[SampleDataset, float]]] = {s: [] for s in SPLITS}
    weights = [s.weight for s in data.train]
    valid_weights = weights + [s.weight for s in data.valid]
    for n, (field, source) in enumerate(data.sources()):
        prefix = local_prefix(source, field, data.tokenizer, data.text_key, cache_root, split_sentences=True)
        indexed = IndexedDataset(prefix)
        documents = len(indexed.document_indices) - 1
        if documents == 0:
            raise ValueError(f"{field}.path={source.path!r} holds no documents")
        held_out = n >= len(data.train)
        every = (
            [(0, 0), (0, documents), (0, 0)] if held_out else split_bounds(documents, data.split_fractions)
        )
        for name, bounds in zip(SPLITS, every, strict=True):
            if bounds[1] <= bounds[0]:
                continue
            planned = getattr(sizes, name)
            among = valid_weights if name == "valid" and data.valid else weights
            if len(among) > 1:
                planned = blended_sizes(among, planned)[n]
            description = {"dataset_path": str(prefix), "index_split": name, "tokenizer": tok_id}
            ds = make(indexed, bounds, planned, indices_dir(prefix, cache_root), description)
            if len(ds) == 0:
                raise ValueError(f"{field}.path={source.path!r}: the {name} split's documents make no {what}")
            per_split[name].append((ds, source.weight))
    out: dict[str, SampleDataset | None] = {}
    for name in SPLITS:
        parts = per_split[name]
        blends = cache_root / "blends"
        out[name] = (
            BlendedDataset([p[0] for p in parts], [p[1] for p in parts], getattr(sizes, name), blends)
            if parts
            else None
        )
    if out["train"] is None:
        raise ValueError("the train split has no documents (check data.split and data.train)")
    return out


def build_encoder_datasets(
    spec: JobSpec, tokenizer: Tokenizer, seq_length: int, cache_root: Path
) -> dict[str, SampleDataset | None]:
    """train/valid/test BERT datasets (None for an empty split) for `spec`'s data."""
    vocab = wordpiece_vocab(tokenizer)
    if spec.model.bert_block.num_labels is not None:  # a sequence-classification fine-tune
        from megatrain.engine.data.classification import build_classification_datasets

        return build_classification_datasets(spec, tokenizer, vocab, seq_length)
    binary = spec.model.bert_block.binary_head

    def make(
        indexed: IndexedDataset,
        documents: tuple[int, int],
        planned: int,
        cache: Path,
        description: dict[str, Any],
    ) -> SampleDataset:
        ds = BERTDataset(
            indexed,
            documents,
            seq_length,
            planned,
            spec.training.seed,
            cache,
            description,
            vocab,
            binary_head=binary,
        )
        return BertSamples(ds)

    what = "BERT sample (the binary head needs documents of at least two sentences)"
    return sentence_datasets(spec, cache_root, make, what)
