"""GPT sample indices over an indexed dataset, as Megatron-LM's GPTDataset builds them.

For one split (a run of sequence ids) and a sequence length L, three arrays decide which tokens each
sample reads (../shared/anchors/megatron-indexed-dataset.md §5):

- document_index: the split's sequence ids repeated over E epochs, shuffled (the final epoch
  shuffled on its own when it is short: fewer than 80% of an epoch's samples), int32;
- sample_index: row i = (position in document_index, token offset) where sample i starts; sample i
  reads L + x tokens (x = 1 when labels come from one extra token), so consecutive samples overlap
  by x tokens and the stream of samples covers every token of the epochs exactly once;
- shuffle_index: the order samples are served in (the final epoch's separately when it is).

All randomness comes from one numpy RandomState(seed), document index first, then shuffle index, as in
Megatron, so the arrays equal Megatron's for the same inputs and seed. The sample index is computed in
closed form (sample i starts at token i·L of the epochs' concatenated stream) instead of Megatron's
C++ walk, with the same answer.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

FINAL_EPOCH_FRACTION = 0.80
"""A final epoch giving fewer than this share of an epoch's samples is shuffled separately."""


def num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int = 1) -> int:
    """The fewest epochs whose tokens give `num_samples` samples (1 when unspecified)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= extra:
        raise ValueError(f"an epoch of {tokens_per_epoch} tokens gives no sample of {seq_length}")
    needed = num_samples * seq_length + extra
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(
    epochs: int, tokens_per_epoch: int, seq_length: int, num_samples: int | None, extra: int = 1
) -> bool:
    """Whether the last epoch contributes so few samples that it is shuffled on its own."""
    if epochs == 1 or num_samples is None:
        return False
    before_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
    from_final = num_samples - before_final
    per_epoch = (tokens_per_epoch - extra) // seq_length
    return from_final < int(FINAL_EPOCH_FRACTION * per_epoch)


def document_index(
    sequences: np.ndarray, epochs: int, rng: np.random.RandomState, separate_final: bool
) -> np.ndarray:
    """The split's sequence ids, `epochs` times, shuffled (the final epoch apart when separate)."""
    if separate_final and epochs > 1:
        first = document_index(sequences, epochs - 1, rng, False)
        return np.concatenate((first, document_index(sequences, 1, rng, False)))
    index = np.tile(np.asarray(sequences, dtype=np.int32), epochs)
    rng.shuffle(index)
    return index


def sample_index(
    sizes: np.ndarray, doc_index: np.ndarray, seq_length: int, tokens_total: int, extra: int = 1
) -> np.ndarray:
    """(num_samples + 1, 2) rows of (position in doc_index, token offset) where each sample starts,
    for every whole sample in `tokens_total` tokens (a partial last sample is dropped)."""
    num_samples = (tokens_total - extra) // seq_length
    lengths = np.asarray(sizes, dtype=np.int64)[doc_index]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    wide = max(len(doc_index), int(lengths.max(initial=0))) > np.iinfo(np.int32).max
    out = np.zeros((num_samples + 1, 2), dtype=np.int64 if wide else np.int32)
    # Sample i ends at token e = i·L + x of the stream; the next one starts x tokens earlier, in the
    # document where e lands (an end exactly on a document's end stays in that document).
    e = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length + extra
    where = np.searchsorted(ends, e, side="left")
    out[1:, 0] = where
    out[1:, 1] = e - starts[where] - extra
    return out


def shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, total): the first `num_samples` shuffled, then the rest on their own."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


@dataclass(frozen=True)
class GPTIndices:
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    def __len__(self) -> int:
        return len(self.shuffle_index)


def build_gpt_indices(
    sizes: np.ndarray,
    sequences: np.ndarray,
    seq_length: int,
    num_samples: int | None,
    seed: int,
    add_extra_token: bool = True,
) -> GPTIndices:
    """The three arrays for the split `sequences` (ids into `sizes`, the sequence lengths)."""
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.asarray(sizes, dtype=np.int64)[sequences].sum())
    epochs = num_epochs(tokens_per_epoch, seq_length, num_samples, extra)
    separate = separate_final_epoch(epochs, tokens_per_epoch, seq_length, num_samples, extra)
    rng = np.random.RandomState(seed)
    docs = document_index(sequences, epochs, rng, separate)
    samples = sample_index(sizes, docs, seq_length, epochs * tokens_per_epoch, extra)
    total = len(samples) - 1
    if separate:
        before_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
        order = shuffle_index(before_final, total, rng)
    else:
        order = shuffle_index(total, total, rng)
    return GPTIndices(docs, samples, order)


def cached_gpt_indices(
    cache_dir: Path, description: dict[str, Any], build: Callable[[], GPTIndices]
) -> GPTIndices:
    """The indices `description` names, from `cache_dir` when built before, else built once and kept.

    Files are named as Megatron names them (`{md5}-GPTDataset-{array}.npy` beside a
    `description.txt`), but the hash covers every field of `description` (Megatron leaves
    add_extra_token_to_sequence out, and reuses a stale cache when it changes). Every process that
    asks takes one file lock, so on a node the first builds and the others wait, then map the files
    (`mmap_mode="r"`: no copy per rank). Files appear under their final names only when complete.
    """
    text = json.dumps(description, sort_keys=True, indent=4, default=str)
    key = hashlib.md5(text.encode()).hexdigest()
    cache_dir.mkdir(parents=True, exist_ok=True)
    names = [f.name for f in fields(GPTIndices)]
    files = {name: cache_dir / f"{key}-GPTDataset-{name}.npy" for name in names}
    marker = cache_dir / f"{key}-GPTDataset-description.txt"
    with open(cache_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists():
            built = build()
            for name, path in files.items():
                tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
                with open(tmp, "wb") as f:
                    np.save(f, getattr(built, name))
                os.replace(tmp, path)
            tmp = marker.with_name(marker.name + f".tmp-{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, marker)  # last: its presence means every array is complete
    return GPTIndices(**{name: np.load(path, mmap_mode="r") for name, path in files.items()})
