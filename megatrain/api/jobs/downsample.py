"""Pure downsampling of a metric series for charts: min/max per bucket, so spikes survive.

A chart of 100,000 steps on a 1,000-pixel-wide canvas can show at most ~2 values per pixel column;
keeping each bucket's lowest and highest loss (rather than a mean or every k-th row) keeps the
outline a full-resolution plot would draw, loss spikes included. The first and last rows are always
kept, so the chart starts where training started and ends at the newest step.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_POINTS = 10


def minmax_indices(values: Sequence[float | None], max_points: int) -> list[int]:
    """Indices (ascending) of at most `max_points` rows of a step-ordered series to keep.

    `values` is the series the buckets are judged by (None = no value: such rows are kept only as
    a bucket's stand-in when the whole bucket has no value).
    """
    n = len(values)
    if max_points < MIN_POINTS:
        raise ValueError(f"max_points={max_points} must be at least {MIN_POINTS}")
    if n <= max_points:
        return list(range(n))
    keep = {0, n - 1}
    buckets = (max_points - 2) // 2  # two rows per bucket, plus the first and last
    inner = n - 2  # rows 1 .. n-2 are split into `buckets` runs of (nearly) equal length
    for b in range(buckets):
        lo = 1 + b * inner // buckets
        hi = 1 + (b + 1) * inner // buckets
        if lo >= hi:
            continue
        best_lo = best_hi = None
        for i in range(lo, hi):
            v = values[i]
            if v is None:
                continue
            if best_lo is None or v < values[best_lo]:  # type: ignore[operator]
                best_lo = i
            if best_hi is None or v > values[best_hi]:  # type: ignore[operator]
                best_hi = i
        if best_lo is None:
            keep.add(lo)
        else:
            keep.update((best_lo, best_hi))  # type: ignore[arg-type]
    return sorted(keep)
