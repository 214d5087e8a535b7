"""The kernels' chunking policies, torch-free so that the memory estimate (megatrain.plan.memory)
plans with exactly the chunks the kernels run."""

from __future__ import annotations

CPU_LOGITS_ELEMENTS = 8 << 20
"""A CPU chunk's fp32 logits: 32 MiB. A host has the memory, and each chunk re-reads the whole
(vocab × hidden) weight gradient it adds to: at T5's 256 decoder tokens and a 30k vocabulary, 8 MiB
chunks (4 of them) measured 1.5× a plain head + cross-entropy, one chunk equal to it."""


def linear_cross_entropy_chunk_rows(
    num_tokens: int, vocab: int, chunk_tokens: int | None = None, device_type: str = "cuda"
) -> int:
    """Token rows per chunk of the fused LM head + loss: a chunk's fp32 logits near 8 MiB on a GPU
    (CPU_LOGITS_ELEMENTS on a CPU), between 64 and 1024 rows (fewer rows than that make the head's
    GEMMs inefficient); `chunk_tokens` overrides it."""
    if chunk_tokens is not None:
        return max(1, min(chunk_tokens, num_tokens))
    budget = CPU_LOGITS_ELEMENTS if device_type == "cpu" else 2 << 20
    return max(1, min(num_tokens, 1024, max(64, budget // max(vocab, 1))))
