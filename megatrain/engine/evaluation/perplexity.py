"""An eval job's perplexity on its own data (`eval.perplexity: [valid, ...]`): every token of a split
once, split as a training job splits the same `data` (data.split's contiguous document ranges of
each source, data.valid's sources held out whole as validation), the documents of each source
concatenated in order and cut into windows of seq_length + 1 tokens that overlap by one (Megatron's
GPT samples, unshuffled), each window's last seq_length tokens scored after the ones before them.

The per-token loss is the scored tokens' summed negative log-likelihood over their number, and the
perplexity its exponential; stored as task `perplexity:SPLIT` with metrics loss, perplexity and
tokens (n: the windows scored).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.engine.data.dataset import default_cache_root, local_prefix
from megatrain.engine.data.gpt_dataset import SPLITS, split_bounds
from megatrain.engine.data.indexed import IndexedDataset
from megatrain.engine.evaluation.scorer import Scorer
from megatrain.spec import JobSpec


def split_windows(
    spec: JobSpec, split: str, seq_length: int, cache_root: Path | None = None
) -> Iterator[list[int]]:
    """The split's windows of at most seq_length + 1 token ids (the last may be shorter)."""
    data, cache_root = spec.data, cache_root or default_cache_root()
    carry: np.ndarray = np.zeros(0, dtype=np.int64)
    for n, (field, source) in enumerate(data.sources()):
        held_out = n >= len(data.train)
        if held_out and split != "valid":
            continue
        indexed = IndexedDataset(local_prefix(source, field, data.tokenizer, data.text_key, cache_root))
        start, end = (
            (0, len(indexed))
            if held_out
            else split_bounds(len(indexed), data.split_fractions)[SPLITS.index(split)]
        )
        for doc in range(start, end):
            carry = np.concatenate([carry, np.asarray(indexed[doc], dtype=np.int64)])
            while len(carry) >= seq_length + 1:
                yield carry[: seq_length + 1].tolist()
                carry = carry[seq_length:]  # the window's last token starts the next one
    if len(carry) >= 2:
        yield carry.tolist()


def measure(
    scorer: Scorer,
    windows: Iterator[list[int]],
    batch_size: int,
    limit: int | None = None,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """{loss, perplexity, tokens: {value, stderr, n}} over the windows (at most `limit`)."""
    total, tokens, count = 0.0, 0, 0
    batch: list[list[int]] = []

    def flush() -> None:
        nonlocal total, tokens
        answers = scorer.loglikelihood(batch, [len(w) - 1 for w in batch])
        total += sum(lp for lp, _ in answers)
        tokens += sum(len(w) - 1 for w in batch)
        batch.clear()
        if on_batch is not None:
            on_batch()

    for window in windows:
        if limit is not None and count >= limit:
            break
        batch.append(window)
        count += 1
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    if not tokens:
        raise ValueError("the split holds no tokens to score (check data.split and the sources)")
    loss = -total / tokens
    return {
        "loss": {"value": loss, "stderr": None, "n": count},
        # (past e^700 a float overflows: no figure rather than a non-JSON infinity)
        "perplexity": {"value": math.exp(loss) if loss < 700 else None, "stderr": None, "n": count},
        "tokens": {"value": float(tokens), "stderr": None, "n": count},
    }


def perplexity_results(
    spec: JobSpec,
    scorer: Scorer,
    batch_size: int,
    on_batch: Callable[[], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every split of eval.perplexity measured: {f"perplexity:{split}": metrics}."""
    assert spec.eval is not None
    seq = scorer.max_length
    return {
        f"perplexity:{split}": measure(
            scorer, split_windows(spec, split, seq), batch_size, spec.eval.limit, on_batch
        )
        for split in spec.eval.perplexity
    }
