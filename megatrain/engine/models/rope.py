"""Rotary position embedding's tables (Hugging Face Llama's rotate-half layout, its rope scaling),
apart from the model that reads them (models.gpt)."""

from __future__ import annotations

import math
from typing import Any

import torch

Rope = tuple[torch.Tensor, torch.Tensor]
"""cos, sin: the (seq_length, hd) tables (attention takes the first T rows), or (B, 1, T, hd) for
per-token position ids."""


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The (hd/2,) rotary frequencies in fp64, scaled as Hugging Face's modeling_rope_utils does:
    linear divides them all by `factor`; llama3 divides the low frequencies (wavelength beyond
    original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones (wavelength
    below original / high_freq_factor) and interpolates smoothly in between."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    seq_length: int, head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (T, head_dim) in the rotate-half layout Hugging Face Llama uses."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float64), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos().float(), angles.sin().float()


def rope_for(cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None) -> Rope:
    """The rotary tables a forward needs: the whole tables, or each token's row of them."""
    if position_ids is None:
        return cos, sin
    return cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)  # (B, 1, T, hd)
