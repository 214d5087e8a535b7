"""Sequence packing: whole documents placed into fixed-size samples, and the arrays a packed sample
hands the model (tokens, labels, loss mask, position ids restarting per document, segment ids).

Placement is best-fit decreasing (documents longest first, each into the fullest sample it still
fits, a new sample when none has room): a document is never split across samples, and samples come
out nearly full. Ties in length are broken by a permutation drawn from the seed, so the plan is a pure
function of (lengths, capacity, seed, key).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from megatrain.engine.data.batch import Batch


def pack(lengths: np.ndarray, capacity: int, seed: int, key: Sequence[int] = ()) -> list[np.ndarray]:
    """Indices into `lengths` grouped into samples of at most `capacity` tokens each (best-fit
    decreasing; deterministic for the seed). Every index appears exactly once."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(
            f"document lengths must be in [1, {capacity}] to pack; got {lengths.min()}..{lengths.max()}"
        )
    order = np.random.default_rng([seed, *key]).permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    bins: list[list[int]] = []
    # Bins by their free space: count_by_space[s] bins have exactly s tokens free (a stack of each).
    count_by_space = np.zeros(capacity + 1, dtype=np.int64)
    by_space: dict[int, list[int]] = {}
    for doc in order.tolist():
        n = int(lengths[doc])
        fits = np.flatnonzero(count_by_space[n:])
        if fits.size:
            space = n + int(fits[0])  # the tightest fit
            b = by_space[space].pop()
            count_by_space[space] -= 1
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(doc)
        left = space - n
        by_space.setdefault(left, []).append(b)
        count_by_space[left] += 1
    return [np.asarray(b, dtype=np.int64) for b in bins]


def packed_sample(
    docs: Sequence[np.ndarray], masks: Sequence[np.ndarray], capacity: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Documents laid end to end in a window of `capacity` tokens, padded with `pad_id`.

    Returns (window, target, segment, position), each (capacity,): the tokens; 1 where a token is a
    loss target (its document's mask, 0 on padding); the document index (padding: one more segment of
    its own); the position within the document (padding counts from 0 too)."""
    window = np.full(capacity, pad_id, dtype=np.int64)
    target = np.zeros(capacity, dtype=np.uint8)
    segment = np.empty(capacity, dtype=np.int64)
    position = np.empty(capacity, dtype=np.int64)
    at = 0
    for i, (doc, mask) in enumerate(zip(docs, masks, strict=True)):
        n = len(doc)
        if at + n > capacity:
            raise ValueError(
                f"documents of {sum(len(d) for d in docs)} tokens overflow a sample of {capacity}"
            )
        window[at : at + n] = doc
        target[at : at + n] = mask
        segment[at : at + n] = i
        position[at : at + n] = np.arange(n)
        at += n
    segment[at:] = len(docs)
    position[at:] = np.arange(capacity - at)
    return window, target, segment, position


def batch_from_samples(
    samples: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], packed: bool
) -> Batch:
    """(B, capacity) windows as a micro-batch of T = capacity - 1: label t is token t+1, counted where
    that token is a target of the same document as token t (never across a document boundary).
    Unpacked samples (one document, then padding) need neither ids: plain causal attention already
    keeps the document from seeing the padding after it."""
    window, target, segment, position = (np.stack(a) for a in zip(*samples, strict=True))
    same_doc = segment[:, 1:] == segment[:, :-1]
    loss_mask = (target[:, 1:].astype(bool) & same_doc).astype(np.float32)
    return Batch(
        tokens=window[:, :-1],
        labels=window[:, 1:],
        loss_mask=loss_mask,
        position_ids=position[:, :-1] if packed else None,
        segment_ids=segment[:, :-1] if packed else None,
    )


def tokens_through(per_sample: np.ndarray, order: Callable[[int], np.ndarray], count: int) -> int:
    """Real tokens (padding and truncated tails not counted) in the first `count` samples of a
    dataset whose epochs visit its samples in `order(epoch)`, sample i holding per_sample[i] tokens:
    what a run that consumed `count` samples trained on."""
    epochs, pos = divmod(int(count), len(per_sample))
    return epochs * int(per_sample.sum()) + int(per_sample[order(epochs)[:pos]].sum())
