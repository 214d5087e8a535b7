"""What EngineLM asks of a model, answered on one device or by a model at any layout.

Two questions make up every lm-eval request: the log-probability of each row's labels over its
masked positions with whether greedy decoding picks every one of them (`loglikelihood`), and the
logits after each row's last token (`last_logits`, from which generation draws its next token).

- `DeviceScorer`: one GPTModel on one device (an eval job's single process): rows right-padded to
  their batch's longest, the logits of the whole batch at once; generation with a KV cache.
- `LayoutScorer`: this rank's share of a model at a tp / sp / cp / pp / dp / ep layout (the
  training job's own ranks between steps, or an eval job at its planned layout). Every rank of the
  job asks the same questions in the same order (lm-eval runs the same requests on each). Rows are
  padded to the model's seq_length and grouped into micro-batches, which the data-parallel replicas
  share out; each micro-batch runs the training forward (through the pipeline's schedule when there
  is one, forward only) and the last stage reduces its logits to a few numbers per row without
  gathering the vocabulary (engine.dpo.token_logps: the max, Σ exp and the label's logit are
  all-reduced over tp). The rows' figures are then summed over cp (each cp rank holds part of every
  row), pp (only the last stage's are non-zero) and dp (each replica filled its own rows), so every
  rank returns the whole answer. Generation at a layout runs the whole sequence again for each new
  token (no KV cache is kept across ranks): lm-eval's generations are short.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.build import RankModel
from megatrain.engine.data.batch import Batch
from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.engine.dpo import token_logps
from megatrain.engine.generate import generate_batch, next_tokens
from megatrain.engine.microbatch import MicroBatch, context_parallel_batch
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.layers import ColumnParallelLinear
from megatrain.engine.parallel.schedules import PipelineSchedule
from megatrain.engine.parallel.state import Group
from megatrain.engine.serving.batcher import Batcher, SamplingParams

RowFn = Callable[[torch.Tensor, nn.Module, MicroBatch], torch.Tensor]
"""(last stage's hidden states, the LM head, micro-batch) -> (B, K) figures per row."""


class Scorer(Protocol):
    max_length: int
    """The longest row scored or generated (at most the model's seq_length)."""
    vocab_limit: int

    def loglikelihood(self, rows: Sequence[Sequence[int]], counts: Sequence[int]) -> list[tuple[float, bool]]:
        """Each row's tokens (at most max_length + 1): (the log-probability of its last `count`
        tokens, each after the ones before it, and whether greedy decoding picks all of them)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], options: Generation) -> list[list[int]]:
        """Each prompt's new ids (prompts of any lengths, each leaving room for max_new_tokens), the
        end-of-document id last where it came; a row may stop early once its text holds a stop
        string (the caller cuts the text there)."""
        ...


@dataclass(frozen=True)
class Generation:
    """How lm-eval asks to generate (lm.py's _generation_options, read as HFLM reads them)."""

    max_new_tokens: int
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234
    """Row i draws from a generator seeded seed + i: the same answers however rows are batched."""
    eos_id: int | None = None
    until: tuple[str, ...] = ()


def _row_scores(hidden: torch.Tensor, head: nn.Module, mb: MicroBatch, vocab_limit: int) -> torch.Tensor:
    """(B, 2): Σ log p(label) over the masked positions, and how many of them greedy misses."""
    logp, hit = token_logps(head(hidden), mb.labels, head, vocab_limit, hits=True)
    assert mb.loss_mask is not None
    mask = mb.loss_mask
    return torch.stack([(logp * mask).sum(-1), ((~hit).float() * mask).sum(-1)], dim=-1)


def _row_logits(hidden: torch.Tensor, head: nn.Module, mb: MicroBatch, vocab_limit: int) -> torch.Tensor:
    """(B, vocab_limit) fp32: the logits at each row's one masked position (zero on a cp rank that
    does not hold it), the vocab shards gathered over tp."""
    assert mb.loss_mask is not None
    logits = torch.einsum("btv,bt->bv", head(hidden).float(), mb.loss_mask)  # (B, V/tp)
    if isinstance(head, ColumnParallelLinear) and head.tp_size > 1:
        parts = [torch.empty_like(logits) for _ in range(head.tp_size)]
        dist.all_gather(parts, logits.contiguous(), group=head.tp_group)
        logits = torch.cat(parts, dim=-1)
    return logits[:, :vocab_limit]


class DeviceScorer:
    """One GPTModel on one device, `batch_size` rows per forward."""

    def __init__(self, model: GPTModel, tokenizer: Tokenizer, batch_size: int, max_length: int):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size, self.max_length = batch_size, max_length
        self.vocab_limit = min(model.config.real_vocab_size, model.config.vocab_size)
        self._device = model.embed.weight.device

    @torch.no_grad()
    def loglikelihood(self, rows: Sequence[Sequence[int]], counts: Sequence[int]) -> list[tuple[float, bool]]:
        width = max(len(r) for r in rows) - 1
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            tokens[r, : len(row) - 1] = torch.tensor(row[:-1])
        logprobs = torch.log_softmax(self.model(tokens.to(self._device))[..., : self.vocab_limit].float(), -1)
        answers = []
        for r, (row, n) in enumerate(zip(rows, counts, strict=True)):
            end = len(row) - 1
            picked = logprobs[r, end - n : end]  # (n, V): the positions predicting the last n tokens
            target = torch.tensor(row[-n:], device=picked.device)
            greedy = bool((picked.argmax(dim=-1) == target).all())
            answers.append((float(picked.gather(1, target[:, None]).sum()), greedy))
        return answers

    def generate(self, prompts: Sequence[Sequence[int]], options: Generation) -> list[list[int]]:
        """Continuous batching (serving.batcher): prompts of any lengths share each decode step,
        batch_size rows at a time, each row ending at end-of-document or its first stop string.
        top_k, which the batcher does not draw with, runs generate_batch on rows of one length."""
        if options.top_k:
            return self._generate_by_length(prompts, options)
        batcher = Batcher(self.model, self.tokenizer, max_batch=self.batch_size,
                          eos_id=options.eos_id, max_waiting=len(prompts))  # fmt: skip
        seqs = [
            batcher.submit(
                list(p),
                SamplingParams(
                    max_tokens=options.max_new_tokens,
                    temperature=0.0 if options.greedy else options.temperature,
                    top_p=options.top_p,
                    seed=options.seed + i,
                    stop=options.until,
                ),
            )  # fmt: skip
            for i, p in enumerate(prompts)
        ]
        while batcher.step():
            pass
        for seq in seqs:
            if seq.finish_reason == "error":
                raise RuntimeError(f"generation failed: {seq.error}")
        return [seq.tokens for seq in seqs]

    def _generate_by_length(self, prompts: Sequence[Sequence[int]], options: Generation) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in prompts]
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        for rows in by_length.values():
            for start in range(0, len(rows), self.batch_size):
                part = rows[start : start + self.batch_size]
                new = generate_batch(
                    self.model, torch.tensor([list(prompts[i]) for i in part]), options.max_new_tokens,
                    greedy=options.greedy, temperature=options.temperature, top_k=options.top_k,
                    top_p=options.top_p, seed=options.seed + part[0], eos_id=options.eos_id,
                    vocab_limit=self.vocab_limit,
                )  # fmt: skip
                for i, ids in zip(part, new, strict=True):
                    out[i] = ids
        return out


class LayoutScorer:
    """This rank's share of a model at any layout; every rank must make the same calls.

    `rows_per_forward`: the rows of one micro-batch (a pipeline's must be the activation shape's
    batch dimension: `pipeline`'s when one is given, else the training micro-batch size).
    `pipeline`: the training schedule to run forwards through (None: one is made for evaluation)."""

    def __init__(
        self,
        model: RankModel,
        seq_length: int,
        vocab_limit: int,
        *,
        rows_per_forward: int,
        pipeline: PipelineSchedule | None = None,
    ):
        self.model, self.state = model, model.state
        self.seq_length = self.max_length = seq_length
        self.vocab_limit, self.rows = vocab_limit, rows_per_forward
        self.device = str(self.state.device)
        self.pipeline = pipeline
        if model.chunks:
            last = model.chunks[-1]
            if last.is_last:
                last.return_hidden = True  # the head is applied here, on the final norm's output
            if pipeline is None:
                s = self.state
                seq = seq_length // s.cp_size // (s.tp_size if s.sequence_parallel else 1)
                shape = (rows_per_forward, seq, last.config.hidden_size)
                dtype = next(model.module.parameters()).dtype
                self.pipeline = PipelineSchedule(model.chunks, s, shape, dtype, s.layout.pipeline_schedule)

    @torch.no_grad()
    def loglikelihood(self, rows: Sequence[Sequence[int]], counts: Sequence[int]) -> list[tuple[float, bool]]:
        masks = [[0.0] * (len(r) - 1 - n) + [1.0] * n for r, n in zip(rows, counts, strict=True)]
        out = self._run([r[:-1] for r in rows], [r[1:] for r in rows], masks, 2, _row_scores)
        return [(float(lp), misses == 0) for lp, misses in out.tolist()]

    @torch.no_grad()
    def last_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """(B, vocab_limit) fp32 on every rank: the logits after each prompt's last token."""
        masks = [[0.0] * (len(p) - 1) + [1.0] for p in prompts]
        return self._run(prompts, prompts, masks, self.vocab_limit, _row_logits)

    def generate(self, prompts: Sequence[Sequence[int]], options: Generation) -> list[list[int]]:
        """Each new token from the whole sequences run again (no KV cache kept across ranks), rows of
        any lengths together; each row's draws from its own seeded CPU generator, the same on
        every rank. Rows end at end-of-document or their budget; stop strings are cut by the caller."""
        generators = [torch.Generator().manual_seed(options.seed + i) for i in range(len(prompts))]
        rows = [list(p) for p in prompts]
        new: list[list[int]] = [[] for _ in rows]
        budget = [min(options.max_new_tokens, self.seq_length - len(p)) for p in rows]
        live = [i for i in range(len(rows)) if budget[i] > 0]
        while live:
            logits = self.last_logits([rows[i] for i in live]).cpu()
            for k, i in enumerate(live):
                token = int(next_tokens(logits[k : k + 1], options.greedy, options.temperature,
                                        options.top_k, options.top_p, generators[i])[0])  # fmt: skip
                rows[i].append(token)
                new[i].append(token)
            live = [i for i in live if len(new[i]) < budget[i] and new[i][-1] != options.eos_id]
        return new

    def _run(
        self,
        tokens: Sequence[Sequence[int]],
        labels: Sequence[Sequence[int]],
        masks: Sequence[Sequence[float]],
        width: int,
        fn: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """(len(tokens), width) fp32 on every rank: fn's figures for each row, the rows padded to
        seq_length and shared out over the data-parallel replicas in micro-batches."""
        s, t, n = self.state, self.seq_length, len(tokens)
        if any(len(x) > t for x in tokens):
            raise ValueError(f"a row of more than seq_length={t} tokens")
        per_rank = -(-n // (self.rows * s.dp_size))
        if self.pipeline is not None:
            per_rank = -(-per_rank // s.pp_size) * s.pp_size  # interleaving wants whole rounds
        total = per_rank * s.dp_size * self.rows
        arrays = {k: np.zeros((total, t), dtype) for k, dtype in
                  (("tokens", np.int64), ("labels", np.int64), ("loss_mask", np.float32))}  # fmt: skip
        for r in range(n):
            for key, values in (("tokens", tokens[r]), ("labels", labels[r]), ("loss_mask", masks[r])):
                arrays[key][r, : len(values)] = values
        mine = [s.dp_rank + k * s.dp_size for k in range(per_rank)]  # micro-batch indices, round robin
        batches = []
        for m in mine:
            part = Batch(**{k: a[m * self.rows : (m + 1) * self.rows] for k, a in arrays.items()})
            part = context_parallel_batch(part, s.cp_rank, s.cp_size)
            batches.append(MicroBatch.from_batch(part, self.device))
        out = torch.zeros((total, width), dtype=torch.float32, device=self.device)
        limit = self.vocab_limit
        module = self.model.module
        was_training = module.training
        module.eval()
        try:
            found = self._forward(batches, lambda h, head, mb: fn(h, head, mb, limit))
        finally:
            module.train(was_training)
        for m, mb in zip(mine, batches, strict=True):
            figures = found.get(id(mb))
            if figures is not None:
                out[m * self.rows : (m + 1) * self.rows] = figures.float()
        for group in (s.cp_group, s.pp_group, s.dp_group):
            _sum(out, group)
        return out[:n]

    def _forward(self, batches: list[MicroBatch], fn: RowFn) -> dict[int, torch.Tensor]:
        """fn's figures for each micro-batch this rank's last stage computed, by id(micro-batch)."""
        found: dict[int, torch.Tensor] = {}
        if self.pipeline is None:
            plain = self.model.module
            for mb in batches:
                hidden = plain.hidden_states(mb.tokens, **mb.model_inputs)  # type: ignore[operator]
                found[id(mb)] = fn(hidden, plain.lm_head, mb)  # type: ignore[arg-type]
            return found
        last = self.model.chunks[-1]

        def keep(out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            found[id(mb)] = fn(out, last.lm_head, mb)
            return out.new_zeros(())

        self.pipeline.forward_only(batches, keep)
        self.pipeline.times.reset()  # the bubble figure is the training schedule's
        return found


def _sum(out: torch.Tensor, group: Group) -> None:
    if group is not None:
        dist.all_reduce(out, group=group)
