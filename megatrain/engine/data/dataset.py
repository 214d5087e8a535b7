"""Splits, token streams, deterministic windows, weighted blending and data-parallel sharding.

A sample is a window of seq_length+1 tokens (inputs and shifted labels) indexed by a global sample
id: sample i is a pure function of (corpus, seed, i). Training position is therefore one integer,
`consumed_samples`, which is all a resumed run needs to continue on exactly the same data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatrain.engine.data.batch import Batch
from megatrain.engine.data.jsonl import read_jsonl_texts
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.spec import DataSpec

SPLITS = ("train", "valid", "test")


def document_split_bounds(num_docs: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) document ranges for train/valid/test, rounded as Megatron does."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * num_docs)))
    # Rounding may over/undershoot by a document or two; move every boundary to close the gap.
    diff = bounds[-1] - num_docs
    bounds = [0] + [max(0, b - diff) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def token_stream(texts: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """All documents' tokens with the end-of-document id after each one, as one 1-D array."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    parts = [np.asarray([*tokenizer.encode(t), tokenizer.eod], dtype=dtype) for t in texts]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


class SourceDataset:
    """Windows of seq_length+1 tokens from one token stream.

    The stream is cut into non-overlapping chunks of seq_length (each window reads one more token,
    the last label). Each epoch visits every chunk once, in an order drawn from (seed, key, epoch).
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int, key: Sequence[int] = ()):
        if len(tokens) == 0:
            raise ValueError("empty token stream")
        if len(tokens) < seq_length + 1:
            # A tiny corpus still trains: repeat it until one window fits.
            tokens = np.tile(tokens, -(-(seq_length + 1) // len(tokens)))
        self.tokens = tokens
        self.seq_length = seq_length
        self.seed = seed
        self.key = tuple(key)
        self.num_chunks = (len(tokens) - 1) // seq_length
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Samples in one epoch; indices beyond it wrap into later epochs."""
        return self.num_chunks

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            rng = np.random.default_rng([self.seed, *self.key, epoch])
            order = rng.permutation(self.num_chunks)
            self._orders = {epoch: order}  # only the current epoch is ever hot
        return order

    def __getitem__(self, index: int) -> np.ndarray:
        epoch, pos = divmod(int(index), self.num_chunks)
        start = int(self._order(epoch)[pos]) * self.seq_length
        return self.tokens[start : start + self.seq_length + 1].astype(np.int64)


class BlendedDataset:
    """Weighted mixture of sources: sample i goes to the source furthest behind its share.

    This is Megatron's deterministic greedy blending: after n samples each source has been drawn
    within one sample of weight·n, with no randomness to replay on resume.
    """

    def __init__(self, sources: Sequence[SourceDataset], weights: Sequence[float]):
        if len(sources) != len(weights) or not sources:
            raise ValueError("need one weight per source")
        total = float(sum(weights))
        self.sources = list(sources)
        self.weights = np.asarray([w / total for w in weights], dtype=np.float64)
        self._source = np.zeros(0, dtype=np.int64)  # which source serves sample i
        self._index = np.zeros(0, dtype=np.int64)  # and which of its samples
        self._counts = np.zeros(len(sources), dtype=np.int64)

    def _extend(self, upto: int) -> None:
        n0 = len(self._source)
        if upto <= n0:
            return
        upto = max(upto, 2 * n0, 1024)
        src = np.empty(upto - n0, dtype=np.int64)
        idx = np.empty(upto - n0, dtype=np.int64)
        for j, i in enumerate(range(n0, upto)):
            s = int(np.argmax(self.weights * (i + 1) - self._counts))
            src[j], idx[j] = s, self._counts[s]
            self._counts[s] += 1
        self._source = np.concatenate([self._source, src])
        self._index = np.concatenate([self._index, idx])

    def __getitem__(self, index: int) -> np.ndarray:
        if len(self.sources) == 1:
            return self.sources[0][index]
        self._extend(index + 1)
        return self.sources[int(self._source[index])][int(self._index[index])]

    def batch(self, sample_ids: Sequence[int]) -> Batch:
        """The samples' windows as one micro-batch."""
        return Batch.from_windows(np.stack([self[i] for i in sample_ids]))


def microbatch_sample_ids(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """The sample ids this data-parallel rank trains on in one iteration, per micro-batch.

    The global batch is [consumed, consumed+global); rank r takes the r-th contiguous slice of
    global/dp samples, cut into micro-batches, so ranks are disjoint and together cover the batch.
    """
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    return [
        list(range(first + m, first + m + micro_batch_size)) for m in range(0, per_rank, micro_batch_size)
    ]


def build_datasets(
    data: DataSpec, tokenizer: Tokenizer, seq_length: int, seed: int
) -> dict[str, BlendedDataset | None]:
    """train/valid/test datasets (None for an empty split), each source split by documents."""
    fractions = data.split_fractions
    per_split: dict[str, list[tuple[SourceDataset, float]]] = {s: [] for s in SPLITS}
    for source_idx, source in enumerate(data.train):
        texts = read_jsonl_texts(source.path, data.text_key)
        if not texts:
            raise ValueError(f"{source.path}: no documents")
        for split_idx, (name, (lo, hi)) in enumerate(
            zip(SPLITS, document_split_bounds(len(texts), fractions), strict=True)
        ):
            if hi > lo:
                stream = token_stream(texts[lo:hi], tokenizer)
                ds = SourceDataset(stream, seq_length, seed, key=(source_idx, split_idx))
                per_split[name].append((ds, source.weight))
    out: dict[str, BlendedDataset | None] = {}
    for name in SPLITS:
        parts = per_split[name]
        out[name] = BlendedDataset([p[0] for p in parts], [p[1] for p in parts]) if parts else None
    if out["train"] is None:
        raise ValueError("the train split has no documents (check data.split and data.train)")
    return out
