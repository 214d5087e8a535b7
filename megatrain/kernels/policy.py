"""The kernels' chunking policies, torch-free so that the memory estimate (megatrain.plan.memory)
plans with exactly the chunks the kernels run."""

from __future__ import annotations


def linear_cross_entropy_chunk_rows(num_tokens: int, vocab: int, chunk_tokens: int | None = None) -> int:
    """Token rows per chunk of the fused LM head + loss: a chunk's fp32 logits near 8 MiB, between
    64 and 1024 rows (fewer rows than that make the head's GEMMs inefficient); `chunk_tokens`
    overrides it."""
    if chunk_tokens is not None:
        return max(1, min(chunk_tokens, num_tokens))
    return max(1, min(num_tokens, 1024, max(64, (2 << 20) // max(vocab, 1))))
