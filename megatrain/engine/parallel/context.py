"""Context parallelism: ring attention over the cp group, applied to a single-device model from outside.

Each cp rank holds 2 of the sequence's 2·cp chunks, chunks r and 2·cp-1-r (microbatch.
context_parallel_batch cuts the micro-batch so, with the kept tokens' true positions); everything but
attention is per token and runs on the local (B, T/cp) tokens unchanged. Attention needs every
earlier key: the K/V blocks travel around the cp ring (P2P send/recv, the next block's transfer
overlapping this block's compute), each block's attention is computed with its log-sum-exp and the
blocks merge exactly (online softmax). Backward passes the blocks around again, recomputing each
block's probabilities from the saved out and lse (flash-attention's backward), and sends each block's
dK/dV along with it, so they arrive back home after a full turn.

The two mirrored chunks make every step after the first exactly half a block of work, never a masked
one. With local chunks [a=r, b=2cp-1-r] and the K/V of rank s = r - i (step i):
  i = 0     own K/V: causal over the local sequence (a before b, both in order);
  s < r     chunk s is before a and b, chunk 2cp-1-s after both: all queries × the first K/V chunk;
  s > r     chunks s and 2cp-1-s lie between a and b: the second query chunk × all K/V.
Packed documents (segment ids) ride with their K/V block and mask it per block. An encoder
(bidirectional attention, BERT) needs every block whole at every step: all queries × all keys.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain import kernels
from megatrain.engine.models.gpt import Attention
from megatrain.engine.models.moe import TopKRouter
from megatrain.engine.parallel.state import Group, ParallelState
from megatrain.kernels.attention import Segments
from megatrain.plan.layout import LayoutError, context_problems


@dataclass(frozen=True)
class Ring:
    """The cp ring this rank sits in: its position, and its neighbours' global ranks."""

    group: Group
    rank: int
    size: int
    next_peer: int
    prev_peer: int

    @classmethod
    def of(cls, state: ParallelState) -> Ring:
        c, n = state.coords, state.cp_size
        peer = functools.partial(state.layout.rank_of, tp=c.tp, dp=c.dp, pp=c.pp)
        return cls(state.cp_group, c.cp, n, peer(cp=(c.cp + 1) % n), peer(cp=(c.cp - 1) % n))

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """Send `tensors` to the next rank and receive the previous rank's into new buffers; returns
        (buffers, works): wait on the works before reading the buffers or touching `tensors`."""
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev_peer, self.group) for b in bufs]
        return bufs, dist.batch_isend_irecv(ops)


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


@dataclass(frozen=True)
class _Step:
    """Which part of one step's work is needed: query rows and K/V columns of the local (2c) sequence."""

    rows: slice
    cols: slice
    causal: bool


def _plan(step: int, rank: int, size: int, c: int, causal: bool = True) -> _Step:
    src = (rank - step) % size
    if not causal:
        return _Step(slice(None), slice(None), False)
    if step == 0:
        return _Step(slice(None), slice(None), True)
    if src < rank:
        return _Step(slice(None), slice(0, c), False)
    return _Step(slice(c, None), slice(None), False)


def _mask(seg: torch.Tensor | None, kv_seg: torch.Tensor | None, s: _Step) -> torch.Tensor | None:
    """(B, 1, Tq, Tk) True where query and key share a document; None without segments."""
    if seg is None or kv_seg is None:
        return None
    return (seg[:, s.rows].unsqueeze(2) == kv_seg[:, s.cols].unsqueeze(1)).unsqueeze(1)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, bo: torch.Tensor, bl: torch.Tensor) -> None:
    """Fold a block's out (B, H, R, hd) and lse (B, H, R) into the running ones for `rows`, in place
    (online softmax): both rescaled to the merged log-sum-exp."""
    old_out, old_lse = out[:, :, rows], lse[:, :, rows]  # views: updated in place
    new_lse = torch.logaddexp(old_lse, bl)
    ref = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)  # rows with no key yet stay 0
    old_out.mul_(torch.exp(old_lse - ref).unsqueeze(-1))
    old_out.add_(bo.mul_(torch.exp(bl - ref).unsqueeze(-1)))
    old_lse.copy_(new_lse)


class RingAttention(torch.autograd.Function):
    """q (B, H, 2c, hd), k and v (B, G, 2c, hd), seg (B, 2c) or None -> out (B, H, 2c, hd)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seg: torch.Tensor | None,
        ring: Ring,
        causal: bool = True,
    ) -> torch.Tensor:
        b, h, t, hd = q.shape
        c, scale = t // 2, 1.0 / math.sqrt(hd)
        block = kernels.get("attention_block", q.device.type)
        out = torch.zeros(b, h, t, hd, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, t), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # (2, B, G, 2c, hd): one message per step
        kv_seg = seg
        for i in range(ring.size):
            if i + 1 < ring.size:
                # The next block's transfer overlaps this block's compute.
                nxt, works = ring.shift([kv] if kv_seg is None else [kv, kv_seg])
            s = _plan(i, ring.rank, ring.size, c, causal)
            b_out, b_lse = block(
                q[:, :, s.rows],
                kv[0][:, :, s.cols],
                kv[1][:, :, s.cols],
                s.causal,
                _mask(seg, kv_seg, s),
                scale,
            )
            _merge(out, lse, s.rows, b_out, b_lse)
            if i + 1 < ring.size:
                _wait(works)
                kv, kv_seg = nxt[0], (nxt[1] if kv_seg is not None else None)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, seg)
        ctx.ring, ctx.scale, ctx.causal = ring, scale, causal
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse, seg = ctx.saved_tensors
        ring: Ring = ctx.ring
        c = q.shape[2] // 2
        grad = kernels.get("attention_block_backward", q.device.type)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, kv_seg = torch.stack([k, v]), seg
        dkv_works: list[Any] = []
        dkv_next: list[torch.Tensor] = []
        for i in range(ring.size):
            if i + 1 < ring.size:
                nxt, works = ring.shift([kv] if kv_seg is None else [kv, kv_seg])
            s = _plan(i, ring.rank, ring.size, c, ctx.causal)
            r = s.rows
            b_dq, b_dk, b_dv = grad(
                dout[:, :, r], q[:, :, r], kv[0][:, :, s.cols], kv[1][:, :, s.cols], out[:, :, r],
                lse[:, :, r], s.causal, _mask(seg, kv_seg, s), ctx.scale,
            )  # fmt: skip
            dq[:, :, r] += b_dq
            # The held block's dK/dV so far (from the ranks it visited before), plus this rank's part.
            if i == 0:
                dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            else:
                _wait(dkv_works)
                dkv = dkv_next[0]
            dkv[0][:, :, s.cols] += b_dk
            dkv[1][:, :, s.cols] += b_dv
            # On to the block's next holder; after the last step that is its owner.
            dkv_next, dkv_works = ring.shift([dkv])
            if i + 1 < ring.size:
                _wait(works)
                kv, kv_seg = nxt[0], (nxt[1] if kv_seg is not None else None)
        _wait(dkv_works)
        dkv = dkv_next[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
    *,
    ring: Ring,
) -> torch.Tensor:
    """The `attention` kernel's contract over a context-parallel sequence: q (B, H, 2c, hd), k and v
    (B, G, 2c, hd) hold this rank's two chunks; causal or not (and per-document with segments) over
    the whole sequence. Collective over the cp ring: every cp rank calls it in the same order."""
    if dropout_p > 0:
        raise ValueError("context parallelism does not run attention dropout (model.attention_dropout=0)")
    if q.shape[2] % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {q.shape[2]} tokens")
    if ring.size == 1:
        return kernels.get("attention", q.device.type)(q, k, v, segments, dropout_p, causal)
    seg = segments.ids.contiguous() if segments is not None else None
    out: torch.Tensor = RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), seg, ring, causal)
    return out


def parallelize_context(model: nn.Module, state: ParallelState) -> nn.Module:
    """Install ring attention in every Attention of `model` (a GPTModel, tensor-parallel or not), in
    place; a no-op at cp = 1. The model must then be fed context_parallel_batch's micro-batches."""
    if state.cp_size == 1:
        return model
    cfg = getattr(model, "config", None)
    # The layout's own rules (megatrain.plan.layout): no attention dropout, a backend ring attention runs.
    problems = context_problems(state.layout, cfg.attention_dropout, cfg.attention_backend) if cfg else []
    if problems:
        raise LayoutError("; ".join(p["message"] for p in problems))
    attend = functools.partial(ring_attention, ring=Ring.of(state))
    for module in model.modules():
        if isinstance(module, Attention):
            module.core_attention = attend
        elif isinstance(module, TopKRouter):
            # Each rank routes its chunks of the sequences; the aux loss balances all of them.
            module.sequence_shards = state.cp_size
            module.sum_counts = functools.partial(_sum_over, group=state.group("cp"))
    return model


def _sum_over(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """counts summed over `group` (no gradient: they are counts)."""
    total = counts.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def skipped_blocks(size: int) -> tuple[int, int]:
    """(chunk-pair blocks computed, skipped) per rank and attention call under load balancing, out
    of the 4·cp chunk × chunk pairs a rank would compute passing the whole K/V around unmasked: step
    0 computes 3 (two diagonal, one full), each later step 2; the rest are fully masked."""
    computed = 3 + 2 * (size - 1)
    return computed, 4 * size - computed
