"""Continuous batching's KV cache: one slot per running sequence, each row at its own position.

models.gpt.KVCache holds one length for its whole batch, so its rows start and stop together. A
server's rows do not: a request joins the batch when it arrives and leaves when it ends. Here every
layer's keys and values are (slots, G, max_len, hd) buffers; the running sequences hold slots
0..B-1 (a finished row's slot is refilled from the last one, so the batch is always one contiguous
view) and each row has its own length. GPTModel.hidden_states runs over it as over a KVCache (its
attention calls `attend`), in one of two modes set before each forward:

- prefill: one new sequence's prompt (1, T) written to its slot at positions 0..T-1 with causal
  attention among them: exactly KVCache's first forward.
- decode: one token per running row (B, 1) at that row's own position (position_ids), attending
  over its slot's positions 0..pos with the rest masked. When every row stands at the same position
  no mask is needed, and a request served alone computes exactly what generate() computes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.engine.models.gpt import KVCache


class SlotCache(KVCache):
    """KV buffers for `slots` sequences of up to `max_len` positions (allocated on first write)."""

    def __init__(self, slots: int, max_len: int):
        super().__init__(max_len)
        self.slots = slots
        self._prefill_slot: int | None = None
        self._positions: torch.Tensor | None = None  # (B,) decode positions
        self._uniform = True
        self._end = 0

    def prefill(self, slot: int) -> None:
        """The next forward writes one prompt (1, T) to `slot` from position 0."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside the cache's {self.slots} slots")
        self._prefill_slot, self._positions = slot, None
        self.length = 0  # hidden_states starts its tokens here and advances it: rows keep their own

    def decode(self, positions: list[int], device: torch.device) -> None:
        """The next forward runs one token for each of rows 0..B-1, row b's at positions[b]."""
        if len(positions) > self.slots:
            raise ValueError(f"{len(positions)} rows do not fit the cache's {self.slots} slots")
        if max(positions) >= self.max_len:
            raise ValueError(
                f"the KV cache holds {self.max_len} positions; {max(positions) + 1} were asked for"
            )
        self._prefill_slot, self.length = None, 0
        self._positions = torch.tensor(positions, device=device)
        self._uniform = len(set(positions)) == 1
        self._end = max(positions) + 1  # keys read: up to the furthest row's position

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (a row that moves down, or a
        prompt another row already holds)."""
        for keys, values in self._buffers.values():
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]

    def attend(
        self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
    ) -> torch.Tensor:
        """q (B, H, T, hd), k and v (B, G, T, hd) of the tokens this forward runs -> (B, H, T, hd)."""
        b, g, t, hd = k.shape
        if layer not in self._buffers:
            shape = (self.slots, g, self.max_len, hd)
            self._buffers[layer] = (k.new_zeros(shape), v.new_zeros(shape))
        keys, values = self._buffers[layer]
        kw: dict[str, Any] = {}
        if self._prefill_slot is not None:
            s = self._prefill_slot
            keys[s : s + 1, :, :t], values[s : s + 1, :, :t] = k, v
            k, v = keys[s : s + 1, :, :t], values[s : s + 1, :, :t]  # the buffer, as KVCache reads it
            k, v = self._grouped(q, k, v, kw)
            return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, dropout_p=dropout_p, **kw)
        pos = self._positions
        if pos is None or t != 1 or b != pos.shape[0]:
            raise RuntimeError("SlotCache: call prefill() or decode() before each forward")
        rows = torch.arange(b, device=k.device)
        keys[rows, :, pos], values[rows, :, pos] = k[:, :, 0], v[:, :, 0]  # (B, G, hd) each
        end = self._end
        k, v = keys[:b, :, :end], values[:b, :, :end]  # (B, G, end, hd)
        mask = None
        if not self._uniform:  # row b sees positions 0..pos[b]; the rest are other rows' leftovers
            mask = (torch.arange(end, device=q.device) <= pos[:, None])[:, None, None, :]  # (B, 1, 1, end)
        k, v = self._grouped(q, k, v, kw)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, **kw)

    def _grouped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Grouped keys and values as KVCache hands them to SDPA (enable_gqa, or repeated heads)."""
        heads, groups = q.shape[1], k.shape[1]
        if groups != heads and self._sdpa_gqa:
            kw["enable_gqa"] = True
        elif groups != heads:
            k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
        return k, v
