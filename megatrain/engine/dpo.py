"""Preference training (DPO, Rafailov et al. 2023): the loss over pairs of sequences, their
log-probabilities, and the reference model's, computed once before training.

A micro-batch holds whole pairs as adjacent rows (chosen, rejected; engine.data.preference). Each
row's log-probability is summed over its loss tokens (the response), for the policy with gradients
and, once, for the reference: the model as it starts (full-parameter DPO), or the base without its
adapters (LoRA: `adapters_disabled`, which the initial adapters equal since B starts at zero). The
reference pass (`prepare_reference`) runs before the first step through the same forward as
training, in whatever layout the job has, and is stored beside the dataset cache, so the training
step reads the reference like any other column of the batch and no second model is ever held.

The loss of a step is the mean over the global batch's pairs, TRL's DPOTrainer's definitions
(sigmoid, ipo, hinge); each micro-batch contributes its pairs' summed loss over this rank's pairs,
and DataParallel's average over dp makes the global mean, whatever the accumulation.

Under context parallelism each cp rank holds a part of every row (microbatch.context_parallel_batch):
its row sums are summed over cp (`sum_over_sequence`), so every cp rank computes the same pair
losses, and each backpropagates them through its own tokens only, cp times over: DataParallel
averages gradients over dp×cp, and the cp ranks' parts add up to the whole row's gradient.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatrain.engine.config import DPOConfig, TransformerConfig
from megatrain.engine.data.preference import PreferenceDataset
from megatrain.engine.lora import adapters_disabled
from megatrain.engine.microbatch import MicroBatch, context_parallel_batch
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.layers import ColumnParallelLinear
from megatrain.engine.parallel.schedules import pipeline_loss
from megatrain.engine.parallel.state import Group, ParallelState

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""The per-pair means a log row carries beside `loss` (TRL's names)."""

LogpsFn = Callable[[torch.Tensor, MicroBatch], torch.Tensor]
"""(last stage's output, micro-batch) -> (B,) each row's log-probability over its loss tokens."""


def _sum_forward_only(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum of x over the group, its gradient reaching this rank's x only (every rank's value is
    the same, so the gradient must not be summed over ranks twice)."""
    total = x.detach().clone()
    dist.all_reduce(total, group=group)
    return x + (total - x.detach())


def sum_over_sequence(rows: torch.Tensor, state: ParallelState | None) -> torch.Tensor:
    """Per-row sums (B,) of this cp rank's part of each sequence -> the whole sequences' sums, on
    every cp rank. The gradient reaching this rank's part is cp× the sum's: DataParallel divides the
    replicas' gradients by dp×cp, where each cp rank's tokens hold a disjoint part of the whole."""
    if state is None or state.cp_size == 1:
        return rows
    total = rows.detach().clone()
    dist.all_reduce(total, group=state.cp_group)
    cp = state.cp_size
    return rows * cp + (total - rows.detach() * cp)


def token_logps(
    logits: torch.Tensor, labels: torch.Tensor, head: nn.Module, vocab_limit: int, hits: bool = False
) -> Any:
    """log p(label) of every token, fp32 (B, T), from the head's logits: (B, T, V), or with a
    tensor-parallel head this rank's vocab shard (B, T, V/tp), never gathered (the max, Σ exp and the
    target logit are all-reduced, as the vocab-parallel cross-entropy does). Ids from vocab_limit
    on are padding, out of the softmax. hits=True: (log p, whether the label is the argmax (B, T))."""
    x = logits.float()
    tp = head.tp_size if isinstance(head, ColumnParallelLinear) else 1
    if tp == 1:
        x = x[..., :vocab_limit]
        logp = F.log_softmax(x, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return (logp, x.argmax(dim=-1) == labels) if hits else logp
    assert isinstance(head, ColumnParallelLinear)
    local_v = x.shape[-1]
    start = head.tp_rank * local_v
    if vocab_limit < start + local_v:
        cols = torch.arange(start, start + local_v, device=x.device) >= vocab_limit
        x = x.masked_fill(cols, float("-inf"))
    top = x.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=head.tp_group)
    shifted = x - top.unsqueeze(-1)
    local = labels - start
    outside = (local < 0) | (local >= local_v)
    target = shifted.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
    target = _sum_forward_only(target.masked_fill(outside, 0.0), head.tp_group)
    sum_exp = _sum_forward_only(shifted.exp().sum(dim=-1), head.tp_group)
    logp = target - sum_exp.log()
    # The label's logit less the max over every shard is 0 exactly where the label is the argmax.
    return (logp, target.detach() == 0) if hits else logp


def head_logps(
    hidden: torch.Tensor,
    head: nn.Module,
    mb: MicroBatch,
    vocab_limit: int,
    state: ParallelState | None = None,
) -> torch.Tensor:
    """(B,) each row's log-probability summed over its loss tokens, from the final norm's output
    through the LM head (a sequence-parallel head gathers the sequence itself); under context
    parallelism over the whole rows (sum_over_sequence)."""
    logp = token_logps(head(hidden), mb.labels, head, vocab_limit)  # (B, T), T/cp under cp
    assert mb.loss_mask is not None, "preference rows always carry a loss mask"
    return sum_over_sequence((logp * mb.loss_mask).sum(dim=-1), state)


def sequence_logps(model: nn.Module, mb: MicroBatch, state: ParallelState | None = None) -> torch.Tensor:
    """(B,) row log-probabilities of a model without a pipeline (any tp, sp, cp)."""
    plain = model.module if isinstance(model, DataParallel) else model
    hidden = plain.hidden_states(mb.tokens, **mb.model_inputs)  # (B, T, C); T/tp under sp
    return head_logps(hidden, plain.lm_head, mb, plain.config.real_vocab_size, state)


def pair_losses(
    logps: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor, cfg: DPOConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair, each (B/2,), from rows' policy and reference
    log-probs (B,) and loss-token counts (B,), rows alternating chosen, rejected. TRL's DPOTrainer:
    sigmoid with conservative label smoothing, ipo on per-token log-ratios, hinge."""
    chosen = logps[0::2] - ref[0::2]  # log π/π_ref of the chosen response
    rejected = logps[1::2] - ref[1::2]
    delta = chosen - rejected
    beta, eps = cfg.beta, cfg.label_smoothing
    if cfg.loss_type == "sigmoid":
        loss = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif cfg.loss_type == "hinge":
        loss = torch.relu(1 - beta * delta)
    elif cfg.loss_type == "ipo":
        per_token = chosen / counts[0::2].clamp_min(1.0) - rejected / counts[1::2].clamp_min(1.0)
        loss = (per_token - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {cfg.loss_type!r}")
    return loss, beta * chosen.detach(), beta * rejected.detach()


class PreferenceLoss:
    """The loop's side of DPO: each micro-batch's share of the step loss, and the step metrics
    (TRL's rewards/* and logps/*) accumulated until the next log row."""

    def __init__(
        self,
        cfg: DPOConfig,
        pairs_per_rank: int,
        device: str | torch.device,
        state: ParallelState | None = None,
    ):
        self.cfg, self.pairs_per_rank, self.state = cfg, pairs_per_rank, state
        # Σ over pairs: rewards chosen, rejected, accuracy, margin, logps chosen, rejected; pairs.
        self.sums = torch.zeros(7, dtype=torch.float64, device=device)

    def _losses(self, logps: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if mb.ref_logps is None or mb.loss_mask is None:
            raise ValueError("a preference micro-batch needs its reference log-probs (prepare_reference)")
        counts = mb.loss_mask.sum(dim=-1)
        if self.cfg.loss_type == "ipo" and self.state is not None and self.state.cp_size > 1:
            counts = counts.float()  # ipo's per-token ratios: the whole rows' token counts
            dist.all_reduce(counts, group=self.state.cp_group)
        return pair_losses(logps, mb.ref_logps, counts, self.cfg)

    def share(self, logps: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's pairs' summed loss over this rank's pairs in the step; records metrics."""
        loss, chosen, rejected = self._losses(logps, mb)
        lp = logps.detach()
        with torch.no_grad():
            row = torch.stack(
                [
                    chosen.sum(),
                    rejected.sum(),
                    (chosen > rejected).float().sum(),
                    (chosen - rejected).sum(),
                    lp[0::2].sum(),
                    lp[1::2].sum(),
                    torch.tensor(float(len(chosen)), device=lp.device),
                ]
            )
            self.sums += row.to(self.sums)
        return loss.sum() / self.pairs_per_rank

    def summed(self, logps: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's pairs' summed loss (validation adds them up; no metrics)."""
        return self._losses(logps, mb)[0].sum()

    def metrics(self, state: ParallelState) -> dict[str, float]:
        """The means over every pair since the last call, over all ranks (collective over pp and
        dp×cp: the last stage holds the sums, tensor-parallel ranks the same ones)."""
        sums = pipeline_loss(self.sums.clone(), state)
        if state.dp_cp_group is not None:
            dist.all_reduce(sums, group=state.dp_cp_group)
        self.sums.zero_()
        pairs = float(sums[-1]) or float("nan")
        return {name: float(v) / pairs for name, v in zip(METRICS, sums[:-1].tolist(), strict=True)}


# -- the reference pass ----------------------------------------------------------------------------


def reference_key(init_from: str | None, mcfg: TransformerConfig, precision: str) -> str:
    """What shapes the reference log-probs besides the data: the starting weights and the model."""
    shape = {"init_from": init_from, "model": repr(asdict(mcfg)), "precision": precision, "version": 1}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def _agree(flag: bool, device: str | torch.device) -> bool:
    """Whether every rank of the world says yes (one all-reduce)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


@torch.no_grad()
def reference_logps(
    ds: PreferenceDataset,
    run_logps: Callable[[list[MicroBatch]], list[torch.Tensor | None]],
    micro_ids: Callable[[int], list[list[int]]],
    global_batch_size: int,
    state: ParallelState,
    device: str,
) -> np.ndarray:
    """(documents in the cache,) float32 log-probs of every sequence of the split under the model
    as it is, NaN for documents outside the split. Each rank runs its slices of global batches over
    one epoch of sequence ids (its cp part of them); the values are summed over dp×cp and pp with a
    count (cp ranks each hold the whole rows' sums; a pair a wrapped last batch visits twice stays
    itself)."""
    n_docs = len(ds.tokens)
    values = torch.zeros(n_docs, dtype=torch.float64, device=device)
    counts = torch.zeros(n_docs, dtype=torch.float64, device=device)
    for start in range(0, len(ds), global_batch_size):
        ids = micro_ids(start)
        parts = [context_parallel_batch(ds.batch(i), state.cp_rank, state.cp_size) for i in ids]
        batches = [MicroBatch.from_batch(part, device) for part in parts]
        for i, logps in zip(ids, run_logps(batches), strict=True):
            if logps is None:  # not the last pipeline stage
                continue
            docs = torch.as_tensor([ds.document(j) for j in i], device=device)
            values.index_add_(0, docs, logps.double())
            counts.index_add_(0, docs, torch.ones_like(docs, dtype=torch.float64))
    both = torch.stack([values, counts])
    for group in (state.pp_group, state.dp_cp_group):
        if group is not None:
            dist.all_reduce(both, group=group)
    out = torch.where(both[1] > 0, both[0] / both[1].clamp_min(1.0), torch.full_like(both[0], float("nan")))
    return out.float().cpu().numpy()


def prepare_reference(
    datasets: dict[str, Any],
    model: nn.Module,
    run_logps: Callable[[list[MicroBatch]], list[torch.Tensor | None]],
    micro_ids: Callable[[int], list[list[int]]],
    global_batch_size: int,
    state: ParallelState,
    key: str,
    say: Callable[[str], None] = print,
) -> None:
    """Attach each split's reference log-probs, read from beside the dataset cache or computed now
    with `model`'s adapters (if any) off, and stored there for later attempts and runs. Collective:
    every rank computes unless every rank has the file (nodes keep their own caches)."""
    device = str(state.device)
    for name, ds in datasets.items():
        if not isinstance(ds, PreferenceDataset):
            continue
        assert ds.prefix is not None
        path = Path(f"{ds.prefix}-ref-{key}-{name}.npy")
        if _agree(path.exists(), device):
            ds.reference = np.load(path)
            continue
        with adapters_disabled(model):
            values = reference_logps(ds, run_logps, micro_ids, global_batch_size, state, device)
        ds.reference = values
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")
        np.save(tmp, values)
        os.replace(tmp, path)  # identical content from every rank: the last rename wins
        say(f"reference log-probs of the {name} split ({ds.stats['pairs']} pairs) stored at {path}")
