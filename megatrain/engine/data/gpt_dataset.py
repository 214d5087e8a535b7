"""Megatron-LM's GPTDataset and BlendedDataset over memory-mapped indexed datasets.

GPTDataset: samples of seq_length + 1 tokens from a split (a contiguous run of sequence ids) of one
IndexedDataset, through the document / sample / shuffle indices of `gpt_indices` (cached beside the
data, built once per node). Reading a sample touches only its own tokens in the map.

BlendedDataset: Megatron's deterministic blending: sample i comes from the dataset furthest below its
weight's share of the first max(i, 1) samples (ties to the lowest index), so after n samples each
dataset has served within one sample of weight·n, with nothing random to replay on resume.

A sample id beyond a dataset's length wraps around (a further pass over the same samples), so a
caller that asks for more than it planned still gets data; plans size datasets so this is rare.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.gpt_indices import GPTIndices, build_gpt_indices, cached_gpt_indices
from megatrain.engine.data.indexed import IndexedDataset

SPLITS = ("train", "valid", "test")
BLEND_OVERSAMPLE = 1.005
"""Each blended dataset is sized for weight · N · 1.005 samples, as in Megatron, so the greedy
blend's lead of a sample or two never runs past a dataset's end."""


class SampleDataset(Protocol):
    def __len__(self) -> int: ...
    def batch(self, sample_ids: Sequence[int]) -> Batch: ...


def split_bounds(count: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges for train/valid/test, rounded as Megatron's _get_split_indices."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * count)))
    # Rounding may over/undershoot by one or two; every boundary after the first moves by the gap.
    diff = bounds[-1] - count
    bounds = [0] + [max(0, b - diff) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def segments(
    tokens: np.ndarray, eod: int, doc_starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(position_ids, segment_ids) of (B, T) inputs, as Megatron's reset_position_ids +
    reset_attention_mask: a new document starts after each `eod` token, and (where the index says
    so, for data stored without EOD tokens) at each True of the (B, T) `doc_starts`."""
    b, t = tokens.shape
    begins = np.zeros((b, t), dtype=bool)
    begins[:, 1:] = tokens[:, :-1] == eod
    if doc_starts is not None:
        begins[:, 1:] |= doc_starts[:, 1:]
    segment_ids = np.cumsum(begins, axis=1).astype(np.int32)
    starts = np.where(begins, np.arange(t), 0)
    np.maximum.accumulate(starts, axis=1, out=starts)
    return np.arange(t, dtype=np.int64) - starts, segment_ids


class GPTDataset:
    """Samples of one split of an indexed dataset, as Megatron's GPTDataset serves them."""

    def __init__(
        self,
        indexed: IndexedDataset,
        sequences: tuple[int, int],
        seq_length: int,
        num_samples: int,
        seed: int,
        cache_dir: Path,
        description: dict[str, Any],
        eod: int | None = None,
    ):
        """`sequences`: the split's [start, end) sequence ids; `description`: what else names the
        data (path, split, tokenizer) in the cache key; `eod`: reset positions and attention at this
        token (packing), or None for plain causal samples."""
        self.indexed, self.seq_length, self.eod = indexed, seq_length, eod
        ids = np.arange(*sequences, dtype=np.int32)
        if int(indexed.sequence_lengths[ids].sum(dtype=np.int64)) <= seq_length:
            raise ValueError(
                f"{indexed.idx_path}: sequences {sequences[0]}..{sequences[1]} hold too few tokens for "
                f"one sample of {seq_length} + 1"
            )
        desc = {
            "class": "GPTDataset",
            **description,
            "num_samples": num_samples,
            "random_seed": seed,
            "sequence_length": seq_length,
            "split_matrix": list(sequences),
            "add_extra_token_to_sequence": True,
        }
        sizes = indexed.sequence_lengths
        self.indices: GPTIndices = cached_gpt_indices(
            cache_dir, desc, lambda: build_gpt_indices(sizes, ids, seq_length, num_samples, seed)
        )

    def __len__(self) -> int:
        return len(self.indices)

    def window(self, index: int) -> np.ndarray:
        """Sample `index`'s seq_length + 1 tokens (int64)."""
        return np.concatenate(self._parts(index)).astype(np.int64)

    def _parts(self, index: int) -> list[np.ndarray]:
        """Sample `index`'s tokens, one array per document it spans (in order)."""
        idx = self.indices
        row = int(idx.shuffle_index[index % len(idx)])
        (doc_first, off_first), (doc_last, off_last) = idx.sample_index[row], idx.sample_index[row + 1]
        doc_first, doc_last = int(doc_first), int(doc_last)
        get, docs = self.indexed.get, idx.document_index
        if doc_first == doc_last:
            return [get(int(docs[doc_first]), int(off_first), int(off_last - off_first) + 1)]
        parts = [get(int(docs[doc_first]), int(off_first))]
        parts += [get(int(docs[i])) for i in range(doc_first + 1, doc_last)]
        parts.append(get(int(docs[doc_last]), 0, int(off_last) + 1))
        return parts

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        samples = [self._parts(i) for i in sample_ids]
        batch = Batch.from_windows(np.stack([np.concatenate(p).astype(np.int64) for p in samples]))
        if self.eod is not None:
            # Documents end at their EOD token when the data has them, and always where the index
            # says one ends: data preprocessed without EOD tokens still packs by document.
            doc_starts = np.zeros(batch.tokens.shape, dtype=bool)
            for row, parts in enumerate(samples):
                ends = np.cumsum([len(x) for x in parts[:-1]], dtype=np.int64)
                doc_starts[row, ends[ends < doc_starts.shape[1]]] = True
            batch.position_ids, batch.segment_ids = segments(batch.tokens, self.eod, doc_starts)
        return batch


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of `size` blended samples, Megatron's greedy rule."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    which = np.empty(size, dtype=np.int16)
    nth = np.empty(size, dtype=np.int64)
    for i in range(size):
        s = max(i, 1)
        best, best_err = 0, w[0] * s - counts[0]
        for d in range(1, len(w)):
            err = w[d] * s - counts[d]
            if err > best_err:
                best, best_err = d, err
        which[i], nth[i] = best, counts[best]
        counts[best] += 1
    return which, nth


class BlendedDataset:
    """Weighted mixture of datasets (weights normalised), Megatron's deterministic blend."""

    def __init__(
        self, datasets: Sequence[SampleDataset], weights: Sequence[float], size: int, cache_dir: Path | None
    ):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("need one weight per dataset")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = size
        if len(datasets) == 1:
            self.dataset_index = np.zeros(size, dtype=np.int16)
            self.dataset_sample_index = np.arange(size, dtype=np.int64)
        else:
            self.dataset_index, self.dataset_sample_index = _cached_blend(self.weights, size, cache_dir)

    def __len__(self) -> int:
        return self.size

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        if len(self.datasets) == 1:
            return self.datasets[0].batch(sample_ids)
        parts = []
        for i in sample_ids:
            i = int(i) % self.size
            d = int(self.dataset_index[i])
            parts.append(self.datasets[d].batch([int(self.dataset_sample_index[i])]))
        return concat_batches(parts)


def concat_batches(parts: Sequence[Batch]) -> Batch:
    """Rows of several batches as one; a field None in some parts is filled with what None means."""

    def default(name: str, b: int, t: int) -> np.ndarray:
        if name == "loss_mask":
            return np.ones((b, t), np.float32)
        if name == "position_ids":
            return np.broadcast_to(np.arange(t, dtype=np.int64), (b, t))
        return np.zeros((b, t), np.int32)  # segment_ids: one segment

    def stack(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        if all(v is None for v in values):
            return None
        return np.concatenate(
            [default(name, *p.tokens.shape) if v is None else v for p, v in zip(parts, values, strict=True)]
        )

    return Batch(
        tokens=np.concatenate([p.tokens for p in parts]),
        labels=np.concatenate([p.labels for p in parts]),
        loss_mask=stack("loss_mask"),
        position_ids=stack("position_ids"),
        segment_ids=stack("segment_ids"),
        # An encoder-decoder's rows (every part has them: a blend holds one kind of dataset).
        dec_tokens=stack("dec_tokens"),
        enc_mask=stack("enc_mask"),
        dec_mask=stack("dec_mask"),
        # An encoder's (BERT) token types and sentence-order labels, likewise.
        token_type_ids=stack("token_type_ids"),
        binary_labels=stack("binary_labels"),
    )


def blended_sizes(weights: Sequence[float], size: int) -> list[int]:
    """Samples to plan for each dataset of a blend of `size` samples."""
    total = float(sum(weights))
    return [math.ceil(float(w) / total * size * BLEND_OVERSAMPLE) for w in weights]


def _cached_blend(weights: list[float], size: int, cache_dir: Path | None) -> tuple[np.ndarray, np.ndarray]:
    if cache_dir is None:
        return blending_indices(weights, size)
    text = json.dumps({"class": "BlendedDataset", "weights": weights, "size": size}, sort_keys=True)
    key = hashlib.md5(text.encode()).hexdigest()
    cache_dir.mkdir(parents=True, exist_ok=True)
    files = [cache_dir / f"{key}-BlendedDataset-{n}.npy" for n in ("dataset_index", "dataset_sample_index")]
    with open(cache_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(f.exists() for f in files):
            for f, array in zip(files, blending_indices(weights, size), strict=True):
                tmp = f.with_name(f.name + f".tmp-{os.getpid()}")
                with open(tmp, "wb") as out:
                    np.save(out, array)
                os.replace(tmp, f)
    a, b = (np.load(f, mmap_mode="r") for f in files)
    return a, b
