"""The torch side of a data.batch.Batch: the micro-batch the models, losses and schedules read.

The loss of a step is Megatron's per-token loss: the sum of every loss token's loss over the number
of loss tokens in the whole global batch (all micro-batches, all data-parallel ranks). Each loss
function returns the mean over its micro-batch's loss tokens; `token_share` rescales that mean into
the micro-batch's share of the global figure, so packing, masking and micro-batching never reweight
a document. Without masks every micro-batch holds the same number of tokens and the share is the
mean divided by the number of micro-batches: exactly the plain mean of before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatrain.engine.data.batch import Batch
from megatrain.engine.parallel.state import ParallelState


@dataclass
class MicroBatch:
    """Tensors (B, T): tokens and labels int64, loss_mask float (None: every label counts),
    position_ids int64 (None: 0..T-1), segment_ids int64 (None: one causal segment per row)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    num_loss_tokens: int = -1
    """Labels that count, known on the host (no device sync); -1: computed in __post_init__."""
    ref_logps: torch.Tensor | None = None
    """Preference training: (B,) float32 reference log-probs of the rows (engine.dpo); else None."""
    token_type_ids: torch.Tensor | None = None
    """An encoder's (B, T) sentence A / B ids; None: all 0 (or not an encoder)."""
    binary_labels: torch.Tensor | None = None
    """An encoder's (B,) sentence-order labels; None without a binary head."""
    binary_scale: float = 1.0
    """The factor on the sentence-order mean that makes token_share give it its per-row share of
    the step: denominator / (loss tokens · micro-batches), set by the training loop per step."""

    def __post_init__(self) -> None:
        if self.num_loss_tokens < 0:
            m = self.loss_mask
            self.num_loss_tokens = self.labels.numel() if m is None else int(torch.count_nonzero(m))

    @classmethod
    def from_batch(cls, batch: Batch, device: str | torch.device) -> MicroBatch:
        """The numpy Batch moved to `device`; None fields stay None. An encoder-decoder's batch (its
        dec_tokens set) becomes a T5MicroBatch."""

        def move(a: object, dtype: torch.dtype) -> torch.Tensor | None:
            if a is None:
                return None
            return torch.as_tensor(a).to(device=device, dtype=dtype, non_blocking=True)

        tokens, labels = move(batch.tokens, torch.int64), move(batch.labels, torch.int64)
        assert tokens is not None and labels is not None
        if batch.dec_tokens is not None:
            return T5MicroBatch(
                tokens,
                labels,
                move(batch.loss_mask, torch.float32),
                num_loss_tokens=batch.num_loss_tokens,
                dec_tokens=move(batch.dec_tokens, torch.int64),
                enc_mask=move(batch.enc_mask, torch.int64),
                dec_mask=move(batch.dec_mask, torch.int64),
            )
        return cls(
            tokens,
            labels,
            move(batch.loss_mask, torch.float32),
            move(batch.position_ids, torch.int64),
            move(batch.segment_ids, torch.int64),
            num_loss_tokens=batch.num_loss_tokens,
            ref_logps=move(batch.ref_logps, torch.float32),
            token_type_ids=move(batch.token_type_ids, torch.int64),
            binary_labels=move(batch.binary_labels, torch.int64),
        )

    @property
    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of GPTModel / StageModule forward besides the tokens (and an
        encoder's token types)."""
        inputs = {"position_ids": self.position_ids, "segment_ids": self.segment_ids}
        if self.token_type_ids is not None:
            inputs["token_type_ids"] = self.token_type_ids
        return inputs

    def split(self, size: int) -> list[MicroBatch]:
        """Rows cut into micro-batches of `size` (tests and benchmarks slice global batches)."""
        parts: dict[str, list[torch.Tensor | None]] = {}
        n = -(-self.tokens.shape[0] // size)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                parts[f.name] = list(value.split(size))
            elif f.name not in ("num_loss_tokens", "binary_scale"):
                parts[f.name] = [None] * n
        return [MicroBatch(**{k: v[i] for k, v in parts.items()}) for i in range(n)]


@dataclass
class T5MicroBatch(MicroBatch):
    """A T5 micro-batch: tokens are the encoder's (B, S), labels and loss_mask the decoder's (B, T).
    dec_tokens (B, T) the decoder's input; enc_mask (B, S) and dec_mask (B, T): 1 real, 0 padding."""

    dec_tokens: torch.Tensor | None = None
    enc_mask: torch.Tensor | None = None
    dec_mask: torch.Tensor | None = None

    @classmethod
    def from_samples(cls, batch: Mapping[str, Any], device: str | torch.device) -> T5MicroBatch:
        """From Megatron's T5 sample fields (data.t5_dataset, stacked): text_enc, text_dec, labels,
        loss_mask, enc_mask, dec_mask."""

        def move(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(batch[key]).to(device=device, dtype=dtype, non_blocking=True)

        return cls(
            move("text_enc", torch.int64),
            move("labels", torch.int64),
            move("loss_mask", torch.float32),
            dec_tokens=move("text_dec", torch.int64),
            enc_mask=move("enc_mask", torch.int64),
            dec_mask=move("dec_mask", torch.int64),
        )

    @property
    def model_inputs(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of T5Stage.forward besides the encoder tokens."""
        return {"dec_tokens": self.dec_tokens, "enc_mask": self.enc_mask, "dec_mask": self.dec_mask}

    def split(self, size: int) -> list[T5MicroBatch]:  # type: ignore[override]
        """Rows cut into micro-batches of `size`."""
        out = []
        for lo in range(0, self.tokens.shape[0], size):
            parts = {
                f.name: v[lo : lo + size] if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                for f in fields(self)
                if f.name != "num_loss_tokens"
            }
            out.append(T5MicroBatch(**parts))
        return out


def context_parallel_index(seq_length: int, rank: int, size: int) -> np.ndarray:
    """The positions context-parallel rank `rank` of `size` keeps of a sequence: the sequence cut in
    2·size equal chunks, chunks `rank` and 2·size-1-rank, in order (Megatron's causal load
    balancing: under a causal mask an early chunk attends to little and a late one to much, so
    every rank pairing one of each does the same work). (2·T/(2·size),) int64."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} is outside cp={size}")
    if seq_length % (2 * size):
        raise ValueError(f"a sequence of {seq_length} tokens does not split into 2×cp={2 * size} chunks")
    c = seq_length // (2 * size)
    first, second = rank * c, (2 * size - 1 - rank) * c
    return np.concatenate([np.arange(first, first + c), np.arange(second, second + c)])


def context_parallel_batch(batch: Batch, rank: int, size: int) -> Batch:
    """This cp rank's part of every row (see context_parallel_index): tokens, labels, loss_mask,
    segment_ids (B, T) -> (B, T/cp), and position_ids made explicit, so that positions (RoPE, learned)
    stay the kept tokens' true ones. size 1: the batch itself."""
    if size == 1:
        return batch
    b, t = batch.tokens.shape
    index = context_parallel_index(t, rank, size)
    positions = (
        batch.position_ids if batch.position_ids is not None else np.broadcast_to(np.arange(t), (b, t))
    )

    def keep(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[:, index])

    return replace(
        batch,
        tokens=keep(batch.tokens),
        labels=keep(batch.labels),
        loss_mask=keep(batch.loss_mask),
        position_ids=keep(positions),
        segment_ids=keep(batch.segment_ids),
        token_type_ids=keep(batch.token_type_ids),
    )


def set_binary_scales(batches: list[MicroBatch], denominator: float) -> None:
    """Each micro-batch's binary_scale for a step of these micro-batches (see MicroBatch): an
    encoder's sentence-order mean then counts as its rows' share of the step, whatever its tokens."""
    for mb in batches:
        mb.binary_scale = max(denominator, 1.0) / (max(mb.num_loss_tokens, 1) * len(batches))


def loss_denominator(batches: list[MicroBatch], state: ParallelState) -> float:
    """This rank's share of the global batch's loss-token count (see `mean_loss_tokens`)."""
    masked = any(b.loss_mask is not None for b in batches)
    return mean_loss_tokens(sum(b.num_loss_tokens for b in batches), masked, state)


def mean_loss_tokens(local: int, masked: bool, state: ParallelState) -> float:
    """The mean over the weight replicas (dp×cp ranks) of their loss-token counts (the global count
    over dp·cp, since DataParallel averages gradients over them; a cp rank counts the tokens of its
    part of each sequence): one all-reduce of one number when the batches carry masks.

    Whether batches carry a loss mask is their dataset's kind (pretraining samples never do,
    fine-tuning samples always do), the same on every rank; unmasked, every rank counts the same
    B·T per micro-batch, so pretraining steps need no collective and no host sync for it."""
    group, size = state.dp_cp_group, state.dp_cp_size
    if group is None or size == 1 or not masked:
        return float(local)
    count = torch.tensor([float(local)], dtype=torch.float64, device=state.device)
    dist.all_reduce(count, group=group)
    return float(count.item()) / size


def token_share(mean: torch.Tensor, num_loss_tokens: int, denominator: float) -> torch.Tensor:
    """A micro-batch's mean loss over its loss tokens as its share of the global per-token loss:
    mean · count / denominator (divided by the exact ratio, so that equal micro-batches give mean / m)."""
    # No loss token here (or anywhere): every loss is then 0 with zero gradients, but for what it
    # adds beside them (an encoder's binary head: binary_scale weighs it for a count of 1; a
    # classifier's batches hold no loss token at all).
    return mean / (max(denominator, 1.0) / max(num_loss_tokens, 1))
